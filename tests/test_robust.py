"""experiments/seeds.py robust (issue 54's report) on records written by hand: the paired differences,
the seeds won and the kept sets' Jaccard, each worked out below from the numbers."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import seeds  # noqa: E402


def write(d, method, seed, kept, ppl, kl):
    corpora = {c: {"ppl": p, "kl": k, "teacher_ppl": 1.0} for c, p, k in
               zip(("shakespeare", "python-docs", "torch-code"), ppl, kl)}
    (d / f"{method}-s{seed}.json").write_text(json.dumps(
        {"method": method, "seed": seed, "kept_layers": kept, "layers_before": 6, "corpora": corpora}))


def test_robust_report_pairs_by_seed_and_counts_jaccard(tmp_path):
    write(tmp_path, "kl-oneshot", 0, [0, 1, 2, 5], (10, 20, 30), (1.0, 2.0, 3.0))
    write(tmp_path, "kl-oneshot", 1, [0, 1, 2, 5], (12, 20, 30), (1.0, 2.0, 3.0))
    write(tmp_path, "reverse", 0, [0, 1, 2, 3], (11, 18, 30), (1.5, 1.0, 3.0))
    write(tmp_path, "reverse", 1, [0, 1, 3, 4], (11, 23, 30), (0.5, 2.0, 3.0))
    out = seeds.robust_report(tmp_path, figure=tmp_path / "removed.png")
    # shakespeare: 11 - 10 = +1, 11 - 12 = -1: mean 0, sd 1.414, one win; python-docs: -2, +3
    reverse_ppl = next(line for line in out.splitlines() if line.startswith("| reverse order"))
    assert "| 11.0 ± 0.0 | +0.0 ± 1.4 (1/2) | 20.5 ± 3.5 | +0.5 ± 3.5 (1/2) | 30.0 ± 0.0 | +0.0 ± 0.0 (0/2) |" \
        in reverse_ppl
    reverse_kl = [line for line in out.splitlines() if line.startswith("| reverse order")][1]
    assert "| 1.000 ± 0.707 | +0.000 ± 0.707 (1/2) | 1.500 ± 0.707 | -0.500 ± 0.707 (1/2) |" in reverse_kl
    # kept sets: reverse's two seeds share {0, 1, 3} of {0, 1, 2, 3, 4}: 3/5; with KL's set {0,1,2,5}
    # seed 0 shares {0, 1, 2} of 5 layers (3/5), seed 1 {0, 1} of 6 (1/3): mean 0.47, min 0.33
    reverse_sets = [line for line in out.splitlines() if line.startswith("| reverse order")][2]
    assert reverse_sets.endswith("| 2 / 2 | 0.60 | 0.47, 0.33 |")
    assert (tmp_path / "removed.png").stat().st_size > 0


def test_table_reads_expert_sets_against_expert_kl(tmp_path):
    """moe_compare.sh's records: no layer removed (no empty "Layers removed" line), the kept (layer,
    expert) pairs against x-kl's of the same fraction and seed, and across seeds."""
    def expert_run(method, seed, kept):
        write(tmp_path, method, seed, [0, 1, 2, 3, 4, 5], (10, 20, 30), (1.0, 2.0, 3.0))
        p = tmp_path / f"{method}-s{seed}.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), "kept_experts": kept}))
    expert_run("x-kl-50", 0, {"0": [0, 1], "3": [2, 3]})
    expert_run("x-kl-50", 1, {"0": [0, 1], "3": [2, 3]})
    expert_run("x-reap-50", 0, {"0": [0, 1], "3": [2, 3]})  # KL's: 4/4
    expert_run("x-reap-50", 1, {"0": [0, 2], "3": [2, 3]})  # shares 3 of 5 pairs: 0.6
    write(tmp_path, "l-kl-50", 0, [0, 1, 5], (10, 20, 30), (1.0, 2.0, 3.0))
    out = seeds.table(tmp_path).splitlines()
    layer_lines = out[out.index("Layers removed, by seed:") + 2:]
    assert layer_lines[:2] == [  # the layers' run alone: an expert run removed none
        "- layers instead: KL one-shot 6 -> 3 + AKD (about x-*-50's parameters): 2-4 (seed 0)", ""]
    reap = next(line for line in out if line.startswith("- REAP one-shot + AKD"))
    # mean (1 + 0.6) / 2 = 0.80, sd of (1, 0.6) 0.28; the two seeds' sets 3 of 5: 0.60
    assert reap == ("- REAP one-shot + AKD, 50% of the experts: with expert KL's set 0.80 ± 0.28 "
                    "(0.60-1.00), across seeds 0.60 (seeds 0, 1)")
    kl = next(line for line in out if line.startswith("- expert KL one-shot"))
    assert "with expert KL's set 1.00 ± 0.00 (1.00-1.00), across seeds 1.00" in kl
