"""Lu et al.'s reverse-order pruning and partial fine-tune (baselines/reverse.py): which layers go,
written out by hand from their prune_llm.py; that --train-last changes only the head, the final
norm and the last N kept layers (every other tensor bitwise the source's) and that their gradients
are the unfrozen model's."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import tiny_config
from test_prune import corpus, run, run_here, tiny_args  # noqa: F401

# (L, k, protect-last) -> the layers removed, written out. Lu et al.'s own two: Llama-3.1-8B keeps
# `range(24)` of 32, Gemma-2-2B `range(20)` of 26 (prune_llm.py, --pr_method tail): the last layer
# goes too. With the last layer protected (prune.py's default) the layers before it go instead.
REMOVED = {(6, 4, 0): [4, 5], (32, 24, 0): [24, 25, 26, 27, 28, 29, 30, 31],
           (26, 20, 0): [20, 21, 22, 23, 24, 25], (30, 20, 0): list(range(20, 30)),
           (6, 4, 1): [3, 4], (30, 20, 1): list(range(19, 29))}


@pytest.mark.parametrize("L, k, last", list(REMOVED))
def test_reverse_order_removes_the_layers_written_out(L, k, last):
    from baselines.reverse import reverse_order
    from surgery import protected_layers, top_k_layers
    with torch.device("meta"):  # the layer count alone: no weights
        model = AutoModelForCausalLM.from_config(tiny_config("llama", L))
    kept = top_k_layers(reverse_order(model), k, protected_layers(L, 1, last))
    assert sorted(set(range(L)) - set(kept)) == REMOVED[(L, k, last)]


def source_weights(model):
    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(model).state_dict().items()}


@pytest.mark.parametrize("chunk", ["0", "16"])  # the plain logits; the fused head + loss (scale/)
def test_partial_finetune_trains_only_the_head_norm_and_last_layers(chunk, make_tiny, corpus, tmp_path,  # noqa: F811
                                                                   monkeypatch):
    """6 -> 4 layers by reverse order (layers 0-3 kept), --train-last 2: layers 2, 3, the final norm
    and the tied embedding / head move; layers 0 and 1 are the source's, bit for bit."""
    model = make_tiny("llama", 6)
    out = tmp_path / "run"
    run_here(tiny_args(model, corpus, out, "--init", "reverse", "--search", "none", "--protect-last", "0",
                       "--train-last", "2", "--logit-chunk", chunk), tmp_path, monkeypatch)
    info = json.loads((out / "model" / "pruning.json").read_text())
    assert info["removed_layers"] == [4, 5]
    src, got = source_weights(model), load_file(str(out / "model" / "model.safetensors"))
    trained = {"model.embed_tokens.weight", "model.norm.weight"} | {
        k for k in got if k.startswith(("model.layers.2.", "model.layers.3."))}
    for name, w in got.items():  # kept layer i is source layer i (0-3 kept in order)
        if name in trained:
            assert not torch.equal(w, src[name]), f"{name} did not train"
        else:
            assert torch.equal(w, src[name]), f"{name} moved though frozen"
    assert trained - {"model.embed_tokens.weight", "model.norm.weight"} and set(got) - trained


@pytest.mark.slow
def test_partial_finetune_on_two_fsdp_ranks_matches_one_process(make_tiny, corpus, tmp_path):  # noqa: F811
    """Two FSDP2 ranks (sharded layers, the vocabulary-parallel tied head fused with the loss) with
    --train-last 2: the frozen layers are the source's bit for bit, the rest as one process's."""
    model = make_tiny("llama", 6)
    flags = ["--init", "reverse", "--search", "none", "--protect-last", "0", "--train-last", "2"]
    run(tiny_args(model, corpus, tmp_path / "one", *flags), tmp_path)
    run(tiny_args(model, corpus, tmp_path / "two", *flags), tmp_path, nproc=2)
    src, one = source_weights(model), load_file(str(tmp_path / "one" / "model" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "model" / "model.safetensors"))
    for name, w in two.items():
        if name.startswith(("model.layers.0.", "model.layers.1.")):
            assert torch.equal(w, src[name]), f"{name} moved though frozen"
        else:
            torch.testing.assert_close(w, one[name], rtol=1e-4, atol=1e-5)


