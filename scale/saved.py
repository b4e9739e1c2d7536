"""
What a decoder layer keeps for the backward, counted from autograd itself: the plan's activation
figure for a family whose layer scale/plan.py's formula does not model (its attention is not q, k, v,
o; its norms are LayerNorms; a shared expert beside the routed ones; MLA; attention sinks ...).

A layer's bytes a token are counted on a small instance of the same family, run on the CPU:

  saved       every tensor autograd saves during the layer's forward (torch.autograd.graph.
              saved_tensors_hooks), once a storage (a view saved twice is one tensor), the weights
              left out: what checkpointing "none" keeps. Attributed to the layer that saves it
              first: a layer's input is its predecessor's output, counted once.
  selective   the layer's input, and the output of every op that scale/fsdp.py's selective policy
              saves (its matmuls and attention: fsdp.saved_ops), counted by a dispatch mode

The bytes a token come from two micro-batches (1 and 2 sequences: what a forward keeps whatever its
tokens cancels), the weights and autocast's copies of them left out (the plan counts those apart),
the routers zeroed (every token to the same top-k experts: no expert's fixed cost moves with the
batch). They are extrapolated to the model's size: a layer keeps per token a sum of terms each
proportional to one width (hidden, head_dim, the intermediate sizes, MLA's ranks), or to the
sequence length (an s x s mask, an eager attention's probabilities), or to neither (a head's
log-sum-exp, a router's logits over E experts, top-k indices). With every width divided by f
(heads, experts, top-k and the vocabulary's role as they are),

    bytes(w, s) = A w + C s + B,    w = 1 / f

(w, S1), (2 w, S1) and (w, 2 S1) give A, B and C, and bytes(1, S) is the model's at sequence length
S. A third point each way, (w / 2, S1) and (w, S1 / 2), checks that the instances are on that line
(a head_dim of 3, a rotary fraction of it rounded down: the next, twice as wide; the narrower one
unchecked where a kernel's alignment refuses it: grouped_mm's rows of 16 bytes); an instance of more
than MAX_PARAMS parameters is not built. f: the largest power of two, at most 64, that leaves every
width of the narrower instance (2 f) a whole number of at least 2, a head's among them where the
config derives it as hidden / heads. A head 1 wide is off the line, and would go unseen as the
narrowest instance (the narrower one, 0 wide, does not build): RoPE's cos and sin, a pair wide,
broadcast it, q and k come out 2 wide and v 1, and SDPA runs its math kernel, which keeps the s x s
probabilities (OLMoE at hidden 1024, 16 heads, f = 64: -50,496 B a token planned, 201,152 saved).
A model whose counted layers hold at most SMALL_PARAMS parameters is counted at its own widths,
f = 1: exact, at about the instances' cost. A width this module does not know to scale stays at
its size: its term lands in B, measured at full width, and the figure is as exact. The layers: one
of each kind (surgery's layer signature: module types, shapes, per-layer settings), the config cut
to those with surgery.pruned_config.

The instance runs in the run's precisions: r the residual stream's bytes (fp32 master weights under
bf16 autocast in one process, r = 4; bf16 weights, FSDP2's, r = 2), c the matmuls' (2 under autocast
or bf16, 4 fp32). A compiled layer keeps no more than the eager one (the partitioner recomputes what
it can): the figure stands for it too, a bound. Where a CPU runs another kernel than a GPU the count
is the CPU's: MLA's attention (query and value widths differ) keeps its probabilities on a CPU, not
in a GPU's memory-efficient kernel, an over-count.
"""
import copy
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runtime import E3Error
from surgery import LayerGates, _layer_signature, decoder_layers, pruned_config

ROUTERS = ("gate", "router")  # a MoE layer's router (its weight, bias, score correction)
VOCAB = 512  # the instances' vocabulary
MAX_PARAMS = 500e6  # the largest instance counted (2 GB in fp32)
SMALL_PARAMS = 2e6  # a model whose counted layers hold no more: counted at its own widths
S1 = 64  # the smaller instance's sequence length (the other 2 S1)
WINDOWS = ("sliding_window", "attention_chunk_size")  # attend within a window: a mask past it
WIDTH_NAMES = ("hidden_size", "head_dim", "n_embd", "n_inner", "ffn_dim", "word_embed_proj_dim",
               "intermediate_size_mlp")
WIDTH_ENDS = ("intermediate_size", "_head_dim", "_lora_rank")


class NotCounted(E3Error):
    """A family whose layers a CPU instance cannot stand for."""


def widths(cfg):
    """The config's width settings (ints), by name."""
    return {k: v for k, v in vars(cfg).items() if type(v) is int and v > 1
            and (k in WIDTH_NAMES or k.endswith(WIDTH_ENDS))}


