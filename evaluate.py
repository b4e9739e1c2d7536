"""
Evaluate layer-pruned causal LMs against their dense teachers: quality, speed, lm-eval tasks,
figures.

  python evaluate.py                         # the packaged dense model alone (a quick check)
  python evaluate.py --model runs/e3         # a prune.py run vs its source model, + figures
  python evaluate.py --model runs/shortgpt runs/minitron runs/e3 --out runs/compare  # one table
  python evaluate.py --model runs/e3 --no-speed --tasks shakespeare_mc  # lm-eval task from ./tasks
  python evaluate.py --model my/checkpoint --teacher none --data test.jsonl --val-frac 1

--model takes Hugging Face checkpoint folders (or hub ids) and prune.py run folders (DIR/model is
the checkpoint, DIR/log.jsonl feeds the figures). Each model is compared with its own teacher:
--teacher if given, else the source_model in its pruning.json (a dense model has none; --teacher
none skips it).

Quality, every statistic on the same predictions:
  text     the held-out END of the token stream of --data (default: the packaged Shakespeare), the
           last --val-frac of it, which prune.py never trains on; --val-frac 1 scores all of --data.
  windows  non-overlapping blocks of --seq-len tokens (stride = seq-len), at most --max-tokens
           tokens. Each block is scored alone: seq-len - 1 next-token predictions, each conditioned
           only on the tokens before it in its block. No padding and no inserted BOS: documents are
           tokenized as in training (cache_teacher.py: the tokenizer's default special tokens, EOS after
           each).
  ppl      exp(mean NLL); kl = mean KL(teacher || model) over the full vocabulary in fp32, logits
           sliced to the tokenizer's vocabulary; top1 = how often both models' most likely tokens
           agree; tail = the model's mean probability outside the teacher's top-K tokens (K: the
           run's --topk, else 10), beside teacher_tail, the teacher's own. Top-K KD (eq. 12) has
           no term for that mass: its minimum puts none there, so a student trained long enough
           on it loses perplexity on every token outside the teacher's top K.
Speed, the dense teacher and the model side by side (interleaved repeats, medians after warm-up):
  ttft     prefill of --batch random prompts of --prompt-len tokens, up to the first greedy token
  tpot     time per further token of a greedy --gen-len loop with the KV cache; tok/s from both
  ideal    the speedup from matmul FLOPs: 2 x the weights a token multiplies in the decoder layers
           (of a MoE's experts, those it is routed to) plus the LM head (once per sequence in
           prefill, as generate() does, once per token in decode). Attention-score FLOPs (QK^T,
           AV) are not counted.
Output: a markdown table (printed), the same as JSON, and PNG figures from a run's log.jsonl, under
--out DIR (report.md, report.json, NAME-*.png) or --report PREFIX (PREFIX.md, PREFIX.json,
PREFIX-NAME-*.png).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cache_teacher import (DEFAULT_VAL_FRAC, Blocks, corpus_blocks, resolve_model, token_file,
                           tokenizer_fingerprint, vocab_size)
from runtime import E3Error, HelpFormatter, load_model, print0, run_main
from surgery import decoder_layers

TASKS_DIR = Path(__file__).resolve().parent / "experiments" / "tasks"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    # models
    p.add_argument("--model", nargs="+", default=["default"],
                   help="checkpoints, hub ids or prune.py run folders "
                        "(default: the packaged SmolLM2-135M)")
    p.add_argument("--teacher", default="auto",
                   help="auto (pruning.json's source_model), none, or a model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the models run")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on GPU, float32 on CPU "
                        "(bf16 matmuls are slow on most CPUs)")
    # what runs
    p.add_argument("--quality", action=argparse.BooleanOptionalAction, default=True,
                   help="perplexity, KL and top-1 agreement on held-out text (default: on)")
    p.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill and decode latency, dense vs pruned, and the FLOP ideal "
                        "(default: on)")
    p.add_argument("--figures", action=argparse.BooleanOptionalAction, default=True,
                   help="a run's score trajectory, importance and loss PNGs (default: on)")
    p.add_argument("--tasks", default="",
                   help="comma-separated lm-eval tasks (needs: pip install lm-eval)")
    # quality
    p.add_argument("--data", default=None, help=".txt/.md, .jsonl or .parquet file or a folder of "
                   "them (cache_teacher.py); default: the packaged Shakespeare")
    p.add_argument("--text-field", default="text",
                   help="the text field (.jsonl) or column (.parquet)")
    p.add_argument("--val-frac", type=float, default=DEFAULT_VAL_FRAC,
                   help="held-out end of the text; 1: all")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per scored window")
    p.add_argument("--max-tokens", type=int, default=8192,
                   help="tokens scored per model; 0: all held-out text")
    p.add_argument("--eval-batch-size", type=int, default=1, help="windows per forward pass")
    # speed
    p.add_argument("--batch", type=int, default=1, help="sequences per generation (speed)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (prefill)")
    p.add_argument("--gen-len", type=int, default=32, help="greedy tokens generated (decode)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; medians reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default); "
                   "on a busy machine fewer threads than cores avoids OpenMP stalls")
    # lm-eval
    p.add_argument("--include-path", default=str(TASKS_DIR),
                   help="folder of local lm-eval task YAMLs")
    p.add_argument("--limit", type=int, default=None, help="documents per task")
    # output
    p.add_argument("--out", default=None, help="folder for report.md, report.json, figures")
    p.add_argument("--report", default=None,
                   help="path prefix instead of --out: PREFIX.md, PREFIX.json")
    p.add_argument("--seed", type=int, default=0, help="the random prompts of the speed test")
    args = p.parse_args(argv)
    # tpot divides by gen_len - 1 further tokens; a window of 1 token has no prediction to score
    if args.gen_len < 2 or min(args.batch, args.prompt_len, args.repeats, args.seq_len - 1) < 1:
        raise E3Error("need --gen-len >= 2, --seq-len >= 2 and --batch, --prompt-len, "
                      "--repeats >= 1")
    return args


# -----------------------------------------------------------------------------
# What a --model value names

def resolve_run(name):
    """(checkpoint, log.jsonl or None, pruning.json dict or None, display name) for a --model
    value."""
    path = Path(resolve_model(name)).expanduser()
    # a run folder given as RUN or as RUN/model: either way the figures need RUN/log.jsonl
    if (path / "model" / "config.json").exists():
        run = path
    elif path.name == "model":
        run = path.parent
    else:
        run = None
    ckpt = run / "model" if run else path
    info_file = ckpt / "pruning.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else None
    log = run / "log.jsonl" if run and (run / "log.jsonl").exists() else None
    # a hub id is no local path: pass it on unchanged for from_pretrained
    return str(ckpt) if path.exists() else name, log, info, (run or path).name


def teacher_name(arg, info):
    if arg == "none":
        return None
    return arg if arg != "auto" else (info or {}).get("source_model")


def load_teacher(name, device, dtype):
    """(teacher, its tokenizer) in eval mode, or one error line."""
    try:
        teacher, ttok = load_model(name, device, dtype)
    except E3Error:
        raise E3Error(f"cannot load the teacher '{name}' (--teacher, else pruning.json's "
                      f"source_model); pass --teacher with the dense source model, or "
                      f"--teacher none") from None
    return teacher.eval(), ttok


def check_same_tokens(name, ttok, tok):
    """KL and top-1 compare the two distributions token id by token id: one vocabulary (a chat
    template or a BOS of its own: no matter). Checked for every model the teacher scores."""
    if ttok.get_vocab() != tok.get_vocab():
        raise E3Error(f"teacher '{name}' has another tokenizer than the model; pass the matching "
                      f"--teacher or --teacher none")


# -----------------------------------------------------------------------------
# Quality: perplexity, KL(teacher || model), top-1 agreement

def eval_blocks(tok, args):
    """[N, seq_len] windows: the held-out end of --data, or all of it with --val-frac 1."""
    if args.val_frac >= 1:  # the first --max-tokens of the stream (0: all): reading stops there
        tokens = token_file(tok, args.data, args.text_field, args.max_tokens or None)
        n = min(tokens.n_tokens, args.max_tokens or tokens.n_tokens) // args.seq_len
        blocks = Blocks(tokens, 0, n, args.seq_len)[:n]
    else:  # the end of the whole corpus: it is read (and tokenised, once) to the end
        blocks = corpus_blocks(tok, args.data, args.seq_len, None, args.val_frac,
                               args.max_tokens or None, args.text_field)["val"]
        n, held_out = blocks.tokens.n_tokens, blocks.tokens.n_tokens - blocks.start
        if int(args.val_frac * n) < held_out:  # set by the floor of 4 windows, not by --val-frac
            print0(f"warning: the held-out end is the last {held_out} tokens, set by --seq-len "
                   f"{args.seq_len}: a run that trained on this text with a shorter --seq-len held "
                   f"out less, and may have trained on these windows' start; score held-out text "
                   f"with --val-frac 1, or pass more --data", file=sys.stderr)
        blocks = blocks[:len(blocks)]
    if len(blocks) == 0:
        raise E3Error(f"--data holds fewer than --seq-len {args.seq_len} tokens to score; "
                      f"pass more text or a smaller --seq-len")
    return blocks


def next_token_logprobs(model, ids, vocab):
    """fp32 log-probabilities of the next token at every position but the last, over the real
    vocabulary."""
    # the last position predicts a token outside the window; columns past `vocab` are the
    # embedding's padding, never a real token, and would take probability mass
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1, :vocab]
    return F.log_softmax(logits.float(), dim=-1)  # fp32: bf16 would round away a small KL


@torch.no_grad()
def quality(model, blocks, vocab, teacher=None, batch_size=1, topk=10, ece_bins=15):
    """ppl of `model` on `blocks` [N, T] (N * (T-1) predictions) and the expected calibration error
    of its top-1 (`ece_bins` equal-width bins of confidence: sum_b n_b / N |accuracy_b -
    confidence_b|); with a teacher also its ppl, the mean KL(teacher || model), top-1 agreement and
    both models' mean mass outside the teacher's `topk` most likely tokens, on the same predictions.
    Sums in float64."""
    dev = next(model.parameters()).device
    # NLL, teacher NLL, KL, agreements, model mass off the teacher's top-K, the teacher's own
    sums = torch.zeros(6, dtype=torch.float64)
    bins = torch.zeros(2, ece_bins, dtype=torch.float64)  # per bin: summed confidence, hits
    for b in blocks.split(batch_size):
        b = b.to(dev)
        target = b[:, 1:].unsqueeze(-1)  # position t is scored on token t + 1
        logp = next_token_logprobs(model, b, vocab)
        # .item() per batch keeps the running sums in float64 on the host: 10^5+ fp32 token terms
        # would drift in the 4th digit, which is where pruned models differ
        sums[0] -= logp.gather(-1, target).double().sum().item()
        conf, top1 = logp.max(-1)
        conf = conf.exp().double().flatten().cpu()
        at = (conf * ece_bins).long().clamp(max=ece_bins - 1)  # each prediction's bin
        bins[0] += torch.bincount(at, conf, minlength=ece_bins)
        bins[1] += torch.bincount(at, (top1 == target[..., 0]).double().flatten().cpu(),
                                  minlength=ece_bins)
        if teacher is not None:
            logq = next_token_logprobs(teacher, b, vocab)
            sums[1] -= logq.gather(-1, target).double().sum().item()
            # KL(teacher || model) = sum_v q (log q - log p): the direction the KD loss minimises
            # (the student must cover the teacher's mass), over the full vocabulary, unlike the
            # top-K training loss
            sums[2] += (logq.exp() * (logq - logp)).sum(-1).double().sum().item()
            sums[3] += (logq.argmax(-1) == logp.argmax(-1)).sum().item()
            # the mass the top-K KD loss never sees: outside the K tokens the teacher ranks first
            top_q, top_ids = logq.topk(topk, dim=-1)
            sums[4] += (1 - logp.gather(-1, top_ids).exp().sum(-1)).double().sum().item()
            sums[5] += (1 - top_q.exp().sum(-1)).double().sum().item()
    n = blocks.shape[0] * (blocks.shape[1] - 1)
    out = {"tokens": n, "windows": blocks.shape[0], "seq_len": blocks.shape[1],
           "ppl": math.exp(sums[0] / n), "ece": (bins[0] - bins[1]).abs().sum().item() / n}
    if teacher is not None:
        out.update(teacher_ppl=math.exp(sums[1] / n), kl=sums[2].item() / n,
                   top1=sums[3].item() / n, tail=sums[4].item() / n,
                   teacher_tail=sums[5].item() / n, tail_k=topk)
    return out


# -----------------------------------------------------------------------------
# Speed: time to first token and time per output token, measured vs ideal

def linear_flops(model):
    """(matmul FLOPs per token of the decoder layers, of the LM head): 2 x each weight matrix a
    token multiplies: nn.Linear, GPT-2's Conv1D, a router's matrix, and of a MoE's experts stored
    as one 3-D tensor (an expert a slice) the num_experts_per_tok a token is routed to."""
    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    layers = 0
    for m in decoder_layers(model).modules():
        for name, p in m.named_parameters(recurse=False):
            if p.dim() < 2 or name.endswith("bias"):  # norms and biases: no matmul
                continue
            routed = p.dim() == 3 and top_k and getattr(m, "num_experts", None) == p.shape[0]
            # 2 FLOPs (a multiply and an add) per weight per token
            layers += 2 * p.numel() * top_k // p.shape[0] if routed else 2 * p.numel()
    return layers, 2 * model.get_output_embeddings().weight.numel()


class Clock:
    """Time stamps: CUDA events on a GPU (they time the queued kernels, not their launch), else
    perf_counter (CPU ops are synchronous)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def seconds(self, a, b):
        if not self.cuda:
            return b - a
        b.synchronize()  # elapsed_time needs both events done
        return a.elapsed_time(b) / 1e3  # events measure milliseconds


