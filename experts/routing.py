"""
Routed experts found by their structure, made unroutable one at a time, and read as they are routed.

  moe_layers(model)            every decoder layer with routed experts: MoE(index, block, router,
                               experts, E); found by structure, never by a family's name
  expert_unroutable(moe, j)    inside the block, the router of that layer never chooses expert j
  RoutingReader(moes, on_call) inside the block, each MoE call's choice, gates and expert outputs

What a routed layer is, in every family transformers 5 builds: a block (the layer's MLP) holding an
experts module whose weights are fused 3-D tensors [E, ., .] (gate_up_proj, down_proj; GPT-OSS's and
Llama-4's transposed, GPT-OSS's with [E, .] biases) and, beside it, a router named `gate` or `router`
whose weight has E rows. A shared expert (Qwen2-MoE, DeepSeek, Llama-4) is an MLP of 2-D weights: it
sees every token, is never routed, and is never listed.

Unroutable. Every family's router starts from E logits z = W_r x (+ b: GPT-OSS), one F.linear, and
then chooses: softmax then top-k (Mixtral renormalises the k gates; Qwen2/3-MoE and OLMoE with
norm_topk_prob; DeepSeek-V2 scales them by routed_scaling_factor), top-k then softmax (GPT-OSS,
GraniteMoE), sigmoid + a score correction, group-limited top-k, renormalise, scale (DeepSeek-V3),
sigmoid of the top-k (Llama-4). Setting z_j = -inf before any of them gives softmax(z)_j = 0 and
sigmoid(z_j) = 0 and leaves the others' softmax that over the E - 1 remaining logits: the top-k is
taken among the others and renormalised exactly as the family would with expert j deleted. A
per-expert score correction added to the choice (DeepSeek-V3's e_score_correction_bias on the
router, MiniMax-M2's on the block, Ernie's [1, E] in a statistics module: every per-expert tensor
of E values but the router's, expert_tensors' one reading) would still let j win a slot: it is set
to -inf at j too, while the block runs. (With DeepSeek-V3's groups, n_group > 1, the group-limited
top-k then runs on j's -inf: the model with j deleted has no such config, its groups would be
uneven.) The logits are reached with a torch function mode (torch.overrides.TorchFunctionMode)
active only while the router's linear map runs (the router, or its nn.Linear child: Hunyuan's
gate.wg): its F.linear of output width E is the logits, masked as it returns; the family's own code
does the rest. tests/test_experts.py checks the masked model against the model built by hand with
expert j deleted (E - 1 in the config, its router row and weights gone), for every MoE family the
project tests; tests/test_moe_families.py for every family transformers ships.

Reading the routing. The gates g_j(x) a family applies are what its experts module is called with,
in one of two conventions: experts(x [T, H], indices [T, k], weights [T, k]) (every family with
fused experts but Llama-4: y = sum_s weights[t, s] f_{indices[t, s]}(x_t)), or experts(u [E T, H])
with u_{j,t} = g_j(x_t) x_t, every token stacked once per expert, the gate scaling the input
(Llama-4; g = 0 off the top-k, so f_j(0) = 0 adds nothing). The first hands over the choice and the
gates; in the second g_j(x_t) = <u_{j,t}, x_t> / <x_t, x_t> (x_t the router's input), exact to the
input's rounding, and the chosen experts are those with g != 0. The expert outputs f_j(x_t) are the
family's own code on the chosen pairs: experts(x repeated k times, the chosen index, weight 1).
"""
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from runtime import E3Error
from surgery import decoder_layers

ROUTER_NAMES = ("gate", "router")  # the router beside the experts, in every family transformers builds


COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # the families' expert counts


def expert_count(config):
    """(the config's key for its routed-expert count, E), or (None, None) for a dense model."""
    text = config.get_text_config()
    return next(((k, getattr(text, k)) for k in COUNT_KEYS if isinstance(getattr(text, k, None), int)),
                (None, None))


