"""
The numbers behind `prune.py --plan RANKS`: from config.json alone (the model on the meta device,
scale.fsdp.meta_model), the micro-batch and activation checkpointing a run on RANKS GPUs can use, what
each rank holds, and how long the run takes on H100s, H200s and A100s. The FLOP count lives here
and nowhere else: experiments/gpu_bench.py imports it for its MFU.

FLOPs (model FLOPs, torchtitan's convention: recomputation is not counted), per trained token at
sequence length s:

    6 N + 12 n s a          forward + backward        (2 N + 4 n s a for a forward alone)

N the matmul parameters: every decoder layer's weights of two or more dimensions and the LM head's
V x d (counted even when tied to the embedding: the head's matmul runs; the input embedding, a
lookup, is not counted); a routed expert (a 3-D weight, experts first) counts at the share of the
experts a token visits, top-k / experts. n the decoder layers, a = heads x head_dim: the two
attention matmuls, QK^T and AV, of 2 s a FLOPs each a token and layer, x 3 for the backward, not
halved for the causal mask (torchtitan's and PaLM's convention: MFU figures compare across
codebases). E3-Pruner's run: the search's T_M steps run all L layers, the T - T_M after the cut the
kept k; the teacher cache is the teacher's forward over the same tokens (the validation split's
few more are left out).

Memory per rank (GB = 1e9 bytes), each phase's at its size (phases(): the search's T_M steps at all
L layers and E routed experts, the gates on; the fine-tune's after the cut at the k layers and N
experts prune.py keeps, no gates; --search none: the fine-tune alone, from step 0), as listed by
memory():

    state        16 B a trainable parameter (fp32 weights, gradients, AdamW's two moments), 4 B a
                 frozen one (LoRA), split over the ranks by FSDP
    activations  micro-batch tokens x L x the bytes a token and layer keeps for the backward, + one
                 layer's whole when checkpointing (its recomputation in the backward)
    unit         FSDP2: 10 B x the largest decoder layer's parameters (its bf16 weights gathered and
                 the next layer's prefetched, its bf16 gradient and the fp32 copy reduce-scattered);
                 one process: the 2 B bf16 copy of every matmul weight autocast caches and, without
                 checkpointing, keeps for the backward (compiled: the LM head's and one layer's, the
                 layers' casts made and freed inside each layer's graph)
    tokens       > 1 rank: every rank's h (bf16) and dL/dh (fp32) a micro-batch, 6 B x ranks x
                 tokens x d (the vocabulary-parallel embedding and head exchange tokens, not weights)
    head         the fused head's chunk of logits, ~4 fp32 copies: 16 B x chunk x V (a chunk is
                 chunk tokens of every rank x the rank's V / ranks rows); the plain path's whole
                 micro-batch of them: 16 B x tokens x V
    batch        the cache's rows on the device: 8 B an input id, 12 B a top-K slot (int64 id, fp32
                 log-prob), 8 B a drawn id, 4 B the entropy

A card's memory is read from the device where there is one (torch.cuda.mem_get_info: what is
free), else taken from GPUS, in bytes as the cards report them (nvidia-smi's memory.total: H100 SXM
81,559 MiB, H200 143,771 MiB); USABLE (90%) of it is planned for: the CUDA context, NCCL's buffers
and the caching allocator's fragmentation take the rest.

The micro-batch: the largest that fits (a divisor of the batch a rank runs), for speed as well as
memory (one H200, the 1B shape: 45% MFU at micro-batch 2, 52% at 8, compiled; experiments/
gpu_bench.json). The fused head's chunk (> 1 rank; one process only with --logit-chunk): the largest
of chunk_sizes that fits beside that micro-batch. A chunk costs a fixed ~1.7 ms on an H200 (1B,
eager: chunks of 256 tokens run at 0.79x the plain head's tok/s, 1024 at 0.92x, 4096 at 0.99x), so
it is made as large as it may be, up to half a micro-batch's tokens: the fused head still holds at
most half the logits the plain one would. On a CPU (no card) 256: there a chunk costs its matmul.

Activation bytes a token and decoder layer (layer_bytes, read off the model's modules on the meta
device; d hidden, q = heads x head_dim, k = kv heads x head_dim, I the MLP's intermediate size (a
MoE layer: top-k x the expert's), h heads; r the residual stream's bytes, c the matmuls'):

    none         2 (4 d + r d + 4)      each pre-norm: x in fp32, 1 / rms, the normed x cast back
                 + 5 c d or 2 r d       autocast (c < r): each linear's own bf16 copy of its
                                        input (q, k, v; gate, up); else the norms' outputs
                 + c (2 q + 2 k) + 4 h  q and k after RoPE, v, SDPA's output, its fp32 LSE
                 + 4 c I                the MLP's gate, act(gate), up, their product
                 (q/k norms: + (4 + c)(q + k) + 4 (h + kv heads); Gemma's (1 + w) norms: 8 d + 4
                 each of four; routed experts: + top-k (2 c d + 12) + 4 E: each copy's input and
                 output, its weight and index, the router's probabilities; a sliding window
                 shorter than the sequence s: + 2 c (q - k) + c s, k and v repeated to every head
                 and the layer's s x s mask, SDPA given a mask instead of its causal flag)
    selective    r d + c (q + 2 k + d) + c q + 4 h + c (2 I + d)   torchtitan's op-level policy:
                 the layer's input and every matmul's output (q, k, v, o; gate, up, down; a MoE's
                 router), SDPA's output and LSE; norms, RoPE and SiLU recomputed
    full         r d   the layer's input alone, the whole layer recomputed in the backward
    search       + r d  on each: the gate of eq. 1 keeps its layer's output (d out / d m)

Compiled (torch.compile's partitioner, each layer one graph): without checkpointing a norm keeps
only its input and 1 / rms (the normed x, the casts and the outputs recomputed; q/k norms: the
projections' c-byte outputs and 1 / rms), the residual after attention recomputed from the
attention's c-byte output (min(r, c) d); with selective checkpointing the down projection's
output goes where no post-norm reads it (c d less; Gemma's keep it); full as eager.

The residual stream, r: bf16 (2) under FSDP2, as torchtitan keeps it: its MixedPrecisionPolicy
casts each layer's input to bf16 and the layer's norms and adds then run in bf16 (its output is
bf16: checked on a CPU, gloo, a tiny Llama fully_shard-ed with param_dtype bf16); fp32 (4) in one
process, autocast over fp32 master weights (autocast casts a matmul's inputs, never the stream: its
adds and norms stay fp32, as mixed precision intends). The plan takes c = 2 (a GPU's bf16); a CPU
run, fp32, is c = 4. (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", arXiv 2205.05198, count the same way for GPT's layers: 34 d + 5 h s bytes in bf16.)

The layers this formula models term by term are Llama's, Qwen3's, Gemma-3's and routed experts
alone (modelled()). Every other layer (LayerNorms, GPT-2's, GPT-NeoX's and OPT's attention, MLA, a
shared expert, extra norms, attention sinks ...) is counted, not modelled: what autograd saves on
small instances of the same family, extrapolated to its widths and sequence length (scale/saved.py;
on the four modelled families it gives the formula's figure to the byte, the MoE's within 0.1%),
the eager figure standing for the compiled one too; a family it cannot count (a Mamba mixer, a
gated delta-net: their GPU kernels keep other tensors than a CPU's fallback) is one error line.

Fitted to no measurement; checked against two: experiments/step_memory.py measures what prune.py's
own training step keeps on a CPU (the host bytes each layer leaves alive, search and fine-tune,
after KL importance) for Llama, Qwen3, Gemma-3 and a MoE, each mode, eager and compiled, fp32 and
bf16 autocast (experiments/step_memory.jsonl; tests/test_step_memory.py); and the bench's probe on
one H200 (experiments/gpu_bench.py --activations: the bytes two depths of the 7b8 shape leave
allocated after a forward, eager; probe_bytes adds autocast's bf16 weight copies in one process
without checkpointing): one process none 326,280 measured, 326,280 modelled (227,464 activations +
98,816 weight copies), selective 109,696 and 109,696, full 16,384 and 16,384; FSDP2 none 186,504
and 186,504, selective 101,504 and 101,504 (full: the probe measured nothing).
The MFU: the bench's, else ASSUMED_MFU; checkpointing's recomputation slows a step by its measured tok/s
ratio, else by RECOMPUTE (full: 8 instead of 6 FLOPs a parameter). A run compiles on a GPU unless
--no-compile (prune.py), so the plan's hours are at the compiled MFU.
"""
import functools
import json
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