@torch.no_grad()
def greedy(model, prompts, gen_len, clock):
    """Greedy generation with the KV cache: (seconds to the first token, seconds per further token,
    tokens [B, gen_len]). The prefill computes the LM head on the last position only, as generate()
    does."""
    if clock.cuda:
        torch.cuda.synchronize()  # nothing queued earlier may land in the prefill time
    t0 = clock.now()
    # a hand-written loop rather than generate(): generate() adds logits processors, stopping
    # criteria and cache set-up whose fixed cost per token would blur the layer-count speedup
    # being measured
    out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
    t1 = clock.now()
    for _ in range(gen_len - 1):  # feed only the newest token: the KV cache holds the rest
        out = model(input_ids=tokens[-1], cache=out.cache, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    t2 = clock.now()
    return clock.seconds(t0, t1), clock.seconds(t1, t2) / (gen_len - 1), torch.cat(tokens, 1)


def speed(models, vocab, batch, prompt_len, gen_len, repeats, warmup=1, seed=0):
    """Latency of each model in `models` {name: model} on the same random prompts. Every repeat runs
    every model once, in alternating order, so drifts in machine load hit them alike; medians of the
    repeats, and every repeat's times (ms) for paired ratios."""
    dev = next(iter(models.values())).device
    # random ids: latency does not depend on the text, and no data is needed; seeded to repeat
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(vocab, (batch, prompt_len), generator=gen).to(dev)
    clock, times = Clock(dev), {name: [] for name in models}
    for r in range(warmup + repeats):
        # order A B, B A, A B, ...: neither model always runs right after the other's cache traffic
        for name in list(models)[::(-1) ** r]:
            ttft, tpot, _ = greedy(models[name], prompts, gen_len, clock)
            if r >= warmup:  # warm-up pays one-off costs: lazy init, allocator growth
                times[name].append((1e3 * ttft, 1e3 * tpot))
    out = {}
    for name, model in models.items():
        ttfts, tpots = (list(t) for t in zip(*times[name]))
        ttft, tpot = statistics.median(ttfts), statistics.median(tpots)  # robust to a stall
        layers, head = linear_flops(model)
        out[name] = {"ttft_ms": ttft, "tpot_ms": tpot,
                     "prefill_tok_s": 1e3 * batch * prompt_len / ttft,
                     "decode_tok_s": 1e3 * batch / tpot,
                     "ttft_ms_runs": ttfts, "tpot_ms_runs": tpots,
                     # prefill runs the LM head once per sequence (logits_to_keep=1 in greedy)
                     "prefill_gflop_per_seq": (prompt_len * layers + head) / 1e9,
                     "decode_gflop_per_token": (layers + head) / 1e9}
    return out


def speedups(dense, pruned):
    """Measured speedups, each the median over repeats of dense time / pruned time of the same
    repeat (run back to back, so a slow moment of the machine mostly cancels), with their
    [min, max], beside the ideal FLOP ratios."""
    out = {}
    for phase, key, flops in (("prefill", "ttft_ms_runs", "prefill_gflop_per_seq"),
                              ("decode", "tpot_ms_runs", "decode_gflop_per_token")):
        ratios = [d / p for d, p in zip(dense[key], pruned[key])]
        out |= {f"{phase}_speedup": statistics.median(ratios),
                f"{phase}_range": [min(ratios), max(ratios)],
                f"{phase}_ideal": dense[flops] / pruned[flops]}
    return out


# -----------------------------------------------------------------------------
# lm-evaluation-harness (optional)

def run_tasks(model, tok, tasks, include_path=None, limit=None, batch_size=1):
    """{task: {metric: value}} from lm-eval on the already-loaded model; local YAMLs from
    include_path."""
    try:  # lm-eval is optional: only --tasks needs it
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise E3Error("--tasks needs lm-evaluation-harness; install it with: "
                      "pip install lm-eval") from None
    local = include_path if include_path and Path(include_path).is_dir() else None
    # the local folder alone first: indexing it takes a moment, lm-eval's own tasks take long
    manager = TaskManager(include_path=local, include_defaults=False) if local else None
    if manager is None or not set(tasks) <= set(manager.all_tasks):
        manager = TaskManager(include_path=local)  # indexes lm-eval's ~14k built-in YAMLs: slow
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size)  # no second load from disk
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                  log_samples=False, bootstrap_iters=1000)
    # lm-eval names a metric "acc,none" (metric, filter): keep the metric, drop stderr and aliases
    return {task: {k.split(",")[0]: v for k, v in metrics.items()
                   if "," in k and "_stderr" not in k}
            for task, metrics in res["results"].items()}


