"""
E3-Pruner: remove whole decoder layers from a Hugging Face causal LM and recover it cheaply
(paper Algorithm 1; our reading of it in SPEC.md). Four stages, in order:

  1. importance  s_l = KL(p_{-l} || p) on --n-calib sequences (or ShortGPT's BI, or random)  SPEC 1
  2. search      first --search-frac of the steps: Gumbel-TopK masks from s, weights and s
                 trained together, tau and k' annealed (sampler.py)                         SPEC 2
  3. fine-tune   the pruned model (only k layers run) with --loss akd|kd|sft on the cached
                 teacher targets of cache_teacher.py (kd.py)                                 SPEC 3, 4
  4. export      OUT/model: a plain HF checkpoint + pruning.json (surgery.py)                SPEC 5

Usage:
  python prune.py                                      # demo: packaged SmolLM2-135M, 30 -> 20 layers, CPU
  python prune.py --model M --keep K --steps 1200      # one process, CPU or one GPU
  torchrun --nproc_per_node 8 prune.py --model meta-llama/Llama-2-7b-hf --keep 13   # FSDP2, bf16
  python prune.py ... --resume                         # continue from OUT/checkpoints
Baselines (README): ShortGPT = --init bi --search none --steps 0; Minitron-style = --init bi
--search none --loss kd; KL one-shot = --init kl --search none; a given layer set, fine-tuned
only = --layers 0,1,4,... (skips stages 1 and 2).

With no --cache, a teacher cache for the needed token budget is built first (same code as
cache_teacher.py) under ~/.cache/e3-pruner/teacher/ ($E3_TEACHER_CACHE), so runs with the same model,
data and budget share it.
OUT holds run.json (the arguments), log.jsonl, checkpoints/ and, when done, model/.
"""
import argparse
import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

import common
import data
from cache_teacher import TeacherCache, build_cache
from common import E3Error, print0
from kd import sft_loss, topk_kd_loss
from parallel import load_from_rank0, parallelize
from sampler import expected_kept, gumbel_noise, gumbel_topk, hard_concrete, kept_layers, lagrangian, temperature
from surgery import (LayerGates, decoder_layers, export, layer_importance, protected_layers, remove_layers,
                     top_k_layers)

# Settings used when --model is not given: the packaged demo, sized for a 2-core CPU (~10 minutes).
DEMO = dict(keep=20, seq_len=128, n_calib=16, tokens=40_960, batch_size=8, micro_batch=4, warmup=4,
            eval_every=10, ckpt_every=20)
# Settings that are the paper's (Appendix E) otherwise.
PAPER = dict(keep=None, seq_len=4096, n_calib=40, tokens=None, batch_size=128, micro_batch=1, warmup=60,
             eval_every=100, ckpt_every=200)


