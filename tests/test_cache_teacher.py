"""cache_teacher.py: targets against a float64 reference, data round trip, ranks, kill/resume, errors."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

import cache_teacher
import demo
import runtime
import surgery
from cache_teacher import TeacherCache, build_cache
from conftest import topk_kd_loss as reference_kd_loss, torchrun_failure

REPO = Path(__file__).resolve().parents[1]
V = 49152


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Three short ASCII documents (Shakespeare) in a .jsonl file whose text field is 'body'."""
    plays = sorted(Path(runtime.default_corpus()).rglob("*.md"))[:3]
    docs = [p.read_text()[:1200].encode("ascii", "ignore").decode() for p in plays]
    path = tmp_path_factory.mktemp("corpus") / "plays.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    return path, docs


@pytest.fixture(scope="session")
def ref(tiny_model, corpus, tmp_path_factory):
    """The reference cache, built in this process (one rank): its build_cache arguments and its path.
    Batches of 3 do not divide shards of 4 sequences, so batch boundaries are exercised too."""
    args = dict(model_name=tiny_model, data=str(corpus[0]), text_field="body", seq_len=16, batch_size=3,
                shard_seqs=4, out=str(tmp_path_factory.mktemp("ref") / "cache"))
    build_cache(**args)
    return args


def cli(args, **override):
    """The cache_teacher.py command line for build_cache arguments."""
    a = {**args, **override}
    return ["cache_teacher.py", "--model", a["model_name"], "--data", a["data"], "--text-field", a["text_field"],
            "--seq-len", str(a["seq_len"]), "--batch-size", str(a["batch_size"]),
            "--shard-seqs", str(a["shard_seqs"]), "--out", a["out"]]


def run(cmd, **kw):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, **kw)


def shard_listing(out):
    return json.loads((Path(out) / "meta.json").read_text())["shards"]


def everything(cache):
    return {s: cache.get(range(cache.len_split(s)), s) for s in ("train", "val")}


def float64_reference(model_path, input_ids, vocab=V, k=10):
    """Top-K log-probabilities and entropy straight from the full HF forward, in float64."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=input_ids).logits[..., :vocab], dim=-1)
    values, ids = logp.topk(k, dim=-1)
    return ids, values, -(logp.exp() * logp).sum(-1)


def assert_matches_float64(cache, model_path):
    for split, got in everything(cache).items():
        ids, logprobs, entropy = float64_reference(model_path, got["input_ids"])
        assert torch.equal(got["topk_ids"], ids), split
        # stored as fp16: rounding is at most 2^-11 relative; the fp32 computation adds ~1e-6
        torch.testing.assert_close(got["topk_logprobs"].double(), logprobs, rtol=2 ** -11, atol=1e-5)
        torch.testing.assert_close(got["entropy"].double(), entropy, rtol=1e-5, atol=1e-5)
        assert (logprobs.exp().sum(-1) < 0.999).all(), "full-softmax values, not renormalised over the top K"


def test_targets_equal_float64_full_vocabulary_reference(ref):
    tok = AutoTokenizer.from_pretrained(ref["model_name"])
    cache = TeacherCache(ref["out"], tok, seq_len=16, topk=10)
    assert (cache.seq_len, cache.topk, cache.vocab_size) == (16, 10, V)
    assert cache.meta["bytes_per_token"] <= 64
    assert_matches_float64(cache, ref["model_name"])


def fp32_targets_written_out(logits, topk, samples=0, generator=None):
    """(n, V) fp32 logits -> the targets an operation at a time, apart from token_stats: the
    log-softmax, its top-K, the entropy over the clamped log p, draws from p less the top-K."""
    logp = F.log_softmax(logits, dim=-1)
    values, ids = logp.topk(topk, dim=-1)
    entropy = -(logp.exp() * logp.clamp(min=torch.finfo(torch.float32).min)).sum(-1)
    p = logp.exp().scatter_(-1, ids, 0)
    draws = torch.multinomial(p, samples, True, generator=generator) if samples else None
    return {"topk_ids": ids, "topk_logprobs": values, "entropy": entropy, "sample_ids": draws}


@pytest.mark.parametrize("samples", [0, 12])
def test_targets_equal_the_fp32_log_softmax_written_out(tiny_model, samples):
    """teacher_targets on a CPU (token_stats eager, 64 tokens a slice) against the fp32 log-softmax of
    model(x).logits written out: the same top-K ids (those of the float64 softmax too) and, for
    hybrid targets, the same draws; log-probs and entropies within 1e-6."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    # top-K: two slices (64 + 56 tokens); hybrid: one (the reference draws from all rows at once)
    x = torch.randint(V, (3, 40) if not samples else (2, 24), generator=torch.Generator().manual_seed(0))
    got = cache_teacher.teacher_targets(model, x, V, 10, samples=samples,
                                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=x).logits.flatten(0, 1)
    want = fp32_targets_written_out(logits, 10, samples, torch.Generator().manual_seed(1))
    assert torch.equal(got["topk_ids"].flatten(0, 1), want["topk_ids"])
    assert torch.equal(want["topk_ids"], logits.double().log_softmax(-1).topk(10).indices)
    for name in ("topk_logprobs", "entropy"):
        torch.testing.assert_close(got[name].flatten(0, 1), want[name], rtol=0, atol=1e-6)
    if samples:
        assert torch.equal(got["sample_ids"].flatten(0, 1), want["sample_ids"])


