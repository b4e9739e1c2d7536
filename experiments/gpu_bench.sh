#!/usr/bin/env bash
# The GPU bench (experiments/gpu_bench.py) as one command for a one-GPU lease: about 7 minutes on one
# H200 (a stage past BUDGET seconds starts no further run), every record under OUT as it is made
# (OUT/records.jsonl), a progress line a run, OUT/gpu_bench.json last and its content as stdout's
# last line: issue 47's goals read off it (gpu_bench.collect). In order of what the goals need first:
#   1. one process, eager: the activation bytes a token and layer for each checkpointing mode; the
#      plain head, the fused head at the plan's chunk and at 256, 1024, 4096 (1B), the teacher's
#      forward (as build_cache runs it: its slices' work compiled on a GPU); 1B at micro-batch 8,
#      SmolLM2-135M at the paper grid's seq 128, Llama-2-7B whole (full checkpointing: one GPU's
#      run); each step without checkpointing profiled
#   2. FSDP2 over one GPU (torchrun, a free port): the activation bytes again (bf16 residual stream),
#      eager (profiled), compiled, checkpointed at 7b8
#   3. one process, compiled (prune.py's default on a GPU): the same shapes, the teacher with its
#      layers compiled, Llama-2-7B whole with full and with selective checkpointing (the plan's
#      pick for one H200)
#
#   bash experiments/gpu_bench.sh OUT [BUDGET_SECONDS]   # PYTHON=...: the interpreter; TINY=1: CPU size
set -u
OUT=${1:?usage: bash experiments/gpu_bench.sh OUT [BUDGET_SECONDS]}
BUDGET=${2:-480}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEADLINE=$(( $(date +%s) + BUDGET ))
left() { echo $(( DEADLINE - $(date +%s) + 60 )); }  # a stage's limit: a run begun at the deadline ends
BENCH="experiments/gpu_bench.py --out $OUT --deadline $DEADLINE --profile ${TINY:+--tiny}"
PORT=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

echo "gpu_bench: 1/3 one process, eager"
timeout "$(left)" $PY $BENCH --activations none,selective,full \
    --runs plain/1b,fused/1b,teacher/1b,plain/7b8,fused/7b8,teacher/7b8,plain/135m,fused/135m,teacher/135m,plain/1bm8,plain/135ms128,fused/135ms128,teacher/135ms128,fused/1b/0/none/256,fused/1b/0/none/1024,fused/1b/0/none/4096,plain/7b/0/full
echo "gpu_bench: 2/3 FSDP2 over one GPU (torchrun, port $PORT)"
timeout "$(left)" $PY -m torch.distributed.run --nproc_per_node 1 --master_port "$PORT" $BENCH \
    --activations none,selective,full \
    --runs fsdp/1b,fsdp/7b8,fsdp/7b8/1,fsdp/1b/1,fsdp/7b8/0/selective,fsdp/7b8/0/full,fsdp/135m,fsdp/135m/1
echo "gpu_bench: 3/3 one process, compiled"
timeout "$(left)" $PY $BENCH --collect "$OUT" \
    --runs plain/1b/1,fused/1b/1,teacher/1b/1,plain/1bm8/1,plain/7b8/1,fused/7b8/1,teacher/7b8/1,plain/135m/1,fused/135m/1,plain/135ms128/1,plain/7b/1/full,plain/7b/1/selective \
    || $PY experiments/gpu_bench.py --collect "$OUT"  # stopped: the JSON of what was measured