def test_partial_finetune_gradients_are_the_whole_models(make_tiny):
    """One AKD backward: the trained tensors' gradients equal the unfrozen model's (the tied matrix's
    includes its lookup's share), and the frozen ones get none."""
    import kd
    from baselines.reverse import train_only_last
    path = make_tiny("llama", 6)
    full, part = (AutoModelForCausalLM.from_pretrained(path) for _ in range(2))
    names = train_only_last(part, 3)
    assert set(names) == {"model.embed_tokens.weight", "model.norm.weight"} | {
        n for n, _ in part.named_parameters() if n.startswith(("model.layers.3.", "model.layers.4.",
                                                               "model.layers.5."))}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (2, 12), generator=g)
    targets = torch.randint(0, 49152, (2, 12, 4), generator=g)
    logp = torch.log_softmax(torch.randn(2, 12, 4, generator=g), -1)
    batch = {"topk_ids": targets, "topk_logprobs": logp, "entropy": torch.rand(2, 12, generator=g)}
    for m in (full, part):
        kd.kd_loss(m(input_ids=ids).logits, batch, weighted=True).backward()
    fp = dict(full.named_parameters())
    for name, p in part.named_parameters():
        if name in names:
            torch.testing.assert_close(p.grad, fp[name].grad, rtol=1e-6, atol=0)
        else:
            assert p.grad is None and not p.requires_grad


@pytest.mark.parametrize("flags, words", [
    (["--train-last", "0"], ["--train-last", "at least 1"]),
    (["--train-last", "-2"], ["--train-last", "at least 1"]),
    (["--train-last", "2", "--lora-rank", "4"], ["--train-last", "--lora-rank"])])
def test_train_last_misuse_is_refused_before_any_work(flags, words, make_tiny, corpus, tmp_path,  # noqa: F811
                                                      capsys, monkeypatch):
    """--train-last 0 would be a full fine-tune, a negative N the head alone, and with --lora-rank the
    last layers' base weights would train beside frozen adapters (AdamW's 16 B a parameter where
    the plan priced LoRA's 4): one error line, no run folder, no teacher cache."""
    from test_prune import one_line_error
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    out = tmp_path / "run"
    one_line_error(tiny_args(make_tiny("llama", 6), corpus, out, "--init", "reverse", "--search", "none",
                             *flags), capsys, *words)
    assert not out.exists() and not (tmp_path / "teacher").exists()


def test_train_last_freezes_at_the_cut_and_after_a_resume(make_tiny, corpus, tmp_path, monkeypatch):  # noqa: F811
    """The search trains every weight; the cut freezes all but the head, the final norm and the last
    N kept layers; a run stopped after the cut and resumed holds the same trainable set (the
    optimizer's parameters counted at each step by a spy on prune.train_step)."""
    import prune
    model = make_tiny("llama", 6)
    seen = {}
    step = prune.train_step

    def spy(m, opt, *a, **k):
        seen.setdefault(str(k.get("t", a[3])) + ("-resumed" if resumed else ""), sorted(
            n for n, p in m.named_parameters() if any(p is q for g in opt.param_groups for q in g["params"])))
        return step(m, opt, *a, **k)
    monkeypatch.setattr(prune, "train_step", spy)
    resumed = False
    flags = ["--search", "gumbel", "--train-last", "1"]
    run_here(tiny_args(model, corpus, tmp_path / "whole", *flags), tmp_path, monkeypatch)
    run_here(tiny_args(model, corpus, tmp_path / "part", *flags, "--until", "5"), tmp_path, monkeypatch)
    resumed = True
    run_here(tiny_args(model, corpus, tmp_path / "part", *flags, "--resume"), tmp_path, monkeypatch)
    everything = sorted(n for n, _ in AutoModelForCausalLM.from_pretrained(model).named_parameters())
    last = {"model.embed_tokens.weight", "model.norm.weight"}  # tied head, final norm, layer 3 of 0-3
    for t in ("1", "4"):  # the search's 4 steps (T_M = 0.5 x 8)
        assert seen[t] == everything
    for t in ("5", "8", "6-resumed", "8-resumed"):
        assert set(seen[t]) == last | {n for n in seen[t] if n.startswith("model.layers.3.")}
        assert any(n.startswith("model.layers.3.") for n in seen[t])
