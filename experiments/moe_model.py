"""
A small Mixture-of-Experts causal LM that routes for real, trained from scratch on a CPU: the
project's MoE test subject (prune.py --experts-keep, experts/), in transformers 5's Qwen3-MoE layout.

  model      Qwen3MoeForCausalLM: 6 layers, hidden 256, 4 query heads and 2 KV heads of 64, every
             layer a sparse MoE block of --experts experts (16; SwiGLU, intermediate --expert-width,
             256), top-2 with the two gates renormalised (norm_topk_prob), tied embeddings; the
             SmolLM2-135M tokenizer of the packaged demo (49,152 ids). ~32.7M parameters, ~16.2M
             active a token at the defaults (the tied embedding, 12.6M, counted once).
  data       --data, a domain of experiments/domains.py or a mixture DOMAIN:W,... (a window's domain
             drawn in proportion to W); the default, the paper-corpus (the plays but their held-out
             end, and ~10,000 Wikipedia vital-article summaries). Each domain's training part only:
             the first 95% of its token stream (cache_teacher.split, the project's own). Windows of
             --seq-len at random offsets.
  training   next-token cross-entropy + 0.01 x Switch's load-balancing loss of each MoE layer
             (--aux-coef), summed over the layers, as Mixtral and Qwen3-MoE are trained: a layer
             shares the training mix's tokens about evenly among its experts, which then
             specialise by text (on code, never trained on, one expert of a layer takes up to 4.6x
             its even share and another 1/16 of it: routing.json). transformers' own aux loss
             pools the layers into one balance instead, and lets an expert starve in one layer
             while busiest in another; a weaker balance starves some too (experiments/RESULTS.md).
             AdamW (0.9, 0.95), wd 0.1 on matrices, lr 1e-3, 5% warmup, cosine to 1e-4, clip 1.0,
             fp32.
  measured   held-out perplexity on each trained domain's last 5% and on the held-out domains
             (python-docs, torch-code: their first 16K tokens, as evaluate.py scores them); routing
             on the same text with experts.importance.frequency_importance: per MoE layer the
             share of tokens each expert receives (a row sums to top-k = 2), its max/min and the
             normalised entropy of share / 2 (1 = uniform).
  written    OUT/: config.json, model.safetensors, the tokenizer files (prune.py --model OUT),
             routing.json; one summary line appended to experiments/results-moe/train.jsonl. The
             checkpoint is reloaded and checked: no missing or unexpected weight, the same logits.

    OMP_NUM_THREADS=1 python experiments/moe_model.py            # runs/moe-small
    OMP_NUM_THREADS=1 python experiments/moe_model.py --out runs/moe-domains \
        --data paper-corpus:1,torch-train:1 --experts 8 --expert-width 512 --steps 700
                          # the domain MoE (prose and code; issue 67): 36.5 min of training here

Deterministic given its flags and the thread count (routing.json records the weights' sha256).
Built on a 2-core x86 CPU, one thread: 1,500 steps of 4 x 256 tokens in 56 minutes (2026-11-28).
"""
import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project's files: cache_teacher, evaluate, experts
sys.path.insert(0, str(ROOT / "experiments"))  # domains.py

import domains  # noqa: E402
from cache_teacher import (DEFAULT_VAL_FRAC, Blocks, corpus_blocks, resolve_model,  # noqa: E402
                           token_file)
from evaluate import quality  # noqa: E402
from experts.importance import frequency_importance  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--out", default="runs/moe-small", help="checkpoint folder")
p.add_argument("--steps", type=int, default=1500, help="optimizer steps")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--seq-len", type=int, default=256, help="tokens a training window")
p.add_argument("--batch-size", type=int, default=4, help="windows a step")
p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight, a layer")
p.add_argument("--data", default="paper-corpus",
               help="training text: a domain of experiments/domains.py, or a mixture DOMAIN:W,... "
                    "(windows drawn from each domain in proportion to W); each domain's last 5%% "
                    "held out")
p.add_argument("--experts", type=int, default=16, help="experts a MoE layer")
p.add_argument("--expert-width", type=int, default=256, help="an expert's intermediate size")
p.add_argument("--data-dir", default="runs/domains",
               help="experiments/domains.py's files (written if absent)")