def instance_config(config, kept, f, seq_len):
    """The config of the small instance: the layers `kept`, every width / f (a head_dim derived as
    hidden // heads that is no whole number written out at its size), a vocabulary of VOCAB ids,
    the windows placed so that the instances' sequences lie on the side of them seq_len does."""
    L = config.get_text_config().num_hidden_layers
    cfg = pruned_config(config, kept) if len(kept) < L else copy.deepcopy(config)
    text = cfg.get_text_config()
    for k, v in widths(config.get_text_config()).items():
        setattr(text, k, v // f)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    if getattr(text, "head_dim", None) is None and heads and hidden and hidden * f % heads:
        text.head_dim = hidden * f // heads  # a floor (GLM's 4096 / 96): written out, at its size
    text.vocab_size = VOCAB  # the layers' bytes do not depend on it
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(text, k, None), int) and getattr(text, k) >= VOCAB:
            setattr(text, k, None)
    for k in WINDOWS:
        w = getattr(text, k, None)
        if isinstance(w, int):
            setattr(text, k, S1 // 4 if seq_len > w else max(w, 4 * S1))
    text.max_position_embeddings = max(getattr(text, "max_position_embeddings", 0) or 0, 4 * S1)
    text.use_cache = False
    return cfg


class _SavedOps(TorchDispatchMode):
    """Counts the bytes of the outputs of `ops` while `on()`: what the selective policy keeps; and
    adds to `weights` every copy made of one (autocast's casts: the plan counts them apart, a fixed
    cost of the step, not of its tokens), held alive while counting (a freed one's address would
    come back as an activation's)."""

    def __init__(self, ops, on, weights):
        super().__init__()
        self.ops, self.on, self.bytes, self.weights, self.copies = ops, on, 0, weights, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func.overloadpacket is torch.ops.aten._to_copy and torch.is_tensor(out)
                and args[0].untyped_storage()._cdata in self.weights):
            self.weights.add(out.untyped_storage()._cdata)
            self.copies.append(out)
        if self.on() and func.overloadpacket in self.ops:
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if torch.is_tensor(t):
                    self.bytes += t.numel() * t.element_size()
        return out


def count(model, batch, seq, autocast, search=False):
    """(saved bytes, selective bytes) a layer of `model` keeps for one forward of batch x seq tokens;
    search: through the gates of eq. 1 (surgery.LayerGates at a mask that takes gradients), whose
    lerp keeps the layer's output and its input (which the layer itself may not keep)."""
    from scale.fsdp import saved_ops
    layers = decoder_layers(model)
    gates = LayerGates(model) if search else None  # its hooks first: they run inside the layer's count
    if gates:
        gates.mask = torch.ones(len(layers), requires_grad=True)
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    seen, where, held = set(), [], []
    saved, selective = [0] * len(layers), [0] * len(layers)
    mode = _SavedOps(saved_ops(), lambda: bool(where), weights)

    def pack(t):  # every tensor seen held alive: a freed one's address would come back as another's
        key = t.untyped_storage()._cdata
        if where and key not in seen and key not in weights:
            seen.add(key)
            held.append(t)
            saved[where[0]] += t.untyped_storage().nbytes()
        return t

    def enter(i):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            selective[i] += x.numel() * x.element_size()  # the checkpoint's input
            mode.bytes = 0
            where.append(i)
        return hook

    def leave(i):
        def hook(module, args, output):
            where.pop()
            selective[i] += mode.bytes
        return hook
    handles = [h for i, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(enter(i), with_kwargs=True), layer.register_forward_hook(leave(i)))]
    ids = torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(0))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode, \
                torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        if gates:
            gates.remove()
    return saved, selective