@dataclass
class MoE:
    index: int          # the decoder layer's index
    block: nn.Module    # the layer's MLP: router, experts (and a shared expert)
    router: nn.Module
    experts: nn.Module  # the fused 3-D weights [E, ., .]
    E: int
    linear: nn.Module = None  # what holds the router's weight [E, H]: the router, or its one Linear


def _router_linear(router, E):
    """The module whose weight [E, H] makes the router's E logits: the router itself (a `weight` of
    E rows), or its one nn.Linear of E outputs (Hunyuan's gate.wg, AFMoE's router.gate); None."""
    weight = getattr(router, "weight", None)
    if torch.is_tensor(weight) and weight.dim() == 2 and weight.shape[0] == E:
        return router
    found = [m for m in router.modules() if isinstance(m, nn.Linear) and m.out_features == E]
    return found[0] if len(found) == 1 else None


def moe_layers(model):
    """[MoE] of the decoder layers that route tokens to experts, in layer order. A module holding 3-D
    weights with a common leading size E is a layer's experts when a router with E rows sits beside
    it (a Mamba mixer's 3-D conv weight has none and is not an expert)."""
    found = []
    for i, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            parent, _, leaf = name.rpartition(".")
            if leaf == "experts" and isinstance(module, nn.ModuleList):
                raise E3Error(f"layer {i}: the experts are a list of modules, not fused 3-D weights; "
                              f"experts/routing.py serves the fused layout of transformers 5")
            stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3]
            if not stacked:
                continue
            E, block = stacked[0].shape[0], layer.get_submodule(parent)
            router = next((m for n, m in block.named_children() if n in ROUTER_NAMES), None)
            linear = router is not None and _router_linear(router, E)
            if linear and all(p.shape[0] == E for p in stacked):
                if block is layer:
                    raise E3Error(f"layer {i}: the experts and their router sit in the decoder layer "
                                  f"itself, beside its MLP, not in an MoE block of their own: "
                                  f"experts/routing.py serves a block")
                found.append(MoE(i, block, router, module, E, linear))
            elif leaf == "experts":
                raise E3Error(f"layer {i}: '{name}' holds {E} experts but no router named "
                              f"{' or '.join(ROUTER_NAMES)} making {E} logits (a weight of {E} rows, or "
                              f"one Linear of {E} outputs) sits beside it: experts/routing.py serves a "
                              f"router that scores the routed experts alone")
    if not found:
        raise E3Error(f"{type(model).__name__} routes no tokens to experts (no decoder layer holds fused "
                      f"3-D expert weights beside a router): expert importance needs an MoE model")
    if len({m.index for m in found}) < len(found):
        raise E3Error("a decoder layer holds two sets of routed experts; experts/routing.py serves one")
    return found


def experts_per_layer(moes):
    """E, the same in every MoE layer (a transformers config has one expert count)."""
    counts = {m.E for m in moes}
    if len(counts) > 1:
        raise E3Error(f"the MoE layers hold different numbers of experts ({sorted(counts)}); "
                      f"one score table [layers, E] needs one")
    return counts.pop()


# -----------------------------------------------------------------------------
# Experts unroutable: one at a time (importance), or a mask a forward (the search, the cut)

class _LogitMask(TorchFunctionMode):
    """While active: the output of every F.linear of width E gets -inf where `keep` [E] is False."""

    def __init__(self, keep):
        super().__init__()
        self.keep, self.hits = keep, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))  # inside its own handler the mode is off: no recursion
        if func is F.linear and out.shape[-1] == self.keep.shape[0]:
            self.hits += 1
            out = out.masked_fill(~self.keep.to(out.device), float("-inf"))
        return out


