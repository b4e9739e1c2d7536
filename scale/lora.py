"""
LoRA (the paper's App. D) for the models too large to train in full, the MoE giants: every weight
frozen, low-rank adapters on the attention and dense MLP linears of each decoder layer, merged into
plain weights at export. prune.py imports this only with --lora-rank > 0.
"""
import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from surgery import decoder_layers

# MoE routers: Mixtral/Qwen/DeepSeek `gate`, Llama-4 and GPT-OSS `router`, Qwen-MoE's shared gate
ROUTERS = ("gate", "router", "shared_expert_gate")


def lora_targets(layer):
    """The nn.Linear maps of a decoder layer that LoRA adapts: attention and the dense or
    shared-expert MLP. Not the routers nor anything inside one (Hunyuan's gate.wg, AFMoE's
    router.gate: a low-rank change reroutes tokens between experts the adapters never see); routed
    experts are fused 3-D tensors in transformers 5, not nn.Linear, and stay frozen (their LoRA is
    optional in the paper)."""
    return [mod for name, mod in layer.named_modules()
            if isinstance(mod, nn.Linear) and not set(name.split(".")) & set(ROUTERS)]


class LoRA(nn.Module):
    """weight -> weight + (alpha / r) B A as a parametrization: the HF module tree stays as it is."""

    def __init__(self, weight, rank, alpha, generator):
        super().__init__()
        # A ~ N(0, 1/in) from the seeded CPU generator (every rank draws the same A); B = 0, so the
        # adapted model starts as the model itself
        A = torch.randn(rank, weight.shape[1], generator=generator, dtype=weight.dtype)
        self.A = nn.Parameter((A / math.sqrt(weight.shape[1])).to(weight.device))
        self.B = nn.Parameter(torch.zeros(weight.shape[0], rank, dtype=weight.dtype,
                                          device=weight.device))
        self.scale = alpha / rank

    def forward(self, weight):
        return weight + self.scale * (self.B @ self.A).to(weight.dtype)


def add_lora(model, rank, alpha, seed, layers=None):
    """Freeze every weight; adapters on the decoder layers' lora_targets are all that train. layers:
    these alone (a layer rebuilt after the expert cut: its adapters then take the old ones' values)."""
    gen = torch.Generator().manual_seed(seed)
    for p in (model.parameters() if layers is None else (p for l in layers for p in l.parameters())):
        p.requires_grad_(False)
    for layer in decoder_layers(model) if layers is None else layers:
        for mod in lora_targets(layer):
            parametrize.register_parametrization(mod, "weight", LoRA(mod.weight, rank, alpha, gen))
            mod.parametrizations.weight.original.requires_grad_(False)


def merge_lora(state, scale):
    """A state dict's LoRA factors folded into plain `.weight` tensors: W + scale B A."""
    out, suffix = {}, ".parametrizations.weight.original"
    for key, value in state.items():
        if key.endswith(suffix):
            base = key[: -len(suffix)]
            A = state[base + ".parametrizations.weight.0.A"].float()
            B = state[base + ".parametrizations.weight.0.B"].float()
            out[base + ".weight"] = value + scale * (B @ A).to(value.dtype)
        elif ".parametrizations.weight.0." not in key:
            out[key] = value
    return out
