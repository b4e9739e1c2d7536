"""
The expert cut at the export: a model whose router can never choose some experts becomes the model
built without them, a plain checkpoint in transformers 5's layout that engines load.

  expert_config(config, N)         the config with N routed experts a layer (num_experts,
                                   num_local_experts or n_routed_experts; n_group, topk_group and
                                   num_experts_per_tok as they were: experts/search.py keeps whole
                                   groups and refuses N below the experts a token is routed to)
  remove_experts(model, kept, ..)  the same model with each MoE layer's kept experts alone: every
                                   tensor of E rows of its experts module and of its router (the
                                   fused gate_up_proj [E, 2I, H] and down_proj [E, H, I], GPT-OSS's
                                   transposed ones and their biases, the router's weight and bias,
                                   DeepSeek-V3's e_score_correction_bias) sliced to the kept rows in
                                   order; the shared expert, attention and norms untouched

The rows are found by structure (experts/routing.moe_layers), the new model is built by the family's
own constructor from the rewritten config and takes the sliced tensors strictly: a tensor of E rows
the family keeps elsewhere would be a missing or unexpected key, one error, not a silent mismatch.
Masked and removed compute the same function: a -inf logit and a deleted row leave the same softmax,
sigmoid and top-k over the others (tests/test_experts.py).
"""
import copy

import torch
from transformers import AutoModelForCausalLM

from experts.routing import moe_layers
from experts.search import expert_count
from runtime import E3Error


def expert_config(config, n):
    """A copy of `config` with n routed experts a layer."""
    new = copy.deepcopy(config)
    key, _ = expert_count(new)
    setattr(new.get_text_config(), key, n)
    return new


def remove_experts(model, kept, layers=None):
    """`model` (every expert still there) rebuilt with the experts `kept` alone: kept maps an original
    layer index (str or int) to the experts it keeps, the same count everywhere; layers: the original
    index of each of the model's layers (a layer cut's kept list), None: the model's own."""
    kept = {int(l): sorted(e) for l, e in kept.items()}
    counts = {len(e) for e in kept.values()}
    if len(counts) != 1:
        raise E3Error(f"the MoE layers keep different numbers of experts ({sorted(counts)}); a config "
                      f"holds one count")
    names = {id(m): name for name, m in model.named_modules()}
    state = model.state_dict()
    for moe in moe_layers(model):
        original = layers[moe.index] if layers is not None else moe.index
        rows = torch.tensor(kept[original])
        for module in (moe.experts, moe.router):
            for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if t.dim() and t.shape[0] == moe.E:
                    key = f"{names[id(module)]}.{name}"
                    state[key] = state[key].index_select(0, rows.to(t.device))
    config = expert_config(model.config, counts.pop())
    with torch.device("meta"):
        new = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype)
    new.load_state_dict(state, strict=True, assign=True)
    old = dict(model.named_buffers())
    for name, b in list(new.named_buffers()):  # those no state dict holds (RoPE's): as they were
        if b.is_meta and name in old:
            owner, _, leaf = name.rpartition(".")
            new.get_submodule(owner)._buffers[leaf] = old[name]
    new.tie_weights()  # assign gave the embedding and a tied head two tensors
    new.generation_config = model.generation_config
    return new.train(model.training)