def layer_list(text):
    return sorted({int(i) for i in text.split(",")})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    # model and data
    p.add_argument("--model", default=None, help="HF folder or hub id (default: packaged SmolLM2-135M demo)")
    p.add_argument("--keep", type=int, help="decoder layers to keep, k")
    p.add_argument("--cache", help="teacher cache from cache_teacher.py (default: build one)")
    p.add_argument("--data", help="corpus for calibration and for building a cache (default: packaged)")
    p.add_argument("--text-field", default="text")
    p.add_argument("--out", help="run folder (default: runs/<model>-keep<k>)")
    # stage 1: importance
    p.add_argument("--init", choices=["kl", "bi", "random"], default="kl")
    p.add_argument("--layers", type=layer_list,
                   help="keep exactly these layers (e.g. 0,1,4,...: another run's kept_layers): no importance,\n"
                        "no search, only fine-tuning; separates a layer set's worth from how it was found")
    p.add_argument("--n-calib", type=int)
    p.add_argument("--protect-first", type=int, default=1, help="first layers never pruned")
    p.add_argument("--protect-last", type=int, default=1, help="last layers never pruned")
    # stage 2: Gumbel-TopK search
    p.add_argument("--search", choices=["gumbel", "none", "l0"], default="gumbel",
                   help="none: freeze the initial top-k; l0: Sheared-LLaMA's hard-concrete baseline")
    p.add_argument("--search-frac", type=float, default=0.1, help="T_M / T")
    p.add_argument("--beta", type=float, default=0.9, help="tau anneals from 1 to 1 - beta")
    p.add_argument("--score-lr", type=float, default=0.05, help="Adam lr of the layer scores S")
    # stage 3: training
    p.add_argument("--loss", choices=["akd", "kd", "sft"], default="akd")
    p.add_argument("--steps", type=int, help="optimizer steps T (or --tokens)")
    p.add_argument("--tokens", type=int, help="token budget; sets T = tokens / (batch-size * seq-len)")
    p.add_argument("--batch-size", type=int, help="GLOBAL batch in sequences, split over ranks and micro-batches")
    p.add_argument("--micro-batch", type=int, help="sequences per forward on each rank")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--topk", type=int, default=10, help="teacher top-K when building a cache")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, help="linear warm-up steps, then cosine to lr/10")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    # scale
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--lora-rank", type=int, default=0, help="> 0: train LoRA adapters, merged at export")
    p.add_argument("--lora-alpha", type=float, default=None, help="default 2 * rank")
    # logging and checkpoints
    p.add_argument("--eval-every", type=int)
    p.add_argument("--ckpt-every", type=int)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    a = p.parse_args(argv)
    if a.layers is not None:  # recorded as such in run.json and pruning.json
        a.init, a.search, a.keep = "given", "none", a.keep or len(a.layers)
    for key, value in (DEMO if a.model is None else PAPER).items():
        if getattr(a, key) is None and not (key == "seq_len" and a.cache):  # a given cache sets seq-len
            setattr(a, key, value)
    a.lora_alpha = a.lora_alpha or 2.0 * a.lora_rank
    return a


def resolve_steps(a):
    # T is the one schedule length everything hangs off (LR, tau, k'); a token budget is the fairer way to
    # compare methods, so --tokens converts to steps, and the paper's 1200 steps are the fallback.
    if a.steps is None:
        a.steps = math.ceil(a.tokens / (a.batch_size * a.seq_len)) if a.tokens else 1200


# -----------------------------------------------------------------------------
# Learning rate: linear warm-up, cosine decay to lr/10 at T (SPEC 4)

def get_lr(step, args):
    # three branches as in nanoGPT: warm-up, after the end, cosine in between (floor lr/10, not 0,
    # so the last steps of a short run still learn)
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if step >= args.steps:
        return args.lr / 10
    ratio = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr / 10 + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.lr / 10)


# -----------------------------------------------------------------------------
# Model set-up: LoRA, FSDP2, optimizer

class LoRA(nn.Module):
    """weight -> weight + (alpha / r) * B @ A, as a parametrization: the HF module tree stays as it is,
    the base weight is frozen, and merging at export is weight + scale * B @ A (see merge_lora)."""

    def __init__(self, weight, rank, alpha, generator):
        super().__init__()
        A = torch.randn(rank, weight.shape[1], generator=generator, dtype=weight.dtype) / math.sqrt(weight.shape[1])
        self.A = nn.Parameter(A.to(weight.device))  # on the meta device too, when the weight is
        self.B = nn.Parameter(torch.zeros(weight.shape[0], rank, dtype=weight.dtype, device=weight.device))  # no-op
        self.scale = alpha / rank

    def forward(self, weight):
        return weight + self.scale * (self.B @ self.A).to(weight.dtype)


def add_lora(model, rank, alpha, seed):
    # Every weight freezes, embeddings and norms included; only the adapters of the decoder layers'
    # linear maps train (SPEC 4). Seeded so that every run builds identical A factors.
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in decoder_layers(model):
        for mod in list(layer.modules()):
            if isinstance(mod, nn.Linear):
                parametrize.register_parametrization(mod, "weight", LoRA(mod.weight, rank, alpha, gen))
                mod.parametrizations.weight.original.requires_grad_(False)


def merge_lora(state, scale):
    """Fold LoRA factors of a full state dict into plain `.weight` tensors (export needs no project code)."""
    out = {}
    for key, value in state.items():
        if key.endswith(".parametrizations.weight.original"):
            base = key[: -len(".parametrizations.weight.original")]
            A, B = state[base + ".parametrizations.weight.0.A"], state[base + ".parametrizations.weight.0.B"]
            out[base + ".weight"] = value + scale * (B.float() @ A.float()).to(value.dtype)
        elif ".parametrizations.weight.0." not in key:
            out[key] = value
    return out