from runtime import print0
from scale.fsdp import meta_model
from scale.saved import NotCounted, counted_bytes
from surgery import decoder_layers, micro_batch_problem, sequences_read

GB, MiB = 1e9, 2**20
# dense bf16 peak (no sparsity) and memory (nvidia-smi's memory.total, = cudaMemGetInfo's total) of
# the cards a run is planned for; peak_flops() reads other names of these (the bench's device)
GPUS = {"H100": (989e12, 81_559 * MiB), "H200": (989e12, 143_771 * MiB),
        "A100": (312e12, 81_920 * MiB)}
PEAKS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
USABLE = 0.9
MODES = ("none", "selective", "full")  # checkpointing, the cheapest in time first (unmeasured)
MIN_CHUNK = 256  # the fused head's tokens a chunk: the fewest the plan tries
LORA_RANK = 16  # what a plan that fits no card suggests
# torchtitan, Llama-3.1-8B on 8 H100s, FSDP2 eager, selective checkpointing, seq 8192: 5,762 tok/s a
# GPU, ~34% MFU counting the LM head (benchmarks/llama3_h100_202412_torchtitan.md)
ASSUMED_MFU = 0.34
ASSUMED = "assumed: torchtitan's FSDP2 eager, Llama-3.1-8B on H100s"
RECOMPUTE = {"none": 1.0, "selective": 0.95, "full": 0.75}  # MFU x this, unless measured
BENCH_JSON = Path(__file__).resolve().parents[1] / "experiments" / "gpu_bench.json"
BENCH_SHAPE = "7b8"  # the bench's shape closest to the models users prune


# -----------------------------------------------------------------------------
# FLOPs

def matmul_params(params, top_k=None):
    """The multiply-adds a token does with these weights: every weight of 2+ dimensions; a 3-D one
    holds routed experts (experts first), of which a token visits top_k."""
    return sum(p.numel() * (min(1.0, (top_k or p.shape[0]) / p.shape[0]) if p.dim() == 3 else 1)
               for p in params if p.dim() >= 2)


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def attention_width(cfg):
    """a = heads x head_dim (Qwen3-32B: 64 x 128 = 8192, wider than its hidden 5120)."""
    heads = cfg.num_attention_heads
    return heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)


def head_params(model):
    """The LM head's V x d, tied or not (its matmul runs either way)."""
    head = model.get_output_embeddings()
    return head.weight.numel() if head is not None else 0


def flops_per_token(model, seq_len, n_layers=None, train=True):
    """Model FLOPs a token at `seq_len`, with n_layers decoder layers of the model's mean layer (all
    of them by default): 6 N + 12 n s a for a training step, 2 N + 4 n s a for a forward (the
    module's docstring)."""
    cfg, layers = text_config(model), decoder_layers(model)
    n = len(layers) if n_layers is None else n_layers
    top_k = getattr(cfg, "num_experts_per_tok", None)
    per_layer = sum(matmul_params(layer.parameters(), top_k) for layer in layers) / len(layers)
    N = n * per_layer + head_params(model)
    return (3 if train else 1) * (2 * N + 4 * n * seq_len * attention_width(cfg))


def run_flops(args, model, L, cut=None):
    """(training FLOPs, teacher-cache FLOPs, tokens): the search's T_M steps at L layers, the rest at
    the kept k of the mean layer of `cut` (default: the model's; plan(): the model of N experts a
    MoE layer where --experts-keep N, cut_models()), and the teacher's forward over every trained
    token."""
    search = sequences_read(args.search_steps, args) * args.seq_len  # --search-batch-size
    after = sequences_read(args.steps, args) * args.seq_len - search
    train = (search * flops_per_token(model, args.seq_len, L)
             + after * flops_per_token(model if cut is None else cut, args.seq_len, args.keep))
    cache = (search + after) * flops_per_token(model, args.seq_len, L, train=False)
    return train, cache, search + after


def peak_flops(device_name):
    """A device name's dense bf16 peak (torch.cuda.get_device_name), or None for one not listed."""
    return next((peak for name, peak in PEAKS if name in (device_name or "")), None)


# -----------------------------------------------------------------------------
# Memory