# -----------------------------------------------------------------------------
# Figures from a prune.py log.jsonl (optional matplotlib)

def read_log(path):
    """{event name: [events in file order]}."""
    events = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            events.setdefault(e.get("event"), []).append(e)
    return events


def figures(log_path, info, prefix):
    """PNG files drawn from a run's log: score trajectory + sampled masks, initial importance,
    losses."""
    try:  # matplotlib is optional: the tables do not need it
        import matplotlib
        matplotlib.use("Agg")  # files only: no display on a server
        import matplotlib.pyplot as plt
    except ImportError:
        print0("figures skipped: matplotlib is not installed (pip install matplotlib)")
        return []
    ev = read_log(log_path)
    pruned = set((info or {}).get("removed_layers", []))
    if not pruned and ev.get("pruned"):  # no pruning.json: the log's last "pruned" event says
        kept = ev["pruned"][-1]["kept"]
        # L from the search's scores; a run without a search knows only its largest kept index
        n_layers = len(ev["search"][0]["scores"]) if ev.get("search") else max(kept) + 1
        pruned = set(range(n_layers)) - set(kept)
    drawn = []
    for name, draw in (("trajectory", _trajectory), ("importance", _importance), ("loss", _losses)):
        fig = draw(plt, ev, pruned)
        if fig is not None:
            path = f"{prefix}-{name}.png"
            fig.savefig(path, dpi=120, bbox_inches="tight")
            plt.close(fig)
            drawn.append(path)
    return drawn