def make_optimizer(model, args, state=None):
    """AdamW over the trainable weights (created after sharding, so it holds the shards). `state`
    carries Adam's moments over when the pruned layers leave the optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    # betas (0.9, 0.95): the usual LLM fine-tuning choice (the paper names only AdamW and the lr)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if state is not None:
        # the kept layers are the same Parameter objects before and after pruning, so their moments
        # carry over; a fresh optimizer would restart Adam's bias correction mid-schedule
        for p in params:
            if p in state:
                opt.state[p] = state[p]
    return opt


def build_model(args, device, rank, world, kept=None):
    """The student in fp32 (the master weights), as this run trains it: pruned to `kept` when resuming
    after the search, with LoRA and checkpointing when asked, FSDP2-sharded under torchrun."""
    ddp = world > 1
    model, tok = common.load_model(args.model, "cpu", torch.float32, weights=rank == 0)
    model.config.use_cache = False
    if kept is not None:  # resuming after the search: rebuild the pruned shape
        remove_layers(model, kept)
    if args.lora_rank:
        add_lora(model, args.lora_rank, args.lora_alpha, args.seed)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not ddp:
        return model.to(device).train(), tok
    full_state = model.state_dict() if rank == 0 else {}  # holds the full tensors while parallelize() splits them
    load_from_rank0(parallelize(model, device), full_state, rank, device)
    return model.train(), tok


# -----------------------------------------------------------------------------
# Data: each rank's share of every global batch

def rank_indices(step, args, n, rank, world):
    """The sequence indices this rank trains on at `step`: the global batch is a slice of a seeded
    permutation (one per epoch), split evenly over ranks, so 1 or N ranks see the same global batch."""
    # No DistributedSampler: the index of every global batch is a pure function of (seed, step), so a
    # resume or a different number of ranks picks up exactly the same sequences.
    start = step * args.batch_size
    epoch, offset = divmod(start, n)
    idx = []
    while len(idx) < args.batch_size:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        idx += order[offset: offset + args.batch_size - len(idx)]
        epoch, offset = epoch + 1, 0
    per_rank = args.batch_size // world
    return idx[rank * per_rank:(rank + 1) * per_rank]


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def student_logits(model, batch, vocab, device):
    """Student logits sliced to the tokenizer's vocabulary (some checkpoints pad the embedding);
    bf16 autocast on one GPU (FSDP has its own mixed precision), upcast to fp32 inside kd.py."""
    with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda" and not is_fsdp(model)):
        return model(input_ids=batch["input_ids"], use_cache=False).logits[..., :vocab]


def loss_from_logits(logits, batch, kind):
    """The training objective (SPEC 3): akd, kd or sft."""
    if kind == "sft":
        return sft_loss(logits, batch["input_ids"])
    entropy = batch["entropy"] if kind == "akd" else None
    return topk_kd_loss(logits, batch["topk_ids"], batch["topk_logprobs"], entropy)


def compute_loss(model, batch, kind, vocab, device):
    """The training objective on one micro-batch."""
    return loss_from_logits(student_logits(model, batch, vocab, device), batch, kind)


def is_fsdp(model):
    return hasattr(model, "set_requires_gradient_sync")


@torch.no_grad()
def validate(model, cache, args, rank, world, device):
    """Mean top-K KD loss (unweighted, the same yardstick whatever --loss is) and next-token
    cross-entropy on the cache's validation split. Every rank runs the same number of forwards."""
    model.eval()
    n = cache.len_split("val")
    per_rank = math.ceil(n / world)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for a in range(0, per_rank, args.micro_batch):
        idx = [rank * per_rank + i for i in range(a, min(a + args.micro_batch, per_rank))]
        real = [i for i in idx if i < n]
        # a rank past the end still runs a (dummy) forward with weight 0: under FSDP every rank must
        # join every all-gather, or the others hang
        batch = to_device(cache.get(real or [0], "val"), device)
        logits = student_logits(model, batch, cache.vocab_size, device)  # one forward, both numbers
        kd_loss, ce = loss_from_logits(logits, batch, "kd"), loss_from_logits(logits, batch, "sft")
        w = len(real)
        totals += torch.tensor([kd_loss.item() * w, ce.item() * w, w], dtype=torch.float64, device=device)
    common.all_reduce_sum(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


# -----------------------------------------------------------------------------
# Stage 1 and 2 helpers

def calibration_batches(args, tok, cache, rank, world):
    """--n-calib sequences, this rank's share, padded with weight-0 batches so all ranks run the same
    number of forwards (FSDP collectives must match). From --data if given, else the cache."""
    if args.data or cache is None:
        seqs = data.train_blocks(tok, args.data, args.seq_len, args.n_calib, args.text_field)
    else:
        seqs = cache.get(list(range(min(args.n_calib, cache.len_split("train")))))["input_ids"]
    per_rank = math.ceil(len(seqs) / world)
    for i in range(rank * per_rank, (rank + 1) * per_rank):
        yield (seqs[i:i + 1], None, 1) if i < len(seqs) else (seqs[:1], None, 0)


def free_layers(L, protected):
    return [i for i in range(L) if i not in protected]


def sample_mask(method, scores, k_t, tau, protected, noise):
    """The search mask over the unprotected layers (protected layers always 1): Gumbel-TopK with k'_t
    ones (noise: Gumbel), or for the l0 baseline a hard-concrete sample (noise: uniform)."""
    free = free_layers(scores.shape[0], protected)
    # The sampler only sees the free layers, so k'_t counts the protected ones as already kept.
    if method == "gumbel":
        sub = gumbel_topk(scores[free], k_t - len(protected), tau, noise=noise[free])
    else:
        sub = hard_concrete(scores[free], noise[free])
    mask = torch.ones(scores.shape[0], device=scores.device)
    return mask.index_put((torch.tensor(free, device=scores.device),), sub)


class LayerCallCounter:
    """Counts decoder-layer forward calls per step: the log shows that only k layers run after the search."""

    def __init__(self):
        self.n, self.handles = 0, []

    def attach(self, model):
        for h in self.handles:
            h.remove()
        self.handles = [layer.register_forward_pre_hook(self._count) for layer in decoder_layers(model)]

    def _count(self, *_):
        self.n += 1


# -----------------------------------------------------------------------------
# Run folder, log and checkpoints

def run_identity(args):
    """The arguments that define a run; --resume and logging cadence may change between invocations."""
    skip = {"resume", "eval_every", "ckpt_every"}
    return {k: v for k, v in sorted(vars(args).items()) if k not in skip}


def prepare_out(args):
    out = Path(args.out)
    run_file = out / "run.json"
    if run_file.exists():
        previous = json.loads(run_file.read_text())
        if previous != run_identity(args):
            raise E3Error(f"'{out}' already holds a different run; pass another --out (or the same "
                          f"arguments with --resume)")
        if not args.resume:
            raise E3Error(f"'{out}' already holds this run; pass --resume to continue it or another --out")
    elif out.exists() and any(out.iterdir()):
        raise E3Error(f"'{out}' exists and is not an E3-Pruner run folder; pass another --out")
    return out


def save_checkpoint(path, model, opt, state, rank):
    """Every rank gathers (FSDP collectives), rank 0 writes tmp then renames: a kill never leaves a
    half-written checkpoint that looks complete. Tensors and plain types only (weights_only loads)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model_sd, opt_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({**state, "model": model_sd, "optim": opt_sd}, tmp)
        os.replace(tmp, path)
        for old in path.parent.glob("step_*.pt"):
            if old != path:
                old.unlink()
        print0(f"checkpoint saved: {path}")


def load_checkpoint_into(model, opt, ckpt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"],
                   options=StateDictOptions(full_state_dict=True))


def newest_checkpoint(out):
    ckpts = sorted((out / "checkpoints").glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return ckpts[-1] if ckpts else None


class Log:
    """log.jsonl on rank 0. On resume, events after the checkpoint's step are dropped (they are redone)."""

    def __init__(self, path, rank, resume_step=None):
        self.path, self.rank = path, rank
        if rank == 0 and resume_step is not None and path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in keep))

    def __call__(self, **event):
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(event) + "\n")