def test_the_gpus_compiled_slice_function_matches_eager(tiny_model):
    """scale/teacher.py's compiled token_stats, what a GPU runs (here inductor on the CPU),
    against token_stats eager on the same fp32 logits: a slice of a padded head's (a strided view)
    with a masked entry. The same top-K ids, log-probs within 1e-6, entropies within 1e-6 relative
    (the sums' order differs); either form (log p returned too or not) captured as one graph."""
    from scale.teacher import compiled
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        logits = model(input_ids=torch.arange(96).view(2, 48)).logits.flatten(0, 1)
    z = logits[:, :V - 64]  # padding rows past the tokenizer cut off: not contiguous
    z[5, 7] = -float("inf")
    want, _ = cache_teacher.token_stats(z, 10)
    got, _ = compiled(cache_teacher.token_stats)(z, 10)
    assert torch.equal(got["topk_ids"], want["topk_ids"])
    torch.testing.assert_close(got["topk_logprobs"], want["topk_logprobs"], rtol=0, atol=1e-6)
    torch.testing.assert_close(got["entropy"], want["entropy"], rtol=1e-6, atol=1e-6)
    assert compiled(cache_teacher.token_stats).__wrapped__ is cache_teacher.token_stats  # the one function, not a copy
    graph = torch.compile(cache_teacher.token_stats, backend="eager", fullgraph=True)
    for with_logp in (False, True):  # each form one graph: all of it compiled, no break
        torch.testing.assert_close(graph(z, 10, with_logp), cache_teacher.token_stats(z, 10, with_logp))


