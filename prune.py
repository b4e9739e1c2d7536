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
  python prune.py ... --resume                 # on from the newest checkpoint in --out

Under torchrun the model is sharded with FSDP2 (scale/, applied by one call in build_student) and
the LM head runs fused with the loss (scale/fused_loss.py). The baselines are flag sets (README);
their code is in baselines/ and is imported only when a flag names it.
"""
import argparse
import contextlib
import hashlib
import json
import math
import time
from fractions import Fraction
from pathlib import Path

import torch
from torch import nn

import kd
from cache_teacher import (TEACHER_CACHE_DIR, E3Error, HelpFormatter, TeacherCache, build_cache,
                           corpus_blocks, init_distributed, load_model, model_fingerprint, print0,
                           resolve_model, run_main, vocab_size)
from sampler import gumbel_noise, gumbel_topk, k_schedule, score_lr_schedule, tau_schedule
from scale.checkpoint import Run
from surgery import (LayerGates, LayerSearch, check_removable, decoder_layers, export_pruned,
                     keep_mask, kl_importance, protected_layers, remove_layers, serving_notes)

# -----------------------------------------------------------------------------
# Settings: the paper's (Appendix E, Llama-2-7B's column) are every flag's default. "T/20" is a
# fraction of the T training steps: the paper's 60 warm-up steps of 1200, so that a shorter budget
# keeps the schedule's shape. --tokens is the budget: T = tokens / (batch x seq-len).
PAPER = dict(tokens=1200 * 128 * 4096, batch_size=128, micro_batch=1, seq_len=4096, lr=1e-4,
             warmup="T/20", eval_every="T/12", ckpt_every="T/6", search_frac=0.1, beta=0.9,
             topk=10, n_calib=40, score_lr=0.05, evo_offspring=32, evo_stages="2048:2,32768:1")
# The demo is a preset, what runs with no --model: the packaged SmolLM2-135M, 30 -> 20 layers,
# sized for a 2-core CPU (~10 minutes). Any flag given still wins.
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
    g.add_argument("--model", help="HF checkpoint folder or hub id (default: the demo's packaged "
                                   "SmolLM2-135M)")
    g.add_argument("--keep", type=int, help="decoder layers to keep, k (required with --model)")
    g.add_argument("--cache", help="teacher cache folder from cache_teacher.py (default: build one)")
    g.add_argument("--data", help="corpus for the cache and the calibration: .txt/.md, .jsonl or "
                                  ".parquet file or folder (default: the packaged Shakespeare)")
    g.add_argument("--text-field", default="text", help="the text field of .jsonl/.parquet rows")
    g.add_argument("--assistant-only", action="store_true", help="chats: loss on the reply only")
    g.add_argument("--out", help="run folder (default: runs/<model>-keep<k>)")
    g = p.add_argument_group("stage 1: importance (Sec. 3.2)")
    g.add_argument("--init", choices=["kl", "bi", "random"], default="kl",
                   help="S_0: KL with the layer bypassed (the paper); baselines/: ShortGPT's Block "
                        "Influence (baselines/shortgpt.py), or N(0, 1)")
    g.add_argument("--layers", type=layer_list, help="keep exactly these layers (0,1,4,...): no "
                   "importance, no search, fine-tuning only")
    g.add_argument("--n-calib", type=int, default=PAPER["n_calib"], help="calibration sequences")
    g.add_argument("--calib-data", help="the calibration text, if not --data (or the cache)")
    g.add_argument("--protect-first", type=int, default=1, help="first layers never pruned")
    g.add_argument("--protect-last", type=int, default=1, help="last layers never pruned")
    g = p.add_argument_group("stage 2: the layer search (Sec. 3.2, Alg. 1-2)")
    g.add_argument("--search", choices=["gumbel", "none", "l0", "evo", "random"], default="gumbel",
                   help="gumbel: Gumbel-TopK (the paper); none: the top-k of S_0; baselines/: l0 = "
                        "Sheared-LLaMA's hard-concrete masks, evo = EvoPress's evolutionary search "
                        "from the top-k of S_0, random = the best of random sets at evo's budget")
    g.add_argument("--search-frac", type=float, default=PAPER["search_frac"], help="T_M / T")
    g.add_argument("--beta", type=float, default=PAPER["beta"], help="tau: from 1 to 1 - beta")
    g.add_argument("--score-lr", type=float, default=PAPER["score_lr"],
                   help="Adam lr of the scores S (the paper gives none)")
    g.add_argument("--masks-per-step", type=int, default=1, help="Gumbel draws a step: global "
                   "micro-batch j runs draw j mod N (an ablation)")
    g.add_argument("--score-scale", type=float, default=1.0,
                   help="S_0 = c x the importance: its gaps against the Gumbel noise (an ablation)")
    g.add_argument("--score-lr-schedule", choices=["constant", "linear"], default="constant",
                   help="S's lr: constant or linear, --score-lr to --score-lr / T_M (an ablation)")
    g.add_argument("--search-loss", choices=["akd", "kd", "sft"],
                   help="the loss of the search steps (default: --loss)")
    g.add_argument("--search-data", help="the text the search reads, with its own teacher cache "
                   "(default: --data)")
    g.add_argument("--evo-generations", type=int,
                   help="evo: generations (default: EvoPress's r (L - r) / 1.5, r layers removed)")
    g.add_argument("--evo-offspring", type=int, default=PAPER["evo_offspring"],
                   help="evo: children a generation")
    g.add_argument("--evo-stages", default=PAPER["evo_stages"],
                   help="evo: successive-halving stages TOKENS:SURVIVORS,..., ending in one")
    g.add_argument("--random-candidates", type=int,
                   help="random: sets drawn (default: as many as evo's forward tokens pay for)")
    g = p.add_argument_group("training (Sec. 3.3, Appendix E)")
    g.add_argument("--loss", choices=sorted(kd.LOSSES), default="akd",
                   help="akd: entropy-weighted top-K KD, eq. 13 (the paper); kd: eq. 12; "
                        "sft: next-token cross-entropy (kd.LOSSES)")
    g.add_argument("--steps", type=int, help="optimizer steps T (default: from --tokens)")
    g.add_argument("--tokens", type=int, default=PAPER["tokens"],
                   help="token budget: T = tokens / (batch-size x seq-len)")
    g.add_argument("--batch-size", type=int, default=PAPER["batch_size"],
                   help="GLOBAL batch in sequences, split over ranks and micro-batches")
    g.add_argument("--micro-batch", type=int, default=PAPER["micro_batch"],
                   help="sequences per forward on each rank")
    g.add_argument("--seq-len", type=int, help=f"tokens per sequence (default: a given --cache's, "
                   f"else {PAPER['seq_len']})")
    g.add_argument("--topk", type=int, default=PAPER["topk"], help="teacher top-K of a new cache")
    g.add_argument("--targets", choices=["topk", "sampled", "hybrid"], default="topk",
                   help="a new cache's: the top-K (the paper), or draws (cache_teacher.py, kd.py)")
    g.add_argument("--samples", type=int, default=12, help="draws a position (sampled, hybrid)")
    g.add_argument("--kd-tail", action="store_true", help="KD over the top-K + the rest (kd.py)")
    g.add_argument("--kd-full", action="store_true", help="KD over the whole vocabulary, the "
                   "teacher beside the student, in the cache's dtype (one process; the reference)")
    g.add_argument("--lr", type=float, default=PAPER["lr"], help="peak AdamW lr")
    g.add_argument("--warmup", type=steps_or_fraction, default=PAPER["warmup"],
                   help="linear warm-up steps (or T/n), then cosine to lr/10")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    g.add_argument("--seed", type=int, default=0, help="data order and every random draw")
    g = p.add_argument_group("scale (scale/, docs/scale.md)")
    g.add_argument("--lora-rank", type=int, default=0,
                   help="> 0: train LoRA adapters only, merged at export (the paper's MoE runs)")
    g.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: 2 x rank)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each layer's activations in the backward")
    g.add_argument("--logit-chunk", type=int, help="tokens a chunk of the LM head fused with the "
                   "loss (scale/: no (B, T, V) logits; on a CPU glibc's mmap threshold fixed at 64 "
                   "KB too, freed tensors go back to the OS at ~2x the step time); 0: the plain "
                   "logits path, kd.py (default: 256 under torchrun, 0 in one process)")
    g.add_argument("--plan", type=int, metavar="RANKS",
                   help="print the run's plan for RANKS ranks from config.json alone, and exit")
    g = p.add_argument_group("run folder")
    g.add_argument("--eval-every", type=steps_or_fraction, default=PAPER["eval_every"],
                   help="validate every N steps (or T/n)")
    g.add_argument("--ckpt-every", type=steps_or_fraction, default=PAPER["ckpt_every"],
                   help="checkpoint every N steps (or T/n)")
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
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


# -----------------------------------------------------------------------------
# The student: fp32 master weights, LoRA for the huge models, FSDP2 under torchrun

def build_student(args, device, world, kept=None):
    """The student as this run trains it: fp32, pruned to `kept` when resuming after the cut, LoRA
    and activation checkpointing if asked; under torchrun sharded by FSDP2, rank 0 alone reading the
    weights (the other ranks build it on the meta device and receive their shards)."""
    rank = torch.distributed.get_rank() if world > 1 else 0
    model, tok = load_model(args.model, "cpu", torch.float32, weights=rank == 0)
    model.config.use_cache = False  # no KV cache in a training forward
    if kept is not None:
        remove_layers(model, kept)
    if args.lora_rank:  # before sharding: FSDP shards the adapters with their layers
        from scale.lora import add_lora
        add_lora(model, args.lora_rank, args.lora_alpha, args.seed)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if world == 1 and not args.logit_chunk:
        return model.to(device).train(), tok
    # FSDP2, torchtitan's layout; its plain form is
    #     for layer in decoder_layers(model): fully_shard(layer)
    #     fully_shard(model)
    # and scale.parallelize adds the memory machinery (docs/scale.md): the embedding and LM head
    # split by vocabulary rows, gloo's collectives in pieces, rank 0's weights sent as shards
    from scale.fsdp import parallelize
    return parallelize(model, device, fused_loss=bool(args.logit_chunk)).train(), tok


def make_optimizer(model, args, carried=None):
    """AdamW over the trainable weights; `carried`: the old optimizer's state, whose moments carry
    over for the parameters still here (a fresh Adam would restart its bias correction)."""
    params = [p for p in model.parameters() if p.requires_grad]
    # betas (0.9, 0.95), the usual LLM choice (the paper names AdamW and the lr); fused: one kernel
    # with no temporaries the size of all the weights
    opt = torch.optim.AdamW(params, args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True)
    for p in params if carried is not None else []:
        if p in carried:  # a kept layer's weights are the same Parameter objects after the cut
            opt.state[p] = carried[p]
    return opt


# -----------------------------------------------------------------------------
# Data and loss

def batch_indices(step, args, n, rank, world):
    """This rank's cached sequences at `step`: the global batch is a slice of a seeded permutation
    (one per epoch, each seed's own) split over the ranks, a pure function of (seed, step): a
    resume, or any number of ranks, trains on exactly the same global batches."""
    start = step * args.batch_size
    epoch, offset = divmod(start, n)
    idx = []
    while len(idx) < args.batch_size:  # a batch past the epoch's end goes on into the next
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed ^ epoch << 32))
        idx += order.tolist()[offset: offset + args.batch_size - len(idx)]
        epoch, offset = epoch + 1, 0
    per_rank = args.batch_size // world
    return idx[rank * per_rank:(rank + 1) * per_rank]


def calibration_batches(args, tok, cache):
    """The --n-calib calibration sequences, one a batch, from --calib-data, else --data, else the
    cache. Every rank scores all of them: the ranks stay in step by construction."""
    if args.calib_data or args.data or cache is None:
        blocks = corpus_blocks(tok, args.calib_data or args.data, args.seq_len,
                               args.n_calib * args.seq_len, text_field=args.text_field)["train"]
        seqs = blocks[:args.n_calib]
    else:
        seqs = cache.get(list(range(min(args.n_calib, cache.len_split("train")))))["input_ids"]
    return [(seqs[i:i + 1], None) for i in range(len(seqs))]


def plain_losses(vocab, autocast=False):
    """losses(model, batch, kinds): kd.LOSSES[kind] of the student's logits, one forward for all the
    kinds asked (validation wants kd and CE). Only the tokenizer's ids count: some checkpoints pad
    the embedding past them. autocast: bf16 matmuls on one GPU (FSDP2 casts by its own policy)."""
    def losses(model, batch, kinds):
        with torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext():
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


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
            for k, v in batch.items()}


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


# -----------------------------------------------------------------------------
# The layer search (Sec. 3.2). What the training loop asks of a search is surgery.LayerSearch's
# protocol: steps (T_M), prepare(), begin_step(t), sample_mask(j), step(), kept(), and its state.
# LayerSearch itself is --search none (the top-k of S_0); the paper's search is below, the
# baselines' in baselines/ (baselines.SEARCHES, by their --search names).

class GumbelTopKSearch(LayerSearch):
    """The paper's search: scores S (one per layer) with their own Adam, a Gumbel-TopK mask each
    step, during the first T_M = --search-frac of the T steps."""

    in_loop = True

    def __init__(self, S0, args, L, T, protected, device):
        super().__init__(S0, args, L, T, protected, device)
        # Adam, not SGD: it moves each score by ~lr a step whatever the gradient's size (the loss
        # is in nats, most layers' gradients are tiny), so --score-lr x T_M is how far S can
        # travel against gaps of 0.1-0.5 nats in S_0 and Gumbel noise of sd 1.28. No weight decay:
        # it would pull every score towards 0, a uniform choice
        self.opt = torch.optim.Adam([self.S], lr=args.score_lr)
        self.gen = torch.Generator().manual_seed(args.seed)  # the same draws on every rank

    def begin_step(self, t):
        """Alg. 1 l.2: tau_t = 1 - beta t / T_M and k'_t = L - ceil((L - k) t / T_M), over the
        search so that k is reached when it ends; Alg. 2 l.1: this step's Gumbel draw g, one for
        all its micro-batches (the step is one sample M of the law), or --masks-per-step of them."""
        self.tau = tau_schedule(t, self.steps, self.args.beta)
        self.k_t = k_schedule(t, self.steps, self.L, self.args.keep)
        self.noise = [gumbel_noise((self.L,), self.gen) for _ in range(self.args.masks_per_step)]
        self.opt.param_groups[0]["lr"] = score_lr_schedule(t, self.steps, self.args.score_lr,
                                                           self.args.score_lr_schedule)

    def sample_mask(self, j=0):
        """Alg. 1 l.4: M = Gumbel-TopK(S, tau_t, k'_t) over the unprotected layers (the protected
        are 1 and count in k'_t): exactly 0/1 in value, dM~/dS in gradient (eq. 7)."""
        free = [i for i in range(self.L) if i not in self.protected]
        noise = self.noise[j % len(self.noise)]
        sub = gumbel_topk(self.S[free], self.k_t - len(self.protected), self.tau, noise=noise[free])
        index = torch.tensor(free, device=self.S.device)
        return torch.ones(self.L, device=self.S.device).index_put((index,), sub)

    def step(self):
        """Alg. 1 l.5: S <- S - lr_S dL/dS. Each rank's dL/dS comes from its own micro-batches: the
        mean over the ranks is the whole batch's (FSDP averages only the model's weights)."""
        self.average_grad()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def log_fields(self):
        return {"tau": self.tau, "k": self.k_t}

    def state_dict(self):
        # the generator too: a resumed search draws the noise the uninterrupted one would have
        return {"S": self.S.detach().cpu(), "opt": self.opt.state_dict(), "gen": self.gen.get_state()}

    def load_state_dict(self, state):
        self.S.data.copy_(state["S"])
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"])


def search_class(name):
    """--search NAME: the paper's here, a baseline's from baselines.SEARCHES (imported if named)."""
    if name in ("gumbel", "none"):
        return GumbelTopKSearch if name == "gumbel" else LayerSearch
    from baselines import SEARCHES
    return SEARCHES[name]


def initial_scores(args, model, tok, cache, L):
    """S_0 (Sec. 3.2): s_l = E_x KL(p_{-l} || p) on the calibration sequences (surgery.py), or a
    baseline's scores by their --init name (baselines.IMPORTANCE); --layers: the given set's
    indicator, so that its top-k is that set."""
    if args.layers is not None:
        return torch.zeros(L).index_fill_(0, torch.tensor(args.layers), 1.0)
    batches = calibration_batches(args, tok, cache)
    if args.init == "kl":
        scores = kl_importance(model, batches, vocab_size(tok))
    else:
        from baselines import IMPORTANCE
        scores = IMPORTANCE[args.init](model, batches, torch.Generator().manual_seed(args.seed))
    # --score-scale c: the same order, c times the gaps against the Gumbel noise
    return args.score_scale * scores.float()


def prune_to_top_k(model, opt, search, args):
    """The end of the search, Alg. 1's return: the mask frozen to the top-k of S, the mode of the
    Plackett-Luce law, and the other layers removed. They never run again and leave the optimizer,
    whose Adam moments for the kept weights carry over. Returns (kept, optimizer)."""
    kept = search.kept()
    for note in serving_notes(model.config, kept):
        print0(f"warning: {note}")
    before = set(model.parameters())
    remove_layers(model, kept)
    if torch.distributed.is_initialized():  # FSDP's root forgets the removed layers' units
        from scale.fsdp import drop_removed_layers
        drop_removed_layers(model)
    for p in before - set(model.parameters()):
        p.grad = None  # freed now, not whenever the old optimizer goes
    return kept, make_optimizer(model, args, carried=opt.state)


def run_identity(args):
    """The arguments that define a run (what may change between --resume's is left out)."""
    skip = {"resume", "eval_every", "ckpt_every", "plan", "logit_chunk", "device", "search_steps"}
    return {k: f"T/{v.denominator}" if isinstance(v, Fraction) else v
            for k, v in sorted(vars(args).items()) if k not in skip}


# -----------------------------------------------------------------------------
# The teacher cache and the plan

def build_teacher_cache(args, tok, data=None, tokens=None):
    """The teacher's targets for `tokens` training tokens of `data` (default: this run's budget of
    --data), in a folder keyed by everything they depend on, built now, before the student exists:
    the teacher and the student are never in memory together."""
    data, tokens = data or args.data, tokens or args.steps * args.batch_size * args.seq_len
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


def plan_line(args, world, model, L, cache=None, cache_bytes=None):
    """T, T_M, the tokens, and per rank the bytes of fp32 weights, gradients and AdamW (16 B per
    trainable parameter, 4 B per frozen one, split over the ranks by FSDP) before and after the cut."""
    def state_gb(params):
        params = list(params)
        frozen = sum(p.numel() for p in params if not p.requires_grad)
        return (4 * frozen + 16 * (sum(p.numel() for p in params) - frozen)) / world / 1e9
    layers = decoder_layers(model)
    search, cut = state_gb(model.parameters()), L - args.keep  # the layers still to go
    after = search - cut * state_gb(layers[-1].parameters())  # at the last layer's size each
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tokens = args.steps * args.batch_size * args.seq_len
    parts = [f"T {args.steps} (search T_M {args.search_steps}, warm-up "
             f"{at(args.warmup, args.steps)})", f"{tokens:,} tokens",
             f"{args.batch_size} x {args.seq_len} tokens a step on {world} rank(s)",
             f"{n / 1e6:,.1f}M params ({trainable / 1e6:,.1f}M trainable)",
             f"weights+grads+Adam {search:.3g} GB/rank in the search, {after:.3g} GB/rank after "
             f"the cut ({L} -> {args.keep} layers)"]
    if hasattr(search_class(args.search), "plan"):  # evo, random: their forward tokens too
        parts.append(search_class(args.search).plan(args, L))
    if cache is not None:
        cache_bytes = sum(s["bytes"] for split in cache.meta["shards"].values() for s in split)
        passes = tokens / (cache.len_split("train") * args.seq_len)
        parts.append(f"{passes:.2f} passes over the {cache.len_split('train') * args.seq_len:,} "
                     f"cached training tokens")
        if passes > 1.01:  # e.g. the paper's budget on the 1.6M-token Shakespeare: ~400 passes
            parts.append("WARNING: the corpus is smaller than the budget, sequences repeat; pass a "
                         "larger --data or a smaller --tokens/--steps")
    if cache_bytes is not None:
        parts.append(f"cache {cache_bytes / 1e9:.3g} GB on disk")
    return "plan: " + " | ".join(parts)


def check_keep(args, L, protected):
    if args.keep is None or not max(1, len(protected)) <= args.keep <= L - 1:
        raise E3Error(f"--keep must be between {max(1, len(protected))} (the protected layers) and "
                      f"{L - 1} for this {L}-layer model; got {args.keep}")
    if args.layers is not None and not (len(args.layers) == args.keep
                                        and set(protected) <= set(args.layers) <= set(range(L))):
        raise E3Error(f"--layers must name --keep ({args.keep}) distinct layers of 0..{L - 1}, the "
                      f"protected {sorted(protected)} among them (--protect-first/--protect-last 0 "
                      f"to drop those)")


def settle(args, L, world):
    """What the flags leave to the model and the world: k from --layers, T from the budget, T_M."""
    if args.layers is not None:  # keep exactly these: no importance, no search
        args.keep, args.init, args.search = args.keep or len(args.layers), "given", "none"
    if args.steps is None:
        args.steps = math.ceil(args.tokens / (args.batch_size * args.seq_len))
    if args.logit_chunk is None:
        args.logit_chunk = 256 if world > 1 else 0
    if args.logit_chunk < 0:
        raise E3Error(f"--logit-chunk must be 0 (the plain logits) or a number of tokens; got "
                      f"{args.logit_chunk}")
    if args.kd_tail and args.targets != "topk" or args.kd_full and (world > 1 or args.logit_chunk):
        raise E3Error("--kd-tail needs a top-K cache (not sampled targets); --kd-full runs in one "
                      "process on the plain logits path (--logit-chunk 0): the teacher beside it")
    protected = protected_layers(L, args.protect_first, args.protect_last)
    check_keep(args, L, protected)
    in_loop = search_class(args.search).in_loop and args.steps and args.search_frac > 0
    # T_M = round(search_frac T), halves up (0.1 x 25: 3), at least one step when there is a search
    t_m = math.floor(Fraction(str(args.search_frac)) * args.steps + Fraction(1, 2))
    args.search_steps = max(1, t_m) if in_loop else 0
    return protected


# -----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    args.model = resolve_model(args.model)
    if args.plan:  # --plan RANKS: from config.json alone, the model on the meta device
        from scale.fsdp import meta_model
        model, bytes_a_token = meta_model(args)
        settle(args, len(decoder_layers(model)), args.plan)
        return print(plan_line(args, args.plan, model, len(decoder_layers(model)), cache_bytes=
                               bytes_a_token * args.steps * args.batch_size * args.seq_len))

    # ================================ SETUP ================================
    t0 = time.time()
    rank, world, args.device = init_distributed()
    shape, tok = load_model(args.model, weights=False)  # the config alone: check every input first
    L = len(decoder_layers(shape))
    cache = TeacherCache(args.cache, tok, seq_len=args.seq_len) if args.cache else None
    if cache:  # a given cache fixes seq-len and its targets
        args.seq_len, args.topk, args.targets = cache.seq_len, cache.topk, cache.targets
        args.samples = cache.samples or args.samples
    protected = settle(args, L, world)
    if args.device.type == "cpu" and (world > 1 or args.logit_chunk):  # the scale wing on a CPU:
        from scale.fsdp import release_freed_memory  # freed tensors go back to the OS
        release_freed_memory()
    if args.batch_size % (world * args.micro_batch):
        raise E3Error(f"--batch-size {args.batch_size} must be a multiple of ranks x --micro-batch "
                      f"({world} x {args.micro_batch})")
    if (args.batch_size // args.micro_batch) % args.masks_per_step:
        raise E3Error(f"--masks-per-step {args.masks_per_step} must divide the "
                      f"{args.batch_size // args.micro_batch} micro-batches of a step")
    check_removable(shape.config, args.layers)  # a layout the config cannot express: stop now
    for note in serving_notes(shape.config, args.layers):  # where an engine would differ
        print0(f"warning: {note}")
    T, T_M = args.steps, args.search_steps
    args.out = args.out or f"runs/{Path(args.model).name}-keep{args.keep}"
    run = Run(args.out, run_identity(args), rank, args.resume)
    cache = cache or build_teacher_cache(args, tok)  # the teacher: loaded, used, freed
    search_cache = cache  # --search-data: the search reads its own text
    if args.search_data and args.search != "none":
        tokens = search_class(args.search).tokens_read(args)
        search_cache = build_teacher_cache(args, tok, args.search_data, tokens)
    if T == 0:  # no cache: check --data now, before anything is written
        calibration_batches(args, tok, None)
    run.create()
    resumed = run.latest()  # None, or the small state of the newest checkpoint
    model, _ = build_student(args, args.device, world, kept=resumed and resumed["kept"])
    teacher = None  # --kd-full: the model that made the cache, in its dtype, frozen, in eval mode
    if args.kd_full and cache:
        teacher = load_model(cache.meta["model"]["model"], args.device,
                             getattr(torch, cache.meta.get("teacher_dtype", "float32")))[0]
        teacher.eval().requires_grad_(False)  # frozen: its forwards record no graph
    opt = make_optimizer(model, args)
    vocab = cache.vocab_size if cache else vocab_size(tok)
    losses = plain_losses(vocab, autocast=args.device.type == "cuda" and world == 1)
    if args.logit_chunk:  # the LM head fused with the loss, checked against kd.py at first use
        from scale.fused_loss import FusedLoss
        losses = FusedLoss(vocab, args.logit_chunk, reference=losses)
    print0(plan_line(args, world, model, L, cache))

    # ====================== STAGE 1: IMPORTANCE (Sec. 3.2) ======================
    if resumed is None:
        run.truncate_log(-1)  # a --resume that found no checkpoint starts over: so does the log
        S0 = initial_scores(args, model, tok, cache, L)  # Alg. 1's input S
        run.log(event="importance", method=args.init, scores=S0.tolist(), step=0)
        print0(f"importance ({args.init}): " + " ".join(f"{s:.3g}" for s in S0.tolist()))
        step, kept = 0, None
    else:
        S0, step, kept = resumed["init_scores"], resumed["step"], resumed["kept"]
        run.load_into(resumed["path"], model, opt)
        run.truncate_log(step)
        print0(f"resumed from {resumed['path']} at step {step} ({'search' if kept is None else 'finetune'})")
    search = search_class(args.search)(S0, args, L, T, protected, args.device)
    if resumed is not None:
        search.load_state_dict(resumed["search"])
    else:  # evo and random choose their layer set now, before any training
        search.prepare(model, search_cache, losses,
                       lambda entry: run.log(event="layer_search", method=args.search, **entry))
    # "search" = Alg. 1 l.3's t <= T_M: all L layers run through their gates; "finetune": after
    # the cut only the k kept layers exist. `step` counts the steps done (t = step + 1 is next)
    phase = "search" if kept is None and step < T_M else "finetune"
    gates = LayerGates(model) if phase == "search" else None
    summary = resumed.get("summary", {}) if resumed else {}  # what was measured before a kill

    def val(when, t, _last={}):
        if not cache or not cache.len_split("val"):  # a cache built with --val-frac 0
            return None
        if _last.get("t") != t:  # at the cut and at an eval step both: the same model, once
            _last.update(t=t, losses=validate(model, cache, losses, args))
        kd_loss, ce = _last["losses"]
        run.log(event="val", step=t, val_loss=kd_loss, val_ce=ce, when=when)
        print0(f"val {when}: kd {kd_loss:.4f} ce {ce:.4f}")
        return {"kd": round(kd_loss, 4), "ce": round(ce, 4)}

    if resumed is None:
        summary["val_dense"] = val("dense", 0)  # the reference: the full model before any step
    if kept is None and phase == "finetune":  # no search (T_M = 0): the cut, now
        kept, opt = prune_to_top_k(model, opt, search, args)
        run.log(event="pruned", step=step, kept=kept)
        print0(f"pruned to {len(kept)} layers: kept {kept}")

    # ================= STAGE 2: SEARCH, THEN FINE-TUNE (Alg. 1) =================
    # ------------------------- TRAINING SECTION BEGIN -------------------------
    n_micro = args.batch_size // (world * args.micro_batch)  # micro-batches a rank runs a step
    tokens_per_step = args.batch_size * args.seq_len
    while step < T:  # Alg. 1 l.1: for t = 1..T
        t, t_step = step + 1, time.time()
        lr = lr_schedule(step, args)  # a pure function of the step: a resume needs no state
        # so are dropout's masks (GPT-2, OPT): each rank its own, on any device, after any resume
        torch.manual_seed((args.seed * 2**40 + t * 2**20 + rank) % 2**63)
        for group in opt.param_groups:
            group["lr"] = lr
        if phase == "search":  # Alg. 1 l.3: t <= T_M
            search.begin_step(t)  # Alg. 1 l.2: tau_t, k'_t, and this step's random draw
        source, kind = (search_cache, args.search_loss) if phase == "search" else (cache, args.loss)
        idx = batch_indices(step, args, source.len_split("train"), rank, world)
        loss_sum = torch.zeros((), dtype=torch.float64)
        weights = [1 / n_micro] * n_micro  # packed text: every micro-batch counts as many tokens
        if source.meta.get("assistant_only"):  # a chat's assistant turns only (scale/data.py)
            from scale.data import micro_batch_weights
            weights = micro_batch_weights(source, idx, n_micro, kind, world)
        for m in range(n_micro):
            if phase == "search":
                # Alg. 1 l.4: M = Gumbel-TopK(S, tau, k'), rebuilt for each micro-batch (each
                # backward frees its graph from S to M~); j: its place in the global batch
                gates.mask = search.sample_mask(rank * n_micro + m)
            batch = training_batch(source, idx[m * args.micro_batch:(m + 1) * args.micro_batch],
                                   args, teacher)
            # the objective is a MEAN over the global batch: each micro-batch's mean x its weight
            # here (1 / n_micro), the mean over the ranks by FSDP's reduce-scatter
            (loss,) = losses(model, {**batch, "weight": weights[m]}, [kind])
            loss.backward()  # one backward: dL/dTheta AND dL/dS through the gates
            loss_sum += loss.detach().double().cpu()
        if world > 1:  # the same number on every rank, so that all stop together on a NaN
            torch.distributed.all_reduce(loss_sum)
            loss_sum /= world
        loss_avg = loss_sum.item()
        if not math.isfinite(loss_avg):  # stop before opt.step() writes NaN into the weights
            raise E3Error(f"loss is {loss_avg} at step {t}; the last checkpoint in "
                          f"{run.ckpt_dir} is intact: lower --lr or check the data, then --resume")
        norm = nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], args.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: all shards'
        # Alg. 1 l.6: Theta <- Theta - lr dL/dTheta (the paper steps S first: both gradients came
        # from one backward at the same (Theta, S), so the order is immaterial)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if phase == "search":  # the layers each of this step's draws ran (--masks-per-step)
            with torch.no_grad():
                masks = [search.sample_mask(j).cpu().tolist() for j in range(args.masks_per_step)]
            search.step()  # Alg. 1 l.5: S <- S - lr_S dL/dS
            run.log(event="search", step=t, scores=search.S.detach().cpu().tolist(), mask=masks[0],
                    **({"masks": masks} if len(masks) > 1 else {}), **search.log_fields())
        step, dt = t, time.time() - t_step
        run.log(event="train", step=t, phase=phase, loss=loss_avg, lr=lr,
                tokens=t * tokens_per_step, tok_per_s=tokens_per_step / dt, grad_norm=norm.item())
        where = "".join(f" | {k} {v:.3g}" for k, v in search.log_fields().items()) \
            if phase == "search" else ""
        print0(f"step {t}/{T} | {phase} | loss {loss_avg:.4f} | lr {lr:.2e}{where} | "
               f"{tokens_per_step / dt:.0f} tok/s | {time.time() - t0:.1f}s")
        if phase == "search" and t == T_M:  # the end of the search: the cut
            gates.remove()  # no hooks from here on: the model is plainly the k kept layers
            kept, opt = prune_to_top_k(model, opt, search, args)  # Alg. 1's return, at T_M
            phase = "finetune"
            run.log(event="pruned", step=t, kept=kept)
            print0(f"pruned to {len(kept)} layers: kept {kept}")
            summary["val_at_pruning"] = val("at pruning", t)
        if t % at(args.eval_every, T) == 0 or t == T:
            if phase == "search":  # never a sampled mask: the set the cut would keep now
                gates.mask = keep_mask(search.kept(), L, args.device)
            summary["val_final"] = val(f"step {t}", t)
        if t % at(args.ckpt_every, T) == 0 and t < T:  # none at T: the export follows at once
            # beside the DCP shards: where the loop stands, the search's state (S, its Adam, the
            # Gumbel generator), so that the resumed run draws what this one would, and the summary
            run.save(t, model, opt, {"phase": phase, "kept": kept, "init_scores": S0,
                                     "search": search.state_dict(), "summary": summary})
    # -------------------------- TRAINING SECTION END --------------------------
    if kept is None:  # a search longer than the run (--search-frac > 1) ends as Alg. 1 does
        kept, opt = prune_to_top_k(model, opt, search, args)
        run.log(event="pruned", step=step, kept=kept)

    # =============================== STAGE 3: EXPORT ===============================
    # pruning.json: how the model was made, enough to redo it (the flags) or compare it (tokens)
    info = {"source_model": args.model, "method": f"init={args.init} search={args.search} "
            f"loss={args.loss}", "flags": run_identity(args), "tokens_trained": T * tokens_per_step,
            "search_forward_tokens": 0, **search.summary(), "initial_scores": S0.tolist(),
            "final_scores": search.S.detach().cpu().tolist()}
    if torch.distributed.is_initialized():  # FSDP2's shards, gathered a tensor at a time onto rank 0
        from scale.fsdp import full_state_dict
        state = full_state_dict(model)
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if rank == 0:
        if args.lora_rank:  # the adapters folded into plain weights
            from scale.lora import merge_lora
            state = merge_lora(state, args.lora_alpha / args.lora_rank)
        export_pruned(args.model, state, kept, L, tok, Path(args.out) / "model", info)
    summary = {"kept_layers": kept, "layers": f"{L} -> {len(kept)}",
               "tokens_trained": T * tokens_per_step, **search.summary(),
               **{k: v for k, v in summary.items() if v is not None},
               "minutes": round((time.time() - t0) / 60, 2), "model": str(Path(args.out) / "model")}
    run.log(event="done", step=T, **summary)
    print0("done: " + json.dumps(summary))
    return model


if __name__ == "__main__":
    run_main(main)
