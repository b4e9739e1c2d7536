"""A fork is one edit: a script outside the project registers its own importance, layer search and
loss in the registries the README names (prune.IMPORTANCE, prune.SEARCHES, kd.LOSSES), and
prune.py's --init, --search, --loss and --search-loss accept them, no project file touched."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
L, K = 6, 4

FORK = '''
import sys
sys.path.insert(0, {root!r})
import torch
import kd, prune
from surgery import LayerSearch, decoder_layers


def depth(model, batches, vocab, generator):
    """The deeper, the more important: the fork's importance."""
    return torch.arange(len(decoder_layers(model)), dtype=torch.float64)


class KeepShallowest(LayerSearch):
    """Keeps the k shallowest layers, whatever the scores: the fork's search."""
    def kept(self):
        return list(range(self.args.keep))


def half_ce(logits, batch):
    """Half the next-token cross-entropy: the fork's loss."""
    return 0.5 * kd.LOSSES["sft"](logits, batch)


prune.IMPORTANCE["depth"] = depth
prune.SEARCHES["shallowest"] = KeepShallowest
kd.LOSSES["half-ce"] = half_ce
prune.run_main(prune.main)
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import cache_teacher
    play = sorted(Path(cache_teacher.default_corpus()).rglob("*.md"))[0]
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(play.read_text()[:20_000])
    return str(path)


def fork_run(tmp_path, *flags):
    fork = tmp_path / "my_fork.py"  # outside the project, as a fork's own file
    fork.write_text(FORK.format(root=str(ROOT)))
    env = {**os.environ, "E3_TEACHER_CACHE": str(tmp_path / "teacher"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(fork), *flags], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def train_losses(out):
    return [e["loss"] for e in map(json.loads, (out / "log.jsonl").read_text().splitlines())
            if e["event"] == "train"]


def test_a_fork_registers_an_importance_a_search_and_a_loss(make_tiny, corpus, tmp_path):
    common = ["--model", make_tiny("llama", L), "--keep", str(K), "--data", corpus, "--seq-len",
              "16", "--batch-size", "2", "--micro-batch", "1", "--steps", "2", "--n-calib", "2",
              "--init", "depth", "--search", "shallowest"]
    out = tmp_path / "run"
    r = fork_run(tmp_path, *common, "--loss", "half-ce", "--search-loss", "half-ce", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    r = fork_run(tmp_path, *common, "--loss", "sft", "--out", str(tmp_path / "sft"))
    assert r.returncode == 0, r.stderr[-3000:]
    # step 1 from the same weights on the same batch: half the project's own cross-entropy
    assert train_losses(out)[0] == pytest.approx(0.5 * train_losses(tmp_path / "sft")[0], rel=1e-5)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    importance = next(e for e in log if e["event"] == "importance")
    assert importance["method"] == "depth" and importance["scores"] == [float(i) for i in range(L)]
    # the search's set, not the top-k of the scores (which would be the deepest layers)
    assert next(e for e in log if e["event"] == "pruned")["kept"] == list(range(K))
    run = json.loads((out / "run.json").read_text())
    assert (run["loss"], run["search_loss"]) == ("half-ce", "half-ce")


def test_an_unregistered_name_is_refused_with_the_registered_ones(tmp_path):
    r = fork_run(tmp_path, "--model", "m", "--keep", "2", "--init", "nope")
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr and "'depth'" in r.stderr