def activation_formula(model, mode, residual_bytes=2, compute_bytes=2, compiled=False, search=False,
                       seq_len=0, which=None):
    """Bytes a token and decoder layer keeps for the backward (the module's docstring), the mean over
    the model's layers (`which`: these indices alone) at seq_len: layer_bytes, read off the modules
    on the meta device, where every layer is of the structure it models (modelled()); else counted
    from what autograd saves on small instances of the model (scale/saved.py: exact in eager, a
    bound compiled). search: with the gate of eq. 1, which keeps its layer's output (d out / d m)."""
    layers, cfg, r = decoder_layers(model), text_config(model), residual_bytes
    which = range(len(layers)) if which is None else which
    if mode == "full" or all(modelled(layers[i]) for i in which):
        each = [layer_bytes(layers[i], cfg, mode, r, compute_bytes, compiled, seq_len) for i in which]
        # the gate's lerp keeps the layer's output, and its input where nothing else does: a bf16
        # stream's eager norms keep their fp32 upcast, not the input (a checkpoint, a compiled
        # layer, an fp32 stream's norms keep it)
        twice = search and mode == "none" and r < 4 and not compiled
        return sum(each) / len(each) + (r * cfg.hidden_size * (2 if twice else 1) if search else 0)
    saved, searched, selective = counted_bytes(model.config, r, compute_bytes, seq_len)
    if mode == "none" and search:  # the gates' lerp as counted: it may keep the input as well
        return sum(searched[i] for i in which) / len(which)
    each = [(saved if mode == "none" else selective)[i] for i in which]
    return sum(each) / len(each) + (r * cfg.hidden_size if search else 0)  # the checkpoint keeps x


RMS_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
GEMMA_NORMS = {"pre_feedforward_layernorm", "post_feedforward_layernorm"}


