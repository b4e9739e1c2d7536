"""Search and calibration data beyond one domain (scale/data.py's mixtures) and the guard of the cut
(baselines/guard.py): the mixture's proportions counted in the tokens the cache and the calibration
actually read, each source told apart by its own words; the guard's held-out KL and its choice
recomputed by brute force from the source model, its layers removed by hand."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime import E3Error
from test_prune import one_line_error, run_here, tiny_args

WORDS = {"a": "apple banana cherry grape lemon mango", "b": "seven eight nine ten eleven twelve",
         "c": "red green blue yellow purple orange"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three one-topic texts whose token sets are disjoint (checked), and each set, from the
    tokenizer alone."""
    import demo
    tok = AutoTokenizer.from_pretrained(demo.default_model())
    root = tmp_path_factory.mktemp("mix")
    ids = {}
    for name, words in WORDS.items():
        text = " ".join(words.split()[i % 6] for i in range(4000))  # ~4K tokens, one word each
        (root / f"{name}.txt").write_text(text)
        ids[name] = set(tok(text)["input_ids"])
    assert not (ids["a"] & ids["b"] or ids["a"] & ids["c"] or ids["b"] & ids["c"])
    return root, ids, tok


def count(rows, ids):
    flat = torch.as_tensor(rows).reshape(-1).tolist()
    return {name: sum(t in s for t in flat) for name, s in ids.items()}


def test_the_mixture_holds_its_proportions_in_the_tokens_read(sources, tiny_model, tmp_path):
    """0.5 / 0.3 / 0.2 of 20 blocks of 16 tokens: 160 / 96 / 64 tokens in the cache the teacher
    built, and the first 10 blocks (the calibration's) 5 / 3 / 2 blocks, 80 / 48 / 32 tokens."""
    from types import SimpleNamespace

    import prune
    from cache_teacher import TeacherCache, build_cache
    root, ids, tok = sources
    spec = f"{root}/a.txt:0.5,{root}/b.txt:0.3,{root}/c.txt:0.2"
    path = build_cache(tiny_model, spec, tmp_path / "cache", seq_len=16, max_tokens=320, shard_seqs=8)
    cache = TeacherCache(path, tok)
    assert count(cache.get(range(cache.len_split("train")))["input_ids"], ids) == {"a": 160, "b": 96, "c": 64}
    held = count(cache.get(range(cache.len_split("val")), "val")["input_ids"], ids)
    assert sum(held.values()) == 16 * cache.len_split("val") and held["a"] > held["b"] > held["c"] > 0
    args = SimpleNamespace(calib_data=spec, data=None, seq_len=16, n_calib=10, text_field="text")
    calib = torch.cat([ids_ for ids_, _ in prune.calibration_batches(args, tok, None)])
    assert count(calib, ids) == {"a": 80, "b": 48, "c": 32}
    # every prefix in proportion, within a block a source: the interleaving of (j + 1/2) / n_i
    first = [max(ids, key=lambda n: count(row, ids)[n]) for row in calib]
    assert first == ["a", "b", "c", "a", "a", "b", "a", "c", "b", "a"]


def test_a_mixture_a_source_cannot_fill_or_that_does_not_parse_is_refused(sources):
    from cache_teacher import corpus_blocks
    root, ids, tok = sources
    with pytest.raises(E3Error, match="a.txt' holds .* too few for its share, 2250 of 2500"):  # 90%
        corpus_blocks(tok, f"{root}/a.txt:0.9,{root}/b.txt:0.1", 16, 40_000)
    with pytest.raises(E3Error, match="neither a file nor a mixture"):
        corpus_blocks(tok, f"{root}/a.txt:half,{root}/b.txt:0.5", 16, 320)


def top_k(scores, k, protected):
    """The kept set, by hand: the protected layers, then the best-scored others."""
    free = sorted((i for i in range(len(scores)) if i not in protected), key=lambda i: -scores[i])
    return sorted(set(protected) | set(free[:k - len(protected)]))


