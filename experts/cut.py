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
                                   Under FSDP2 a layer at a time: gathered, cut, sharded again.

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
    the new one and sliced the same way. Under FSDP2 each MoE layer's unit is rebuilt whole:
    gathered, cut, prepare(layer) (what parallelize did to a layer before sharding it: activation
    checkpointing, compile), sharded again, one layer at a time (scale.fsdp.replace_layer)."""
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
            _fill(block, moe.block, per_expert, index, moments, whole=False)
            owner, _, leaf = path.rpartition(".")
            setattr(layer.get_submodule(owner), leaf, block)
        else:
            from scale.fsdp import replace_layer
            new, states = skeleton[moe.index], {}
            _fill(new, layer, per_expert, index, moments, whole=True, states=states)
            moved = replace_layer(model, moe.index, (prepare or (lambda x: x))(new), states)
            if moments is not None:
                moments.update(moved)
    key, _ = expert_count(model.config)
    for cfg in {id(c): c for c in (model.config, *layer_configs(model.config, len(skeleton)))}.values():
        setattr(cfg.get_text_config(), key, n)  # in place: the model's config says N
    return model


def _fill(new, old, per_expert, index, moments, whole, states=None):
    """`new` (a module built on the meta device for N experts) given `old`'s tensors: a per-expert
    one (per_expert[(id(module), name)] = its dim) sliced to `index` on its dim, every other the
    same object, and (not whole) every child holding no per-expert tensor the same module (a shared
    expert, with its LoRA). whole (FSDP2): every tensor gathered into a plain one, its optimizer
    state (moments) gathered too and kept in states[qualified name], for the new shards."""
    owners = {m for m, _ in per_expert}

    def walk(new, old, prefix):
        for name, child in list(new.named_children()):
            mine = getattr(old, name)
            if not whole and not any(id(m) in owners for m in mine.modules()):
                setattr(new, name, mine)
            else:
                walk(child, mine, f"{prefix}{name}.")
        for table in ("_parameters", "_buffers"):
            for name in list(getattr(new, table)):
                t = getattr(old, table)[name]
                dim = per_expert.get((id(old), name))
                if t is None:  # a registered None (a Linear without bias)
                    getattr(new, table)[name] = None
                    continue

                def cut(x):  # gathered (FSDP2), then the kept experts' rows
                    x = x.full_tensor() if hasattr(x, "full_tensor") else x
                    return x if dim is None else x.index_select(dim, index.to(x.device))
                value = cut(t.detach()) if dim is not None or whole else t
                if isinstance(t, nn.Parameter) and value is not t:
                    value = nn.Parameter(value, requires_grad=t.requires_grad)
                    state = moments.pop(t, None) if moments is not None else None
                    if state is not None:
                        state = {k: cut(v) if torch.is_tensor(v) and v.shape == t.shape else v
                                 for k, v in state.items()}
                        if whole:
                            states[prefix + name] = state
                        else:
                            moments[value] = state
                built = getattr(new, table)[name]
                if built is not None and tuple(built.shape) != tuple(value.shape):
                    raise E3Error(f"{type(new).__name__}.{name}: the family builds {tuple(built.shape)} for "
                                  f"fewer experts, the cut made {tuple(value.shape)}: experts/cut.py "
                                  f"cannot rebuild this family's experts")
                getattr(new, table)[name] = value
        new.train(old.training)
    walk(new, old, "")
    if any(t.is_meta for t in [*new.parameters(), *new.buffers()]) and not any(
            t.is_meta for t in [*old.parameters(), *old.buffers()]):
        raise E3Error(f"{type(new).__name__} built for fewer experts holds a tensor the model's does "
                      f"not: experts/cut.py cannot rebuild it")


def remove_experts(model, kept, layers=None):
    """A copy of `model` with the experts `kept` alone (cut_experts on a deep copy); `model` stays."""
    return cut_experts(copy.deepcopy(model), kept, layers)