def expert_tensors(moe):
    """The per-expert tensors of an MoE layer, the one reader of them (the mask, the cut, the plan's
    count, LoRA's targets): [(module, name, dim)] for every parameter and buffer with a dimension of
    size E, dim the first such, in the experts module (its fused weights and biases, dim 0), the
    router and its children (its weight [E, H] and bias; a gate's statistics module: Ernie's
    moe_statics [1, E]) and the block itself (MiniMax-M2's e_score_correction_bias [E]). The block's
    other children (a shared expert, its gate) see every token: never routed, never listed."""
    found = []
    for module, recurse in ((moe.experts, True), (moe.router, True), (moe.block, False)):
        for owner_name, owner in (module.named_modules() if recurse else [("", module)]):
            for name, t in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
                dims = [d for d, size in enumerate(t.shape) if size == moe.E]
                if dims and (module is not moe.experts or dims[0] == 0):
                    found.append((owner, name, dims[0]))
    return found


def corrections(moe):
    """The per-expert tensors the mask places beside the router's logits: each one of E floating
    values outside the experts and the router's linear map (a score correction added to the choice:
    DeepSeek-V3's, Ernie's, MiniMax-M2's), set to -inf at a masked expert while the block runs. A
    per-expert tensor that is neither an expert's weight, the router's logits, nor one of these is
    one the mask cannot place: check_placeable refuses its family."""
    lora = [m for name, m in moe.linear.named_modules() if "parametrizations" in name.split(".")]
    inside = {id(m) for m in (*moe.experts.modules(), *lora)}  # a LoRA on the router's map
    return [(m, n, d) for m, n, d in expert_tensors(moe)
            if id(m) not in inside and not (m is moe.linear and n in ("weight", "bias"))]


def check_placeable(moe):
    """One error line where a per-expert tensor of `moe` is none the mask can place (works on the
    meta device: shapes alone)."""
    for m, n, d in corrections(moe):
        t = getattr(m, n)
        if t.numel() != moe.E or not t.is_floating_point():
            raise E3Error(f"layer {moe.index}: {type(m).__name__}.{n} {tuple(t.shape)} holds a value "
                          f"per expert that is neither an expert's weight, the router's logits nor a "
                          f"score correction of {moe.E} values: experts/routing.py cannot make an "
                          f"expert unroutable in this family")


def masked_routing(moe, keep):
    """The forwards that make the experts where keep() [E] is False unroutable in `moe`'s layer
    (keep() None: every expert routable), as (module, make) pairs for forward_replaced: the router's
    linear map, its E logits -inf there before the family's choice (a torch function mode active
    while it runs: the one F.linear of width E it makes), and the block: the score corrections, each
    a masked copy (-inf there), while it runs. A linear map that makes no or several outputs of width
    E, or a block that never calls it (its logits made another way), is refused with one line."""
    placed, calls = corrections(moe), [0]

    def logits(own):
        def forward(*args, **kwargs):
            mask = keep()
            if mask is None:
                return own(*args, **kwargs)
            calls[0] += 1
            with _LogitMask(mask.detach() != 0) as found:  # bool [E] of 0/1 values, no host sync
                out = own(*args, **kwargs)
            if found.hits != 1:
                raise E3Error(f"layer {moe.index}: {type(moe.linear).__name__} made {found.hits} outputs "
                              f"of width {moe.E} with F.linear, not one (the router's logits): "
                              f"experts/routing.py cannot make an expert unroutable in this family")
            return out
        return forward

    def corrected(own):
        def forward(*args, **kwargs):
            mask = keep()
            if mask is None:
                return own(*args, **kwargs)
            found, calls[0] = [], 0
            for m, n, d in placed:
                table = m._parameters if n in m._parameters else m._buffers
                t, shape = table[n], [1] * table[n].dim()
                shape[d] = moe.E
                found.append((table, n, t))
                table[n] = t.masked_fill(~(mask.detach() != 0).to(t.device).view(shape), float("-inf"))
            try:
                out = own(*args, **kwargs)
            finally:
                for table, n, t in found:
                    table[n] = t
            if not calls[0]:
                raise E3Error(f"layer {moe.index}: {type(moe.block).__name__} never called "
                              f"{type(moe.linear).__name__} for its logits: experts/routing.py cannot make "
                              f"an expert unroutable in this family")
            return out
        return forward
    return [(moe.linear, logits), (moe.block, corrected)]


