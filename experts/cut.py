"""
The expert cut: a model whose router can never choose some experts becomes the model built without
them, in place, once the set is final (prune.py: at T_M, or at once with --search none), so that the
fine-tune, its optimizer and the export hold N experts a layer, not E.

  expert_config(config, N)         the config with N routed experts a layer (num_experts,
                                   num_local_experts or n_routed_experts; n_group, topk_group and
                                   num_experts_per_tok as they were: experts/search.py keeps whole
                                   groups and refuses N below the experts a token is routed to)
  cut_experts(model, kept, ..)     in place: each MoE layer's block rebuilt by the family's own
                                   constructor from that config (its num_experts and every other
                                   setting read from it), the per-expert tensors (routing.
                                   expert_tensors: the fused experts, the router's rows, a score
                                   correction) sliced to the kept experts in order, everything else
                                   (a shared expert, its gate, the layer around the block) the same
                                   objects. An optimizer's state moves with the parameters: AdamW's
                                   moments are per element, so a kept expert's rows are its own.
                                   Under FSDP2 a layer's unit at a time, shard to shard.

The same function serves the cut in training, a resume after it (the source model cut again before
the checkpoint's weights are loaded) and the export (the model built on the meta device from the
source, cut to the same shapes, then handed the trained weights strictly: a tensor of E rows the
family keeps elsewhere would be a missing or unexpected key, one error, not a silent mismatch).
Masked and removed compute the same function: a -inf logit and a deleted row leave the same softmax,
sigmoid and top-k over the others (tests/test_experts.py, tests/test_expert_search.py).
"""
import copy

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from experts.routing import expert_count, expert_tensors, moe_layers
from runtime import E3Error
from surgery import decoder_layers, layer_configs


def expert_config(config, n):
    """A copy of `config` with n routed experts a layer."""
    new = copy.deepcopy(config)
    key, _ = expert_count(new)
    setattr(new.get_text_config(), key, n)
    return new


def cut_experts(model, kept, layers=None, moments=None, prepare=None):
    """`model` (every expert still there) with the experts `kept` alone, in place; returns it. kept
    maps an original layer index (str or int) to the experts it keeps, the same count everywhere;
    layers: the original index of each of the model's layers (a layer cut's kept list), None: the
    model's own; moments: an optimizer's state (opt.state), its entries for a cut parameter moved to
    the new one and sliced the same way. Under FSDP2 each MoE layer's unit is rebuilt whole, one
    layer at a time: the N-expert layer on the meta device, prepare(layer) (what parallelize_student
    did to the old one: LoRA, checkpointing, compile), sharded, its shards made from the old shards
    (scale.fsdp.replace_layer: no tensor gathered whole)."""
    if kept is None:  # a checkpoint of the time the cut kept every expert until the export
        raise E3Error("this checkpoint was saved after the cut by an E3-Pruner that kept the removed "
                      "experts until the export: start the run again (or resume from before the cut)")
    kept = {int(l): sorted(e) for l, e in kept.items()}
    counts = {len(e) for e in kept.values()}
    if len(counts) != 1:
        raise E3Error(f"the MoE layers keep different numbers of experts ({sorted(counts)}); a config "
                      f"holds one count")
    n = counts.pop()
    with torch.device("meta"):  # the family's own N-expert layers, shapes alone
        skeleton = decoder_layers(AutoModelForCausalLM.from_config(expert_config(model.config, n)))
    sharded = any(hasattr(p, "full_tensor") for p in model.parameters())  # FSDP2's DTensors
    for moe in moe_layers(model):
        index = torch.tensor(kept[layers[moe.index] if layers is not None else moe.index])
        layer = decoder_layers(model)[moe.index]
        per_expert = {(id(m), name): dim for m, name, dim in expert_tensors(moe)}
        if not sharded:  # the block alone rebuilt, the layer around it the same object
            path = next(name for name, m in layer.named_modules() if m is moe.block)
            block = skeleton[moe.index].get_submodule(path)
            _fill(block, moe.block, per_expert, index, moments)
            owner, _, leaf = path.rpartition(".")
            setattr(layer.get_submodule(owner), leaf, block)
        else:
            from scale.fsdp import replace_layer
            names = {id(m): name for name, m in layer.named_modules()}
            dims = {f"{names[id(m)]}.{n}".lstrip("."): d for m, n, d in expert_tensors(moe)}
            replace_layer(model, moe.index, (prepare or (lambda x: x))(skeleton[moe.index]),
                          lambda name: (dims[name], index) if name in dims else None, moments)
    key, _ = expert_count(model.config)
    for cfg in {id(c): c for c in (model.config, *layer_configs(model.config, len(skeleton)))}.values():
        setattr(cfg.get_text_config(), key, n)  # in place: the model's config says N
    return model


def _fill(new, old, per_expert, index, moments):
    """`new` (a block built on the meta device for N experts) given `old`'s tensors: a per-expert one
    (per_expert[(id(module), name)] = its dim) sliced to `index` on its dim, its optimizer state
    (moments) with it, every other tensor the same object, and every child holding no per-expert
    tensor the same module (a shared expert, with its LoRA); each checked against the shape the
    family builds for N experts."""
    owners = {m for m, _ in per_expert}

    def walk(new, old):
        for name, child in list(new.named_children()):
            mine = getattr(old, name)
            if not any(id(m) in owners for m in mine.modules()):
                setattr(new, name, mine)
            else:
                walk(child, mine)
        for table in ("_parameters", "_buffers"):
            for name in list(getattr(new, table)):
                t, dim = getattr(old, table)[name], per_expert.get((id(old), name))
                if dim is not None:
                    cut = t.detach().index_select(dim, index.to(t.device))
                    if isinstance(t, nn.Parameter):
                        cut = nn.Parameter(cut, requires_grad=t.requires_grad)
                        state = moments.pop(t, None) if moments is not None else None
                        if state is not None:  # AdamW's moments are per element: the kept rows
                            moments[cut] = {k: v.index_select(dim, index.to(v.device))
                                            if torch.is_tensor(v) and v.shape == t.shape else v
                                            for k, v in state.items()}
                    t = cut
                built = getattr(new, table)[name]
                if (built is None) != (t is None) or t is not None and tuple(built.shape) != tuple(t.shape):
                    raise E3Error(f"{type(new).__name__}.{name}: the family builds "
                                  f"{None if built is None else tuple(built.shape)} for fewer experts, the "
                                  f"cut made {None if t is None else tuple(t.shape)}: experts/cut.py cannot "
                                  f"rebuild this family's experts")
                getattr(new, table)[name] = t
        new.training = old.training
    walk(new, old)


def remove_experts(model, kept, layers=None):
    """A copy of `model` with the experts `kept` alone (cut_experts on a deep copy); `model` stays."""
    return cut_experts(copy.deepcopy(model), kept, layers)