def test_the_guard_keeps_the_held_out_best_of_the_sets_visited(make_tiny, sources, tmp_path, monkeypatch):
    """A 6 -> 4 Gumbel search on a two-text mixture, --lr 0 (the weights at the cut are the source's)
    and a fast score lr (the set moves: seed 1 ends on another set than S_0's), --guard 4: each candidate's held-out top-K KL recomputed
    from the source model with the other layers dropped by hand, the choice its argmin."""
    from cache_teacher import TeacherCache
    model_path = make_tiny("llama", 6)
    root, ids, tok = sources
    spec = f"{root}/a.txt:0.5,{root}/c.txt:0.5"
    out = tmp_path / "run"
    extra = ["--search-data", spec, "--guard", "4", "--lr", "0", "--score-lr", "3.0", "--seed", "1",
             "--steps", "12", "--until", "cut"]
    run_here(tiny_args(model_path, str(root / "b.txt"), out, *extra), tmp_path, monkeypatch)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    S = [e["scores"] for e in log if e["event"] == "importance"] + [e["scores"] for e in log
                                                                    if e["event"] == "search"]
    sets = [top_k(s, 4, [0, 5]) for s in S]
    cands = []
    for s in sets[:0:-1][:4] + sets[:1]:  # the last 4 steps' (the final first), then S_0's
        cands += [s] * (s not in cands)
    assert len(cands) >= 2, "the search kept one set throughout: nothing for the guard to choose"
    (guard,) = [e for e in log if e["event"] == "guard"]
    assert [s for s, _ in guard["scores"]] == cands
    meta = {p.parent: json.loads(p.read_text()) for p in (tmp_path / "teacher").glob("*/meta.json")}
    (cache_dir,) = [p for p, m in meta.items() if m["data"] == spec]
    held = TeacherCache(cache_dir, tok).get(range(meta[cache_dir]["sequences"]["val"]), "val")
    ref = {}
    for s in cands:
        m = AutoModelForCausalLM.from_pretrained(model_path).eval()
        m.model.layers = torch.nn.ModuleList([m.model.layers[i] for i in s])
        with torch.no_grad():
            logq = torch.log_softmax(m(input_ids=held["input_ids"]).logits.double(), -1)
        logp = held["topk_logprobs"].double()
        ref[tuple(s)] = (logp.exp() * (logp - logq.gather(-1, held["topk_ids"]))).sum(-1).mean().item()
    for s, v in guard["scores"]:
        assert v == pytest.approx(ref[tuple(s)], rel=1e-5)
    assert guard["kept"] == list(min(ref, key=ref.get))
    assert json.loads((out / "stopped.json").read_text())["kept_layers"] == guard["kept"]
    # stopped mid-search and resumed: the sets visited before the stop come back with the checkpoint
    part = tmp_path / "part"
    run_here(tiny_args(model_path, str(root / "b.txt"), part, *extra, "--until", "3"), tmp_path, monkeypatch)
    run_here(tiny_args(model_path, str(root / "b.txt"), part, *extra, "--resume"), tmp_path, monkeypatch)
    assert [e for e in map(json.loads, (part / "log.jsonl").read_text().splitlines())
            if e["event"] == "guard"] == [guard]


def test_a_guarded_run_stopped_at_the_cut_and_resumed_exports_the_whole_runs_record(
        make_tiny, sources, tmp_path, monkeypatch):
    """The guard's record (each candidate's held-out KL, the choice) travels in the checkpoint with the
    sets visited: a guarded run stopped at the cut (--until cut) and resumed exports the pruning.json
    of the run made in one go, its guard scores included, the --out aside."""
    model_path = make_tiny("llama", 6)
    root, ids, tok = sources
    extra = ["--search-data", f"{root}/a.txt:0.5,{root}/c.txt:0.5", "--guard", "4", "--score-lr", "3.0",
             "--seed", "1", "--steps", "12"]
    whole, halves, data = tmp_path / "whole", tmp_path / "halves", str(root / "b.txt")
    run_here(tiny_args(model_path, data, whole, *extra), tmp_path, monkeypatch)
    run_here(tiny_args(model_path, data, halves, *extra, "--until", "cut"), tmp_path, monkeypatch)
    run_here(tiny_args(model_path, data, halves, *extra, "--resume"), tmp_path, monkeypatch)
    one, two = (json.loads((out / "model" / "pruning.json").read_text()) for out in (whole, halves))
    assert len(one["guard"]) >= 2  # candidates to choose among
    assert {**two, "flags": {**two["flags"], "out": None}} == {**one, "flags": {**one["flags"], "out": None}}


def test_a_guard_that_cannot_run_or_would_choose_on_the_reported_split_is_refused_before_any_work(
        make_tiny, sources, tmp_path, capsys, monkeypatch):
    """--guard chooses on the held-out end of --search-data. Without it, or with --data's own text
    (however spelled, or as a source of a mixture, or the text of the --cache the run validates on),
    it would choose on the split the run reports (val_final, evaluate.py). That, N < 1 and a search
    that takes no training step are each one error line before any work: no run folder, no cache."""
    import prune
    from cache_teacher import build_cache
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    model_path = make_tiny("llama", 6)
    root, ids, tok = sources
    data, out, mix = str(root / "b.txt"), tmp_path / "run", f"{root}/a.txt:0.5,{root}/c.txt:0.5"
    for extra, words in (
            (["--search", "none", "--guard", "4", "--search-data", mix], ["--guard", "takes none"]),
            (["--search", "evo", "--guard", "4", "--search-data", mix], ["--guard", "takes none"]),
            (["--search-frac", "0", "--guard", "4", "--search-data", mix], ["--guard", "takes none"]),
            (["--guard", "0", "--search-data", mix], ["--guard", "at least 1"]),
            (["--guard", "-2", "--search-data", mix], ["--guard", "at least 1"]),
            (["--guard", "4"], ["--guard", "--search-data"]),  # it would score --data's held-out end
            (["--guard", "4", "--search-data", f"{root}/../{root.name}/b.txt"], ["validation text"]),
            (["--guard", "4", "--search-data", f"{root}/a.txt:0.5,{root}/b.txt:0.5"], ["validation text"]),
            (["--guard", "4", "--search-data", str(root)], ["validation text"])):  # the folder of b.txt
        one_line_error(tiny_args(model_path, data, out, *extra), capsys, *words)
        assert not out.exists() and not (tmp_path / "teacher").exists(), extra
    cache = build_cache(model_path, data, tmp_path / "cache", seq_len=32, max_tokens=8 * 4 * 32)
    for given in (["--data", str(root / "a.txt")], []):  # the run validates on the cache's text, b.txt
        argv = tiny_args(model_path, data, out, "--cache", cache, "--guard", "4", "--search-data", data)
        argv[argv.index("--data"):argv.index("--data") + 2] = given
        one_line_error(argv, capsys, "--guard", "validation text")
        assert not out.exists() and not (tmp_path / "teacher").exists()
