"""
Benchmarks with a goal each. Every benchmark is a function `bench_<name>` that prints one line
`name: value (goal ...)`; add new ones to BENCHES.

    python bench.py             # all of them
    python bench.py caching     # some, by name

They run on the packaged default model (SmolLM2-135M) with small settings: a minute or two on a 2-core CPU.
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import common
from cache_teacher import compute_shards


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_caching(model_name=None, seq_len=256, batch_size=4, shards=2, shard_seqs=4, topk=10, repeats=5):
    """Teacher-cache throughput (forward, top-K, entropy, writing the shards) over plain teacher-forward
    throughput on the same model and batches, timed side by side and reported as the median ratio over
    `repeats`; plus the size of the cache per token."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = common.load_model(model_name, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.eval()
    blocks = common.pack(common.token_stream(tok, common.read_documents()[:1]), seq_len)[:shards * shard_seqs]
    jobs = {("train", j): blocks[j * shard_seqs:(j + 1) * shard_seqs] for j in range(shards)}
    identity = {"vocab_size": common.vocab_size(tok), "topk": topk}

    def plain():
        with torch.no_grad():
            for batch in blocks.split(batch_size):
                model(input_ids=batch.to(device)).logits
        _sync(device)

    def caching():
        with tempfile.TemporaryDirectory() as out:
            compute_shards(model, jobs, out, identity, batch_size)
            _sync(device)
            return sum(f.stat().st_size for f in Path(out).iterdir()) / blocks.numel()

    ratios, seconds = [], []
    for r in range(repeats + 1):  # the first round warms up and is not counted
        t0 = time.perf_counter()
        plain()
        t1 = time.perf_counter()
        bytes_per_token = caching()
        t2 = time.perf_counter()
        if r:
            ratios.append((t1 - t0) / (t2 - t1))
            seconds.append((t1 - t0, t2 - t1))
    n = blocks.numel()
    plain_s, cache_s = (statistics.median(s) for s in zip(*seconds))
    print(f"caching: {statistics.median(ratios):.3f} of plain-forward throughput (goal >= 0.9; "
          f"{n / cache_s:.0f} vs {n / plain_s:.0f} tok/s), {bytes_per_token:.1f} bytes/token (goal <= 64 at "
          f"K={topk}) [{common.default_model() if model_name is None else model_name}, {device}, "
          f"{shards * shard_seqs}x{seq_len} tokens, median of {repeats}]", flush=True)


BENCHES = {"caching": bench_caching}


def main():
    names = sys.argv[1:] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise common.E3Error(f"unknown benchmark {', '.join(unknown)}; pick from {', '.join(BENCHES)}")
    for name in names:
        BENCHES[name]()


if __name__ == "__main__":
    common.run_main(main)
