"""evaluate.py: quality numbers against an independent float64 recomputation, the speed harness, figures
from a log, lm-eval on the local task, the report, and one-line errors. Tiny random Llama models."""
import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import runtime
import evaluate
import surgery

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("thou art the king of night and day my lord shall we go to war or peace o sweet love "
         "what light through yonder window breaks it is the east and juliet is the sun").split()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP threads waiting on each
    other make every forward pass ~100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_llama(layers, seed):
    """Random Llama with a wide init so the next-token distributions are far from uniform and
    KL / top-1 between two models are not trivially 0 or 1."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, initializer_range=0.3)
    return LlamaForCausalLM(cfg).eval()


def write_log(path, L=4, k=2, steps=40, search=8):
    """A synthetic log.jsonl in prune.py's format."""
    rng = random.Random(0)
    scores = [1.0 / (1 + l) for l in range(L)]
    events = [{"event": "importance", "method": "kl", "scores": scores},
              {"event": "val", "step": 0, "val_loss": 3.0}]
    for t in range(1, search + 1):
        scores = [s + rng.gauss(0, 0.1) for s in scores]
        kt = L - math.ceil((L - k) * t / search)
        picked = sorted(range(L), key=lambda l: -scores[l] - rng.gauss(0, 1))[:kt]
        events.append({"event": "search", "step": t, "tau": 1 - 0.9 * t / search, "k": kt, "scores": scores,
                       "mask": [float(l in picked) for l in range(L)]})
    events.append({"event": "pruned", "step": search, "kept": sorted(range(L), key=lambda l: -scores[l])[:k]})
    for t in range(1, steps + 1):
        events.append({"event": "train", "step": t, "phase": "search" if t <= search else "finetune",
                       "loss": 2 + 1 / t + rng.random() * 0.1, "lr": 1e-4, "tokens": 64 * t, "tok_per_s": 1e3})
        if t % 10 == 0:
            events.append({"event": "val", "step": t, "val_loss": 2 + 1 / t, "val_ce": 4 + 1 / t})
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    """A dense 4-layer teacher folder, a prune.py-shaped run folder (layers 0 and 3 of the teacher, with
    pruning.json and log.jsonl), and a small text file."""
    root = tmp_path_factory.mktemp("evaluate")
    teacher = tiny_llama(4, seed=1)
    teacher.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    student = surgery.remove_layers(tiny_llama(4, seed=1), [0, 3])
    student.save_pretrained(root / "run" / "model")
    tokenizer.save_pretrained(root / "run" / "model")
    info = {"source_model": str(root / "teacher"), "layers_before": 4, "kept_layers": [0, 3],
            "removed_layers": [1, 2], "method": "e3", "flags": {"topk": 7}, "tokens_trained": 0,
            "initial_scores": [1, 0.5, 0.3, 0.25], "final_scores": [1, 0.2, 0.1, 0.3]}
    (root / "run" / "model" / "pruning.json").write_text(json.dumps(info))
    write_log(root / "run" / "log.jsonl")
    rng = random.Random(0)
    text = root / "text.txt"
    text.write_text(" ".join(rng.choice(WORDS) for _ in range(400)))
    return {"root": root, "teacher": root / "teacher", "run": root / "run", "text": text,
            "student_model": student, "teacher_model": teacher}


def reference_quality(student_dir, teacher_dir, blocks, vocab, k):
    """ppl, KL(teacher || student), top-1 agreement and both models' mass outside the teacher's k
    most likely tokens, and the student's top-1 expected calibration error over 15 bins, recomputed in
    float64 with other library calls (a sort, not topk; the bins by a Python loop)."""
    s = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float64)
    t = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64)
    nll = kl = agree = n = tail = teacher_tail = 0.0
    bins = [[0, 0.0, 0.0] for _ in range(15)]  # predictions, confidence, correct
    with torch.no_grad():
        for b in blocks:
            ls = F.log_softmax(s(b[None]).logits[0, :-1, :vocab], -1)
            lt = F.log_softmax(t(b[None]).logits[0, :-1, :vocab], -1)
            nll += F.cross_entropy(ls, b[1:], reduction="sum").item()
            kl += F.kl_div(ls, lt, log_target=True, reduction="sum").item()
            agree += (ls.argmax(-1) == lt.argmax(-1)).sum().item()
            order = lt.argsort(-1, descending=True)[:, :k]  # the teacher's k first tokens
            tail += (1 - ls.exp().gather(-1, order).sum(-1)).sum().item()
            teacher_tail += (1 - lt.exp().gather(-1, order).sum(-1)).sum().item()
            for row, nxt in zip(ls.exp(), b[1:]):
                conf = row.max().item()
                at = min(int(conf * 15), 14)
                bins[at][0] += 1
                bins[at][1] += conf
                bins[at][2] += float(row.argmax().item() == nxt.item())
            n += len(b) - 1
    ece = sum(m / n * abs(c / m - a / m) for m, c, a in bins if m)
    return math.exp(nll / n), kl / n, agree / n, tail / n, teacher_tail / n, ece


