"""
The host memory of an expert-pruned run against the model built at its pruned size (issue 66): a
random ~100M-parameter Qwen3-MoE whose routed experts dominate its state (4 layers, hidden 512, 8
experts of width 2048, top-2, the demo's SmolLM2 tokenizer, tied embeddings), pruned one-shot to 4
experts a layer (--experts-keep 4 --search none --expert-init reap: the cut at step 0) and trained 3
steps; beside it the same 3 steps of the model built with 4 experts (the same run: --experts-keep 4
on a 4-expert model, its range check lifted here alone, so that the cut keeps every expert), and of
the 8-expert model (--experts-keep 8, the same way). Each run in its own process, one teacher cache
for all (built first, from the 8-expert model); the figure is the process's resident peak (VmHWM).

    python experiments/expert_cut_memory.py [--out DIR]

Prints one JSON line a run and the ratio; DIR keeps the models, the cache and the runs.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = r"""
import sys, json
sys.path.insert(0, {root!r})
import experts.search as search, prune
check = search.check_args
def lifted(args, config):  # N = E: the cut keeps every expert (the reference runs alone)
    n, args.experts_keep = args.experts_keep, 2
    try:
        check(args, config)
    finally:
        args.experts_keep = n
search.check_args = lifted
prune.main({argv!r})
print("PEAK", json.dumps({{k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in open("/proc/self/status"))
                         if k in ("VmHWM", "VmRSS")}}))
"""


def model(path, experts):
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM
    sys.path.insert(0, str(ROOT))
    from cache_teacher import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=64, intermediate_size=2048, moe_intermediate_size=2048,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True,
                         max_position_embeddings=512)
    m = Qwen3MoeForCausalLM(cfg)
    if experts < 8:  # the same weights, the first `experts` of each layer
        from experts.cut import cut_experts
        cut_experts(m, {l: list(range(experts)) for l in range(4)})
    m.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in m.parameters())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="keep the models, cache and runs here (default: a temporary folder)")
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp())
    sizes = {e: model(out / f"moe{e}", e) for e in (8, 4)}
    common = ["--seq-len", "128", "--batch-size", "4", "--micro-batch", "2", "--steps", "3", "--n-calib", "2",
              "--search", "none", "--expert-init", "reap", "--eval-every", "100", "--ckpt-every", "100"]
    cache = out / "cache"
    subprocess.run([sys.executable, str(ROOT / "cache_teacher.py"), "--model", str(out / "moe8"), "--seq-len",
                    "128", "--max-tokens", str(3 * 4 * 128), "--out", str(cache)], check=True, cwd=ROOT)
    rows = {}
    for name, source, n in (("pruned 8 -> 4", "moe8", 4), ("built with 4", "moe4", 4), ("built with 8", "moe8", 8)):
        argv = ["--model", str(out / source), "--experts-keep", str(n), "--cache", str(cache),
                "--out", str(out / f"run-{source}-{n}"), *common]
        proc = subprocess.run([sys.executable, "-c", RUN.format(root=str(ROOT), argv=argv)], cwd=ROOT,
                              capture_output=True, text=True)
        peak = next((json.loads(l[5:]) for l in proc.stdout.splitlines() if l.startswith("PEAK ")), None)
        if peak is None:
            sys.exit(proc.stderr[-3000:])
        rows[name] = {"peak_rss_mb": round(peak["VmHWM"] / 1024), "params_source": sizes[8 if source == "moe8" else 4]}
        print(json.dumps({"run": name, **rows[name]}), flush=True)
    print(json.dumps({"ratio_pruned_to_built_with_4": round(rows["pruned 8 -> 4"]["peak_rss_mb"]
                                                            / rows["built with 4"]["peak_rss_mb"], 3)}))


if __name__ == "__main__":
    main()
