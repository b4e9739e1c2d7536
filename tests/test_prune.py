"""prune.py end to end on tiny random models: 1 process == 2 FSDP2 ranks, kill + resume == uninterrupted,
the schedules in the log, only k layers running after the search, export == training model, and the
one-line errors of bad input."""
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

from conftest import free_port, torchrun_failure

ROOT = Path(__file__).resolve().parents[1]
L, K = 6, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One Shakespeare play as a .txt file: a small, real corpus."""
    import runtime
    plays = sorted(Path(runtime.default_corpus()).rglob("*.md"))
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(plays[0].read_text()[:60_000])
    return str(path)


def tiny_args(model, corpus, out, *extra):
    return ["--model", model, "--keep", str(K), "--data", corpus, "--seq-len", "32", "--batch-size", "4",
            "--micro-batch", "1", "--steps", "8", "--search-frac", "0.5", "--warmup", "2", "--n-calib", "4",
            "--eval-every", "4", "--ckpt-every", "3", "--lr", "1e-3", "--score-lr", "0.2", "--out", str(out),
            *extra]


def run(args, tmp_path, nproc=1, check=True, torchrun=False, **kw):
    env = {**os.environ, "E3_TEACHER_CACHE": str(tmp_path / "teacher"), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", free_port()] if nproc > 1 or torchrun else [sys.executable]
    proc = subprocess.run(launcher + [str(ROOT / "prune.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, **kw)
    if check:
        assert proc.returncode == 0, torchrun_failure(proc.stdout, proc.stderr)
    return proc


def run_here(args, tmp_path, monkeypatch):
    """prune.py's command line run in this process, its teacher cache where run() puts it: for a test
    where no launcher, kill or exit status is under test (a process costs ~8 s of imports)."""
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    prune.main(args)


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


def test_every_seed_has_its_own_data_order_in_every_epoch():
    """batch_indices: one seeded permutation an epoch; seed s's second epoch is not seed s + 1's
    first, and epoch 0 is torch.randperm under the seed itself (what every recorded run read)."""
    from types import SimpleNamespace

    import prune

    def epoch(seed, e, n=16, b=8):  # two steps an epoch
        args = SimpleNamespace(batch_size=b, search_batch_size=b, search_steps=0, seed=seed, steps=4)
        return sum((prune.batch_indices(step, args, n, 0, 1) for step in (2 * e, 2 * e + 1)), [])
    assert epoch(0, 0) == torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()
    assert sorted(epoch(0, 1)) == list(range(16)) and epoch(0, 1) != epoch(1, 0)


def test_log_shows_the_schedules(single_run):
    search = events(single_run, "search")
    assert [e["step"] for e in search] == [1, 2, 3, 4]  # T_M = 0.5 * 8
    ks = [e["k"] for e in search]
    assert ks[0] < L and ks[-1] == K and ks == sorted(ks, reverse=True)  # k' = L - ceil((L-k) t/T_M)
    assert search[-1]["tau"] == pytest.approx(0.1) and search[0]["tau"] == pytest.approx(1 - 0.9 / 4)
    for e in search:
        assert sum(e["mask"]) == e["k"] and set(e["mask"]) <= {0.0, 1.0}
        assert e["mask"][0] == e["mask"][-1] == 1.0  # protected first and last layers
    assert events(single_run, "search")[0]["scores"] != events(single_run, "importance")[0]["scores"]
    assert [e["phase"] for e in events(single_run, "train")] == ["search"] * 4 + ["finetune"] * 4
    kept = events(single_run, "pruned")[0]["kept"]
    meta = json.loads((single_run / "model" / "pruning.json").read_text())
    assert meta["kept_layers"] == kept and len(kept) == K and meta["layers_before"] == L
    assert len(events(single_run, "val")) >= 3


@pytest.mark.parametrize("frac, T, T_M", [(0.1, 25, 3), (0.1, 15, 2), (0.1, 35, 4), (0.1, 45, 5),
                                           (0.1, 1200, 120), (0.05, 80, 4), (0.01, 20, 1), (0, 20, 0)])
def test_search_steps_are_the_search_fraction_of_T_rounded_half_up(frac, T, T_M):
    """T_M = round(search_frac T), halves up whatever the float (0.1 x 35 = 3.5000000000000004 and
    0.1 x 25 = 2.5 alike), at least one step when there is a search, none at --search-frac 0."""
    import prune
    args = prune.parse_args(["--model", "m", "--keep", "4", "--steps", str(T), "--search-frac", str(frac)])
    prune.resolve_args(args, 1)
    assert args.search_steps == T_M


@pytest.fixture(scope="module")
def two_rank_run(make_tiny, corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    out = tmp / "run"
    run(tiny_args(make_tiny("llama", L), corpus, out), tmp, nproc=2)
    return out


@pytest.mark.slow  # more ranks or processes than the default run's one of each
def test_one_rank_under_torchrun_exports_what_one_process_does(single_run, make_tiny, corpus, tmp_path):
    """torchrun --nproc_per_node 1 --logit-chunk (one GPU's scale wing: FSDP2 over a world of one)
    exports the plain one-process run's layers and weights: its export handed FSDP2's DTensors to
    safetensors, which could not save them (seen on an H100)."""
    out = tmp_path / "run"
    run(tiny_args(make_tiny("llama", L), corpus, out, "--logit-chunk", "16"), tmp_path, torchrun=True)
    assert events(out, "pruned")[0]["kept"] == events(single_run, "pruned")[0]["kept"]
    assert_same_weights(single_run, out, atol=1e-4)


def test_only_k_layers_run_after_the_cut(make_tiny, corpus, tmp_path, monkeypatch):
    """Counted from outside prune.py (a global forward hook on every decoder layer, training forwards
    only): T_M steps x 4 micro-batches x L layers (masked layers still run: their delta is the score's
    gradient), then (T - T_M) x 4 x K. A removed layer that still ran would add 4 x (L - K) a step."""
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    calls = []

    def count(module, args):
        if type(module).__name__.endswith("DecoderLayer") and torch.is_grad_enabled():
            calls.append(id(module))
    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        prune.main(tiny_args(make_tiny("llama", L), corpus, tmp_path / "run"))
    finally:
        handle.remove()
    assert len(calls) == 4 * 4 * L + 4 * 4 * K
    assert len(set(calls[4 * 4 * L:])) == K  # the fine-tune steps run K distinct layers


def test_validation_during_the_search_runs_the_top_k_not_a_sampled_mask(make_tiny, corpus, tmp_path, monkeypatch):
    """With lr 0 and score-lr 0 nothing moves: the validation at every search step must be that of the
    model the search would keep (the top-k of S), i.e. equal to the validation right after the cut, on
    the physically pruned model. The old code validated whatever mask the last step had sampled."""
    out = tmp_path / "frozen"
    run_here(tiny_args(make_tiny("llama", L), corpus, out, "--lr", "0", "--score-lr", "0", "--eval-every",
                       "1", "--ckpt-every", "100"), tmp_path, monkeypatch)
    vals = {e["when"]: e["val_loss"] for e in events(out, "val")}
    during = [vals[f"step {t}"] for t in (1, 2, 3)]
    assert during == pytest.approx([vals["at pruning"]] * 3, rel=0, abs=1e-6), vals
    assert vals["dense"] != pytest.approx(vals["at pruning"], abs=1e-3)  # the cut does change the model


def kill_after_first_checkpoint(args, tmp_path, nproc):
    """Start prune.py (nproc ranks), SIGKILL every process once the first checkpoint is complete."""
    env = {**os.environ, "E3_TEACHER_CACHE": str(tmp_path / "teacher"), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", free_port()] if nproc > 1 else [sys.executable]
    proc = subprocess.Popen(launcher + [str(ROOT / "prune.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in proc.stdout:
        if "checkpoint saved" in line:
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def assert_same_weights(a_out, b_out, atol):
    a, b = weights(a_out), weights(b_out)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


@pytest.mark.slow  # by default: resume 2 -> 1 rank, and kill + resume in one process
def test_two_ranks_killed_mid_search_resume_on_two_ranks(two_rank_run, make_tiny, corpus, tmp_path):
    """A sharded (DCP) checkpoint taken mid-search (step 3 of T_M = 4) by 2 ranks, resumed by 2 ranks:
    the same layers and weights as the uninterrupted 2-rank run."""
    out = tmp_path / "run"
    args = tiny_args(make_tiny("llama", L), corpus, out)
    kill_after_first_checkpoint(args, tmp_path, nproc=2)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_3"]
    proc = run(args + ["--resume"], tmp_path, nproc=2)
    assert "at step 3 (search)" in proc.stdout
    assert events(out, "pruned")[0]["kept"] == events(two_rank_run, "pruned")[0]["kept"]
    assert [e["step"] for e in events(out, "search")] == [1, 2, 3, 4]  # no step logged twice
    assert_same_weights(two_rank_run, out, atol=1e-5)


def test_bi_init_two_ranks_killed_mid_search_resume_on_one(make_tiny, corpus, tmp_path, monkeypatch):
    """--init bi under torchrun checkpoints (it crashed with KeyError: 0 in get_state_dict), and a
    checkpoint of 2 ranks resumes in 1 process: DCP reshards on load. Reference: 1 process throughout
    (the reference and the resume in this one)."""
    model = make_tiny("llama", L)
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_here(tiny_args(model, corpus, ref, "--init", "bi"), tmp_path, monkeypatch)
    args = tiny_args(model, corpus, out, "--init", "bi")
    kill_after_first_checkpoint(args, tmp_path, nproc=2)
    run_here(args + ["--resume"], tmp_path, monkeypatch)
    assert events(out, "pruned")[0]["kept"] == events(ref, "pruned")[0]["kept"]
    assert_same_weights(ref, out, atol=1e-4)


def test_two_fsdp_ranks_match_one_process(single_run, two_rank_run):
    out = two_rank_run
    assert events(out, "pruned")[0]["kept"] == events(single_run, "pruned")[0]["kept"]
    a, b = weights(single_run), weights(out)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4, msg=key)


@pytest.mark.slow  # more ranks or processes than the default run's one of each
def test_two_fsdp_ranks_with_lora_match_one_process(make_tiny, corpus, tmp_path, monkeypatch):
    """Rank 1 builds the model on the meta device, LoRA factors included, and gets everything from rank 0:
    a wrong shard, a garbage buffer (Qwen3's rotary inv_freq) or an untied embedding would show here."""
    model = make_tiny("qwen3", L)
    one, two = tmp_path / "one", tmp_path / "two"
    run_here(tiny_args(model, corpus, one, "--lora-rank", "4"), tmp_path, monkeypatch)
    run(tiny_args(model, corpus, two, "--lora-rank", "4"), tmp_path, nproc=2)
    assert events(two, "pruned")[0]["kept"] == events(one, "pruned")[0]["kept"]
    a, b = weights(one), weights(two)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4, msg=key)


# GPT-2 holds llama's case and dropout's: llama alone is slow
@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "gpt2"])
def test_sigkill_then_resume_matches_uninterrupted(arch, make_tiny, corpus, tmp_path, monkeypatch, request):
    """Killed after its first checkpoint (step 3, mid-search) and resumed: the same layers, weights and
    summary as the uninterrupted run. GPT-2 trains with dropout 0.1: the resumed steps must draw the
    masks the uninterrupted run drew."""
    out = tmp_path / "run"
    seed = ["--seed", "20240601"] if arch != "llama" else []  # (a date: a large seed)
    args = tiny_args(make_tiny(arch, L), corpus, out, *seed)
    if arch == "llama":  # the uninterrupted reference: the module's single_run, else made here
        single_run = request.getfixturevalue("single_run")
    else:
        single_run = tmp_path / "reference"
        run_here(tiny_args(make_tiny(arch, L), corpus, single_run, *seed), tmp_path, monkeypatch)
    env = {**os.environ, "E3_TEACHER_CACHE": str(tmp_path / "teacher"), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "prune.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # kill right after the first checkpoint is complete
        if "checkpoint saved" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (out / "model").exists()
    run_here(args + ["--resume"], tmp_path, monkeypatch)  # (in this process)
    assert events(out, "pruned")[0]["kept"] == events(single_run, "pruned")[0]["kept"]
    a, b = weights(single_run), weights(out)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5, msg=key)
    assert [e["step"] for e in events(out, "train")] == list(range(1, 9))  # no step logged twice
    # the summary keeps what was measured before the kill (the dense model's and the cut's val loss)
    done, ref = events(out, "done")[0], events(single_run, "done")[0]
    for key in ["val_dense", "val_at_pruning", "val_final"]:
        assert key in done and done[key] == pytest.approx(ref[key], abs=2e-4), key


