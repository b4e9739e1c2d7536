"""prune.py end to end on tiny random models: 1 process == 2 FSDP2 ranks, kill + resume == uninterrupted,
the schedules in the log, only k layers running after the search, export == training model, and the
one-line errors of SPEC 7."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
L, K = 6, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One Shakespeare play as a .txt file: a small, real corpus."""
    import common
    plays = sorted(Path(common.default_corpus()).rglob("*.md"))
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(plays[0].read_text()[:60_000])
    return str(path)


def tiny_args(model, corpus, out, *extra):
    return ["--model", model, "--keep", str(K), "--data", corpus, "--seq-len", "32", "--batch-size", "4",
            "--micro-batch", "1", "--steps", "8", "--search-frac", "0.5", "--warmup", "2", "--n-calib", "4",
            "--eval-every", "4", "--ckpt-every", "3", "--lr", "1e-3", "--score-lr", "0.2", "--out", str(out),
            *extra]


def run(args, tmp_path, nproc=1, check=True, **kw):
    env = {**os.environ, "E3_TEACHER_CACHE": str(tmp_path / "teacher"), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(29500 + os.getpid() % 1000)] if nproc > 1 else [sys.executable]
    proc = subprocess.run(launcher + [str(ROOT / "prune.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, **kw)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def weights(out):
    return load_file(str(Path(out) / "model" / "model.safetensors"))


def events(out, kind):
    return [e for e in map(json.loads, (Path(out) / "log.jsonl").read_text().splitlines()) if e["event"] == kind]


@pytest.fixture(scope="module")
def single_run(make_tiny, corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    out = tmp / "run"
    run(tiny_args(make_tiny("llama", L), corpus, out), tmp)
    return out


def test_log_shows_schedules_and_only_k_layers_run_after_search(single_run):
    search = events(single_run, "search")
    assert [e["step"] for e in search] == [1, 2, 3, 4]  # T_M = 0.5 * 8
    ks = [e["k"] for e in search]
    assert ks[0] < L and ks[-1] == K and ks == sorted(ks, reverse=True)  # k' = L - ceil((L-k) t/T_M)
    assert search[-1]["tau"] == pytest.approx(0.1) and search[0]["tau"] == pytest.approx(1 - 0.9 / 4)
    for e in search:
        assert sum(e["mask"]) == e["k"] and set(e["mask"]) <= {0.0, 1.0}
        assert e["mask"][0] == e["mask"][-1] == 1.0  # protected first and last layers
    assert events(single_run, "search")[0]["scores"] != events(single_run, "importance")[0]["scores"]
    train = events(single_run, "train")
    assert [e["layers_run"] for e in train] == [L] * 4 + [K] * 4  # masked layers run; pruned ones don't
    kept = events(single_run, "pruned")[0]["kept"]
    meta = json.loads((single_run / "model" / "pruning.json").read_text())
    assert meta["kept_layers"] == kept and len(kept) == K and meta["layers_before"] == L
    assert len(events(single_run, "val")) >= 3


def test_two_fsdp_ranks_match_one_process(single_run, make_tiny, corpus, tmp_path):
    out = tmp_path / "run2"
    run(tiny_args(make_tiny("llama", L), corpus, out), tmp_path, nproc=2)
    assert events(out, "pruned")[0]["kept"] == events(single_run, "pruned")[0]["kept"]
    a, b = weights(single_run), weights(out)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4, msg=key)


def test_two_fsdp_ranks_with_lora_match_one_process(make_tiny, corpus, tmp_path):
    """Rank 1 builds the model on the meta device, LoRA factors included, and gets everything from rank 0:
    a wrong shard, a garbage buffer (Qwen3's rotary inv_freq) or an untied embedding would show here."""
    model = make_tiny("qwen3", L)
    one, two = tmp_path / "one", tmp_path / "two"
    run(tiny_args(model, corpus, one, "--lora-rank", "4"), tmp_path)
    run(tiny_args(model, corpus, two, "--lora-rank", "4"), tmp_path, nproc=2)
    assert events(two, "pruned")[0]["kept"] == events(one, "pruned")[0]["kept"]
    a, b = weights(one), weights(two)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4, msg=key)


def test_sigkill_then_resume_matches_uninterrupted(single_run, make_tiny, corpus, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(make_tiny("llama", L), corpus, out)
    env = {**os.environ, "E3_TEACHER_CACHE": str(tmp_path / "teacher"), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "prune.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # kill right after the first checkpoint is complete
        if "checkpoint" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (out / "model").exists()
    run(args + ["--resume"], tmp_path)
    assert events(out, "pruned")[0]["kept"] == events(single_run, "pruned")[0]["kept"]
    a, b = weights(single_run), weights(out)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5, msg=key)
    assert [e["step"] for e in events(out, "train")] == list(range(1, 9))  # no step logged twice


def test_resume_after_the_search_on_two_ranks(single_run, tmp_path):
    """The single run's last checkpoint (step 6, after pruning) resumed by 2 FSDP ranks: the pruned shape is
    rebuilt (rank 1 on the meta device), the 1-process checkpoint loads into the shards, the result is the same."""
    import shutil
    out = tmp_path / "run"
    shutil.copytree(single_run, out)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_6.pt"]
    args = {**json.loads((out / "run.json").read_text()), "out": str(out)}  # the copy is now this run's folder
    (out / "run.json").write_text(json.dumps(args, indent=1))
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in args.items() if v is not None and not isinstance(v, bool)]
    proc = run(argv + ["--eval-every", "4", "--ckpt-every", "3", "--resume"], tmp_path, nproc=2)
    assert "at step 6 (finetune)" in proc.stdout
    assert [e["step"] for e in events(out, "train")] == list(range(1, 9))
    a, b = weights(single_run), weights(out)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4, msg=key)


def test_exported_logits_equal_training_model(make_tiny, corpus, tmp_path, monkeypatch):
    """In-process, with LoRA: the model in memory at the end == the exported checkpoint (LoRA merged)."""
    import common
    import prune
    monkeypatch.setattr(common, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    out = tmp_path / "run"
    model = prune.main(tiny_args(make_tiny("llama", L), corpus, out, "--lora-rank", "4"))
    ids = torch.randint(0, 49152, (2, 20), generator=torch.Generator().manual_seed(0))
    exported = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert not any("lora" in k or "parametrizations" in k for k in weights(out))


def assert_one_line_error(proc, *words):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]


def tree_state(path):
    return {str(p): p.stat().st_mtime_ns for p in Path(path).rglob("*")}


def test_bad_inputs_fail_with_one_line(single_run, make_tiny, corpus, tmp_path):
    model = make_tiny("llama", L)
    new = tmp_path / "new"
    for keep in ("0", str(L), "1"):  # outside 1..L-1, or below the 2 protected layers
        a = tiny_args(model, corpus, new)
        a[a.index("--keep") + 1] = keep
        assert_one_line_error(run(a, tmp_path, check=False), "--keep")
    assert_one_line_error(run(tiny_args(str(tmp_path / "nope"), corpus, new), tmp_path, check=False), "model")
    assert_one_line_error(run(tiny_args(model, str(tmp_path / "nope.txt"), new), tmp_path, check=False), "data")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert_one_line_error(run(tiny_args(model, str(empty), new), tmp_path, check=False), "no text")
    assert not new.exists()  # nothing written for a run that could not start

    # an output folder that holds a different (finished) run is refused and left untouched
    before = tree_state(single_run)
    other = tiny_args(model, corpus, single_run, "--loss", "kd")
    assert_one_line_error(run(other, tmp_path, check=False), "different run")
    assert_one_line_error(run(tiny_args(model, corpus, single_run), tmp_path, check=False), "--resume")
    assert tree_state(single_run) == before


def test_cache_mismatch_and_unknown_architecture(make_tiny, corpus, tmp_path):
    from cache_teacher import build_cache
    model = make_tiny("llama", L)
    cache = tmp_path / "cache"
    build_cache(model, corpus, str(cache), topk=5, seq_len=16, max_tokens=2000)
    args = tiny_args(model, corpus, tmp_path / "a", "--cache", str(cache))
    assert_one_line_error(run(args, tmp_path, check=False), "seq")  # cache made with seq-len 16, run asks 32
    # a cache made with another tokenizer
    from transformers import AutoTokenizer
    other = tmp_path / "other-tok"
    AutoModelForCausalLM.from_pretrained(model).save_pretrained(other)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens(["<thou>", "<thee>"])
    tok.save_pretrained(other)
    a = tiny_args(str(other), corpus, tmp_path / "b", "--cache", str(cache))
    a.remove("--seq-len"), a.remove("32")
    assert_one_line_error(run(a, tmp_path, check=False), "tokenizer")
    # a truncated shard
    shard = sorted(cache.rglob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    a = tiny_args(model, corpus, tmp_path / "c", "--cache", str(cache))
    a.remove("--seq-len"), a.remove("32")
    assert_one_line_error(run(a, tmp_path, check=False), "shard")


def test_sheared_llama_l0_baseline_runs(make_tiny, corpus, tmp_path):
    out = tmp_path / "l0"
    run(tiny_args(make_tiny("llama", L), corpus, out, "--search", "l0"), tmp_path)
    search = events(out, "search")
    assert [e["k"] for e in search][-1] == K and len(search) == 4
    assert any(0 < m < 1 for e in search for m in e["mask"])  # soft masks in the forward pass
    assert len(json.loads((out / "model" / "pruning.json").read_text())["kept_layers"]) == K
    assert [e["layers_run"] for e in events(out, "train")][-1] == K


def test_baseline_flag_sets_run(make_tiny, corpus, tmp_path):
    """ShortGPT (--init bi --search none --steps 0) prunes with no training and no teacher cache."""
    out = tmp_path / "shortgpt"
    run(tiny_args(make_tiny("llama", L), corpus, out, "--init", "bi", "--search", "none", "--steps", "0"), tmp_path)
    meta = json.loads((out / "model" / "pruning.json").read_text())
    assert meta["tokens_trained"] == 0 and len(meta["kept_layers"]) == K
    init = events(out, "importance")[0]["scores"]
    free = sorted(range(1, L - 1), key=lambda i: -init[i])[: K - 2]
    assert meta["kept_layers"] == sorted([0, L - 1] + free)  # top-k of BI, protected layers kept
    assert not (tmp_path / "teacher").exists()


def test_keep_only_the_protected_layers(make_tiny, corpus, tmp_path):
    """k'_t reaches the protected count: the free layers' mask no longer depends on the scores."""
    out = tmp_path / "k2"
    a = tiny_args(make_tiny("llama", L), corpus, out, "--keep", "2", "--steps", "4")
    run(a, tmp_path)
    assert json.loads((out / "model" / "pruning.json").read_text())["kept_layers"] == [0, L - 1]


def test_given_layers_train_exactly_as_the_search_free_run_that_chose_them(make_tiny, corpus, tmp_path):
    """--layers skips stages 1 and 2: given the layers that KL one-shot (--search none) keeps, it trains
    bit for bit the same model (same seed, same data order); a set without the protected layers fails."""
    model = make_tiny("llama", L)
    oneshot, given = tmp_path / "oneshot", tmp_path / "given"
    run(tiny_args(model, corpus, oneshot, "--search", "none", "--steps", "4"), tmp_path)
    kept = json.loads((oneshot / "model" / "pruning.json").read_text())["kept_layers"]
    a = tiny_args(model, corpus, given, "--steps", "4", "--layers", ",".join(map(str, kept)))
    a.remove("--keep"), a.remove(str(K))  # k is the number of given layers
    run(a, tmp_path)
    meta = json.loads((given / "model" / "pruning.json").read_text())
    assert meta["kept_layers"] == kept and "init=given search=none" in meta["method"]
    assert not events(given, "search") and events(given, "importance")[0]["method"] == "given"
    w1, w2 = weights(oneshot), weights(given)
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    free = [i for i in range(1, L - 1) if i not in kept]
    no_first = free + kept[2:]  # K layers, but not the protected layer 0
    bad = tiny_args(model, corpus, tmp_path / "bad", "--layers", ",".join(map(str, no_first)))
    assert_one_line_error(run(bad, tmp_path, check=False), "--layers")