def test_logits_beyond_the_tokenizer_are_sliced_off(tiny_model, corpus, tmp_path):
    """A checkpoint whose LM head has padding rows (vocabulary 49216 for a 49152-token tokenizer);
    the padding rows are made to win the softmax, so keeping them would change every target."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.resize_token_embeddings(V + 64)
    with torch.no_grad():
        model.lm_head.weight[V:] = 3 * model.lm_head.weight[:64]
    padded = tmp_path / "padded"
    model.save_pretrained(padded)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(padded)
    out = build_cache(str(padded), str(corpus[0]), tmp_path / "cache", text_field="body", seq_len=16,
                      max_tokens=64, max_val_tokens=32)
    cache = TeacherCache(out, AutoTokenizer.from_pretrained(padded))
    full = float64_reference(padded, cache.get([0])["input_ids"], vocab=V + 64)[0]
    assert (full >= V).any(), "the padding rows should dominate the unsliced softmax"
    assert_matches_float64(cache, padded)


def test_packed_ids_decode_to_the_corpus(ref, corpus):
    tok = AutoTokenizer.from_pretrained(ref["model_name"])
    cache = TeacherCache(ref["out"], tok)
    text = "".join(d + tok.eos_token for d in corpus[1])  # documents separated by EOS
    got = everything(cache)
    decode = lambda ids: tok.decode(ids.flatten().tolist(), clean_up_tokenization_spaces=False)
    train, val = decode(got["train"]["input_ids"]), decode(got["val"]["input_ids"])
    assert len(train) > 2000 and text.startswith(train)
    start = text.rfind(val)  # the validation split is the end of the stream, apart from training
    assert start >= len(train) and len(tok(text[start + len(val):])["input_ids"]) <= cache.seq_len
    assert cache.len_split("val") >= 4


def test_get_reads_rows_in_any_order(ref):
    cache = TeacherCache(ref["out"], AutoTokenizer.from_pretrained(ref["model_name"]))
    n = cache.len_split("train")
    full = cache.get(range(n))
    order = [n - 1, 0, 5, 5, 2]
    some = cache.get(order)
    assert some["input_ids"].dtype == some["topk_ids"].dtype == torch.int64
    assert some["topk_logprobs"].dtype == some["entropy"].dtype == torch.float32
    assert some["topk_ids"].shape == (5, 16, 10) and some["entropy"].shape == (5, 16)
    assert some["targets"] == full["targets"] == "topk"  # the kind, for kd.TARGETS
    for k in set(full) - {"targets"}:
        assert torch.equal(some[k], full[k][order])
    with pytest.raises(IndexError):
        cache.get([n])


def test_complete_cache_is_skipped_without_loading_the_teacher(ref, monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("the teacher was loaded for a complete cache")
    monkeypatch.setattr(cache_teacher, "load_model", refuse)
    assert build_cache(**ref) == ref["out"]


def test_a_different_cache_in_out_is_refused(ref):
    with pytest.raises(runtime.E3Error, match="another topk"):
        build_cache(**{**ref, "topk": 5})


def test_cache_refuses_other_k_or_seq_len(ref):
    tok = AutoTokenizer.from_pretrained(ref["model_name"])
    with pytest.raises(runtime.E3Error, match="--topk 10, not 20"):
        TeacherCache(ref["out"], tok, topk=20)
    with pytest.raises(runtime.E3Error, match="--seq-len 16, not 32"):
        TeacherCache(ref["out"], tok, seq_len=32)


def test_truncated_shard_is_refused_then_recomputed(ref, tmp_path):
    out = shutil.copytree(ref["out"], tmp_path / "cache")
    shard = out / "train-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    tok = AutoTokenizer.from_pretrained(ref["model_name"])
    with pytest.raises(runtime.E3Error, match="truncated"):
        TeacherCache(out, tok)
    build_cache(**{**ref, "out": str(out)})  # resumes: recomputes the damaged shard only
    assert shard_listing(out) == shard_listing(ref["out"])


def test_a_shard_another_teacher_dtype_made_is_computed_again(ref, tmp_path):
    """A build killed on a GPU (a bf16 teacher) and finished on a CPU (fp32) must not leave the two
    teachers' shards under one meta.json: a shard that another teacher dtype made is redone."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    out = shutil.copytree(ref["out"], tmp_path / "cache")
    (out / "meta.json").unlink()  # as a killed build leaves it
    shard = out / "train-00001.safetensors"
    with safe_open(shard, "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["topk_logprobs"] -= 0.5  # a stand-in for the other teacher's numbers
    made = {**json.loads(metadata["e3_identity"]), "teacher_dtype": "bfloat16"}
    save_file(tensors, shard, {"e3_identity": json.dumps(made, sort_keys=True)})
    build_cache(**{**ref, "out": str(out)})
    assert shard_listing(out) == shard_listing(ref["out"])  # the same bytes as the one-teacher build


def test_two_ranks_give_the_same_cache_as_one(ref, tmp_path):
    out = str(tmp_path / "cache2")
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             *cli(ref, out=out)])
    assert r.returncode == 0, torchrun_failure(r.stderr)
    assert shard_listing(out) == shard_listing(ref["out"])  # same files, byte for byte (sha256)
    tok = AutoTokenizer.from_pretrained(ref["model_name"])
    a, b = everything(TeacherCache(out, tok)), everything(TeacherCache(ref["out"], tok))
    for split in a:
        assert a[split].pop("targets") == b[split].pop("targets")
        for k in a[split]:
            assert torch.equal(a[split][k], b[split][k])