def instance_params(cfg):
    """The parameters of the model of `cfg` (built on the meta device)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).parameters())


def per_token(config, kept, f, seqs, r, c, seq_len):
    """{seq: per layer of the instance, (saved, saved in the search, selective) bytes a token, the
    slope from 1 to 2 sequences of seq tokens} for each of `seqs`, the instance built once."""
    from transformers import AutoModelForCausalLM
    cfg = instance_config(config, kept, f, seq_len)
    n = instance_params(cfg)
    if n > MAX_PARAMS:
        raise NotCounted(f"{config.model_type}: its activations could not be counted: the instance "
                         f"would hold {n / 1e6:,.0f}M parameters")
    with torch.random.fork_rng(devices=[]):  # the run's random state untouched
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if r == 2 else torch.float32)
    model.train()
    with torch.no_grad():  # the routers uniform: every token to the same top-k experts, so that no
        for name, module in model.named_modules():  # expert's fixed cost moves with the batch
            if name.rsplit(".", 1)[-1] in ROUTERS:
                for t in [*module.parameters(), *module.buffers()]:
                    t.zero_()
    autocast = r == 4 and c == 2
    out = {}
    for seq in seqs:
        counts = {(n, search): count(model, n, seq, autocast, search) for n in (1, 2) for search in (False, True)}

        def slope(search, k):  # k: 0 saved, 1 selective
            return [(b - a) / seq for a, b in zip(counts[1, search][k], counts[2, search][k])]
        out[seq] = slope(False, 0), slope(True, 0), slope(False, 1)  # saved; in the search; selective
    return out


_MEASURED = {}


def counted_bytes(config, r, c, seq_len):
    """Bytes a token at seq_len for `config`'s model, one a layer, counted on small instances (the
    module's docstring): (saved, saved in the search: the gates' too, selective's); made once a
    config and precision."""
    key = (config.to_json_string(use_diff=False), r, c, seq_len)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(config, r, c, seq_len)
    return _MEASURED[key]


def _measure(config, r, c, seq_len):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    mixers = [type(m).__name__ for m in decoder_layers(meta).modules()
              if any(isinstance(c, torch.nn.Conv1d) for c in m.children())]
    if mixers:  # a short causal convolution: a Mamba or delta-net mixer, which a GPU runs in its own
        # kernels (mamba-ssm, fla, causal-conv1d), a CPU in transformers' chunked fallback
        raise NotCounted(f"{config.model_type}: its activations could not be counted: its "
                         f"{mixers[0]} runs on a GPU in kernels that keep other tensors than the "
                         f"fallback a CPU instance runs")
    kinds = [json.dumps(_layer_signature(layer), sort_keys=True, default=str) for layer in decoder_layers(meta)]
    first = {}  # each kind of layer: the first layer of it, the one the instances keep
    for i, kind in enumerate(kinds):
        first.setdefault(kind, i)
    kept = sorted(first.values())
    text = config.get_text_config()
    sizes = widths(text)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    if getattr(text, "head_dim", None) is None and hidden and heads and hidden % heads == 0:
        sizes["head_dim"] = hidden // heads  # derived: it shrinks with hidden, and must stay 2 wide

    def valid(f):  # the widths / f: each a whole number, at least 2
        return all(v % f == 0 and v // f >= 2 for v in sizes.values())
    f = 128
    while f > 1 and not valid(f):
        f //= 2
    f, why = max(1, f // 2), None  # 2 f stays valid: the narrowest instance checks the others
    if instance_params(instance_config(config, kept, 1, seq_len)) <= SMALL_PARAMS:
        f = 1  # small: the model's own widths

    def narrower(f):  # the instance at 2 f, or None where it does not run (a kernel's alignment
        try:  # of its rows: grouped_mm's 16 bytes): then the widths' line is not checked
            return per_token(config, kept, 2 * f, [S1], r, c, seq_len)[S1]
        except NotCounted:
            raise
        except Exception:  # noqa: BLE001
            return None

    def linear(x0, x1, x2):  # at v, 2 v, 4 v: on one line (x0 None: not checked)
        return x0 is None or all(abs((c - b) - 2 * (b - a)) <= 0.01 * abs(c) + 8
                   for k in range(3) for a, b, c in zip(x0[k], x1[k], x2[k]))
    while True:  # the smallest instances on which the bytes are linear in the widths and in s
        try:
            at_f = per_token(config, kept, f, [S1 // 2, S1, 2 * S1], r, c, seq_len)
            short, base, long = at_f[S1 // 2], at_f[S1], at_f[2 * S1]
            wide = per_token(config, kept, f // 2, [S1], r, c, seq_len)[S1] if f > 1 else base
            if linear(short, base, long) and (f == 1 or linear(narrower(f), base, wide)):
                break
            why = "the bytes a token are not linear in the widths and the sequence length"
        except NotCounted as e:  # too large to build here: say why the smaller ones did not serve
            raise NotCounted(f"{e}" + (f"; the smaller ones: {why}" if why else "")) from None
        except Exception as e:  # noqa: BLE001 (a width too small for this family: twice as wide)
            why = f"a forward of the model from this config fails ({type(e).__name__}: " \
                  f"{str(e).splitlines()[0][:200]})"
        if f == 1:
            raise NotCounted(f"{config.model_type}: its activations could not be counted: {why}")
        f //= 2
    w = 1 / f  # bytes(1, seq_len) = base + A (1 - w) + C (seq_len - S1), per kind and layer

    def at(k, j):  # k: saved, saved in the search, selective
        A = (wide[k][j] - base[k][j]) / w if f > 1 else 0.0
        C = (long[k][j] - base[k][j]) / S1
        return base[k][j] + A * (1 - w) + C * (seq_len - S1)
    return tuple(tuple(at(k, kept.index(first[kind])) for kind in kinds) for k in range(3))