def default_cache_dir(args):
    ident = {**common.model_fingerprint(args.model), "data": str(Path(args.data).resolve()) if args.data else
             "packaged", "seq_len": args.seq_len, "topk": args.topk, "tokens": args.steps * args.batch_size * args.seq_len}
    return common.TEACHER_CACHE_DIR / hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


# -----------------------------------------------------------------------------

def main(argv=None):
    t0 = time.time()
    args = parse_args(argv)
    rank, world, device = common.init_distributed()
    args.model = common.resolve_model(args.model)
    if args.batch_size % (world * args.micro_batch):
        raise E3Error(f"--batch-size {args.batch_size} must be a multiple of ranks x --micro-batch "
                      f"({world} x {args.micro_batch})")
    args.out = args.out or f"runs/{Path(args.model).name}-keep{args.keep}"

    # ---- validate every input before anything is written
    model, tok = build_model(args, device, rank, world)
    L = len(decoder_layers(model))
    protected = protected_layers(L, args.protect_first, args.protect_last)
    if args.keep is None or not (max(1, len(protected)) <= args.keep <= L - 1):
        raise E3Error(f"--keep must be between {max(1, len(protected))} (the protected layers) and {L - 1} "
                      f"for this {L}-layer model; got {args.keep}")
    if args.layers is not None and not (len(args.layers) == args.keep
                                        and set(protected) <= set(args.layers) <= set(range(L))):
        raise E3Error(f"--layers must name --keep ({args.keep}) distinct layers of 0..{L - 1}, the protected "
                      f"{sorted(protected)} among them (--protect-first/--protect-last 0 to drop those)")
    cache = None
    if args.cache:  # a given cache fixes seq-len and K unless they are given too (then they must match)
        cache = TeacherCache(args.cache, tok, seq_len=args.seq_len)
        args.seq_len, args.topk = cache.seq_len, cache.topk
    resolve_steps(args)
    out = prepare_out(args)
    if torch.distributed.is_initialized():  # every rank has checked OUT before rank 0 writes to it
        torch.distributed.barrier()
    if cache is None and args.steps > 0:
        cache_dir = str(default_cache_dir(args))
        build_cache(args.model, args.data, cache_dir, topk=args.topk, seq_len=args.seq_len,
                    max_tokens=args.steps * args.batch_size * args.seq_len, text_field=args.text_field)
        cache = TeacherCache(cache_dir, tok, seq_len=args.seq_len, topk=args.topk)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.json").write_text(json.dumps(run_identity(args), indent=1))

    T = args.steps
    T_M = max(1, round(args.search_frac * T)) if args.search != "none" and T > 0 else 0
    gen = torch.Generator().manual_seed(args.seed)  # Gumbel noise: same seed, same draws, every rank
    ckpt_path = newest_checkpoint(out) if args.resume else None
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True) if ckpt_path else None
    log = Log(out / "log.jsonl", rank, ckpt["step"] if ckpt else None)

    if ckpt is None:
        # ---- stage 1: importance initialisation (SPEC 1)
        if args.init == "given":  # --layers: the indicator of the given set, so its top-k is that set
            init = torch.zeros(L).index_fill_(0, torch.tensor(args.layers), 1.0)
        else:
            init = layer_importance(model, calibration_batches(args, tok, cache, rank, world), args.init,
                                    vocab=common.vocab_size(tok), generator=torch.Generator().manual_seed(args.seed))
        init = init.float()
        log(event="importance", method=args.init, scores=init.tolist(), step=0)
        print0(f"importance ({args.init}): " + " ".join(f"{s:.3g}" for s in init.tolist()))
        # Gumbel-TopK starts from the importance; Sheared-LLaMA's log-alphas start all-on (P(z>0) ~ 0.98)
        scores = init.clone() if args.search != "l0" else torch.full((L,), 3.0)
        kept, step, phase = None, 0, "search" if T_M else "finetune"
        lambdas = torch.zeros(2)
        opt = make_optimizer(model, args)
    else:
        init, scores, kept, step, phase = ckpt["init_scores"], ckpt["scores"], ckpt["kept"], ckpt["step"], ckpt["phase"]
        lambdas = ckpt["lambdas"]
        gen.set_state(ckpt["gen_state"])
        torch.set_rng_state(ckpt["torch_rng"])
        score_state, lag_state = ckpt["score_optim"], ckpt["lag_optim"]
        if kept is not None:
            model, _ = build_model(args, device, rank, world, kept)
        opt = make_optimizer(model, args)
        load_checkpoint_into(model, opt, ckpt)
        print0(f"resumed from {ckpt_path} at step {step} ({phase})")
        del ckpt

    scores = nn.Parameter(scores.to(device))
    score_opt = torch.optim.Adam([scores], lr=args.score_lr)  # SPEC 2: own lr, no weight decay
    lambdas = nn.Parameter(lambdas.to(device))  # l0 baseline only: Lagrange multipliers, gradient ascent
    lag_opt = torch.optim.Adam([lambdas], lr=args.score_lr, maximize=True)
    if phase == "search" and ckpt_path:
        score_opt.load_state_dict(score_state)
        lag_opt.load_state_dict(lag_state)
    gates = LayerGates(model) if phase == "search" else None
    counter = LayerCallCounter()
    counter.attach(model)

    def prune_now():
        """End of the search (or no search): freeze the mask to the top-k of S, drop the other layers
        from the model and from the optimizer. They never run again."""
        nonlocal kept, phase, gates, opt
        # No noise here: the final choice is the mode of the Plackett-Luce distribution, top-k of S.
        kept = top_k_layers(scores.detach().cpu(), args.keep, protected)
        if gates is not None:
            gates.remove()
            gates = None
        before = set(model.parameters())
        remove_layers(model, kept)
        for p in before - set(model.parameters()):
            p.requires_grad_(False)
            p.grad = None
        opt = make_optimizer(model, args, opt.state)
        counter.attach(model)
        phase = "finetune"
        log(event="pruned", step=step, kept=kept)
        print0(f"pruned to {len(kept)} layers: kept {kept}")
        if cache is not None:
            summary["val_at_pruning"] = validate_and_log(step, "at pruning")

    def validate_and_log(t, when):
        kd_loss, ce = validate(model, cache, args, rank, world, device)
        log(event="val", step=t, val_loss=kd_loss, val_ce=ce, when=when)
        print0(f"val {when}: kd {kd_loss:.4f} ce {ce:.4f}")
        return {"kd": round(kd_loss, 4), "ce": round(ce, 4)}

    summary = {}
    if cache is not None and not ckpt_path:
        summary["val_dense"] = validate_and_log(step, "dense")
    if kept is None and phase == "finetune":
        prune_now()

    # ---- stages 2 and 3: the training loop (Algorithm 1)
    n_micro = args.batch_size // (world * args.micro_batch)
    tokens_per_step = args.batch_size * args.seq_len
    # Search steps (t <= T_M) run all L layers, each through its gate m_l (LayerGates): the loss
    # reaches S through the straight-through mask (eq. 7). Fine-tune steps run only the k kept layers.
    while step < T:
        t = step + 1  # the paper counts from 1
        t_step = time.time()
        lr = get_lr(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        if phase == "search":
            tau, k_t = temperature(t, T_M, args.beta), kept_layers(t, T_M, L, args.keep)
            # one draw per step, shared by its micro-batches, the same on every rank
            noise = gumbel_noise(scores.shape, gen) if args.search == "gumbel" else torch.rand(L, generator=gen)
        counter.n = 0
        idx = rank_indices(step, args, cache.len_split("train"), rank, world)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for m in range(n_micro):
            if is_fsdp(model):
                model.set_requires_gradient_sync(m == n_micro - 1)  # reduce-scatter once per step
            if phase == "search":
                # re-built per micro-batch (not re-drawn): each backward frees the graph of M~
                gates.mask = sample_mask(args.search, scores, k_t, tau, protected, noise)
            batch = to_device(cache.get(idx[m * args.micro_batch:(m + 1) * args.micro_batch]), device)
            # divided by n_micro so the accumulated gradient is the mean over the global batch
            loss = compute_loss(model, batch, args.loss, cache.vocab_size, device) / n_micro
            loss.backward()
            loss_sum += loss.detach()
        loss_avg = common.all_reduce_sum(loss_sum).item() / world
        if not math.isfinite(loss_avg):
            raise E3Error(f"loss is {loss_avg} at step {t}; the last checkpoint in {out / 'checkpoints'} is "
                          f"intact: lower --lr or check the data, then --resume")
        grad_norm = nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], args.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if phase == "search":
            if scores.grad is None:  # k'_t = the protected layers alone: the mask did not depend on S
                scores.grad = torch.zeros_like(scores)
            common.all_reduce_sum(scores.grad)  # scores live outside FSDP: average their gradient by hand
            scores.grad /= world
            if args.search == "l0":  # steer the expected kept count to the same k'_t schedule
                free = free_layers(L, protected)
                lagrangian(expected_kept(scores[free]) + len(protected), k_t, lambdas).backward()
                lag_opt.step()
                lag_opt.zero_grad(set_to_none=True)
            mask = gates.mask.detach()
            score_opt.step()
            score_opt.zero_grad(set_to_none=True)
            log(event="search", step=t, tau=tau, k=k_t, scores=scores.detach().cpu().tolist(),
                mask=mask.cpu().tolist())
        step = t
        dt = time.time() - t_step
        log(event="train", step=t, phase=phase, loss=loss_avg, lr=lr, tokens=t * tokens_per_step,
            tok_per_s=tokens_per_step / dt, grad_norm=grad_norm.item(), layers_run=counter.n // n_micro)
        extra = f" | tau {tau:.3f} | k' {k_t}" if phase == "search" and args.search == "gumbel" else \
            f" | E[kept] target {k_t}" if phase == "search" else ""
        print0(f"step {t}/{T} | {phase} | loss {loss_avg:.4f} | lr {lr:.2e}{extra} | "
               f"{tokens_per_step / dt:.0f} tok/s | {time.time() - t0:.1f}s")
        if phase == "search" and t == T_M:
            prune_now()
        if t % args.eval_every == 0 or t == T:
            summary["val_final"] = validate_and_log(t, f"step {t}")
        if t % args.ckpt_every == 0 and t < T:
            state = {"step": t, "phase": phase, "kept": kept, "scores": scores.detach().cpu(),
                     "init_scores": init, "gen_state": gen.get_state(), "torch_rng": torch.get_rng_state(),
                     "score_optim": score_opt.state_dict(), "lambdas": lambdas.detach().cpu(),
                     "lag_optim": lag_opt.state_dict()}
            save_checkpoint(out / "checkpoints" / f"step_{t}.pt", model, opt, state, rank)

    if kept is None:  # --steps 0, or a search that ended at T (T_M == T)
        prune_now()

    # ---- stage 4: export (SPEC 5)
    # Every rank takes part in the gather; rank 0 receives the full fp32 tensors on CPU and loads them into
    # a fresh pruned copy of the source model, so the files carry no FSDP, LoRA or gate leftovers.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        state = merge_lora(state, args.lora_alpha / args.lora_rank) if args.lora_rank else state
        # built on the meta device and given the gathered tensors themselves (assign): no second full copy
        export_model, _ = common.load_model(args.model, "cpu", torch.float32, weights=False)
        remove_layers(export_model, kept)
        export_model.load_state_dict(state, strict=True, assign=True)
        export_model.tie_weights()  # assign replaced the shared embedding/LM-head tensor by two copies
        export_model.to(getattr(export_model.config, "dtype", None) or torch.float32)
        info = {"source_model": args.model, "method": f"init={args.init} search={args.search} loss={args.loss}",
                "flags": run_identity(args), "tokens_trained": T * tokens_per_step,
                "initial_scores": init.tolist(), "final_scores": scores.detach().cpu().tolist()}
        export(export_model, tok, out / "model", kept, L, info)
        summary = {"kept_layers": kept, "layers": f"{L} -> {len(kept)}", "tokens_trained": T * tokens_per_step,
                   **summary, "minutes": round((time.time() - t0) / 60, 2), "model": str(out / "model")}
        log(event="done", step=T, **summary)
        print0("done: " + json.dumps(summary))
    return model


if __name__ == "__main__":
    common.run_main(main)