@pytest.mark.slow  # more ranks or processes than the default run's one of each
def test_resume_after_the_search_on_two_ranks(single_run, tmp_path):
    """The single run's last checkpoint (step 6, after pruning) resumed by 2 FSDP ranks: the pruned shape is
    rebuilt (rank 1 on the meta device), the 1-process checkpoint loads into the shards, the result is the same."""
    import shutil
    out = tmp_path / "run"
    shutil.copytree(single_run, out)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_6"]
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
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
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


def one_line_error(argv, capsys, *words):
    """prune.py's command line run in this process (run_main, as `python prune.py` does): exit status 2
    and one `error:` line holding `words`, no traceback."""
    import runtime
    import prune
    with pytest.raises(SystemExit) as e:
        runtime.run_main(lambda: prune.main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and all(w in lines[0] for w in words), err[-2000:]


def test_bad_inputs_fail_with_one_line(single_run, make_tiny, corpus, tmp_path, capsys, monkeypatch):
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    model = make_tiny("llama", L)
    new = tmp_path / "new"
    for keep in ("0", str(L), "1"):  # outside 1..L-1, or below the 2 protected layers
        a = tiny_args(model, corpus, new)
        a[a.index("--keep") + 1] = keep
        if keep == "0":  # once as a user runs it: a process of its own
            assert_one_line_error(run(a, tmp_path, check=False), "--keep")
        else:
            one_line_error(a, capsys, "--keep")
    one_line_error(tiny_args(str(tmp_path / "nope"), corpus, new), capsys, "model")
    one_line_error(tiny_args(model, corpus, new, "--logit-chunk", "-1"), capsys, "--logit-chunk")
    one_line_error(tiny_args(model, str(tmp_path / "nope.txt"), new), capsys, "data")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    one_line_error(tiny_args(model, str(empty), new), capsys, "no text")
    for until in ("cutt", "-1"):  # a step or "cut"
        one_line_error(tiny_args(model, corpus, new, "--until", until), capsys, "--until")
    assert not new.exists()  # nothing written for a run that could not start

    # an output folder that holds a different (finished) run is refused and left untouched
    before = tree_state(single_run)
    other = tiny_args(model, corpus, single_run, "--loss", "kd")
    assert_one_line_error(run(other, tmp_path, check=False), "different run")
    one_line_error(tiny_args(model, corpus, single_run), capsys, "--resume")
    # a stop before the newest checkpoint (step 6) cannot be reached from it
    one_line_error(tiny_args(model, corpus, single_run, "--resume", "--until", "2"), capsys, "--until", "6")
    assert tree_state(single_run) == before


def test_cache_mismatch_and_unknown_architecture(make_tiny, corpus, tmp_path, capsys, monkeypatch):
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
    import prune  # the next two in this process (the first ran as a user runs it)
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    one_line_error(a, capsys, "tokenizer")
    # a truncated shard
    shard = sorted(cache.rglob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    a = tiny_args(model, corpus, tmp_path / "c", "--cache", str(cache))
    a.remove("--seq-len"), a.remove("32")
    one_line_error(a, capsys, "shard")


def test_sheared_llama_l0_baseline_runs(make_tiny, corpus, tmp_path, monkeypatch):
    out = tmp_path / "l0"
    run_here(tiny_args(make_tiny("llama", L), corpus, out, "--search", "l0"), tmp_path, monkeypatch)
    search = events(out, "search")
    assert [e["k"] for e in search][-1] == K and len(search) == 4
    assert any(0 < m < 1 for e in search for m in e["mask"])  # soft masks in the forward pass
    assert len(json.loads((out / "model" / "pruning.json").read_text())["kept_layers"]) == K


def test_baseline_flag_sets_run(make_tiny, corpus, tmp_path, monkeypatch):
    """ShortGPT (--init bi --search none --steps 0) prunes with no training and no teacher cache."""
    out = tmp_path / "shortgpt"
    run_here(tiny_args(make_tiny("llama", L), corpus, out, "--init", "bi", "--search", "none", "--steps", "0"),
             tmp_path, monkeypatch)
    meta = json.loads((out / "model" / "pruning.json").read_text())
    assert meta["tokens_trained"] == 0 and len(meta["kept_layers"]) == K
    init = events(out, "importance")[0]["scores"]
    free = sorted(range(1, L - 1), key=lambda i: -init[i])[: K - 2]
    assert meta["kept_layers"] == sorted([0, L - 1] + free)  # top-k of BI, protected layers kept
    assert not (tmp_path / "teacher").exists()


def test_keep_only_the_protected_layers(make_tiny, corpus, tmp_path, monkeypatch):
    """k'_t falls to the protected count, where the free layers' mask no longer depends on the scores.
    With lr 0 the weights do not move, so the export must be the source model with only its first and
    last layers, written out here by slicing the ModuleList by hand."""
    model = make_tiny("llama", L)
    out = tmp_path / "k2"
    run_here(tiny_args(model, corpus, out, "--keep", "2", "--steps", "4", "--lr", "0"), tmp_path, monkeypatch)
    search = events(out, "search")
    assert [e["k"] for e in search] == [4, 2]  # T_M = 2: k' = 6 - ceil(4 t / 2)
    assert search[-1]["mask"] == [1.0] + [0.0] * (L - 2) + [1.0]
    source = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    source.model.layers = torch.nn.ModuleList([source.model.layers[0], source.model.layers[L - 1]])
    source.model.layers[1].self_attn.layer_idx = 1
    exported = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, source(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.slow  # a variant of a run the default tests make: a flag's own path
def test_given_layers_train_exactly_as_the_search_free_run_that_chose_them(make_tiny, corpus, tmp_path, monkeypatch,
                                                                           capsys):
    """--layers skips stages 1 and 2: given the layers that KL one-shot (--search none) keeps, it trains
    bit for bit the same model (same seed, same data order), as --search-frac 0 does; a set without
    the protected layers fails."""
    model = make_tiny("llama", L)
    oneshot, given = tmp_path / "oneshot", tmp_path / "given"
    run_here(tiny_args(model, corpus, oneshot, "--search", "none", "--steps", "4"), tmp_path, monkeypatch)
    kept = json.loads((oneshot / "model" / "pruning.json").read_text())["kept_layers"]
    a = tiny_args(model, corpus, given, "--steps", "4", "--layers", ",".join(map(str, kept)))
    a.remove("--keep"), a.remove(str(K))  # k is the number of given layers
    run_here(a, tmp_path, monkeypatch)
    meta = json.loads((given / "model" / "pruning.json").read_text())
    assert meta["kept_layers"] == kept and "init=given search=none" in meta["method"]
    assert not events(given, "search") and events(given, "importance")[0]["method"] == "given"
    w1, w2 = weights(oneshot), weights(given)
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    # --search-frac 0 (T_M = 0): the Gumbel search takes no step, the top-k of S_0 as --search none
    no_steps = tmp_path / "no-steps"
    run_here(tiny_args(model, corpus, no_steps, "--steps", "4", "--search-frac", "0"), tmp_path, monkeypatch)
    assert not events(no_steps, "search") and events(no_steps, "pruned")[0]["kept"] == kept
    w3 = weights(no_steps)
    assert w3.keys() == w1.keys() and all(torch.equal(w1[k], w3[k]) for k in w1)
    free = [i for i in range(1, L - 1) if i not in kept]
    no_first = free + kept[2:]  # K layers, but not the protected layer 0
    one_line_error(tiny_args(model, corpus, tmp_path / "bad", "--layers", ",".join(map(str, no_first))),
                   capsys, "--layers")


@pytest.mark.slow  # by default: 2 ranks == 1 process with the search
def test_given_layers_on_two_ranks_match_one_process(make_tiny, corpus, tmp_path, monkeypatch):
    """Pruned before the first training step (--layers; the same path as --search none): under FSDP the
    root unit (embeddings, final norm, LM head) must train as in one process, and checkpoints work."""
    model = make_tiny("llama", L)
    one, two = tmp_path / "one", tmp_path / "two"
    a = ["--layers", "0,2,3,5", "--ckpt-every", "3"]
    run_here(tiny_args(model, corpus, one, *a), tmp_path, monkeypatch)  # --keep 4 = the 4 given layers
    run(tiny_args(model, corpus, two, *a), tmp_path, nproc=2)
    source = load_file(str(Path(model) / "model.safetensors"))
    trained = weights(one)
    assert not torch.equal(trained["model.norm.weight"], source["model.norm.weight"])  # the root trains
    assert_same_weights(one, two, atol=1e-4)


# -----------------------------------------------------------------------------
# The search's variants (issue 17's ablation flags): each changes exactly what it says


def test_masks_per_step_gives_each_draw_its_share_of_the_micro_batches(make_tiny, corpus, tmp_path, monkeypatch):
    """--masks-per-step 2 with 4 micro-batches a step: micro-batches 0 and 2 run one mask, 1 and 3 another,
    each a valid k'_t subset with the protected layers on; the first draw is the draw of the one-mask run
    (the generator's stream is unchanged). Scores all equal (--score-scale 0): the draws differ by chance alone."""
    import runtime
    import prune
    import surgery
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    masks = []

    class Recording(surgery.LayerGates):  # every mask the loop puts on the gates, in order
        @property
        def mask(self):
            return self._mask

        @mask.setter
        def mask(self, value):
            self._mask = value
            if value is not None and torch.is_grad_enabled():
                masks.append(value.detach().tolist())
    monkeypatch.setattr(prune, "LayerGates", Recording)
    model = make_tiny("llama", L)
    common_flags = ("--score-scale", "0", "--score-lr", "0", "--lr", "0", "--steps", "4", "--search-frac", "1",
                    "--eval-every", "100")
    runs = {}
    for n in (1, 2):
        masks.clear()
        prune.main(tiny_args(model, corpus, tmp_path / f"n{n}", *common_flags, "--masks-per-step", str(n)))
        runs[n] = [masks[4 * s:4 * s + 4] for s in range(4)]  # 4 micro-batches a step (search steps only)
        assert len(masks) == 16
    differ = 0
    for t, (one, two) in enumerate(zip(runs[1], runs[2]), 1):
        k_t = L - -(-(L - K) * t // 4)  # k'_t = L - ceil((L - k) t / T_M), T_M = 4
        assert one == [one[0]] * 4  # one draw a step: every micro-batch runs it
        assert two[0] == two[2] and two[1] == two[3]
        for m in two:
            assert sum(m) == k_t and m[0] == m[-1] == 1.0 and set(m) <= {0.0, 1.0}
        differ += two[0] != two[1]
    assert runs[2][0][0] == runs[1][0][0]  # step 1: the first of two draws is the one-mask run's draw
    assert differ >= 2  # 4 steps of 2 draws of 2-3 of 4 free layers: equal every time with p < 1e-2
    # the log holds every draw a step ran (the first as "mask", as with one draw)
    for n in (1, 2):
        logged = events(tmp_path / f"n{n}", "search")
        assert [e["mask"] for e in logged] == [step[0] for step in runs[n]]
        assert [e.get("masks") for e in logged] == ([None] * 4 if n == 1 else [step[:2] for step in runs[n]])

    with pytest.raises(runtime.E3Error, match="masks-per-step"):  # 4 micro-batches do not split in 3
        prune.main(tiny_args(model, corpus, tmp_path / "n3", "--masks-per-step", "3"))


@pytest.mark.slow  # a variant of a run the default tests make: a flag's own path
def test_score_scale_lr_schedule_search_loss_and_calib_data(single_run, make_tiny, corpus, tmp_path, monkeypatch):
    """--score-scale 3: S_0 is 3 x the importance of the plain run (its log). --score-lr-schedule linear: Adam
    steps S at 0.2, 0.15, 0.1, 0.05 (lr_S (T_M - t + 1) / T_M, T_M = 4, written out). --search-loss sft: the
    search's micro-batches use next-token CE, the fine-tune's AKD. --calib-data: the importance is that of a
    run whose --data is that file."""
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    kinds, score_lrs = [], []
    plain_losses, adam_step = prune.plain_losses, torch.optim.Adam.step

    def recording_losses(*a, **k):  # the losses every training micro-batch asks for
        losses = plain_losses(*a, **k)
        return lambda model, batch, asked: [kinds.extend(asked) if torch.is_grad_enabled() else None,
                                            losses(model, batch, asked)][1]

    def recording_step(self, *a, **k):
        if len(self.param_groups[0]["params"]) == 1 and self.param_groups[0]["params"][0].numel() == L:
            score_lrs.append(self.param_groups[0]["lr"])  # the scores' Adam (the weights' is AdamW)
        return adam_step(self, *a, **k)
    monkeypatch.setattr(prune, "plain_losses", recording_losses)
    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    model = make_tiny("llama", L)
    out = tmp_path / "variants"
    prune.main(tiny_args(model, corpus, out, "--score-scale", "3", "--score-lr-schedule", "linear",
                         "--search-loss", "sft"))
    plain = events(single_run, "importance")[0]["scores"]
    assert events(out, "importance")[0]["scores"] == pytest.approx([3 * s for s in plain], rel=1e-5)
    assert score_lrs == pytest.approx([0.2, 0.15, 0.1, 0.05])
    assert kinds == ["sft"] * 16 + ["akd"] * 16  # 4 search steps, then 4 fine-tune steps, 4 micro-batches

    # another text for the calibration only: the importance of a run trained on that text
    other = tmp_path / "other.txt"
    import runtime
    plays = sorted(Path(runtime.default_corpus()).rglob("*.md"))
    other.write_text(plays[1].read_text()[:60_000])
    short = ("--steps", "1", "--search", "none")
    prune.main(tiny_args(model, corpus, tmp_path / "calib", *short, "--calib-data", str(other)))
    prune.main(tiny_args(model, str(other), tmp_path / "data", *short))
    calib = events(tmp_path / "calib", "importance")[0]["scores"]
    assert calib == pytest.approx(events(tmp_path / "data", "importance")[0]["scores"], rel=1e-6)
    assert calib != pytest.approx(plain, rel=1e-3)


@pytest.mark.slow  # a variant of a run the default tests make: a flag's own path
def test_search_data_is_what_the_search_reads(make_tiny, corpus, tmp_path, monkeypatch):
    """--search-data: the Gumbel search's micro-batches come from that text and the fine-tune's from --data;
    evo and random score their sets on it. The search text is digits only, the play has letters: each batch
    tells, decoded, where it came from."""
    import baselines.evo
    import prune
    from transformers import AutoTokenizer
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    digits = tmp_path / "digits.txt"
    digits.write_text(" ".join(str(i * 7919 % 1000) for i in range(6000)))
    model = make_tiny("llama", L)
    tok = AutoTokenizer.from_pretrained(model)
    texts, plain_losses = [], prune.plain_losses

    def recording_losses(*a, **k):  # the text of every training micro-batch
        losses = plain_losses(*a, **k)

        def record(m, batch, kinds):
            if torch.is_grad_enabled():
                texts.extend(tok.batch_decode(batch["input_ids"], skip_special_tokens=True))
            return losses(m, batch, kinds)
        return record
    monkeypatch.setattr(prune, "plain_losses", recording_losses)
    prune.main(tiny_args(model, corpus, tmp_path / "gumbel", "--search-data", str(digits)))
    is_digits = [set(text) <= set("0123456789 ") for text in texts]
    assert is_digits == [True] * 16 + [False] * 16  # 4 search steps, then 4 fine-tune steps, 4 micro-batches

    scored = []
    cache_score = baselines.evo.cache_score
    monkeypatch.setattr(baselines.evo, "cache_score",
                        lambda m, cache, *a: scored.append(cache) or cache_score(m, cache, *a))
    prune.main(tiny_args(model, corpus, tmp_path / "evo", "--search", "evo", "--evo-generations", "1",
                         "--evo-offspring", "2", "--evo-stages", "64:1", "--steps", "1", "--search-data", str(digits)))
    rows = scored[0].get(list(range(scored[0].len_split("train"))))["input_ids"]
    assert all(set(text) <= set("0123456789 ") for text in tok.batch_decode(rows, skip_special_tokens=True))


def test_bench_drives_the_search_with_prune_settings():
    """experiments/bench.py's search step runs GumbelTopKSearch on prune.py's own parsed settings: one step on 30 scores
    keeps k' = 25 layers (k'_1 of T_M = 2, written out) and moves S. (Its hand-made settings once lacked the
    fields a new flag added, and `bench.py search` died with an AttributeError.)"""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench
    import prune
    S0 = torch.linspace(1, 0, 30)
    search = prune.GumbelTopKSearch(S0.clone(), bench.prune_args(30, search_steps=2), 30, 20, [0, 29], "cpu")
    search.begin_step(1)
    mask = search.sample_mask()
    assert mask.sum().item() == 25 and set(mask.tolist()) == {0.0, 1.0}
    (mask * torch.arange(30.0)).sum().backward()
    search.step()
    assert not torch.equal(search.S.detach(), S0)


def test_exported_initial_scores_are_the_importance_not_the_searched_scores(single_run):
    """pruning.json's initial_scores are S_0 as the importance logged them before the search; the search's
    Adam moves S, not S_0 (S once shared S_0's storage, and both fields read the final scores)."""
    info = json.loads((Path(single_run) / "model" / "pruning.json").read_text())
    assert info["initial_scores"] == pytest.approx(events(single_run, "importance")[0]["scores"], rel=1e-6)
    assert info["final_scores"] == pytest.approx(events(single_run, "search")[-1]["scores"], rel=1e-6)
    assert info["final_scores"] != pytest.approx(info["initial_scores"], rel=1e-3)


@pytest.mark.slow  # a variant of a run the default tests make: a flag's own path
def test_a_cache_without_a_validation_split_validates_nothing(make_tiny, corpus, tmp_path, monkeypatch, capsys):
    """A cache built with --val-frac 0 has no validation sequences: the run trains and exports, and
    logs no validation (it logged 0/0 = NaN at every one, silently)."""
    from cache_teacher import build_cache
    model = make_tiny("llama", L)
    cache = build_cache(model, corpus, str(tmp_path / "cache"), topk=5, seq_len=32, max_tokens=4096,
                        val_frac=0)
    out = tmp_path / "run"
    a = tiny_args(model, corpus, out, "--cache", cache)
    a.remove("--seq-len"), a.remove("32")
    run_here(a, tmp_path, monkeypatch)
    assert not events(out, "val") and "NaN" not in (out / "log.jsonl").read_text()
    done = json.loads(capsys.readouterr().out.split("done: ")[-1])
    assert not any(k.startswith("val") for k in done) and len(done["kept_layers"]) == K


def test_a_training_step_reads_the_device_once_whatever_its_micro_batches():
    """prune.train_step sums the micro-batches' losses on the device and reads the step's loss and
    gradient norm once: beyond what the model's own forward reads (transformers checks the position
    ids for packed sequences, one read a forward), a step's host syncs (each would stall a GPU) do
    not grow with its micro-batches; counted at the dispatcher (tests/host_syncs.py)."""
    import prune
    from conftest import tiny_config
    from host_syncs import HostSyncs
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama", layers=2, vocab=64))
    args = prune.parse_args(["--model", "m", "--keep", "1"])
    args.device, args.out = torch.device("cpu"), "run"
    opt, losses = prune.make_optimizer(model, args), prune.plain_losses(64)

    def syncs(n_micro):
        batches = [{"input_ids": torch.randint(64, (1, 8)), "weight": 1 / n_micro} for _ in range(n_micro)]
        with HostSyncs() as seen:
            prune.train_step(model, opt, losses, batches, "sft", 1, args)
        return len(seen.syncs)
    with torch.no_grad(), HostSyncs() as forward:  # the model's own, once a forward
        model(input_ids=torch.randint(64, (1, 8)), use_cache=False)
    for n in (1, 2, 6):  # the step's loss and its gradient norm, once each
        assert syncs(n) == n * len(forward.syncs) + 2


def test_a_run_resumes_whatever_its_micro_batch_checkpointing_or_compile(tmp_path):
    """The objective (the global batch's mean) does not depend on the micro-batch, the activation
    checkpointing or compile, and a GPU's plan picks the first two per card: a run folder resumes
    with other values, also one written before --compile existed; a changed lr is another run, a
    flag the folder predates is its default (other than the default: another run)."""
    import prune
    from runtime import E3Error
    base = ["--model", "m", "--keep", "2", "--micro-batch", "2"]
    prune.Run(tmp_path / "r", prune.run_identity(prune.parse_args(base)), 0, False).create()
    run_json = tmp_path / "r" / "run.json"
    older = {k: v for k, v in json.loads(run_json.read_text()).items()}
    run_json.write_text(json.dumps({**older, "micro_batch": 2, "activation_checkpointing": False}))
    other = prune.parse_args(base[:-1] + ["4", "--activation-checkpointing", "selective", "--compile"])
    prune.Run(tmp_path / "r", prune.run_identity(other), 0, True)  # resumes: no error
    # another run: the message names what differs, also a flag the folder's prune.py did not have
    with pytest.raises(E3Error, match=r"different run \(lr: 0.0001 -> 0.001\)"):
        prune.Run(tmp_path / "r", prune.run_identity(prune.parse_args(base + ["--lr", "1e-3"])), 0, True)
    run_json.write_text(json.dumps({k: v for k, v in older.items() if k != "expert_init"}))
    prune.Run(tmp_path / "r", prune.run_identity(prune.parse_args(base)), 0, True)  # its default: resumes
    with pytest.raises(E3Error, match=r"different run \(expert_init: 'kl' -> 'reap'\)"):
        prune.Run(tmp_path / "r", prune.run_identity(prune.parse_args(base + ["--expert-init", "reap"])), 0, True)


def test_a_tokenizer_with_more_ids_than_the_embedding_is_refused_before_any_work(tmp_path, tokenizer):
    """Every id a batch holds comes from the tokenizer: checked once against the embedding's rows,
    so that no batch needs a host-side check (a GPU would stop at a device-side assert instead)."""
    import prune
    from runtime import E3Error
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_config(tiny_config("llama", 4, vocab=1000)).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    with pytest.raises(E3Error, match="49152 ids outnumber the model's 1000 embedding rows"):
        prune.main(["--model", str(tmp_path / "m"), "--keep", "2", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a variant of a run the default tests make: a flag's own path
def test_the_search_steps_read_their_own_batch_size(make_tiny, corpus, tmp_path, monkeypatch, capsys):
    """--search-batch-size: the search's T_M steps read that many sequences a step, the fine-tune
    --batch-size (the ablation of the tokens a search step sees, its steps and the fine-tune held):
    the tokens logged step by step and in the summary, written out here; a batch the ranks and
    micro-batches cannot split is one error line."""
    out = tmp_path / "run"
    args = tiny_args(make_tiny("llama", L), corpus, out, "--search-batch-size", "2")
    run_here(args, tmp_path, monkeypatch)  # 8 steps, a search of 4 at 2 x 32 tokens, then 4 at 4 x 32
    tokens = [e["tokens"] for e in events(out, "train")]
    assert tokens == [64, 128, 192, 256, 384, 512, 640, 768]
    done = events(out, "done")[0]
    assert done["tokens_trained"] == 768
    assert json.loads((out / "model" / "pruning.json").read_text())["tokens_trained"] == 768
    one_line_error(args[:-2] + ["--out", str(tmp_path / "bad"), "--search-batch-size", "3", "--micro-batch", "2"],
                   capsys, "--search-batch-size 3 must be a multiple")


def test_the_micro_batch_must_divide_only_the_batches_the_run_takes(make_tiny):
    """--search-batch-size and --masks-per-step are a search step's: a run that takes none (--search
    none, evo, --search-frac 0) is not held to them; --batch-size is a fine-tune step's: a run that is
    all search (--search-frac 1) is not held to it. A run that takes the step is."""
    import prune
    from transformers import AutoConfig
    from runtime import E3Error
    model = make_tiny("llama", L)
    config = AutoConfig.from_pretrained(model)

    def problem(*flags):  # 8 steps of 4 sequences, search steps of 3, micro-batches of 2
        args = prune.parse_args(["--model", model, "--keep", str(K), "--steps", "8", "--batch-size", "4",
                                 "--search-batch-size", "3", "--micro-batch", "2", *flags])
        prune.resolve_args(args, 1)
        try:
            prune.check_args(args, config, L, 1)
        except E3Error as e:
            return str(e)
    for no_search in (["--search", "none"], ["--search", "evo"], ["--search-frac", "0"]):
        assert problem(*no_search) is None, no_search
        assert problem(*no_search, "--search-batch-size", "4", "--masks-per-step", "3") is None, no_search
    assert "--search-batch-size 3 must be a multiple of ranks x --micro-batch (1 x 2)" in problem()
    assert "--masks-per-step 3 must divide" in problem("--search-batch-size", "4", "--masks-per-step", "3")
    assert problem("--batch-size", "3", "--search-batch-size", "4", "--search-frac", "1") is None
    assert "--batch-size 3 must be a multiple" in problem("--batch-size", "3", "--search-batch-size", "4")


def test_compile_and_selective_checkpointing_train_what_eager_trains(single_run, make_tiny, corpus, tmp_path):
    """prune.py --compile --activation-checkpointing selective (each layer torch.compiled, inductor,
    its matmuls' outputs kept for the backward) against the same run eager (single_run): the same
    layers kept, the losses within 1e-3, the export's tensor names the same and its weights within 1e-4."""
    run(tiny_args(make_tiny("llama", L), corpus, tmp_path / "compiled", "--compile",
                  "--activation-checkpointing", "selective"), tmp_path)
    eager, compiled = events(single_run, "done")[0], events(tmp_path / "compiled", "done")[0]
    assert compiled["kept_layers"] == eager["kept_layers"]
    for a, b in zip(events(single_run, "train"), events(tmp_path / "compiled", "train")):
        assert abs(a["loss"] - b["loss"]) < 1e-3
    w, v = weights(single_run), weights(tmp_path / "compiled")
    assert sorted(w) == sorted(v) and max((w[k] - v[k]).abs().max().item() for k in w) < 1e-4


def test_until_stops_at_the_cut_and_resume_goes_on_as_one_run(make_tiny, corpus, tmp_path, capsys, monkeypatch):
    """--until cut: the first T_M steps of the T-step run (its schedules), checkpointed, stopped.json
    written, nothing exported; --resume without it then goes on to T. The two halves are the
    uninterrupted run: the same layers, step losses and weights, the held-out split where it has it,
    minutes summed over the processes (a clock that moves a minute a training step: 8 steps, 8
    minutes). Without --cache the teacher is cached once, over the whole run's tokens: where the
    corpus is read up to depends on the budget past 2^24 tokens (here past 1,024), and with it where
    the held-out split lies. A given cache larger than the budget: the run reads its first rows, in
    the order of its seed and budget, as from the cache it would build (the same step losses)."""
    import cache_teacher
    import prune
    from types import SimpleNamespace
    monkeypatch.setattr(cache_teacher, "READ_WHOLE_TOKENS", 1024)
    clock, train_step = [0.0], prune.train_step

    def a_minute_a_step(*a, **k):
        clock[0] += 60
        return train_step(*a, **k)
    monkeypatch.setattr(prune, "train_step", a_minute_a_step)
    monkeypatch.setattr(prune, "time", SimpleNamespace(time=lambda: clock[0]))
    model = make_tiny("llama", L)
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    run_here(tiny_args(model, corpus, straight), tmp_path, monkeypatch)
    capsys.readouterr()
    run_here(tiny_args(model, corpus, halves, "--until", "cut"), tmp_path, monkeypatch)
    assert "stopped at step 4 of 8" in capsys.readouterr().out and not (halves / "model").exists()
    stop = json.loads((halves / "stopped.json").read_text())
    search = events(halves, "search")
    assert [e["step"] for e in events(halves, "train")] == [1, 2, 3, 4]
    assert [e["tau"] for e in search] == [e["tau"] for e in events(straight, "search")]
    assert stop["initial_scores"] == events(halves, "importance")[0]["scores"]
    assert stop["final_scores"] == search[-1]["scores"] and len(search) == 4
    S_T = stop["final_scores"]  # the cut's set: the protected first and last, then the top of S_T
    assert stop["kept_layers"] == sorted([0, L - 1] + sorted(range(1, L - 1), key=lambda i: -S_T[i])[:K - 2])
    assert stop["kept_layers"] == events(straight, "pruned")[0]["kept"] and stop["layers_before"] == L
    (cut_val,) = [e for e in events(halves, "val") if e["when"] == "at pruning"]
    assert stop["step"] == 4 and stop["val_at_pruning"]["kd"] == round(cut_val["val_loss"], 4)
    assert stop["minutes"] == 4
    dense = [e["val_ce"] for e in events(straight, "val") if e["when"] == "dense"]
    assert [e["val_ce"] for e in events(halves, "val") if e["when"] == "dense"] == dense
    run_here(tiny_args(model, corpus, halves, "--resume"), tmp_path, monkeypatch)
    assert [e["loss"] for e in events(halves, "train")] == pytest.approx(
        [e["loss"] for e in events(straight, "train")], abs=1e-5)
    a, b = weights(straight), weights(halves)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5, msg=key)
    assert events(halves, "done")[0]["minutes"] == events(straight, "done")[0]["minutes"] == 8
    assert len(list((tmp_path / "teacher").glob("*/meta.json"))) == 1  # one cache, built once
    cache = tmp_path / "cache"
    cache_teacher.build_cache(model, corpus, str(cache), seq_len=32, max_tokens=2 * 8 * 4 * 32)
    run_here(tiny_args(model, corpus, tmp_path / "given", "--cache", str(cache)), tmp_path, monkeypatch)
    assert [e["loss"] for e in events(tmp_path / "given", "train")] == pytest.approx(
        [e["loss"] for e in events(straight, "train")], abs=1e-5)
