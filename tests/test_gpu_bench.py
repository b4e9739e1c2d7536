"""experiments/gpu_bench.sh, the GPU lease's one command, run whole at tiny sizes on the CPU (every
shape tiny, fp32, FSDP2 over one gloo rank, no compile): each path's record, the profile's keys, the
activation probe beside scale/plan.py's formula, and the JSON as stdout's last line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import gpu_bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the lease's command at CPU size: run it (-m slow) before a GPU window
def test_the_lease_command_at_tiny_sizes(tmp_path):
    env = {**os.environ, "TINY": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "experiments/gpu_bench.sh", str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last == json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    runs = {(r["path"], r["shape"], r.get("compile", 0), r.get("ac", "none"), r.get("chunk")): r
            for r in last["runs"]}
    tiny_chunk = gpu_bench.chunk_sizes(gpu_bench.TINY[1] * gpu_bench.TINY[2])[0]  # the plan's pick
    assert tiny_chunk == 32  # half the micro-batch's 2 x 32 tokens
    eager = [(path, shape, 0, "none", {"plain": 0}.get(path, tiny_chunk))
             for shape in ("1b", "7b8", "135m") for path in ("plain", "fused", "fsdp")]
    eager += [("plain", "1bm8", 0, "none", 0), ("plain", "135ms128", 0, "none", 0),
              ("fused", "135ms128", 0, "none", tiny_chunk)]
    swept = [("fused", "1b", 0, "none", chunk) for chunk in (256, 1024, 4096)]  # the chunk sweep
    checkpointed = [("fsdp", "7b8", 0, "full", tiny_chunk), ("plain", "7b", 0, "full", 0)]
    for key in eager + swept + checkpointed:
        run = runs[key]
        assert "error" not in run, (key, run)
        assert run["tok_s"] > 0 and run["flops_per_token"] > 0 and run["device"] == "cpu"
        assert run["mfu"] is None and run["peak_gb"] is None  # a CPU has no peak in the table
    for key in eager + checkpointed:  # FSDP2 where the path says so, not the plain one
        assert runs[key]["fsdp2"] == (key[0] == "fsdp"), key
    for key in eager:  # profiled: eager, no checkpointing
        assert runs[key]["profile"]["host_syncs"] == 0 and runs[key]["profile"]["span_ms"] > 0
    for shape in ("1b", "7b8", "135m"):  # the cache's forward beside its eager self and the plain one
        run = runs[("teacher", shape, 0, "none", None)]
        assert min(run["tok_s"], run["eager_tok_s"], run["plain_tok_s"], run["over_plain"]) > 0
    assert last["goals"]["teacher_over_plain_1b (>= 1.3)"] == runs[("teacher", "1b", 0, "none", None)][
        "over_plain"]
    assert all(r["skipped"] for key, r in runs.items() if key[2])  # compiled: on a GPU only
    assert ("plain", "7b", 1, "selective", None) in runs  # the one-H200 recipe's, skipped here
    for path in ("plain", "fsdp"):  # the probe in both paths, modelled (no allocator to read here)
        probe = last["activations"][path]
        assert probe["none"]["formula"] > probe["selective"]["formula"] > probe["full"]["formula"] > 0
        assert probe["full"]["measured"] is None
    assert set(last["goals"]) >= {"fused_over_plain_1b (>= 0.95)", "fsdp_over_plain_1b (>= 0.9)",
                                  "micro_batch_8_over_2_1b_compiled (> 1)"}
    assert "gpu_bench: 2/3 FSDP2 over one GPU" in done.stdout


def test_busy_time_is_the_union_of_the_kernels():
    assert gpu_bench.busy([(0, 2), (1, 3), (5, 6), (5.5, 5.8)]) == 4


def test_a_run_spec():
    assert gpu_bench.run_spec("fsdp/7b8/1/full") == {"path": "fsdp", "shape": "7b8", "compile": 1,
                                                     "ac": "full"}
    assert gpu_bench.run_spec("plain/1b") == {"path": "plain", "shape": "1b", "compile": 0,
                                              "ac": "none"}
    assert gpu_bench.run_spec("teacher/135m") == {"path": "teacher", "shape": "135m"}
    assert gpu_bench.run_spec("fused/1b/0/none/1024") == {"path": "fused", "shape": "1b", "compile": 0,
                                                          "ac": "none", "chunk": 1024}
    assert gpu_bench.run_spec("teacher/1b/1") == {"path": "teacher", "shape": "1b", "compile": 1}