SHARDED_TEACHER = """
import os, sys
import cache_teacher, runtime, transformers
rank, real_load, weights = int(os.environ["RANK"]), cache_teacher.load_model, []
def recording_load(*a, **kw):
    weights.append(kw.get("weights", True))
    return real_load(*a, **kw)
cache_teacher.load_model = recording_load
if rank > 0:  # from_pretrained is what reads a checkpoint's weights: no rank but 0 may call it
    transformers.AutoModelForCausalLM.from_pretrained = lambda *a, **kw: sys.exit("rank 1 read the weights")
sys.argv = ["cache_teacher.py", *sys.argv[1:]]
runtime.run_main(cache_teacher.main)
os.write(1, f"weights loaded {rank} {' '.join(map(str, weights))}\\n".encode())  # one write, one line
"""


@pytest.mark.slow  # more ranks or processes than the default run's one of each
def test_a_sharded_teacher_gives_the_one_process_cache(ref, tmp_path):
    """--shard-teacher on 2 ranks: the teacher is FSDP2-sharded, rank 1 builds it on the meta device and
    never reads the weights, and the cache equals the 1-process one (same ids, log-probs within 1e-3).
    Two of rank 0's shards are already there (a resumed run): it has fewer batches than rank 1 and
    must run dummy forwards for rank 1's all-gathers, or the run hangs."""
    script, out = tmp_path / "sharded.py", str(tmp_path / "cache")
    script.write_text(SHARDED_TEACHER)
    Path(out).mkdir()
    for name in ("train-00000.safetensors", "train-00002.safetensors"):  # shards 0 and 2: rank 0's
        shutil.copy(Path(ref["out"]) / name, Path(out) / name)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
             *cli(ref, out=out)[1:], "--shard-teacher"], env=env)
    assert r.returncode == 0, torchrun_failure(r.stderr)
    loads = {line.split()[2]: line.split()[3:] for line in r.stdout.splitlines() if line.startswith("weights")}
    assert loads == {"0": ["True"], "1": ["False"]}, r.stdout
    tok = AutoTokenizer.from_pretrained(ref["model_name"])
    a, b = everything(TeacherCache(out, tok)), everything(TeacherCache(ref["out"], tok))
    for split in a:
        for k in ("input_ids", "topk_ids"):
            assert torch.equal(a[split][k], b[split][k]), (split, k)
        for k in ("topk_logprobs", "entropy"):
            torch.testing.assert_close(a[split][k], b[split][k], rtol=0, atol=1e-3)


OPEN_ON_EACH_RANK = """
import os, sys
say = lambda line: os.write(1, (line + "\\n").encode())  # one write: the ranks' lines never interleave
import cache_teacher, runtime, torch
from transformers import AutoTokenizer
hashed, real_sha256 = [], cache_teacher._sha256
cache_teacher._sha256 = lambda f: hashed.append(f.name) or real_sha256(f)
def main():
    runtime.init_distributed()
    cache_teacher.TeacherCache(sys.argv[1], AutoTokenizer.from_pretrained(sys.argv[2]))
    say(f"hashed {torch.distributed.get_rank()} {' '.join(hashed)}")
runtime.run_main(main)
"""


