"""
Host memory of prune.py's ranks under torchrun: only rank 0 reads the weights, the others build the model
on the meta device and receive their FSDP shards (parallel.load_from_rank0). Prints each rank's peak resident
memory before and after building the model, and at exit, beside the checkpoint's fp32 size.

    python experiments/host_memory.py                 # a random 453M-parameter Llama (1.8 GB fp32), 2 ranks
    python experiments/host_memory.py --model DIR --nproc 4

The run itself is `prune.py --steps 0 --init random --search none` (load, shard, prune, export): no
training, so the peaks are those of loading and exporting.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # kB on Linux


def rank_main(argv):
    """Runs inside each torchrun rank: prune.main with the peak printed around build_model."""
    sys.path.insert(0, str(ROOT))
    import common
    import prune
    rank, build = os.environ["RANK"], prune.build_model
    report = Path(os.environ["E3_MEMORY_REPORT"]) / f"rank{rank}.txt"  # one file a rank: no interleaving

    def note(when):
        with open(report, "a") as f:
            f.write(f"rank {rank}: peak {peak_mb():5d} MB {when}\n")

    def measured_build(*a, **k):
        note("before build_model")
        out = build(*a, **k)
        note("after build_model")
        return out

    prune.build_model = measured_build
    common.run_main(lambda: prune.main(argv))
    note("at exit (after the export)")


def random_llama(path):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(ROOT))
    import common
    cfg = LlamaConfig(vocab_size=49152, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(common.default_model()).save_pretrained(path)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (default: a random 24-layer, 1024-wide Llama)")
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(Path(tmp) / "llama-453m")
        if a.model is None:
            random_llama(model)
        size = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 2**20
        print(f"checkpoint: {model} ({size:.0f} MB on disk)", flush=True)
        layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "E3_MEMORY_REPORT": tmp}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), __file__,
               "--rank-main", "--model", model, "--keep", str(layers - 2), "--init", "random", "--search", "none",
               "--steps", "0", "--seq-len", "128", "--out", str(Path(tmp) / "run")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        for r in range(a.nproc):
            print((Path(tmp) / f"rank{r}.txt").read_text(), end="")


if __name__ == "__main__":
    if "--rank-main" in sys.argv:
        rank_main([x for x in sys.argv[1:] if x != "--rank-main"])
    else:
        main()