args = p.parse_args()
LR, MIN_LR, WARMUP, CLIP, LOG_EVERY, EVAL_EVERY = 1e-3, 1e-4, max(1, args.steps // 20), 1.0, 10, 250
HELD_OUT_TOKENS = 16_384  # a held-out domain's first tokens scored, as evaluate.py's runs do
t_start = time.time()
torch.manual_seed(args.seed)

# -----------------------------------------------------------------------------
# Text: the demo's tokenizer, the paper-corpus split the project's way, the held-out domains

from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

tok = AutoTokenizer.from_pretrained(resolve_model(None))  # the packaged SmolLM2-135M's
vocab = len(tok)
data = Path(args.data_dir)
mix = {d: float(w or 1) for d, _, w in (x.partition(":") for x in args.data.split(","))}
names = (*mix, *(d for d in ("python-docs", "torch-code") if d not in mix))  # trained, then held out
if not all((data / f"{n}.jsonl").exists() for n in names):
    domains.write(data, names)
T, B = args.seq_len, args.batch_size
train, val, held_out = {}, {}, {}
for name in mix:
    blocks = corpus_blocks(tok, data / f"{name}.jsonl", T, val_frac=DEFAULT_VAL_FRAC)
    train[name] = blocks["train"].tokens.read(0, len(blocks["train"]) * T)  # the first 95%, in memory
    val[name] = blocks["val"][:len(blocks["val"])]  # [N, T]: never trained on
for name in names[len(mix):]:
    tokens = token_file(tok, data / f"{name}.jsonl")
    n = min(tokens.n_tokens, HELD_OUT_TOKENS) // T
    held_out[name] = Blocks(tokens, 0, n, T)[:n]
print("; ".join(f"{k}: {len(train[k]):,} training tokens, {val[k].numel():,} held out" for k in mix)
      + "; " + ", ".join(f"{k}: {v.numel():,} tokens" for k, v in held_out.items()))
gen = torch.Generator().manual_seed(args.seed)
p_domain = torch.tensor(list(mix.values())) / sum(mix.values())


def get_batch():
    """B windows of T tokens at random offsets of the training text, each from a domain drawn in
    the mixture's proportions (labels = inputs: the model shifts them itself)."""
    if len(mix) == 1:  # one domain: the offsets alone are drawn
        text = next(iter(train.values()))
        ix = torch.randint(len(text) - T, (B,), generator=gen).tolist()
        return torch.stack([text[i:i + T] for i in ix])
    src = torch.multinomial(p_domain, B, replacement=True, generator=gen).tolist()
    out = []
    for d in src:
        text = train[list(mix)[d]]
        i = torch.randint(len(text) - T, (1,), generator=gen).item()
        out.append(text[i:i + T])
    return torch.stack(out)


# -----------------------------------------------------------------------------
# The model

config = Qwen3MoeConfig(
    vocab_size=vocab, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, num_experts=args.experts, num_experts_per_tok=2,
    moe_intermediate_size=args.expert_width, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    tie_word_embeddings=True, max_position_embeddings=max(1024, T),
    router_aux_loss_coef=args.aux_coef,  # a layer's; the training loop below applies it
    output_router_logits=False,  # saved off: a reader's forward stays plain; training asks for it
    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
n_total = sum(p.numel() for p in model.parameters())  # the tied embedding once
moe = config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size  # a layer's experts
idle = 1 - config.num_experts_per_tok / config.num_experts  # the experts a token does not use
n_active = n_total - config.num_hidden_layers * moe * idle
print(f"parameters: {n_total / 1e6:.2f}M total, {n_active / 1e6:.2f}M active a token "
      f"({config.num_experts_per_tok} of {config.num_experts} experts)")

# weight decay on the matrices and the experts' 3-D weights, none on the norms' gains
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                         {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step):
    """Linear warmup, then cosine from LR down to MIN_LR at the last step."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    frac = (step - WARMUP) / max(1, args.steps - WARMUP)
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * frac))


@torch.no_grad()
def val_check(windows=16):
    """The loss on the first held-out windows, and the smallest and largest share of their
    tokens an expert receives in any MoE layer (uniform: k / E)."""
    model.eval()
    first = torch.cat([v[:windows // len(val)] for v in val.values()])  # each domain alike
    loss = model(input_ids=first, labels=first).loss.item()
    share, _ = frequency_importance(model, [(first, None)], vocab)
    model.train()
    return f"val loss {loss:.4f} | expert share min {share.min():.3f} max {share.max():.3f}"


# -----------------------------------------------------------------------------
# Training

model.train()
t0, history = time.time(), []
for step in range(args.steps):
    for group in opt.param_groups:
        group["lr"] = lr_at(step)
    x = get_batch()
    out = model(input_ids=x, output_router_logits=True)  # logits, and each layer's router logits
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())  # t predicts t + 1
    # Switch's loss a layer, E sum_i f_i P_i (f_i: the share of top-k slots expert i fills, P_i:
    # its mean router probability); 2 = k when balanced. Given all the layers' logits at once,
    # load_balancing_loss_func would balance expert i's slots summed over the layers instead.
    aux = [load_balancing_loss_func((g,), config.num_experts, config.num_experts_per_tok)
           for g in out.router_logits]
    (ce + config.router_aux_loss_coef * sum(aux)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ce, aux = ce.item(), sum(a.item() for a in aux) / len(aux)
    history.append(ce)
    if step % LOG_EVERY == 0 or step == args.steps - 1:
        dt = time.time() - t0
        print(f"step {step:5d}/{args.steps} | loss {ce:.4f} | aux {aux:.4f} | "
              f"lr {lr_at(step):.2e} | norm {norm:.2f} | {dt / (step + 1):.2f}s/step | "
              f"{(step + 1) * B * T / dt:.0f} tok/s | {dt / 60:.1f} min", flush=True)
    if (step + 1) % EVAL_EVERY == 0 and step + 1 < args.steps:
        print(f"step {step + 1:5d} | {val_check()} (16 windows)", flush=True)
train_s = time.time() - t0
final_loss = sum(history[-50:]) / len(history[-50:])  # the last 50 steps' mean: less noise than one
print(f"trained {args.steps} steps, {args.steps * B * T:,} tokens in {train_s / 60:.1f} min; "
      f"train loss (last 50 steps) {final_loss:.4f}")

# -----------------------------------------------------------------------------
# Measured: perplexity and routing on held-out text


def routing(windows):
    """Per MoE layer: the share of the tokens each expert receives, its max and min, and the
    normalised entropy H(share / k) / log E (1: uniform)."""
    share, layers = frequency_importance(model, [(b, None) for b in windows.split(8)], vocab)
    q = share / config.num_experts_per_tok  # a distribution over the experts, each row
    entropy = -(q * q.clamp_min(1e-12).log()).sum(-1) / math.log(config.num_experts)
    return {"layers": layers, "share": share.tolist(), "max": share.max(-1).values.tolist(),
            "min": share.min(-1).values.tolist(), "entropy": entropy.tolist()}


model.eval()
texts = {**{f"{k}-val": v for k, v in val.items()}, **held_out}
results = {}
for name, windows in texts.items():
    results[name] = {"ppl": quality(model, windows, vocab, batch_size=8)["ppl"],
                     "tokens": windows.numel(), "routing": routing(windows)}
    print(f"{name}: ppl {results[name]['ppl']:.2f} on {windows.numel():,} tokens")
uniform = config.num_experts_per_tok / config.num_experts
first = next(iter(texts))
r = results[first]["routing"]
print(f"routing on {first} (uniform share {uniform:.3f}):")
for i, l in enumerate(r["layers"]):
    # total variation between this text's routing and each other text's: do domains route apart?
    tv = [0.5 * sum(abs(a - b) for a, b in zip(r["share"][i], results[d]["routing"]["share"][i]))
          / config.num_experts_per_tok for d in list(texts)[1:]]
    print(f"  layer {l}: max {r['max'][i]:.3f} min {r['min'][i]:.3f} entropy {r['entropy'][i]:.3f} | "
          + " ".join(f"TV vs {d} {v:.3f}" for d, v in zip(list(texts)[1:], tv)))

# -----------------------------------------------------------------------------
# Written: the checkpoint, reloaded and checked; the record

out_dir = Path(args.out)
model.save_pretrained(out_dir)  # safetensors; the tied head saved once
tok.save_pretrained(out_dir)
reloaded, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
reloaded.eval()
with torch.no_grad():
    x = next(iter(val.values()))[:4]
    same = torch.equal(model(input_ids=x).logits, reloaded(input_ids=x).logits)
assert same, "the reloaded checkpoint's logits differ from the trained model's"
weights = hashlib.sha256(b"".join(t.numpy().tobytes() for _, t in sorted(
    model.state_dict().items()))).hexdigest()[:16]
record = {"out": str(out_dir), "command": " ".join(sys.argv), "data": mix, "seed": args.seed, "steps": args.steps,
          "batch_size": B, "seq_len": T, "aux_coef": args.aux_coef, "tokens": args.steps * B * T,
          "params_total": n_total, "params_active": int(n_active),
          "train_minutes": round(train_s / 60, 2),
          "total_minutes": round((time.time() - t_start) / 60, 2), "threads": torch.get_num_threads(),
          "final_train_loss": final_loss, "weights_sha256": weights, "torch": torch.__version__,
          "results": results}
(out_dir / "routing.json").write_text(json.dumps(record, indent=1) + "\n")
summary = {k: v for k, v in record.items() if k != "results"}
summary.update({f"ppl_{k}": v["ppl"] for k, v in results.items()},
               entropy_min=min(r["entropy"]), max_share=max(r["max"]), min_share=min(r["min"]))
log = ROOT / "experiments" / "results-moe" / "train.jsonl"
log.parent.mkdir(parents=True, exist_ok=True)
with open(log, "a") as f:
    f.write(json.dumps(summary) + "\n")
print(f"saved {out_dir} (reloaded: no missing or unexpected weight, same logits); "
      f"{out_dir / 'routing.json'}; appended to {log.relative_to(ROOT)}; "
      f"{(time.time() - t_start) / 60:.1f} min in all")
