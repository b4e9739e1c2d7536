"""Why a sparse target's gap to full-vocabulary KD grows with training (experiments/RESULTS.md).

At one position, with p_s the student's and p_t the teacher's next-token distribution, the gradient
of the KL at the student's logits is p_s - q, q the target's distribution (kd.py):
  full KD                            q = p_t: the signal, ||p_s - p_t||^2, which shrinks as the
                                     student nears the teacher
  sampled, N draws from p_t          E q = p_t; it adds E||q - p_t||^2 = (1 - sum_v p_t,v^2) / N
  hybrid, the top-K kept, N draws    E q = p_t; it adds r^2 (1 - sum_v pi_v^2) / N, with r the mass
  off it                             off the top-K and pi = p_t / r off it
  top-K (eq. 12)                     E q != p_t: the bias r p_s - p_t,off (p_t,off = p_t off the
                                     top-K, 0 on it), squared
Every added variance is the teacher's alone: it stays while the signal shrinks, so the longer a run
trains, the larger the share of its gradient that is the target's noise. Averaged over the held-out
end of the packaged corpus (evaluate.py's text), for each model given:
    python experiments/target_noise.py RUN_DIR [RUN_DIR ...] [--max-tokens 8192]
"""
import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cache_teacher import DEFAULT_VAL_FRAC, vocab_size  # noqa: E402
from demo import default_model  # noqa: E402
from runtime import load_model  # noqa: E402
from evaluate import eval_blocks, next_token_logprobs  # noqa: E402

SAMPLED = (8, 12, 24)
HYBRID = ((8, 12), (16, 24))
TOPK = 10


@torch.no_grad()
def teacher_terms(p_t):
    """Per position (p_t: (n, V)): each unbiased sparse target's added variance E||q - p_t||^2."""
    sq = (p_t * p_t).sum(-1)  # sum_v p_t,v^2, one pass over the vocabulary for every target
    out = {f"sampled N={n}": (1 - sq) / n for n in SAMPLED}
    top = p_t.topk(max(k for k, _ in HYBRID), dim=-1).values  # sorted, largest first
    for k, n in HYBRID:
        r = (1 - top[..., :k].sum(-1)).clamp(min=0)
        off_sq = sq - (top[..., :k] ** 2).sum(-1)  # sum of p_t^2 off the top-K
        out[f"hybrid K={k} N={n}"] = (r * r - off_sq) / n  # r^2 (1 - sum_off pi^2) / N
    return out


@torch.no_grad()
def top_k_bias(p_s, p_t, k=TOPK):
    """||r p_s - p_t,off||^2: top-K KD's expected gradient minus full KD's."""
    ids = p_t.topk(k, dim=-1).indices
    off = p_t.scatter(-1, ids, 0.0)
    r = off.sum(-1, keepdim=True)
    return ((r * p_s - off) ** 2).sum(-1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", help="prune.py --out folders (their model/) or model folders")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    teacher, tok = load_model(default_model())
    teacher.eval()
    vocab = vocab_size(tok)
    blocks = eval_blocks(tok, SimpleNamespace(data=None, val_frac=DEFAULT_VAL_FRAC,
                                              seq_len=args.seq_len, max_tokens=args.max_tokens,
                                              text_field="text"))
    students = {Path(run).name: load_model(str(Path(run) / "model" if (Path(run) / "model").exists()
                                                 else run))[0].eval() for run in args.runs}
    sums = {}  # summed over every held-out position, a window at a time (V-wide rows are large)
    add = lambda key, v: sums.__setitem__(key, sums.get(key, 0.0) + v.sum().item())  # noqa: E731
    windows = torch.as_tensor(blocks[:len(blocks)])
    for ids in windows:
        p_t = next_token_logprobs(teacher, ids[None], vocab).exp()[0]
        for k, v in teacher_terms(p_t).items():
            add(k, v)
        for name, student in students.items():
            p_s = next_token_logprobs(student, ids[None], vocab).exp()[0]
            add((name, "signal"), ((p_s - p_t) ** 2).sum(-1))
            add((name, "bias"), top_k_bias(p_s, p_t))
    n = len(windows) * (args.seq_len - 1)
    terms = {k: v / n for k, v in sums.items() if isinstance(k, str)}
    print(f"{len(windows)} held-out windows of {args.seq_len} tokens; added variance a position "
          "(the teacher's alone): " + ", ".join(f"{k} {v:.4f}" for k, v in terms.items()))
    print("\n| model | signal E||p_s - p_t||^2 | top-10 bias^2 | " +
          " | ".join(f"{k} / signal" for k in terms) + " |")
    print("|---|---|---|" + "---|" * len(terms))
    for name in students:
        signal, bias = sums[(name, "signal")] / n, sums[(name, "bias")] / n
        print(f"| {name} | {signal:.4f} | {bias:.4f} | " +
              " | ".join(f"{v / signal:.3f}" for v in terms.values()) + " |")


if __name__ == "__main__":
    main()
