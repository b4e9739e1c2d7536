"""The packaged demo end to end: `python prune.py` with no arguments (SmolLM2-135M, 30 -> 20 layers on
Shakespeare). Minutes on a CPU, so opt-in: python -m pytest -q -m slow"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.first  # the longest test by minutes
def test_prune_with_no_arguments_runs_the_demo(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "prune.py")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout.split("done: ")[-1])
    assert done["layers"] == "30 -> 20" and len(done["kept_layers"]) == 20
    assert done["val_final"]["kd"] < done["val_at_pruning"]["kd"] / 2  # fine-tuning recovers the teacher
    meta = json.loads((tmp_path / done["model"] / "pruning.json").read_text())
    assert meta["kept_layers"] == done["kept_layers"] and meta["layers_before"] == 30
