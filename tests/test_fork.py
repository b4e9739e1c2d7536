"""The README's two forks. By copy: `cp prune.py my_prune.py`, an edit, `python my_prune.py` (or
torchrun): the copy's own code runs, its registries included (and the same for cache_teacher.py). By
name: a script outside the project registers its own importance, layer search and loss in the
registries (prune.IMPORTANCE, prune.SEARCHES, kd.LOSSES), and prune.py's --init, --search, --loss and
--search-loss accept them, no project file touched."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import free_port, torchrun_failure

ROOT = Path(__file__).resolve().parents[1]
L, K = 6, 4

# (the text in the original, what the copy has instead): each a behaviour the original never shows
PRUNE_EDITS = [
    ("def main(argv=None):\n", "def main(argv=None):\n    print0('my_prune.main runs')\n"),
    # the original always keeps the protected last layer; the edited search keeps the k shallowest
    ("    in_loop = True\n", "    in_loop = True\n\n    def kept(self):\n"
                            "        return list(range(self.args.keep))\n"),
]
# the original stores fp16 log-probs
CACHE_EDITS = [('"topk_logprobs": torch.float16', '"topk_logprobs": torch.float32')]

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
    import runtime
    play = sorted(Path(runtime.default_corpus()).rglob("*.md"))[0]
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


def copied(script, edits, folder):
    """`cp script folder/my_<script>` with the edits made: each anchor must be in the original once."""
    text = (ROOT / script).read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"{script} no longer holds {old!r} once: update the test's edit"
        text = text.replace(old, new)
    copy = folder / f"my_{script}"
    copy.write_text(text)
    return copy


def run_copy(copy, flags, ranks, tmp_path):
    """The copy run as a user runs it: `python my_x.py ...` or `torchrun ... my_x.py ...`, from its
    own folder, the project found on PYTHONPATH (a copy beside prune.py needs nothing)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "E3_TEACHER_CACHE": str(tmp_path / "teacher"),
           "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_port", free_port()] if ranks > 1 else [sys.executable]
    r = subprocess.run([*launcher, str(copy), *flags], cwd=copy.parent, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, torchrun_failure(r.stdout, r.stderr)
    return r


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_copy_of_prune_py_runs_its_own_edits(make_tiny, corpus, tmp_path, ranks):
    """The copy's main prints, and its edited GumbelTopKSearch makes the cut: the k shallowest
    layers, a set prune.py never keeps (its last layer is protected)."""
    copy = copied("prune.py", PRUNE_EDITS, tmp_path)
    out = tmp_path / "run"
    r = run_copy(copy, ["--model", make_tiny("llama", L), "--keep", str(K), "--data", corpus,
                        "--seq-len", "16", "--batch-size", "2", "--micro-batch", "1", "--steps", "2",
                        "--n-calib", "2", "--out", str(out)], ranks, tmp_path)
    assert r.stdout.count("my_prune.main runs") == 1, r.stdout[-3000:]  # printed by rank 0 alone
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert next(e for e in log if e["event"] == "pruned")["kept"] == list(range(K))
    assert json.loads((out / "model" / "pruning.json").read_text())["kept_layers"] == list(range(K))


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_copy_of_cache_teacher_py_stores_what_its_edit_says(make_tiny, corpus, tmp_path, ranks):
    """The copy's storage_dtypes, edited to keep fp32 log-probs, is what writes the shards."""
    copy = copied("cache_teacher.py", CACHE_EDITS, tmp_path)
    out = tmp_path / "cache"
    run_copy(copy, ["--model", make_tiny("llama", L), "--data", corpus, "--seq-len", "16",
                    "--max-tokens", "256", "--shard-seqs", "4", "--out", str(out)], ranks, tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtypes"]["topk_logprobs"] == "float32"
    for shard in (s["file"] for split in ("train", "val") for s in meta["shards"][split]):
        with safe_open(out / shard, "pt") as f:
            assert f.get_slice("topk_logprobs").get_dtype() == "F32", shard


def test_an_unregistered_name_is_refused_with_the_registered_ones(tmp_path):
    r = fork_run(tmp_path, "--model", "m", "--keep", "2", "--init", "nope")
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr and "'depth'" in r.stderr