def _trajectory(plt, ev, pruned):
    """The paper's Appendix C figure: (a) score of every layer at every search step, pruned layers
    hatched; (b) the scores of the layers the Gumbel-TopK sampler kept in that step's forward
    pass."""
    search = sorted(ev.get("search", []), key=lambda e: e["step"])
    if not search:
        return None
    scores = torch.tensor([e["scores"] for e in search]).T  # [L, steps]
    masks = torch.tensor([e["mask"] for e in search]).T
    steps, L = [e["step"] for e in search], scores.shape[0]
    # height grows with L so that every layer keeps a readable row
    fig, axes = plt.subplots(2, 1, figsize=(10, 1.6 + 0.18 * L), sharex=True,
                             constrained_layout=True)
    extent = (steps[0] - 0.5, steps[-1] + 0.5, -0.5, L - 0.5)
    vmin, vmax = scores.min().item(), scores.max().item()  # one colour scale for (a) and (b)
    sampled = torch.where(masks > 0.5, scores, torch.nan)
    cmap = plt.get_cmap("viridis").with_extremes(bad="0.92")  # blank: not sampled in that step
    for ax, data, title in (
            (axes[0], scores, "(a) layer scores S per search step; hatched: pruned layers"),
            (axes[1], sampled, "(b) sampled: scores of the layers the Gumbel-TopK mask kept")):
        im = ax.imshow(data.numpy(), aspect="auto", origin="lower", cmap=cmap, vmin=vmin, vmax=vmax,
                       extent=extent, interpolation="nearest")
        # the paper's "shadowed blocks"; red shows on the colormap and on blank cells
        for l in pruned:
            ax.axhspan(l - 0.5, l + 0.5, facecolor="none", hatch="///", edgecolor="tab:red",
                       linewidth=0)
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=10, loc="left")
        # past 40 layers, label every 5th: the labels would overlap
        ax.set_yticks(range(L), [str(l) if L <= 40 or l % 5 == 0 else "" for l in range(L)],
                      fontsize=7)
        for l, label in enumerate(ax.get_yticklabels()):
            label.set_color("tab:red" if l in pruned else "black")
        ax.xaxis.get_major_locator().set_params(integer=True)
        fig.colorbar(im, ax=ax, pad=0.01, label="score")
    kept = [int(m.sum()) for m in masks.T]
    axes[1].set_xlabel(f"search step (layers kept by the sampler: {kept[0]} -> {kept[-1]}, "
                       f"tau {search[0]['tau']:.2f} -> {search[-1]['tau']:.2f})")
    return fig