def test_quality_matches_float64_recomputation(assets, tokenizer, tmp_path):
    rows = evaluate.main(["--model", str(assets["run"]), "--data", str(assets["text"]), "--val-frac", "1",
                          "--seq-len", "48", "--max-tokens", "0", "--eval-batch-size", "3", "--no-speed",
                          "--no-figures", "--out", str(tmp_path)])
    q = rows[0]["quality"]
    # the windows, rebuilt by hand: the tokenizer's encoding of the one document, EOS, cut every 48 tokens
    ids = tokenizer(assets["text"].read_text())["input_ids"] + [tokenizer.eos_token_id]
    blocks = torch.tensor(ids[: len(ids) // 48 * 48]).view(-1, 48)
    assert q["windows"] == len(blocks) and q["tokens"] == len(blocks) * 47
    ppl, kl, top1, tail, teacher_tail, ece = reference_quality(assets["run"] / "model", assets["teacher"],
                                                          blocks, 49152, k=7)
    assert q["ppl"] == pytest.approx(ppl, rel=1e-4)
    assert q["ece"] == pytest.approx(ece, abs=2 / q["tokens"]) and ece > 0.01  # fp32 near-ties
    assert q["kl"] == pytest.approx(kl, rel=1e-4) and kl > 0.05  # not a trivially uniform pair
    assert q["top1"] == pytest.approx(top1, abs=1.5 / q["tokens"])  # an fp32 near-tie may flip one
    assert 0 < top1 < 1
    # the run distilled on K = 7 (its pruning.json's flags): the tail is measured off the same K
    assert q["tail_k"] == 7
    assert q["tail"] == pytest.approx(tail, rel=1e-4) and q["teacher_tail"] == pytest.approx(teacher_tail, rel=1e-4)
    assert 0.05 < tail < 0.995 and tail != pytest.approx(teacher_tail, rel=1e-2)
    saved = json.loads((tmp_path / "report.json").read_text())["rows"][0]["quality"]
    assert saved["kl"] == q["kl"]


def test_default_windows_are_the_held_out_end(assets, tokenizer):
    args = evaluate.parse_args(["--data", str(assets["text"]), "--seq-len", "16", "--max-tokens", "0"])
    blocks = evaluate.eval_blocks(tokenizer, args)
    # the stream and the split written out: the text, EOS; the last max(5%, 4 x 17 tokens) held out
    ids = torch.tensor(tokenizer(assets["text"].read_text())["input_ids"] + [tokenizer.eos_token_id])
    val = ids[len(ids) - max(int(len(ids) * 0.05), 4 * 17):]
    assert torch.equal(ids[-len(val):], val) and torch.equal(blocks.flatten(), val[: blocks.numel()])
    assert len(val) - blocks.numel() < 16


def test_windows_a_shorter_training_run_may_have_read_are_warned_about(assets, tokenizer, capsys):
    """On a corpus where 5% is less than 4 windows, the held-out end is set by --seq-len: a run that
    trained with a shorter --seq-len held out less, and trained on the start of these windows."""
    ids = tokenizer(assets["text"].read_text())["input_ids"]
    short, long_ = (evaluate.parse_args(["--data", str(assets["text"]), "--seq-len", str(n),
                                         "--max-tokens", "0"]) for n in (4, 64))
    n = len(ids) + 1  # the text, then EOS
    assert 4 * 5 <= int(0.05 * n) < 4 * 65  # 5% sets seq-len 4's end, not 64's
    # what the warning is about: scored from n - 4 x 65, where a run at --seq-len 16 trained to
    assert n - 4 * 65 < n - max(int(0.05 * n), 4 * 17)
    blocks = evaluate.eval_blocks(tokenizer, long_)
    assert torch.equal(blocks.flatten(), torch.tensor(ids + [tokenizer.eos_token_id])[n - 4 * 65:][
        :blocks.numel()])
    warning = capsys.readouterr().err
    assert "--seq-len 64" in warning and "may have trained on" in warning
    evaluate.eval_blocks(tokenizer, short)  # 5% of the text: every run held out as much
    assert "may have trained on" not in capsys.readouterr().err


def test_speed_on_a_virtual_clock(assets, monkeypatch):
    """speed() and speedups() timed by a clock that only advances 1 ms per decoder-layer call: the
    4-layer teacher takes exactly 4 ms per forward, the 2-layer student 2 ms, so every number is known
    here: TTFT and TPOT, the token rates, the measured speedup 2.0 and its range, the ideal from
    hand-counted weights."""
    from surgery import decoder_layers
    dense, pruned = assets["teacher_model"], assets["student_model"]
    now_ms = [0.0]

    class VirtualClock:
        cuda = False

        def __init__(self, device):
            pass

        def now(self):
            return now_ms[0] / 1e3

        def seconds(self, a, b):
            return b - a

    def tick(*_):
        now_ms[0] += 1.0
    handles = [layer.register_forward_hook(tick) for m in (dense, pruned) for layer in decoder_layers(m)]
    monkeypatch.setattr(evaluate, "Clock", VirtualClock)
    try:
        res = evaluate.speed({"dense": dense, "model": pruned}, 49152, batch=2, prompt_len=8, gen_len=4,
                             repeats=3, warmup=1)
    finally:
        for h in handles:
            h.remove()
    for name, layers in (("dense", 4), ("model", 2)):
        r = res[name]
        assert r["ttft_ms_runs"] == pytest.approx([layers] * 3) and r["tpot_ms_runs"] == pytest.approx([layers] * 3)
        assert r["ttft_ms"] == pytest.approx(layers) and r["tpot_ms"] == pytest.approx(layers)
        assert r["prefill_tok_s"] == pytest.approx(2 * 8 * 1000 / layers)  # 16 prompt tokens per TTFT
        assert r["decode_tok_s"] == pytest.approx(2 * 1000 / layers)  # 2 sequences, 1 token each per TPOT
    x = evaluate.speedups(res["dense"], res["model"])
    assert x["decode_speedup"] == pytest.approx(2.0) and x["decode_range"] == pytest.approx([2.0, 2.0])
    assert x["prefill_speedup"] == pytest.approx(2.0)
    # ideal from hand-counted weights: q, o 64x64; k, v 64x32 (2 of 4 heads); gate, up, down 64x128
    layer, head = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128), 2 * 49152 * 64
    assert x["decode_ideal"] == pytest.approx((4 * layer + head) / (2 * layer + head))
    assert x["prefill_ideal"] == pytest.approx((8 * 4 * layer + head) / (8 * 2 * layer + head))


def test_greedy_loop_matches_generate(assets):
    model = assets["student_model"]
    prompts = torch.randint(49152, (2, 8), generator=torch.Generator().manual_seed(0))
    _, _, tokens = evaluate.greedy(model, prompts, 6, evaluate.Clock("cpu"))
    ref = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert tokens.shape == (2, 6) and torch.equal(tokens, ref[:, 8:])


def test_greedy_loop_passes_the_kv_cache_by_its_current_name(assets):
    """transformers 5 renamed past_key_values to cache, the old name to be removed in 5.40: the loop
    must not use it (a fresh install of a later 5.x would break evaluate.py and bench.py)."""
    import warnings
    prompts = torch.randint(49152, (1, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluate.greedy(assets["student_model"], prompts, 4, evaluate.Clock("cpu"))
    assert not [w for w in caught if "past_key_values" in str(w.message)], caught


def test_figures_from_log(assets, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    info = json.loads((assets["run"] / "model" / "pruning.json").read_text())
    files = evaluate.figures(assets["run"] / "log.jsonl", info, str(tmp_path / "e3"))
    assert [f.rsplit("-", 1)[1] for f in files] == ["trajectory.png", "importance.png", "loss.png"]
    for f in files:
        pixels = torch.tensor(image.imread(f))
        assert pixels.shape[0] > 200 and pixels.shape[1] > 400 and pixels.std() > 0.05
    # a run without a search (ShortGPT) has no trajectory, and nothing crashes
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"event": "train", "step": 1, "phase": "finetune", "loss": 2.0}) + "\n")
    assert [f.rsplit("-", 1)[1] for f in evaluate.figures(log, None, str(tmp_path / "sg"))] == ["loss.png"]


def test_report_several_models(assets, tmp_path):
    rows = evaluate.main(["--model", str(assets["run"]), str(assets["teacher"]), "--data", str(assets["text"]),
                          "--val-frac", "1", "--seq-len", "32", "--max-tokens", "256", "--prompt-len", "8",
                          "--gen-len", "3", "--repeats", "1", "--report", str(tmp_path / "cmp")])
    pruned, dense = rows
    assert pruned["layers"] == "2/4" and pruned["teacher"] == str(assets["teacher"])
    assert {"prefill_speedup", "prefill_ideal", "decode_speedup", "decode_ideal"} <= set(pruned["speedup"])
    assert dense["layers"] == "4/4" and dense["teacher"] is None and "kl" not in dense["quality"]
    # the dense model alone reaches the teacher's perplexity, as measured in the pruned model's row
    assert dense["quality"]["ppl"] == pytest.approx(pruned["quality"]["teacher_ppl"], rel=1e-6)
    table = (tmp_path / "cmp.md").read_text()
    assert "| run | 2/4 |" in table and "| teacher | 4/4 |" in table
    assert json.loads((tmp_path / "cmp.json").read_text())["rows"][0]["name"] == "run"
    drawn = [str(tmp_path / f"cmp-run-{n}.png") for n in ("trajectory", "importance", "loss")]
    assert pruned["figures"] == (drawn if importlib.util.find_spec("matplotlib") else [])  # from the run's log


def test_every_model_is_checked_against_the_teacher_it_reuses(assets, tmp_path):
    """--model A B with one teacher: the teacher loads once, and B's tokenizer is checked against it
    too (a model whose ids of two tokens are swapped would read a KL and top-1 of other tokens)."""
    other = tmp_path / "other"
    for f in assets["teacher"].iterdir():
        (other / f.name).parent.mkdir(exist_ok=True)
        (other / f.name).write_bytes(f.read_bytes())
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġand"] = vocab["Ġand"], vocab["Ġthe"]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    common = ["--teacher", str(assets["teacher"]), "--data", str(assets["text"]), "--val-frac", "1",
              "--seq-len", "32", "--max-tokens", "64", "--no-speed", "--no-figures", "--out", str(tmp_path / "o")]
    for models in ([other], [assets["teacher"], other]):
        with pytest.raises(runtime.E3Error, match="another tokenizer"):
            evaluate.main(["--model", *map(str, models)] + common)