@pytest.mark.slow  # more ranks or processes than the default run's one of each
def test_two_ranks_split_the_shard_check_and_both_refuse_a_corrupt_one(ref, tmp_path):
    """Under torchrun each rank hashes every other shard, not all of them; a corrupt shard that only rank 1
    hashes still stops rank 0 too, with the one error line (no rank goes on alone or waits forever)."""
    out = shutil.copytree(ref["out"], tmp_path / "cache")
    script = tmp_path / "open_cache.py"
    script.write_text(OPEN_ON_EACH_RANK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(out), ref["model_name"]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = run(cmd, env=env)
    assert r.returncode == 0, torchrun_failure(r.stderr)
    listed = [s["file"] for split in ("train", "val") for s in shard_listing(out)[split]]
    hashed = {line.split()[1]: line.split()[2:] for line in r.stdout.splitlines() if line.startswith("hashed")}
    assert hashed == {"0": listed[0::2], "1": listed[1::2]}, r.stdout
    shard = out / listed[1]  # rank 1's
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # same size, different bytes: only the hash can tell
    shard.write_bytes(bytes(data))
    r = run(cmd, env=env)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and not any(line.startswith("hashed") for line in r.stdout.splitlines()), r.stdout
    assert len(errors) == 1 and "corrupt" in errors[0] and listed[1] in errors[0], r.stderr[-3000:]


SLOW_WRITER = """
import os, sys, time
sys.path.insert(0, {repo!r})
import cache_teacher, runtime
rename = os.replace
def slow_rename(src, dst):
    rename(src, dst)
    if str(dst).endswith(".safetensors"):
        time.sleep(2)
cache_teacher.os.replace = slow_rename
runtime.run_main(cache_teacher.main)
"""


def test_sigkill_then_rerun_equals_an_uninterrupted_run(ref, tmp_path):
    out = tmp_path / "cache"
    # the script as a user runs it, its writer pausing 2 s after each shard it renames into place:
    # time to kill it between two shards
    slow = tmp_path / "slow_writer.py"
    slow.write_text(SLOW_WRITER.format(repo=str(REPO)))
    proc = subprocess.Popen([sys.executable, str(slow), *cli(ref, out=str(out))[1:]], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = out / "train-00000.safetensors"
    deadline = time.time() + 600  # generous: on a loaded machine loading and one shard can take minutes
    while not first.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert first.exists() and not (out / "meta.json").exists()
    total = sum(len(v) for v in shard_listing(ref["out"]).values())
    assert len(list(out.glob("*.safetensors"))) < total
    stamp = first.stat().st_mtime_ns
    r = run([sys.executable, *cli(ref, out=str(out))])
    assert r.returncode == 0, r.stderr[-3000:]
    assert first.stat().st_mtime_ns == stamp, "a finished shard was computed again"
    assert shard_listing(out) == shard_listing(ref["out"])
    assert not list(out.glob("*.tmp"))


def test_a_teacher_saved_again_at_its_path_is_another_teacher(ref, tmp_path):
    """The cache's identity holds the teacher's weight files, not only its path and config.json: the
    same config saved again with other weights (a re-exported model used as the next teacher) is
    refused by the cache the old weights made, never served its targets."""
    teacher = shutil.copytree(ref["model_name"], tmp_path / "teacher")
    args = {**ref, "model_name": str(teacher), "out": str(tmp_path / "cache")}
    build_cache(**args)
    model = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2)
    model.save_pretrained(teacher)
    with pytest.raises(runtime.E3Error, match="another model"):
        build_cache(**args)


def _tokenizer_variant(tiny_model, path, change):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    change(tok)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("case", ["missing data", "empty data", "unread format", "truncated shard",
                                  "other vocabulary", "other tokenizer"])
def test_bad_input_ends_with_one_error_line(case, ref, tmp_path, capsys, monkeypatch):
    """Exit status 2 and one `error:` line, no traceback: the first case as a user runs it (a process of
    its own), the others in this process through run_main, as `python cache_teacher.py` calls main."""
    argv = None
    if case in ("missing data", "empty data", "unread format"):
        # the unread format is refused in scale/data.py
        data = tmp_path / ("none.csv" if case == "unread format" else "none.txt")
        if case != "missing data":
            data.write_text("a,b\n" if case == "unread format" else "  \n")
        argv = cli(ref, data=str(data), out=str(tmp_path / "c"))
        expect = {"missing data": "does not exist", "empty data": "no text found",
                  "unread format": "not in a format"}[case]
    else:
        cache, tok = ref["out"], ref["model_name"]
        if case == "truncated shard":
            cache = shutil.copytree(ref["out"], tmp_path / "cache")
            with open(cache / "val-00000.safetensors", "r+b") as f:
                f.truncate(1000)
            expect = "truncated"
        elif case == "other vocabulary":
            tok = _tokenizer_variant(tok, tmp_path / "tok", lambda t: t.add_tokens(["<extra>"]))
            expect = "vocabulary"
        else:
            tok = _tokenizer_variant(tok, tmp_path / "tok", lambda t: setattr(t, "eos_token", "<|im_start|>"))
            expect = "another tokenizer"
    if case == "missing data":
        r = run([sys.executable, *argv])
        code, err = r.returncode, r.stderr
    else:
        if argv:
            monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as e:
            runtime.run_main(cache_teacher.main if argv else
                             lambda: cache_teacher.TeacherCache(str(cache), AutoTokenizer.from_pretrained(tok)))
        code, err = e.value.code, capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert len(errors) == 1 and expect in errors[0], err[-3000:]


def test_fp16_logprobs_change_the_kd_loss_negligibly():
    """The measurement behind storing log-probabilities as fp16: on the default model and corpus, with a
    student that lost 6 of its 30 layers, the kd and akd losses against fp16-rounded targets are within
    1e-3 (relative) of those against the fp32 targets."""
    model, tok = runtime.load_model(demo.default_model())
    ids = cache_teacher.corpus_blocks(tok, None, 128, 12 * 128)["train"][10:12]
    vocab = cache_teacher.vocab_size(tok)
    targets = cache_teacher.teacher_targets(model, ids, vocab, 10)
    surgery.remove_layers(model, [i for i in range(30) if i not in range(12, 18)])
    stored = cache_teacher.storage_dtypes(vocab)["topk_logprobs"]

    def loss(logprobs, entropy):  # the student's loss as prune.py computes it (kd.py)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[..., :vocab]
        return reference_kd_loss(logits, targets["topk_ids"], logprobs, entropy)
    for entropy in (None, targets["entropy"]):
        exact = loss(targets["topk_logprobs"], entropy)
        rounded = loss(targets["topk_logprobs"].to(stored).float(), entropy)
        assert exact > 0.05  # a real gap between student and teacher, so the ratio means something
        assert abs(rounded / exact - 1) < 1e-3, (rounded.item(), exact.item())


def test_weights_the_config_does_not_build_are_refused(make_tiny, tmp_path):
    """A checkpoint whose config names fewer layers than its weights hold (a pruned config beside
    unpruned weights) would load as another model, its extra layers dropped with a warning."""
    src = Path(make_tiny("llama", 4))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    runtime.load_model(str(src))  # the checkpoint as saved loads
    with pytest.raises(runtime.E3Error, match="model.layers.2"):
        runtime.load_model(str(bad))


def test_gpu_ranks_can_reduce_cpu_tensors(monkeypatch):
    """Under torchrun on GPUs the ranks all-reduce CPU tensors too (the step's loss for the log,
    --assistant-only's position counts, object gathers): the process group needs a backend for CPU
    tensors beside NCCL, which serves CUDA tensors only (torch's own capability table)."""
    got = {}
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend: got.update(b=backend))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    runtime.init_distributed()
    capability = torch.distributed.Backend.backend_capability
    pairs = [p.split(":") for p in got["b"].split(",")] if ":" in got["b"] else \
        [(device, got["b"]) for device in capability[got["b"]]]
    assert {"cpu", "cuda"} <= {device for device, _ in pairs}, got["b"]
    assert all(device in capability[backend] for device, backend in pairs), got["b"]


