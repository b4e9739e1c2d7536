"""experiments/compare.sh paper-regime, the GPU grid's one command, run whole at toy size on the CPU
(TINY=1: random 30- and 18-layer models with the demo tokenizer in place of SmolLM2-135M and
Gemma-3-270M, 10 steps of 4 x 128 tokens): the corpus, one teacher cache per model, every method
trained, scored on the three held-out texts and recorded with how far its search moved S; and the
paper corpus keeps the held-out texts out."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cache_teacher
import demo
import runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import domains  # noqa: E402
import seeds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# the default run: E3 (its 1K-token search-step arm) on the SmolLM2 stand-in, every line of the mode
# but the other methods' flags;
# -m slow: the whole grid, both models (~5 minutes here)
GRIDS = [pytest.param("smollm2", "e3-sb1k", id="e3"),
         pytest.param("smollm2 gemma3", "kl-oneshot e3-akd evo e3-sb1k", id="grid",
                      marks=pytest.mark.slow)]


@pytest.mark.parametrize("models, methods", GRIDS)
def test_the_grid_command_at_tiny_sizes(tmp_path, make_tiny, models, methods):
    env = {**os.environ, "TINY": "1", "OMP_NUM_THREADS": "1", "JOBS": "2", "SEEDS": "0",
           "RUNS": str(tmp_path / "runs"), "RESULTS": str(tmp_path / "results"),
           "SMOLLM2": make_tiny("llama", 30), "GEMMA3": make_tiny("gemma3_text", 18),
           "MODELS": models, "METHODS": methods}
    done = subprocess.run(["bash", "experiments/compare.sh", "paper-regime"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    smol, gemma = tmp_path / "results", tmp_path / "results-gemma3"
    names = {p.stem for p in smol.glob("*.json")} | {p.stem for p in gemma.glob("*.json")}
    expect = {f"{m}-paper{'-gemma' if model == 'gemma3' else ''}-s0" for model in models.split()
              for m in methods.split() if model == "smollm2" or not m.startswith("e3-sb")}
    assert names == expect
    for name in expect:
        r = json.loads(next(p for p in (smol / f"{name}.json", gemma / f"{name}.json")
                            if p.exists()).read_text())
        assert set(r["corpora"]) == {"shakespeare", "python-docs", "torch-code"}
        assert r["flags"]["steps"] == 10 and r["flags"]["search_frac"] == 0.1  # T_M = 1
        assert r["flags"]["lr"] == 1e-4 and r["flags"]["warmup"] == "T/20"  # the paper's
        assert len(r["kept_layers"]) == (12 if "gemma" in name else 20)
        assert r["flags"]["search_batch_size"] == (8 if name.startswith("e3-sb1k") else 4)
        s = r["search"]
        assert s["kl_kept"] == seeds.kl_top_k(json.loads(
            (tmp_path / "runs" / name / "model" / "pruning.json").read_text())["initial_scores"],
            len(r["kept_layers"]), r["layers_before"])
        if name.startswith("kl-oneshot"):  # no search: S never moves, the set is KL's
            assert s["moved_max"] == 0 and s["jaccard_kl"] == 1
    # one cache per model, read by every run
    assert len(list((tmp_path / "runs").glob("cache-*/meta.json"))) == len(models.split())
    assert "Jaccard with KL's set" in done.stdout and "E3 (AKD), 1K-token search steps, paper schedule" in done.stdout


def test_the_paper_corpus_keeps_the_held_out_texts_out(tmp_path):
    pytest.importorskip("transformers")
    docs = domains.paper_corpus()
    text = "\n".join(docs)
    tok = runtime.load_model(demo.default_model(), weights=False)[1]
    held_out = cache_teacher.corpus_blocks(tok, None, 128, None)["val"]  # evaluate.py's Shakespeare
    for row in (0, len(held_out) // 2, len(held_out) - 1):
        assert tok.decode(held_out[row:row + 1][0])[10:200] not in text
    for other in (domains.python_docs()[:20] + domains.torch_code()[:5]):
        assert other[:300] not in text
    assert len(text) > 9_000_000 and len(docs) > 10_000  # the plays and the articles both


def test_a_search_record():
    info = {"initial_scores": [5, 1, .3, .2, .5, .1, 4], "final_scores": [5, 1, .1, .6, .5, .1, 4],
            "kept_layers": [0, 1, 3, 4, 6], "layers_before": 7,
            "flags": {"protect_first": 1, "protect_last": 1, "init": "kl"}}
    r = seeds.search_record(info)
    # the unprotected scores 1, .5, .3 | .2, .1: three kept; S moved layers 2 and 3 by .2 and .4
    assert r["kl_kept"] == [0, 1, 2, 4, 6] and r["swapped"] == 1
    assert r["cut_gap"] == pytest.approx(.1) and r["moved_max"] == pytest.approx(.4)
    assert r["moved_mean"] == pytest.approx(.12) and r["jaccard_kl"] == pytest.approx(4 / 6)


# the default run: stage 1 alone; -m slow: both stages (KL one-shot's run, two resumes to T, six scorings)
STAGES = [pytest.param(("search",), id="search"),
          pytest.param(("search", "finetune"), id="both", marks=pytest.mark.slow)]


@pytest.mark.parametrize("stages", STAGES)
def test_the_cpu_stages_at_tiny_size(tmp_path, make_tiny, stages):
    """experiments/paper_cpu.sh at toy size (T = 20, T_M = 2): stage 1 stops each arm at the cut and
    records its search; stage 2 runs KL one-shot to the same step on the same cache, then both on
    to T, scored on the three held-out texts. The E3 fine-tune keeps the set its search stopped
    with; KL one-shot keeps the top-k of the same S_0."""
    env = {**os.environ, "TINY": "1", "OMP_NUM_THREADS": "1", "JOBS": "2", "KEEP": "4",
           "RUNS": str(tmp_path / "runs"), "RESULTS": str(tmp_path / "results"),
           "SMOLLM2": make_tiny("llama", 6),
           "E3_TEACHER_CACHE": str(tmp_path / "teacher")}
    e3_run = tmp_path / "runs" / "smollm2-e3-sb1k-search-s0"
    for stage in stages:
        done = subprocess.run(["bash", "experiments/paper_cpu.sh", stage], cwd=ROOT, env={
            **env, "ARMS": "smollm2:8:0"}, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        # stage 1 stops at the cut, nothing exported; stage 2 resumes the same folder to T and exports
        assert (e3_run / "model").exists() == (stage == "finetune")
    res = tmp_path / "results"
    search = json.loads((res / "e3-sb1k-search-s0.json").read_text())
    assert search["step"] == 2 and search["flags"]["steps"] == 20 and search["corpora"] == {}
    assert len(search["trajectory"]) == 2 and search["search"]["kl_kept"]
    if stages == ("search",):
        return
    e3, kl = (json.loads((res / f"{m}-sb1k-paired-s0.json").read_text()) for m in ("e3", "kl-oneshot"))
    assert e3["kept_layers"] == search["kept_layers"] and e3["step"] == kl["step"] == 20
    S0 = json.loads((e3_run / "stopped.json").read_text())["initial_scores"]
    assert kl["kept_layers"] == sorted([0, 5] + sorted(range(1, 5), key=lambda i: -S0[i])[:2])
    for r in (e3, kl):
        assert set(r["corpora"]) == {"shakespeare", "python-docs", "torch-code"}
        assert r["tokens_trained"] == 20 * 8 * 128
    # one cache, the whole run's, built by stage 1 and read by both stages
    tokens = sorted(json.loads(p.read_text())["max_tokens"] for p in (tmp_path / "teacher").glob("*/meta.json"))
    assert tokens == [20 * 8 * 128]
    assert "e3-sb1k-paired - kl-oneshot-sb1k-paired" in subprocess.run(
        [sys.executable, "experiments/seeds.py", "table", str(res)], cwd=ROOT, capture_output=True, text=True).stdout