def modelled(layer):
    """Whether layer_bytes models this decoder layer term by term: Llama's (q, k, v, o; per-head q/k
    norms; RMSNorms, Gemma's four), with a gated MLP or routed experts alone (a router and fused
    experts, no bias, no shared expert)."""
    children = dict(layer.named_children())
    if set(children) not in (RMS_LAYER, RMS_LAYER | GEMMA_NORMS):
        return False
    attn, mlp = children["self_attn"], children["mlp"]
    parts = dict(attn.named_children())
    head_dim = getattr(attn, "head_dim", None)
    if (not {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(parts) <= {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "q_norm", "k_norm", "rotary_emb"}
            or next(attn.parameters(recurse=False), None) is not None  # sinks
            or any(parts[n].weight.numel() != head_dim for n in ("q_norm", "k_norm") if n in parts)):
        return False
    norms = [m for n, m in children.items() if n.endswith("layernorm")]
    if not all("RMSNorm" in type(m).__name__ for m in norms):
        return False
    names = set(dict(mlp.named_children()))
    if names == {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return True
    experts = getattr(mlp, "experts", None)
    return (names in ({"gate", "experts"}, {"router", "experts"}) and experts is not None
            and {n for n, _ in experts.named_parameters()} == {"gate_up_proj", "down_proj"})


def layer_bytes(layer, cfg, mode, r, c, compiled=False, seq_len=0):
    """One decoder layer's bytes a token for the backward (the module's docstring, term by term): r
    the residual stream's bytes, c the matmuls' (2: bf16 by autocast or FSDP2's policy; 4: fp32);
    seq_len: a sliding window's mask is s x s."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    q = attention_width(cfg)
    hk = getattr(cfg, "num_key_value_heads", None) or h
    k = hk * q // h
    if mode == "full":
        return r * d
    attn, mlp = layer.self_attn, layer.mlp
    gemma = hasattr(layer, "pre_feedforward_layernorm")  # sandwich norms, Gemma's (1 + w) RMSNorm
    experts = getattr(mlp, "experts", None)
    if experts is not None:  # routed experts: E router logits; each of a token's top-k copies
        E, top = experts.down_proj.shape[0], cfg.num_experts_per_tok  # down_proj: [E, d, I]
        inter = top * experts.down_proj.shape[-1]
    else:
        inter = cfg.intermediate_size
    sdpa = c * q + 4 * h  # SDPA's output, and its fp32 log-sum-exp
    if mode == "selective":  # the input and every matmul's output: q k v o, the MLP's three, SDPA
        if experts is not None:  # the router's logits; the experts' grouped matmul is no matmul
            return r * d + c * (q + 2 * k + d) + sdpa + c * E  # the policy keeps: recomputed
        kept = r * d + c * (q + 2 * k + d) + sdpa + c * (2 * inter + d)
        # compiled: down's output goes where nothing needs it (no post-norm reads it, Gemma's does)
        return kept - (c * d if compiled and not gemma else 0)
    autocast = c < r  # one process: every linear casts its fp32 input, a bf16 copy each
    # a norm's normed x is kept for its weight's gradient: none for a frozen weight (LoRA)
    normed = 1 if layer.input_layernorm.weight.requires_grad else 0
    if gemma:  # x.float() and its normed fp32 copy, 1 / rms; two pre-norms and two post-norms
        norms = 4 * (4 * d + normed * 4 * d + 4)
    else:  # x in fp32, 1 / rms, the normed x cast back (r bytes); each pre-norm
        norms = 2 * (4 * d + normed * r * d + 4)
    if compiled:  # the partitioner recomputes a norm from its input and 1 / rms; the residual
        # after attention from the attention's output (c bytes); Gemma's post-norms keep theirs
        norms = r * d + 2 * c * d + 16 if gemma else r * d + min(r, c) * d + 8
    linears = (3 + (1 if experts is not None else 2)) if autocast else 0  # q k v; gate up (router)
    outputs = (linears * c * d if autocast else 2 * r * d) if not compiled else 0
    qk_norms = 0
    if hasattr(attn, "q_norm"):  # per head: the projection in fp32, its normed copy, 1 / rms
        qk_norms = (4 + normed * (4 if gemma else c)) * (q + k) + 4 * (h + hk)
        if compiled:  # recomputed from the projections' outputs and 1 / rms
            qk_norms = c * (q + k) + 4 * (h + hk)
    mlp_bytes = 4 * c * inter  # gate, act(gate), up, their product
    if experts is not None:  # in the stream's dtype (autocast does not cast the grouped matmul;
        # compiled: act(gate) recomputed), + each copy's input and output, its weight and index;
        mlp_bytes = (3 if compiled else 4) * r * inter + top * (2 * r * d + 4 + 8) + 4 * E  # the
        # router's probabilities
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(cfg, "sliding_window", None)
    masked = 0
    if window and seq_len > window:  # SDPA with a mask, not its causal flag: k and v repeated to
        masked = 2 * c * (q - k) + c * seq_len  # every head, and the layer's own s x s mask kept
    return norms + outputs + qk_norms + c * (2 * q + 2 * k) + 4 * h + mlp_bytes + masked


def residual_bytes(fsdp):
    """The residual stream's bytes a unit: bf16 under FSDP2, fp32 in one process (the docstring)."""
    return 2 if fsdp else 4


def probe_bytes(model, mode, fsdp, tokens):
    """What experiments/gpu_bench.py --activations measures, bytes a token and layer: the formula,
    and in one process without checkpointing the bf16 copy of a layer's matmul weights autocast
    keeps for the backward, spread over the probe's tokens (under FSDP2 the gathered bf16 weights
    are freed after each layer's forward; under checkpointing the recomputation casts again)."""
    act = activation_formula(model, mode, residual_bytes(fsdp))
    layers = decoder_layers(model)
    copies = 2 * matmul_params(p for layer in layers for p in layer.parameters()) / len(layers)
    return act + (copies / tokens if mode == "none" and not fsdp else 0)


def load_bench(path=BENCH_JSON):
    """The bench's JSON (experiments/gpu_bench.py), or {} where none is kept in the repo."""
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}


def activation_bytes(model, mode, fsdp, compiled=False, search=True, seq_len=0):
    """Bytes a token and layer in a training step on a GPU (bf16 matmuls; the residual stream bf16
    under FSDP2, fp32 in one process), in the search with the gates: the formula, fitted to no
    measurement (experiments/step_memory.py and the bench's probes check it)."""
    return activation_formula(model, mode, residual_bytes(fsdp), 2, compiled, search, seq_len)


def state_bytes(params, ranks):
    """fp32 weights, gradients and AdamW's two moments: 16 B a trainable parameter, 4 B a frozen
    one (LoRA's base), split over the ranks by FSDP."""
    params = list(params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return (16 * trainable + 4 * (sum(p.numel() for p in params) - trainable)) / ranks


def chunk_sizes(tokens):
    """The fused head's chunks worth trying for a micro-batch of `tokens` tokens a rank, largest
    first: powers of two from half the tokens down to MIN_CHUNK (the module's docstring)."""
    top = 2 ** max(0, (tokens // 2).bit_length() - 1)
    return [top >> i for i in range(max(1, (top // MIN_CHUNK).bit_length()))]


@functools.lru_cache(maxsize=4)
def sizes(model):
    """The counts memory() reads, once a model (choose() asks for many micro-batches): the state's
    bytes on one rank, the largest layer's parameters, each layer's matmul weights, the head's."""
    layers = decoder_layers(model)
    top_k = getattr(text_config(model), "num_experts_per_tok", None)
    return SimpleNamespace(state=state_bytes(model.parameters(), 1),
                           layer=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
                           cast=[matmul_params(layer.parameters(), top_k) for layer in layers],
                           head=head_params(model))


@functools.lru_cache(maxsize=64)
def layer_activations(model, mode, fsdp, compiled, search, seq_len):
    """activation_bytes, once a model and setting (choose() and min_ranks ask memory() for many
    micro-batches and ranks; as sizes(), the model is taken not to change after its first plan)."""
    return activation_bytes(model, mode, fsdp, compiled, search, seq_len)


def memory(args, model, ranks, micro_batch, mode, measured=None, chunk=None, search=True):
    """Bytes on each of `ranks` GPUs in a training step of `model` (the module's docstring), by part;
    chunk: the fused head's (default: --logit-chunk's; 0 the plain head); search: a search step (the
    gates of eq. 1 keep their layers' outputs), else a fine-tune step (no gates)."""
    measured = {} if measured is None else measured
    cfg, layers, n = text_config(model), decoder_layers(model), sizes(model)
    tokens, V, d = micro_batch * args.seq_len, cfg.vocab_size, cfg.hidden_size
    fsdp = ranks > 1
    chunk = args.logit_chunk if chunk is None else chunk
    compiled = bool(getattr(args, "compile", False))
    act = layer_activations(model, mode, fsdp, compiled, search, args.seq_len)
    recompute = (layer_activations(model, "none", fsdp, compiled, False, args.seq_len)
                 if mode != "none" else 0)
    K = 0 if args.targets == "sampled" else args.topk
    N = 0 if args.targets == "topk" else args.samples
    return {
        "state": n.state / ranks,
        "activations": tokens * (len(layers) * act + recompute),
        "unit": (10 * n.layer if fsdp
                 else 2 * ((max(n.cast) if getattr(args, "compile", False) else sum(n.cast)) + n.head)),
        "tokens": 6 * ranks * tokens * d if fsdp else 0,
        "head": 16 * chunk * ranks * math.ceil(V / ranks) if chunk else 16 * tokens * V,
        "batch": tokens * (8 + 12 * K + 8 * N + 4),
    }


def choose(args, model, ranks, card_bytes, measured=None, search=True):
    """The run's micro-batch, checkpointing and the fused head's chunk on `ranks` cards of card_bytes
    each: checkpointing only when memory needs it (none, then the faster of selective and full by
    the bench's measurements of this path, measured: the JSON, default the repo's; else selective
    first, RECOMPUTE), with it the
    largest micro-batch that runs every step (surgery.micro_batch_problem: it divides the search's
    batch and the fine-tune's on a rank, and splits among --masks-per-step) and fits USABLE of the
    card, and with that the largest chunk (chunk_sizes: the fused head, where --logit-chunk is
    unset, above one rank: prune.py sets 0 for one); a --micro-batch, --activation-checkpointing or
    --logit-chunk given is kept. Returns (micro_batch, mode, chunk, memory by part); (None, None,
    None, the smallest run's memory) where nothing fits. search: memory()'s (a search step, else a
    fine-tune step)."""
    sizes = [m for m in range(args.batch_size // ranks, 0, -1)
             if not micro_batch_problem(args, ranks, m)] or [1]  # none: prune.py's check says why
    sizes = [args.micro_batch] if getattr(args, "micro_batch", None) else sizes
    measured = load_bench() if measured is None else measured
    compiled = bool(getattr(args, "compile", False))
    fastest = sorted(MODES, key=lambda mode: -mfu(measured, ranks, mode, compiled)[0])  # stable
    modes = [args.activation_checkpointing] if getattr(args, "activation_checkpointing", None) else fastest
    for mode in modes:
        for m in sizes:
            chunks = [args.logit_chunk] if args.logit_chunk is not None else chunk_sizes(m * args.seq_len)
            for chunk in chunks:
                parts = memory(args, model, ranks, m, mode, measured, chunk, search)
                if sum(parts.values()) <= USABLE * card_bytes:
                    return m, mode, chunk, parts
    least = MIN_CHUNK if args.logit_chunk is None else None
    return None, None, None, memory(args, model, ranks, 1, "full", measured, least, search)


def min_ranks(args, model, ranks, card_bytes, measured=None, search=True):
    """The fewest ranks above `ranks` (dividing every batch, as prune.py requires) on which a run
    (search: a search step, else a fine-tune step) fits, or None. A number of ranks where even one
    sequence at its smallest chunk (the least choose() tries, each mode) does not fit is passed over
    at once."""
    chunk = args.logit_chunk if args.logit_chunk is not None else min(chunk_sizes(args.seq_len))
    modes = [args.activation_checkpointing] if getattr(args, "activation_checkpointing", None) else MODES

    def fits(n):
        if micro_batch_problem(args, n, 1):
            return False
        least = min(sum(memory(args, model, n, getattr(args, "micro_batch", None) or 1, mode, measured,
                               chunk, search).values()) for mode in modes)
        return least <= USABLE * card_bytes and choose(args, model, n, card_bytes, measured, search)[0]
    return next((n for n in range(ranks + 1, args.batch_size + 1) if fits(n)), None)


@functools.lru_cache(maxsize=2)
def lora_of(model):
    """The model on the meta device with --lora-rank LORA_RANK's adapters (every base weight
    frozen), made once a plan."""
    import copy

    from scale.lora import add_lora
    lora = copy.deepcopy(model)
    add_lora(lora, LORA_RANK, 2.0 * LORA_RANK, 0)
    return lora


def with_lora(args, model, ranks, card_bytes, measured=None, search=True):
    """choose()'s pick for the run with --lora-rank LORA_RANK (4 B a frozen parameter, not 16),
    where it runs without LoRA."""
    if args.lora_rank:
        return None, None, None, None
    return choose(args, lora_of(model), ranks, card_bytes, measured, search)


def card_memory():
    """(the device's name, its free bytes) where CUDA has a device (torch.cuda.mem_get_info: what
    this process can have, after its context and any other process), else None."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(), torch.cuda.mem_get_info()[0]


# -----------------------------------------------------------------------------
# Time

def mfu(measured, ranks, mode, compiled=False, what="train", logit_chunk=0):
    """(MFU, its source) for a run on `ranks` GPUs with checkpointing `mode`: the bench's record of
    that path at BENCH_SHAPE (FSDP2 above one rank, else the one-process run of the same head: the
    plain one, or the fused one at the chunk nearest logit_chunk; the teacher's forward for the
    cache), else ASSUMED_MFU; checkpointing's slowdown measured, else RECOMPUTE's."""
    runs = [r for r in measured.get("runs", []) if r.get("shape") == BENCH_SHAPE and r.get("mfu")]
    on = f"on {measured.get('device')}"
    if what == "cache":
        found = [r for r in runs if r["path"] == "teacher"]
        return (found[0]["mfu"], f"measured {on}") if found else (ASSUMED_MFU, ASSUMED)
    paths = ["fsdp", "fused"] if ranks > 1 else ["fused"] if logit_chunk else ["plain"]
    path = next((p for p in paths if any(r["path"] == p for r in runs)), paths[0])
    same = [r for r in runs if r["path"] == path and bool(r.get("compile")) == compiled]
    if logit_chunk:  # the fused head's records nearest the chunk (a log scale: 2x is 2x)
        near = min((abs(math.log2(r.get("chunk") or MIN_CHUNK) - math.log2(logit_chunk))
                    for r in same), default=None)
        same = [r for r in same if abs(math.log2(r.get("chunk") or MIN_CHUNK)
                                       - math.log2(logit_chunk)) == near]
    label = f"{path}" + (", one process" if ranks > 1 and path != "fsdp" else "") + (
        f", chunk {same[0].get('chunk') or MIN_CHUNK}" if logit_chunk and same else "") + (
        ", compiled" if compiled else ", eager")
    exact = [r for r in same if r.get("ac", "none") == mode]
    if exact:
        return exact[0]["mfu"], f"measured {on}, {label}, checkpointing {mode}"
    base = [r for r in same if r.get("ac", "none") == "none"]
    rate, source = (base[0]["mfu"], f"measured {on}, {label}") if base else (ASSUMED_MFU, ASSUMED)
    if mode == "none":
        return rate, source
    # the slowdown checkpointing showed on this path, else the plain one's, the other way compiled
    for other in (path, "plain"):
        ratio = {r.get("ac", "none"): r["mfu"] for r in runs if r["path"] == other
                 and bool(r.get("compile")) != compiled}
        if mode in ratio and "none" in ratio:
            slow = ratio[mode] / ratio["none"]
            return rate * slow, (f"{source}; x {slow:.3f} for {mode} checkpointing (measured: "
                                 f"{other}, {'eager' if compiled else 'compiled'})")
    return rate * RECOMPUTE[mode], f"{source}; x {RECOMPUTE[mode]} for {mode} checkpointing (assumed)"


# -----------------------------------------------------------------------------
# The plan

def cards():
    """The kinds a plan is made for: GPUS, and this machine's GPU where it has one (its free
    memory, its peak where peak_flops knows its name): {kind: (peak or None, bytes)}."""
    here = card_memory()
    return {**GPUS, **({f"this GPU ({here[0]})": (peak_flops(here[0]), here[1])} if here else {})}


def on_card(args, model, ranks, kind, card, flops, measured, search=True):
    """What `ranks` GPUs of `kind` (card: (peak, bytes)) make of the run: (summary entry, its
    lines). flops: (training, cache). The entry states every number its hours come from: hours =
    (training FLOPs / mfu + cache FLOPs / cache_mfu) / (ranks x peak_flops), each rate rounded
    before it is used. model, search: the run's largest phase's (plan())."""
    peak, card_bytes = card
    m, mode, chunk, parts = choose(args, model, ranks, card_bytes, measured, search)
    total = sum(parts.values()) / GB
    entry = {"micro_batch": m, "activation_checkpointing": mode, "logit_chunk": chunk,
             "gb_per_rank": round(total, 2), "fits": m is not None, "mfu": None, "cache_mfu": None,
             "peak_flops": peak, "hours": None, "gpu_hours": None}
    where = (f"plan: memory per rank on {kind} ({card_bytes / GB:.1f} GB, {USABLE:.0%} usable = "
             f"{USABLE * card_bytes / GB:.1f}):")
    detail = ", ".join(f"{k} {v / GB:.3g}" for k, v in parts.items())
    if m is None:
        entry["min_ranks"] = min_ranks(args, model, ranks, card_bytes, measured, search)
        lm, lmode, _, lparts = with_lora(args, model, ranks, card_bytes, measured, search)
        entry["lora"] = lm and {"lora_rank": LORA_RANK, "micro_batch": lm,
                                "activation_checkpointing": lmode,
                                "gb_per_rank": round(sum(lparts.values()) / GB, 2)}
        fixes = [f"--lora-rank {LORA_RANK} (base weights frozen: micro-batch {lm}, checkpointing "
                 f"{lmode}, {sum(lparts.values()) / GB:.1f} GB)"] if lm else []
        fixes += [f"{entry['min_ranks']} ranks"] if entry["min_ranks"] else []
        return entry, [f"{where} nothing fits {ranks} rank(s): {total:.1f} GB at micro-batch 1 with "
                       f"full checkpointing ({detail} GB); what fits: "
                       f"{' or '.join(fixes) or 'nothing up to the batch in ranks'}"]
    compiled = bool(getattr(args, "compile", False))
    rate, source = mfu(measured, ranks, mode, compiled, logit_chunk=chunk)
    cache_rate, cache_source = mfu(measured, ranks, mode, compiled, "cache")
    head = f", the fused head in chunks of {chunk} tokens" if chunk else ""
    lines = [f"{where} micro-batch {m} x {args.seq_len} tokens, activation checkpointing {mode}"
             f"{head}: {total:.1f} GB ({detail} GB)"]
    if peak:
        rate, cache_rate = round(rate, 4), round(cache_rate, 4)
        seconds = (flops[0] / rate + flops[1] / cache_rate) / (ranks * peak)
        entry.update(mfu=rate, cache_mfu=cache_rate, hours=round(seconds / 3600, 3),
                     gpu_hours=round(seconds * ranks / 3600, 2))
        lines.append(f"plan: time on {ranks} x {kind}: {entry['hours']:.2f} h "
                     f"({entry['gpu_hours']:.1f} GPU-h): training at {rate:.0%} MFU ({source}), "
                     f"the cache at {cache_rate:.0%} ({cache_source})")
    return entry, lines


# -----------------------------------------------------------------------------
# The run's phases, each at its size: the search at the source's, the fine-tune after the cut at the
# pruned model's (prune.py removes the dropped layers and experts at the cut: their weights,
# gradients and AdamW moments freed)

def build(config, args):
    """The model of `config` on the meta device, LoRA added as scale.fsdp.meta_model adds it."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if args.lora_rank:
        from scale.lora import add_lora
        add_lora(model, args.lora_rank, args.lora_alpha, args.seed)
    return model


def cut_models(args, model, L):
    """(the model of N routed experts a MoE layer at all L layers, the one the fine-tune trains): the
    source's config with --experts-keep N's expert count (experts.cut.expert_config, the export's
    own), and that with --keep k's k layers (surgery.pruned_config): the k largest by parameters
    (the first among equals), as the plan does not know which the search keeps: the most k layers
    can hold (any k on a model whose layers are all alike); --layers' own where given. `model` itself
    for what is not cut (--keep unset: every layer); made once a plan (state_line and plan() ask
    alike)."""
    keep = L if args.keep is None else args.keep
    layers = getattr(args, "layers", None)
    return _cut_models(model, L, keep, tuple(sorted(layers)) if layers else None,
                       getattr(args, "experts_keep", None), args.lora_rank, args.lora_alpha, args.seed)


@functools.lru_cache(maxsize=2)
def _cut_models(model, L, keep, layers, experts_keep, lora_rank, lora_alpha, seed):
    from surgery import pruned_config
    args = SimpleNamespace(lora_rank=lora_rank, lora_alpha=lora_alpha, seed=seed)
    wide = model
    if experts_keep:
        from experts.cut import expert_config
        wide = build(expert_config(model.config, experts_keep), args)
    if keep >= L:
        return wide, wide
    size = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
    kept = list(layers) if layers else sorted(sorted(range(L), key=lambda i: -size[i])[:keep])
    return wide, build(pruned_config(wide.config, kept), args)


def phases(args, model, L):
    """The run's phases, each trained at its size, largest first: [SimpleNamespace(name, steps,
    model, search)]: the search's T_M steps at the source's (E experts, L layers, the gates of eq. 1
    on), then the fine-tune's T - T_M at cut_models()'s (N experts, k layers, no gates); --search
    none (T_M = 0) cuts at step 0: the fine-tune alone. A phase of no steps is left out (T = 0: the
    search's size stands)."""
    cut = cut_models(args, model, L)[1]
    T, T_M = args.steps, args.search_steps
    found = [SimpleNamespace(name="search", steps=T_M, model=model, search=True)] if T_M else []
    if T - T_M > 0:
        found.append(SimpleNamespace(name="finetune", steps=T - T_M, model=cut, search=False))
    return found or [SimpleNamespace(name="search", steps=0, model=model, search=True)]


def phase_plan(args, phase, ranks, kinds, measured, first=None):
    """A phase's summary entry and its line: its steps, layers, routed experts a MoE layer (None:
    dense), parameters, the state a rank holds (weights, gradients, AdamW: state_bytes) on `ranks`,
    and for each kind of card choose()'s micro-batch, checkpointing, chunk and bytes a rank on
    `ranks`, and the fewest ranks on which the phase fits (min_ranks from 1; None: none up to the
    batch). first: on_card()'s entries for this phase ({kind: entry}), where plan() made them."""
    from experts.routing import expert_count
    model = phase.model
    params = sum(p.numel() for p in model.parameters())
    entry = {"steps": phase.steps, "layers": len(decoder_layers(model)),
             "experts": expert_count(model.config)[1], "params": params,
             "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
             "state_gb_per_rank": round(state_bytes(model.parameters(), ranks) / GB, 2), "by_kind": {}}
    picks = []
    for kind, (_, card_bytes) in kinds.items():
        if first is not None:
            e = first[kind]
            m, mode, chunk, gb = e["micro_batch"], e["activation_checkpointing"], e["logit_chunk"], e["gb_per_rank"]
        else:
            m, mode, chunk, parts = choose(args, model, ranks, card_bytes, measured, phase.search)
            gb = round(sum(parts.values()) / GB, 2)
        fewest = min_ranks(args, model, 0, card_bytes, measured, phase.search)
        entry["by_kind"][kind] = {"micro_batch": m, "activation_checkpointing": mode, "logit_chunk": chunk,
                                  "gb_per_rank": gb, "fits": m is not None, "fewest_ranks": fewest}
        on = (f"micro-batch {m}, checkpointing {mode}, {gb:.1f} GB a rank" if m is not None
              else f"nothing fits ({gb:.1f} GB a rank at the least)")
        picks.append(f"{kind}: {on}; fits from {fewest or 'no number up to the batch of'} rank(s)")
    experts = f", {entry['experts']} experts a MoE layer" if entry["experts"] else ""
    line = (f"plan: the {phase.name}, {phase.steps} steps at {entry['layers']} layers{experts}: "
            f"{params / 1e6:,.1f}M params, weights+grads+Adam {entry['state_gb_per_rank']:.3g} GB/rank; "
            f"on {ranks} rank(s) " + " | ".join(picks))
    return entry, line


def plan(args, model, L, ranks, cache_bytes=None, measured=None, gpu="H100", kinds=None):
    """prune.py --plan RANKS: (lines to print, summary: one JSON object). args: prune.parse_args()'s
    namespace once prune.py has resolved it for L layers on RANKS (T, T_M, compile; the logit
    chunk where given: its resolve_args); model: the student on the meta device (scale.fsdp.
    meta_model); measured: the bench's JSON (default: experiments/gpu_bench.json if the repo keeps
    one; {} for the formula and the assumed MFU alone); kinds: {kind: (peak, bytes)} (default:
    cards()). The summary's micro_batch, activation_checkpointing, logit_chunk, gb_per_rank, fits
    (and min_ranks, lora) are `gpu`'s; by_kind holds every kind's; mfu (training's), cache_mfu (the
    teacher's forward), peak_flops, hours and gpu_hours each kind's on `ranks` (the rates None
    where the run does not fit), hours = (train_flops / mfu + cache_flops / cache_mfu) / (ranks x
    peak_flops). Those are the run's largest phase's (phases(): the search's; --search none: the
    fine-tune's, N experts and k layers): prune.py picks one micro-batch and checkpointing for the
    run, and the smaller phase runs with them too. phases: {"search", "finetune": phase_plan()'s
    entry}, each phase at its own size; fewest_ranks: {kind: the most of the phases' fewest ranks
    (None: one of them fits on none)}, what the run needs."""
    measured = load_bench() if measured is None else measured
    kinds = cards() if kinds is None else kinds
    train_flops, cache_flops, tokens = run_flops(args, model, L, cut_models(args, model, L)[0])
    compiled = bool(getattr(args, "compile", False))
    runs = phases(args, model, L)
    first = runs[0]  # the largest: the fine-tune's model is the search's less what the cut removes
    act = {mode: activation_bytes(first.model, mode, ranks > 1, compiled, first.search, args.seq_len)
           for mode in MODES}
    lines = [f"plan: training {train_flops:.3g} FLOP ({args.search_steps} search steps at {L} "
             f"layers, {args.steps - args.search_steps} at {args.keep}), teacher cache "
             f"{cache_flops:.3g} FLOP (its forward over the {tokens:,} tokens); activations a token "
             f"and layer in the {first.name}: " + ", ".join(f"{mode} {b / 1e3:.1f} KB" for mode, b in act.items())
             + f"; {'compiled' if getattr(args, 'compile', False) else 'eager'}"]
    by_kind = {}
    for kind, card in kinds.items():
        by_kind[kind], more = on_card(args, first.model, ranks, kind, card, (train_flops, cache_flops),
                                      measured, first.search)
        lines += more
    each = {}
    for i, phase in enumerate(runs):
        each[phase.name], line = phase_plan(args, phase, ranks, kinds, measured, None if i else by_kind)
        lines.append(line)
    fewest = {kind: None if None in (f := [e["by_kind"][kind]["fewest_ranks"] for e in each.values()])
              else max(f) for kind in kinds}
    lines.append("plan: the run needs the most of its phases' (" + ", ".join(each) + "): fewest "
                 + ", ".join(f"{kind} {n or '-'}" for kind, n in fewest.items()))
    per_kind = ("mfu", "cache_mfu", "peak_flops", "hours", "gpu_hours")  # by kind; the rest `gpu`'s
    summary = {"params": sum(p.numel() for p in model.parameters()), "tokens": tokens,
               "train_flops": train_flops, "cache_flops": cache_flops, "ranks": ranks, "gpu": gpu,
               **{k: v for k, v in by_kind[gpu].items() if k not in per_kind},
               **{k: {kind: e[k] for kind, e in by_kind.items()} for k in per_kind},
               "by_kind": by_kind, "measured_on": measured.get("device"),
               "compile": bool(getattr(args, "compile", False)),
               "activation_bytes": {mode: round(b) for mode, b in act.items()},
               "phases": each, "fewest_ranks": fewest}
    if cache_bytes is not None:
        summary["cache_gb"] = round(cache_bytes / GB, 2)
    return lines, summary


# -----------------------------------------------------------------------------
# prune.py's two uses: --plan RANKS, and the micro-batch a GPU run picks

def state_line(args, ranks, model, L):
    """Parameters, and per rank the state (state_bytes) before and after the cut: after it the
    model cut_models() builds (k layers, N experts a MoE layer); --search none cuts at step 0."""
    search = state_bytes(model.parameters(), ranks) / GB
    cut = cut_models(args, model, L)[1]
    after = state_bytes(cut.parameters(), ranks) / GB
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    from experts.routing import expert_count
    E, N = expert_count(model.config)[1], expert_count(cut.config)[1]
    what = f"{L} -> {args.keep} layers" + (f", {E} -> {N} experts a MoE layer" if E != N else "")
    when = (f"{search:.3g} GB/rank in the search, {after:.3g} GB/rank after the cut ({what})"
            if args.search_steps else f"{after:.3g} GB/rank, the whole run after the cut at step 0 ({what})")
    return (f"plan: {n / 1e6:,.1f}M params ({trainable / 1e6:,.1f}M trainable) | weights+grads+Adam "
            + when)


def cache_meta(path):
    """What a run reads of a given --cache (its seq-len and targets fix the run's), from its
    meta.json alone: a plan hashes no shard and needs no tokenizer. None without one."""
    if path is None:
        return None
    meta = json.loads((Path(path) / "meta.json").read_text())
    return SimpleNamespace(seq_len=meta["seq_len"], topk=meta["topk"], samples=meta.get("samples"),
                           targets=meta.get("targets", "topk"))


def expert_kl_cost(args, model, summary):
    """--experts-keep with --expert-init kl: the exact expert KL importance's cost on a rank
    (experts.importance.kl_forwards: the dense pass, then ceil(E / R) partial forwards from each MoE
    layer, the experts shared out among the ranks) over the --n-calib sequences every rank reads
    (prune.calibration_batches): its FLOPs; hours = FLOPs / (cache_mfu x one card's peak), a floor
    (a forward, as the cache's); and the bf16 bytes FSDP gathers a rank for it: (R - 1) / R of every
    decoder layer and of the LM head's rows each forward (FSDP2 gathers in a layer's hooks, which run
    for the replayed layers too: their forward is replaced, not their call). summary: plan()'s.
    Returns (line, {summary fields})."""
    from experts.importance import kl_forwards
    forwards = Counter(kl_forwards(model, args.plan))  # {layers a forward runs (the last n): how many}
    L, ranks = len(decoder_layers(model)), args.plan
    calls = sum(n * c for n, c in forwards.items())
    flops = args.n_calib * args.seq_len * sum(
        c * flops_per_token(model, args.seq_len, n, train=False) for n, c in forwards.items())
    weights = sum(p.numel() for p in decoder_layers(model).parameters()) + head_params(model)
    gathered = args.n_calib * sum(forwards.values()) * weights * 2 * (1 - 1 / ranks)
    gpu, rate, peak = summary["gpu"], summary["cache_mfu"], summary["peak_flops"]
    hours = {k: rate[k] and peak[k] and round(flops / (rate[k] * peak[k]) / 3600, 3) for k in rate}
    when = (f": at least {hours[gpu]:.2f} h (its FLOPs on one {gpu} at the cache's {rate[gpu]:.0%} "
            f"MFU), beside {summary['hours'][gpu]:.2f} h for the run's training and cache" if hours.get(gpu) else "")
    fsdp = f", and FSDP gathers {gathered / 1e12:,.1f} TB a rank for it" if ranks > 1 else ""
    return (f"plan: --expert-init kl scores each expert exactly: {sum(forwards.values()):,} forwards a "
            f"calibration sequence on a rank (the dense one, then ceil(E / ranks) from each MoE layer "
            f"on), {calls:,} layer calls = {calls / L:,.0f} forwards' worth, {flops:.3g} FLOP over "
            f"{args.n_calib} x {args.seq_len} tokens{when}{fsdp} (reap, frequency: one forward)"), {
        "expert_importance_forwards": sum(forwards.values()), "expert_importance_layer_calls": calls,
        "expert_importance_flops": flops, "expert_importance_hours": hours,
        "expert_importance_gathered_bytes": round(gathered)}


def print_plan(args, resolve_args, check_args, search, schedule_line):
    """prune.py --plan RANKS: args resolved and checked as a run's, for RANKS ranks, a given
    --cache's meta.json and the model on the meta device (fsdp.meta_model), by the caller's own
    resolve_args and check_args (a copied prune.py plans with its own code); search: the search's
    class. Prints the schedule, the state a rank holds, the search's own forward tokens (evo,
    random), then plan()'s lines per GPU kind; the last line one JSON object."""
    ranks = args.plan
    resolve_args(args, ranks, cache_meta(args.cache))
    model, bytes_a_token = meta_model(args)
    L = len(decoder_layers(model))
    check_args(args, model.config, L, ranks)
    cache_bytes = bytes_a_token * sequences_read(args.steps, args) * args.seq_len
    lines, summary = plan(args, model, L, ranks, cache_bytes=cache_bytes)
    experts = []
    if getattr(args, "experts_keep", None):  # the routed experts' cut (experts/search.py)
        from experts.search import plan_line
        line, fields = plan_line(args, model, L)
        experts, summary = [line], {**summary, **fields}
        if args.expert_init == "kl":
            line, fields = expert_kl_cost(args, model, summary)
            experts, summary = [*experts, line], {**summary, **fields}
    print("\n".join([schedule_line(args, ranks) + f" | cache {cache_bytes / GB:.3g} GB on disk",
                     state_line(args, ranks, model, L), *experts,
                     *([f"plan: {search.plan(args, L)}"] if hasattr(search, "plan") else []),
                     *lines]))
    print(json.dumps(summary))


def pick_for_card(args, world):
    """prune.py's --micro-batch, --activation-checkpointing and (> 1 rank) --logit-chunk, where unset,
    decided here alone (a value given is kept, fitting or not): on a GPU choose()'s pick for its
    free memory, where nothing fits one sequence with full checkpointing; on CPU ranks the fused
    head in chunks of MIN_CHUNK (there a chunk costs its matmul; prune.py: one sequence, no
    checkpointing). The pick is for the run's largest phase (phases(): the search's; --search none:
    the cut model's, N experts and k layers from step 0), and holds for the smaller one after it."""
    if None not in (args.micro_batch, args.activation_checkpointing, args.logit_chunk):
        return
    here = card_memory()
    try:
        if here:
            model = meta_model(args)[0]
            first = phases(args, model, len(decoder_layers(model)))[0]
            micro, mode, chunk, _ = choose(args, first.model, world, here[1], search=first.search)
        else:
            micro, mode, chunk = None, None, None
    except NotCounted as e:  # a family whose activations the plan cannot count: the least memory
        print0(f"warning: {e}; trying one sequence with full checkpointing")
        micro, mode, chunk = 1, "full", None
    if here and micro is None:
        print0("warning: the plan finds no micro-batch that fits this GPU (prune.py --plan): "
               "trying one sequence with full checkpointing")
        micro, mode = 1, "full"
    args.micro_batch = args.micro_batch or micro
    args.activation_checkpointing = args.activation_checkpointing or mode
    args.logit_chunk = (chunk or MIN_CHUNK) if args.logit_chunk is None else args.logit_chunk
    if here:
        head = f", the fused head in chunks of {args.logit_chunk} tokens" if args.logit_chunk else ""
        print0(f"micro-batch {args.micro_batch}, activation checkpointing "
               f"{args.activation_checkpointing}{head}")
