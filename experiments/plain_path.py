"""
What one plain run reads: the project files a single-process run of the default method enters (the
teacher cache, KL importance, the Gumbel search, AKD, the export), counted with coverage.py, and their
non-blank lines. The design's goal: at most 6 files and 2,000 lines; the scale, architectures and
baselines wings are not entered.

    pip install coverage && python experiments/plain_path.py

A tiny random Llama (6 layers) with the demo's tokenizer, one play of the packaged corpus:
`cache_teacher.py`, then `prune.py --cache ...`, each under `coverage run`, in a fresh temporary
folder. A file counts as entered when coverage saw any of its lines run.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(path):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(ROOT))
    import demo
    import runtime
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=True)).save_pretrained(path)
    AutoTokenizer.from_pretrained(demo.default_model()).save_pretrained(path)
    play = sorted(Path(runtime.default_corpus()).rglob("*.md"))[0]
    (Path(path).parent / "play.txt").write_text(play.read_text()[:60_000])
    return str(Path(path).parent / "play.txt")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "llama")
        corpus = tiny_model(model)
        env = {**os.environ, "COVERAGE_FILE": str(Path(tmp) / ".coverage"),
               "E3_TOKEN_CACHE": str(Path(tmp) / "tokens"), "OMP_NUM_THREADS": "1"}
        cache = str(Path(tmp) / "cache")
        run = [sys.executable, "-m", "coverage", "run", "-a", "--source", str(ROOT)]
        subprocess.run(run + ["cache_teacher.py", "--model", model, "--data", corpus, "--out", cache,
                              "--seq-len", "32", "--max-tokens", "4096"],
                       cwd=ROOT, env=env, check=True, capture_output=True)
        subprocess.run(run + ["prune.py", "--model", model, "--keep", "4", "--cache", cache,
                              "--batch-size", "4", "--micro-batch", "2", "--steps", "10",
                              "--n-calib", "4", "--out", str(Path(tmp) / "run")],
                       cwd=ROOT, env=env, check=True, capture_output=True)
        report = Path(tmp) / "coverage.json"
        subprocess.run([sys.executable, "-m", "coverage", "json", "-o", str(report)], cwd=ROOT,
                       env=env, check=True, capture_output=True)
        files = json.loads(report.read_text())["files"]
    entered = {}
    for name, f in files.items():
        rel = Path(name).resolve().relative_to(ROOT)
        if f["executed_lines"] and rel.parts[0] not in ("tests", "experiments"):
            entered[str(rel)] = sum(1 for line in (ROOT / rel).read_text().splitlines()
                                    if line.strip())
    for name, n in sorted(entered.items()):
        print(f"{name:<24} {n:>5} non-blank lines")
    print(f"{len(entered)} files, {sum(entered.values())} non-blank lines "
          f"(goal: at most 6 files and 2,000 lines)")


if __name__ == "__main__":
    main()
