"""
Peak host memory of one training step (forward + backward of the KD loss), the plain logits path
against prune.py's fused head + loss, as the sequence grows: the (T, V) term the fusion removes.

    python experiments/logits_memory.py                  # seq 256, 1024, 2048; one process each
    python experiments/logits_memory.py --seq 512 4096

The model is host_memory.py's random Llama (10 layers of 768, SmolLM2's 49K vocabulary, tied: 108.5M
parameters), fp32, one process, micro-batch 1, gradients already allocated (a step after the
first). Each measurement runs in a fresh process (glibc's mmap threshold fixed, as host_memory.py
does) and reports the step's peak resident memory above the resident memory at its start.

  plain   model(x).logits, an fp32 log-softmax over all of them, eq. 13 (as before the fusion)
  fused   scale.fused_loss.FusedLoss: the head and the loss in chunks of --logit-chunk tokens
          (256, and 64)
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V = 49152


def resident_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024  # kB


def one(mode, seq, chunk):
    """In a fresh process: the step's peak above its start, MB."""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import prune
    from scale.fused_loss import FusedLoss
    cfg = LlamaConfig(vocab_size=V, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                      num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, V, (1, seq))
    teacher = torch.log_softmax(torch.randn(1, seq, V), -1)
    top_lp, top_ids = teacher.topk(10, -1)
    entropy = -(teacher.exp() * teacher).sum(-1)
    del teacher  # the cache holds only the top-K and the entropy
    batch = {"input_ids": ids, "topk_ids": top_ids, "topk_logprobs": top_lp, "entropy": entropy}
    losses = prune.plain_losses(V)
    if mode == "fused":
        losses = FusedLoss(V, chunk, reference=losses)
    for p in model.parameters():  # as in every step after the first: the gradients exist
        p.grad = torch.zeros_like(p)

    def step():
        (loss,) = losses(model, batch, ["akd"])  # prune.py's: kd.py on model(x).logits, or fused
        loss.backward()

    step()  # warm-up: the allocator's first touches
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set (VmHWM) to the current one
    start = resident_mb("VmRSS")
    step()
    print(resident_mb("VmHWM") - start)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 2048])
    a = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    runs = [("plain", 0), ("fused", 256), ("fused", 64)]
    print(f"{'tokens':>7}" + "".join(f"{m + (f' {c}' if c else ''):>12}" for m, c in runs)
          + f"{'T x V x 4 B':>13}   (step peak above its start, MB)")
    for seq in a.seq:
        row = []
        for mode, chunk in runs:
            out = subprocess.run([sys.executable, __file__, "--one", mode, str(seq), str(chunk)],
                                 env=env, capture_output=True, text=True, check=True)
            row.append(int(out.stdout.split()[-1]))
        print(f"{seq:>7}" + "".join(f"{r:>12}" for r in row) + f"{seq * V * 4 / 2**20:>13.0f}",
              flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
