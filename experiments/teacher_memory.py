"""
Peak host memory of each rank building a small teacher cache with a random 251M-parameter Llama
(1 GB of fp32 safetensors): one process, 2 ranks each holding the whole teacher, and 2 ranks with
--shard-teacher (FSDP2; only rank 0 reads the weights). glibc's mmap threshold is fixed, as in
data_memory.py, so that the peaks repeat.

    python experiments/teacher_memory.py
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK_MAIN = """import os, resource, sys
sys.path.insert(0, sys.argv.pop(1))
import cache_teacher, runtime
sys.argv = ["cache_teacher.py", *sys.argv[1:]]
try:
    runtime.run_main(cache_teacher.main)
finally:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    os.write(1, f"rank {os.environ.get('RANK', 0)}: peak {peak} MB\\n".encode())
"""


def random_llama(path):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(ROOT))
    import demo
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=1024, intermediate_size=4096,
                      num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(demo.default_model()).save_pretrained(path)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        random_llama(tmp / "llama")
        (tmp / "rank_main.py").write_text(RANK_MAIN)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(4 << 20)}
        args = [str(ROOT), "--model", str(tmp / "llama"), "--max-tokens", "2048",
                "--seq-len", "256", "--max-val-tokens", "256", "--batch-size", "4",
                "--shard-seqs", "4"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2"]
        runs = {"1 process": [sys.executable], "2 ranks, whole teacher each": torchrun,
                "2 ranks, --shard-teacher": torchrun}
        for i, (what, launch) in enumerate(runs.items()):
            extra = ["--shard-teacher"] if "shard" in what else []
            out = ["--out", str(tmp / f"cache{i}")]
            cmd = [*launch, str(tmp / "rank_main.py"), *args, *out, *extra]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            peaks = sorted(line for line in r.stdout.splitlines() if line.startswith("rank"))
            print(f"{what}: {'; '.join(peaks) or r.stderr[-2000:]}", flush=True)


if __name__ == "__main__":
    main()