@contextmanager
def forward_replaced(module, make):
    """Inside the block module.forward is make(its forward as found); then what was found again (a
    wrapper's, else the class's)."""
    found = vars(module).get("forward")
    module.forward = make(module.forward)
    try:
        yield
    finally:
        vars(module).update(forward=found) if found else vars(module).pop("forward")


@contextmanager
def expert_unroutable(moe, experts):
    """Inside the block, the router of `moe`'s layer never chooses `experts` (an index or several):
    the top-k is taken among the others and renormalised as the family does (masked_routing)."""
    keep = torch.ones(moe.E, dtype=torch.bool)
    keep[sorted({experts} if isinstance(experts, int) else set(experts))] = False
    with ExitStack() as stack:
        for module, make in masked_routing(moe, lambda: keep):
            stack.enter_context(forward_replaced(module, make))
        yield


class ExpertGates:
    """The routed experts of the search, a 0/1 mask per MoE layer, in routing (the cut then removes
    the others: experts/cut.py): while installed, each MoE layer moes[m] (row rows[m] of an [M, E]
    mask) routes with the mask

        `mask` in training mode when set (the search's draw), else `hard` (the set the cut would
        keep now; None: every expert)

    where m_j = 0 makes expert j unroutable (masked_routing) and each chosen expert's gate is
    multiplied by m_j, 1 in value: the forward is the masked model's exactly, and the gradient
    dL/dm_j = sum over the tokens routed to j of g_j(x) <dL/dy, f_j(x)> reaches the scores through
    the straight-through mask (an unchosen expert has none: the routing adds no pass over the
    experts). The gate is what the experts module is called with: experts(x, indices, weights)
    (weights[t, s] the gate of expert indices[t, s]), or experts(u) with u_{j,t} = g_j(x_t) x_t
    stacked per expert (Llama-4, which gates the input). remove() puts the forwards back."""

    def __init__(self, moes, rows):
        self.mask = self.hard = None
        self.stack = ExitStack()
        for moe, row in zip(moes, rows):
            for module, make in masked_routing(moe, lambda moe=moe, row=row: self.row(moe, row)):
                self.stack.enter_context(forward_replaced(module, make))
            self.stack.callback(moe.experts.register_forward_pre_hook(
                lambda module, args, kwargs, moe=moe, row=row: _gated(moe, self.row(moe, row), args, kwargs),
                with_kwargs=True).remove)

    def row(self, moe, row):
        """The mask layer `row` routes with now, as bool-able 0/1 values [E] (None: every expert)."""
        mask = self.mask if moe.router.training and self.mask is not None else self.hard
        return None if mask is None else mask[row]

    def remove(self):
        self.stack.close()


def _gated(moe, m, args, kwargs):
    """The experts' call with each chosen expert's gate multiplied by m [E] (None: as it is)."""
    if m is None:
        return None
    args, kwargs = list(args), dict(kwargs)
    slots = [(c, k) for c, keys in ((args, range(len(args))), (kwargs, list(kwargs))) for k in keys
             if torch.is_tensor(c[k])]
    index = [c[k] for c, k in slots if not c[k].is_floating_point()]
    if len(slots) == 3 and len(index) == 1:  # experts(x, indices, weights)
        c, k = next((c, k) for c, k in slots if c[k].is_floating_point() and c[k].shape == index[0].shape)
        c[k] = c[k] * m.to(c[k].dtype)[index[0]]
    elif len(slots) == 1:  # experts(u), the rows of expert j times m_j
        (c, k), E = slots[0], moe.E
        c[k] = (c[k].view(E, -1, c[k].shape[-1]) * m.to(c[k].dtype)[:, None, None]).view(c[k].shape)
    else:
        raise E3Error(f"layer {moe.index}: {type(moe.experts).__name__} is called with {len(slots)} "
                      f"tensors, neither (x, indices, weights) nor the stacked inputs: "
                      f"experts/routing.py cannot gate its experts")
    return tuple(args), kwargs