def _importance(plt, ev, pruned):
    """Initial per-layer importance (paper Sec. 3.2) as bars, the finally pruned layers in another
    colour."""
    if not ev.get("importance"):
        return None
    e = ev["importance"][-1]
    s = e["scores"]
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(s)), 3.2), constrained_layout=True)
    colors = ["tab:red" if l in pruned else "tab:blue" for l in range(len(s))]
    ax.bar(range(len(s)), s, color=colors)
    if min(s) > 0 and max(s) / min(s) > 100:  # KL importance spans decades (layer 0 dominates)
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(f"importance ({e.get('method', '?')})")
    ax.set_title("initial layer importance; red: pruned in the end", fontsize=10, loc="left")
    ax.set_xlim(-0.6, len(s) - 0.4)
    ax.set_xticks(range(len(s)), [str(l) for l in range(len(s))], fontsize=7)
    return fig


def _losses(plt, ev, pruned):
    """Training loss per step (search and fine-tuning phases) and validation loss."""
    train, val = ev.get("train", []), ev.get("val", [])
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5), constrained_layout=True)
    for phase, color in (("search", "tab:orange"), ("finetune", "tab:blue")):
        pts = [(e["step"], e["loss"]) for e in train if e.get("phase") == phase]
        if pts:
            ax.plot(*zip(*pts), color=color, lw=1, label=f"train ({phase})")
    if val:
        ax.plot([e["step"] for e in val], [e["val_loss"] for e in val], "o-", color="k", ms=3,
                label="validation")
    search_end = max((e["step"] for e in train if e.get("phase") == "search"), default=None)
    if search_end is not None:
        ax.axvline(search_end, color="0.5", ls="--", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    handles = ax.get_legend_handles_labels()[0]
    ce = [(e["step"], e["val_ce"]) for e in val if "val_ce" in e]
    if ce:  # next-token cross-entropy on the data: another scale than the distillation loss
        ax2 = ax.twinx()
        handles += ax2.plot(*zip(*ce), "s:", color="tab:green", ms=3, label="validation CE (right)")
        ax2.set_ylabel("cross-entropy (nats)")
    ax.legend(handles=handles, fontsize=8)
    ax.set_title("loss curves (dashed: end of the mask search)", fontsize=10, loc="left")
    return fig


# -----------------------------------------------------------------------------
# Report

def markdown(rows):
    """One row per model; speed cells are dense -> model, and measured speedup (ideal)."""
    tasks = sorted({(t, m) for r in rows for t, ms in r.get("tasks", {}).items() for m in ms})
    head = ["model", "layers", "params (M)", "ppl", "teacher ppl", "KL", "top-1",
            "mass off top-K (teacher)", "TTFT ms",
            "prefill x (ideal)", "TPOT ms", "decode x (ideal)"] + [f"{t} {m}" for t, m in tasks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def num(x, spec):
        return "-" if x is None else format(x, spec)

    for r in rows:
        q, s, d, x = r.get("quality", {}), r.get("speed"), r.get("dense_speed"), r.get("speedup")

        def ms(key):  # "dense -> model" when there is a teacher to time, else the model alone
            if not s:
                return "-"
            return f"{d[key]:.1f} -> {s[key]:.1f}" if d else f"{s[key]:.1f}"

        def times(phase):
            return f"{x[phase + '_speedup']:.2f} ({x[phase + '_ideal']:.2f})" if x else "-"

        cells = [r["name"], r["layers"], f"{r['params_m']:.1f}", num(q.get("ppl"), ".2f"),
                 num(q.get("teacher_ppl"), ".2f"), num(q.get("kl"), ".4f"),
                 num(q.get("top1"), ".3f"),
                 "-" if q.get("tail") is None else f"{q['tail']:.3f} ({q['teacher_tail']:.3f})",
                 ms("ttft_ms"), times("prefill"), ms("tpot_ms"), times("decode")]
        cells += [num(r.get("tasks", {}).get(t, {}).get(m), ".3f") for t, m in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def output_paths(args, runs):
    """(report prefix, figure prefix): --report P gives P.md and P-NAME-*.png; --out DIR (default:
    RUN/eval for a single run folder, else out/eval) gives DIR/report.md and DIR/NAME-*.png."""
    if args.report:
        return args.report, args.report + "-"
    logs = [log for _, log, _, _ in runs if log]
    if args.out:
        out = Path(args.out)
    elif len(runs) == 1 and logs:  # a single run folder: the report goes inside it
        out = logs[0].parent / "eval"
    else:
        out = Path("out/eval")
    return str(out / "report"), str(out) + os.sep


def evaluate_one(args, spec, blocks_for, teachers, dtype, fig_prefix):
    ckpt, log, info, name = spec
    model, tok = load_model(ckpt, args.device, dtype)
    model.eval()
    tname = teacher_name(args.teacher, info)
    if tname and tname not in teachers:
        teachers.clear()  # one teacher in memory at a time; runs from one source share it
        teachers[tname] = load_teacher(tname, args.device, dtype)
    teacher, ttok = teachers.get(tname, (None, None))
    if teacher is not None:
        check_same_tokens(tname, ttok, tok)
    # the depth before pruning: pruning.json knows it; else the teacher's, if there is one
    L = (info or {}).get("layers_before") or (len(decoder_layers(teacher)) if teacher else None)
    k = len(decoder_layers(model))
    row = {"name": name, "model": ckpt, "teacher": tname, "layers": f"{k}/{L or k}",
           "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
           "method": (info or {}).get("method"),
           "tokens_trained": (info or {}).get("tokens_trained")}
    vocab = vocab_size(tok)
    if args.quality:
        print0(f"[{name}] quality on held-out windows ...")
        # the tail is measured off the K the run distilled on (pruning.json's flags), else 10
        topk = (info or {}).get("flags", {}).get("topk") or 10
        row["quality"] = quality(model, blocks_for(tok), vocab, teacher, args.eval_batch_size,
                                 topk)
    if args.speed:
        print0(f"[{name}] speed: batch {args.batch}, prompt {args.prompt_len}, gen {args.gen_len}, "
               f"{args.repeats} repeats, {torch.get_num_threads()} CPU threads ...")
        pair = {"dense": teacher, "model": model} if teacher is not None else {"model": model}
        res = speed(pair, vocab, args.batch, args.prompt_len, args.gen_len, args.repeats,
                    args.warmup, args.seed)
        runs = [t for r in res.values() for t in (r["ttft_ms_runs"], r["tpot_ms_runs"])]
        # spread relative to the median: a speedup read from such timings is not to be trusted
        if max((max(t) - min(t)) / statistics.median(t) for t in runs) > 0.25:
            print0("note: timings of the same model differ by more than 25% between repeats: the "
                   "machine is busy (on a shared CPU, threads waiting on each other stall: try "
                   "--threads 1), or pass more --repeats; every repeat's times are in the JSON "
                   "report")
        row["speed"], row["dense_speed"] = res["model"], res.get("dense")
        if teacher is not None:
            row["speedup"] = speedups(res["dense"], res["model"])
    if args.tasks:
        print0(f"[{name}] lm-eval tasks: {args.tasks}")
        row["tasks"] = run_tasks(model, tok, args.tasks.split(","), args.include_path, args.limit,
                                 args.eval_batch_size)
    if args.figures and log:
        row["figures"] = figures(log, info, fig_prefix + name)
    return row


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"auto": torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    runs = [resolve_run(m) for m in args.model]
    names = [r[3] for r in runs]
    # two runs with one folder name (a/e3, b/e3) get -0, -1: their figures must not overwrite
    runs = [(c, l, i, n if names.count(n) == 1 else f"{n}-{j}")
            for j, (c, l, i, n) in enumerate(runs)]
    if args.model == ["default"]:
        print0("no --model given: evaluating the packaged dense model alone; pass --model RUN_DIR "
               "(a prune.py --out folder) to compare a pruned model with its teacher")
    prefix, fig_prefix = output_paths(args, runs)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    blocks_cache = {}

    def blocks_for(tok):  # tokenize the corpus once per tokenizer
        key = tokenizer_fingerprint(tok)
        if key not in blocks_cache:
            blocks_cache[key] = eval_blocks(tok, args)
        return blocks_cache[key]

    teachers, rows = {}, []
    for spec in runs:
        rows.append(evaluate_one(args, spec, blocks_for, teachers, dtype, fig_prefix))
    table = markdown(rows)
    settings = vars(args) | {"dtype": str(dtype), "threads": torch.get_num_threads()}
    # the settings that make the numbers comparable, above the table they qualify
    header = (f"Quality: non-overlapping {args.seq_len}-token windows of held-out text, no BOS "
              f"inserted; KL(teacher || model) in nats/token, full vocabulary, fp32. Speed: "
              f"{args.device}, {dtype}, batch {args.batch}, prompt {args.prompt_len}, "
              f"{args.gen_len} greedy tokens, median of {args.repeats}; ideal = matmul-FLOP ratio "
              f"(decoder linears + LM head).\n\n")
    Path(f"{prefix}.md").write_text(header + table)
    Path(f"{prefix}.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2)
                                      + "\n")
    print0("\n" + table)
    print0(f"report: {prefix}.md, {prefix}.json",
           *(f for r in rows for f in r.get("figures", [])), sep=", ")
    return rows


if __name__ == "__main__":
    run_main(main)