def test_lm_eval_local_task_offline(assets, tokenizer, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    res = evaluate.run_tasks(assets["student_model"], tokenizer, ["shakespeare_mc"], ROOT / "experiments" / "tasks", batch_size=8)
    assert 0 <= res["shakespeare_mc"]["acc"] <= 1 and 0 <= res["shakespeare_mc"]["acc_norm"] <= 1


def test_errors_are_one_line(assets, tmp_path, capsys):
    bad_teacher = tmp_path / "run"
    (bad_teacher / "model").mkdir(parents=True)
    for f in (assets["run"] / "model").iterdir():
        (bad_teacher / "model" / f.name).write_bytes(f.read_bytes())
    info = json.loads((bad_teacher / "model" / "pruning.json").read_text()) | {"source_model": "/nowhere/dense"}
    (bad_teacher / "model" / "pruning.json").write_text(json.dumps(info))
    for argv, needle in ((["--model", "/nowhere/model"], "--model"),
                         (["--model", str(bad_teacher), "--data", str(assets["text"])], "--teacher"),
                         (["--model", str(assets["teacher"]), "--data", "/nowhere.txt"], "--data"),
                         (["--gen-len", "1"], "--gen-len")):
        with pytest.raises(SystemExit) as e:
            runtime.run_main(lambda: evaluate.main(argv + ["--out", str(tmp_path / "o")]))
        err = capsys.readouterr().err  # may hold transformers' loading progress bars before the error
        assert e.value.code == 2 and "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("error:") and err.count("error:") == 1 and needle in err


def test_optional_packages_missing(assets, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(runtime.E3Error, match="pip install lm-eval"):
        evaluate.run_tasks(assets["student_model"], None, ["shakespeare_mc"])
    assert evaluate.figures(assets["run"] / "log.jsonl", None, str(tmp_path / "x")) == []
    assert "pip install matplotlib" in capsys.readouterr().out


@pytest.mark.slow
def test_no_arguments_evaluates_the_packaged_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default report lands in ./out/eval
    rows = evaluate.main(["--seq-len", "128", "--max-tokens", "256", "--prompt-len", "8", "--gen-len", "2",
                          "--repeats", "1", "--warmup", "0"])
    assert rows[0]["layers"] == "30/30" and 5 < rows[0]["quality"]["ppl"] < 200
    assert (tmp_path / "out" / "eval" / "report.md").exists() and "--model RUN_DIR" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral", "gpt_oss"])
def test_ideal_flops_count_every_matmul_a_token_meets(arch):
    """linear_flops against the weights counted by hand: GPT-2's layers are transformers' Conv1D,
    not nn.Linear, and a MoE's experts one 3-D tensor each, of which a token meets its top-k."""
    from test_architectures import tiny
    h, inner, L = 32, 64, 6  # test_architectures' tiny configs: hidden 32, MLP 64, 6 layers
    if arch == "gpt2":  # c_attn h x 3h, c_proj h x h, c_fc h x 4h's inner, c_proj back
        layer = h * 3 * h + h * h + 2 * h * inner
    else:  # q, o h x h; k, v h x 16 (2 of 4 heads of 8)
        layer = 2 * h * h + 2 * h * 16
        if arch == "llama":
            layer += 3 * h * inner  # gate, up, down
        else:  # the router (4 x h), then 2 of the 4 experts' gate, up, down (biases: none)
            layer += 4 * h + 2 * 3 * h * inner
    assert evaluate.linear_flops(tiny(arch)) == (2 * L * layer, 2 * 49152 * h)