# -----------------------------------------------------------------------------
# Reading the routing as the family computes it

class RoutingReader:
    """Inside `with RoutingReader(moes, on_call, outputs):` every call of an MoE layer's experts
    calls on_call(m, chosen, gates, norms) first, m the layer's place in `moes` and, for its T
    tokens (the batch flattened, batch-major): chosen [T, E] bool, the experts the router chose;
    gates [T, E] float64, the gate the family applies to each (0 off the choice); norms [T, E]
    float64, ||f_j(x_t)||_2 of each chosen expert's output (0 elsewhere; None if not `outputs`)."""

    def __init__(self, moes, on_call, outputs=True):
        self.moes, self.on_call, self.outputs, self.inputs = moes, on_call, outputs, {}

    def __enter__(self):
        def remember(m):  # the router's input: each token's x (the stacked convention needs it)
            return lambda module, args, kwargs: self.inputs.__setitem__(
                m, (args[0] if args else kwargs["hidden_states"]).detach())

        def read(m):
            return lambda module, args, kwargs: self._read(m, args, kwargs)
        self.handles = [h for m, moe in enumerate(self.moes) for h in (
            moe.router.register_forward_pre_hook(remember(m), with_kwargs=True),
            moe.experts.register_forward_pre_hook(read(m), with_kwargs=True))]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _read(self, m, args, kwargs):
        moe, E = self.moes[m], self.moes[m].E
        tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
        index = [t for t in tensors if not t.is_floating_point()]
        norms = None
        if len(tensors) == 3 and len(index) == 1:  # experts(x, indices [T, k], weights [T, k])
            idx = index[0]
            weights = next(t for t in tensors if t.is_floating_point() and t.shape == idx.shape)
            x = next(t for t in tensors if t.is_floating_point() and t is not weights)
            T, k = idx.shape
            gates = torch.zeros(T, E, dtype=torch.float64, device=x.device)
            gates.scatter_(1, idx, weights.double())
            chosen = torch.zeros(T, E, dtype=torch.bool, device=x.device).scatter_(1, idx, True)
            if self.outputs:  # f_j(x_t) for each chosen pair: the family's code, top-1, weight 1
                # (.forward, not the call: the module's hooks, this one included, do not run again)
                f = moe.experts.forward(x.repeat_interleave(k, 0), idx.reshape(-1, 1),
                                        torch.ones(T * k, 1, dtype=weights.dtype, device=x.device))
                norms = torch.zeros_like(gates).scatter_(1, idx, f.double().norm(dim=-1).view(T, k))
        elif len(tensors) == 1:  # experts(u), u_{j,t} = g_j(x_t) x_t stacked per expert (Llama-4)
            x = self.inputs[m].reshape(-1, tensors[0].shape[-1])
            T = x.shape[0]
            if tensors[0].shape[0] != E * T:
                raise E3Error(f"layer {moe.index}: the experts got {tensors[0].shape[0]} rows for "
                              f"{T} tokens and {E} experts; experts/routing.py cannot read the gates")
            u, xd = tensors[0].reshape(E, T, -1).double(), x.double()
            gates = ((u * xd).sum(-1) / (xd * xd).sum(-1).clamp_min(1e-300)).T  # [T, E]
            chosen = gates != 0
            if self.outputs:  # every token through every expert, as the family runs them
                f = moe.experts.forward(x.repeat(E, 1)).reshape(E, T, -1)
                norms = f.double().norm(dim=-1).T * chosen
        else:
            raise E3Error(f"layer {moe.index}: {type(moe.experts).__name__} is called with "
                          f"{len(tensors)} tensors, neither (x, indices, weights) nor the stacked "
                          f"inputs: experts/routing.py cannot read the routing")
        self.on_call(m, chosen, gates, norms)
