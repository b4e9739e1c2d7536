"""experiments/gpu_check.py, the command every GPU window opens with, at CPU size (--tiny): it runs
and says what it measured, so that a lease is not spent on a crash."""
import json

import pytest

from experiments import gpu_check


def test_the_7b_part_runs_the_plans_pick_and_reports_it(tmp_path, monkeypatch):
    """Part 7b at CPU size: the shape's folder (config, a tokenizer trained here of the config's
    vocabulary), the plan, then prune.main with random weights: KL importance, 3 search and 3
    fine-tune steps, the export with the kept layers; the teacher's and the student's weights are
    the same draw (the dense validation's KD to the cache's own targets is the teacher's, -0)."""
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    gpu_check.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path), "--parts", "7b", "--tiny"])
    (record,) = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["records"]
    assert record["ok"] and record["search_tok_s"] > 0 and record["finetune_tok_s"] > 0
    from transformers import AutoTokenizer
    assert len(AutoTokenizer.from_pretrained(tmp_path / "llama2-7b-shape")) == gpu_check.TINY["vocab_size"]
    log = [json.loads(x) for x in (tmp_path / "out" / "7b-log.jsonl").read_text().splitlines()]
    assert [e["phase"] for e in log if e["event"] == "train"] == ["search"] * 3 + ["finetune"] * 3
    done = next(e for e in log if e["event"] == "done")
    assert len(done["kept_layers"]) == 3 and done["val_dense"]["kd"] == pytest.approx(0, abs=1e-3)


@pytest.mark.slow
def test_the_first_part_runs_the_readme_command_and_loads_the_export(tmp_path):
    gpu_check.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path), "--parts", "first", "--tiny"])
    (record,) = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["records"]
    assert record["rc"] == 0 and record["export"] == {"layers": 20, "dtype": "torch.float32", "finite": True}
    assert record["done"]["layers"] == "30 -> 20"