def test_a_masked_vocabulary_entry_leaves_the_entropy_finite():
    # a teacher that masks tokens (logit -inf, e.g. a banned id) contributes 0 log 0 = 0 to H_t;
    # 0 x -inf would make it NaN and stop AKD at its first step
    logits = torch.randn(1, 5, 12, dtype=torch.float64)
    logits[..., [3, 7]] = -float("inf")
    teacher = lambda input_ids, use_cache: type("Out", (), {"logits": logits.float()})
    got = cache_teacher.teacher_targets(teacher, torch.zeros(1, 5, dtype=torch.long), 12, topk=4)
    p = torch.softmax(logits[..., [i for i in range(12) if i not in (3, 7)]], -1)
    expected = -(p * p.log()).sum(-1)  # float64, over the finite entries only
    assert torch.isfinite(got["entropy"]).all()
    torch.testing.assert_close(got["entropy"].double(), expected, rtol=1e-5, atol=1e-6)


def test_forward_batch_fills_a_gpu_within_a_shard():
    """build_cache's default batch: 8 sequences on a CPU (what every CPU cache was built with); on a
    GPU ~16K tokens a forward, never fewer than 8 sequences nor more than a shard."""
    from cache_teacher import forward_batch
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [forward_batch(s, 64, cuda) for s in (128, 512, 2048, 4096)] == [64, 32, 8, 8]
    assert forward_batch(128, 16, cuda) == 16
    assert [forward_batch(s, 64, cpu) for s in (128, 4096)] == [8, 8]
