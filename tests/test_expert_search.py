"""The expert search and cut (experts/search.py, experts/cut.py, routing.ExpertGates) on a tiny model of
every MoE family the project tests, each against a reference written here: a mask on the gates against
the model whose layers were built by hand without those experts; the straight-through gradient of a
gate against a float64 central difference of the loss with the expert's own weights scaled; the cut
and its export against the masked model, reloaded by plain transformers; prune.py end to end with
experts, with layers and experts, resumed across the cut; the refusals, one line each."""
import copy
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from experts.cut import remove_experts
from experts.routing import ExpertGates, moe_layers
from runtime import E3Error
from surgery import decoder_layers
from test_architectures import CONFIGS, VOCAB, tiny
from test_experts import COUNT_KEYS, MOE, batches, moe_model
from test_prune import corpus, events, run_here, tiny_args, weights  # noqa: F401  (corpus: a fixture)

# per MoE row: the experts kept (2 of 4: every family routes a token to at most 2)
SETS = [[0, 2], [1, 3], [2, 3], [0, 1]]


def deleted(model, drop):
    """Independent reference: the family's model built with one expert count fewer... as many fewer
    as `drop` names, every tensor whose first size E shrank losing the rows of `drop` (found by
    comparing with the small model's shapes, not by the code under test)."""
    config = copy.deepcopy(model.config)
    key = next(k for k in COUNT_KEYS if getattr(config, k, None) == 4)
    setattr(config, key, 4 - len(drop))
    small = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype).eval()
    target, keep = small.state_dict(), [j for j in range(4) if j not in drop]
    small.load_state_dict({name: t[keep] if t.shape != target[name].shape else t
                           for name, t in model.state_dict().items()})
    return small


def layered_reference(model, sets):
    """model with each MoE layer m taken from the model built without the experts outside sets[m]."""
    ref = copy.deepcopy(model)
    layers = decoder_layers(ref)
    for m, moe in enumerate(moe_layers(model)):
        small = deleted(model, [j for j in range(4) if j not in sets[m]])
        layers[moe.index] = decoder_layers(small)[moe.index]
    return ref


def kept_mask(sets, M):
    return torch.zeros(M, 4).scatter_(1, torch.tensor(sets[:M]), 1.0)


FAMILIES = MOE + ["glm4_moe"]  # GLM-4-MoE: DeepSeek-V3's routing, its own classes


@pytest.mark.parametrize("arch", FAMILIES)
def test_gates_route_as_the_experts_deleted_and_the_cut_exports_that_model(arch, tmp_path):
    """A hard mask on ExpertGates (in training mode: `mask`; in eval mode: `hard`) == the model whose
    layers were built without the masked experts; remove_experts == both, and its save_pretrained
    reloads with nothing missing, unexpected or random, logits equal; the gates removed, the dense
    model again."""
    model, (x, attn) = moe_model(arch), batches()[0]
    moes = moe_layers(model)
    sets = SETS[:len(moes)]
    with torch.no_grad():
        dense = model(x, attention_mask=attn).logits
        reference = layered_reference(model, sets)(x, attention_mask=attn).logits
    assert not torch.allclose(reference, dense, atol=1e-4)  # the comparison can fail
    gates = ExpertGates(moes, list(range(len(moes))))
    gates.hard = kept_mask(sets, len(moes))
    with torch.no_grad():
        torch.testing.assert_close(model(x, attention_mask=attn).logits, reference, rtol=1e-5, atol=1e-5)
        model.train()  # training mode, no draw: the hard mask; a draw: the draw
        torch.testing.assert_close(model(x, attention_mask=attn).logits, reference, rtol=1e-5, atol=1e-5)
        gates.mask, gates.hard = kept_mask(sets, len(moes)), None
        torch.testing.assert_close(model(x, attention_mask=attn).logits, reference, rtol=1e-5, atol=1e-5)
        model.eval()  # eval mode ignores the draw: every expert (hard None)
        torch.testing.assert_close(model(x, attention_mask=attn).logits, dense, rtol=0, atol=0)
    gates.remove()
    assert not any("forward" in vars(m.router) for m in moes)
    cut = remove_experts(model, {m.index: s for m, s in zip(moes, sets)})
    with torch.no_grad():
        torch.testing.assert_close(cut(x, attention_mask=attn).logits, reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x, attention_mask=attn).logits, dense, rtol=0, atol=0)
    key = next(k for k in COUNT_KEYS if getattr(cut.config, k, None) is not None)
    assert getattr(cut.config, key) == 2 and getattr(model.config, key) == 4
    cut.save_pretrained(tmp_path)
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x, attention_mask=attn).logits, reference, rtol=1e-5, atol=1e-5)


def scaled_weights(model, moe, s):
    """{name: tensor} of `moe`'s expert weights with expert j's times s[j] where its gate acts: its
    output (down_proj, and GPT-OSS's down_proj_bias), or, in Llama-4, which gates the expert's input,
    its input (gate_up_proj)."""
    names = {id(m): n for n, m in model.named_modules()}
    llama4 = "llama4" in type(model).__name__.lower()
    return {f"{names[id(moe.experts)]}.{n}": p * s.view(-1, *[1] * (p.dim() - 1))
            for n, p in moe.experts.named_parameters()
            if ((n == "gate_up_proj") if llama4 else n.startswith("down_proj"))}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "llama4_text", "granitemoe"])
def test_the_straight_through_gradient_is_the_gate_s_derivative(arch):
    """dL/dm_j at a hard mask, by autograd through the gates, == dL/ds_j in float64 where s_j scales
    expert j's own weights where its gate acts (its output; Llama-4: its input), the weights a
    function of s (torch.func.functional_call), the gates a constant mask: for the kept experts; a
    masked expert gets none (it never ran)."""
    model = moe_model(arch).double()
    model.config._experts_implementation = "eager"  # torch._grouped_mm has no float64
    x, attn = batches()[0]
    moes = moe_layers(model)
    target = torch.randn(*x.shape, VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    hard = kept_mask([[0, 1, 2]] * 4, len(moes)).double()
    m = hard.clone().requires_grad_()
    gates = ExpertGates(moes, list(range(len(moes))))
    gates.hard = m
    (model(x, attention_mask=attn).logits * target).mean().backward()
    gates.hard, checked = hard, 0  # the reference: no gradient through the gates
    for r, moe in enumerate(moes):
        s = torch.ones(4, dtype=torch.float64, requires_grad=True)
        logits = torch.func.functional_call(model, scaled_weights(model, moe, s), (x,),
                                            {"attention_mask": attn}).logits
        (reference,) = torch.autograd.grad((logits * target).mean(), s)
        assert m.grad[r, 3] == 0 and reference[3] == 0
        torch.testing.assert_close(m.grad[r], reference, rtol=1e-5, atol=1e-10)
        checked += int((reference.abs() > 1e-7).sum())
    assert checked >= len(moes) * 2  # the gradients are not all 0
    gates.remove()


# -----------------------------------------------------------------------------
# prune.py with experts: every MoE family end to end, the resume, the refusals

from test_architectures import saved  # noqa: E402, F401  (a fixture)
from test_prune import one_line_error  # noqa: E402


def exported_logits_match(model, out):
    """The export reloads with nothing missing or unexpected, and its logits are those of the model
    prune.py returned (the training model, its removed experts unroutable, eval mode)."""
    back, info = AutoModelForCausalLM.from_pretrained(Path(out) / "model", output_loading_info=True)
    assert not any(info.values()), info
    x = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x).logits, model.eval()(x).logits, rtol=1e-4, atol=1e-4)
    return back


# the structurally different ones by default (a shared expert, DeepSeek's sigmoid routing and MLA,
# GPT-OSS's transposed experts with biases, Llama-4's gated inputs); the rest in -m slow
DEFAULT = ("qwen2_moe", "deepseek_v3", "gpt_oss", "llama4_text")


@pytest.mark.parametrize("arch", [a if a in DEFAULT else pytest.param(a, marks=pytest.mark.slow) for a in FAMILIES])
def test_prune_py_searches_cuts_and_exports_experts_and_layers(arch, saved, corpus, tmp_path, monkeypatch):  # noqa: F811
    """prune.py --keep 4 --experts-keep 2 on each MoE family: KL importance of the layers and of the
    experts, both Gumbel searches in the same steps (the draws: k'_t experts in every MoE row), the
    cut, AKD, the export: pruning.json lists 2 experts for each kept MoE layer, the config counts 2,
    the checkpoint reloads clean and computes what the run's model computed."""
    import prune
    out = tmp_path / "run"
    argv = tiny_args(saved(arch), corpus, out, "--experts-keep", "2", "--steps", "6", "--n-calib", "2")
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    model = prune.main(argv)
    info = json.loads((out / "model" / "pruning.json").read_text())
    moe_rows = events(out, "expert_importance")[0]["layers"]
    kept_moe = [l for l in moe_rows if l in info["kept_layers"]]
    assert sorted(map(int, info["kept_experts"])) == kept_moe and len(info["kept_layers"]) == 4
    assert all(len(e) == 2 and e == sorted(set(e)) for e in info["kept_experts"].values())
    searched = events(out, "expert_search")
    assert [e["k"] for e in searched] == [3, 2, 2]  # k'_t = 4 - ceil(2 t / 3): T_M = 3
    final = torch.tensor(searched[-1]["scores"])
    for r, l in enumerate(moe_rows):  # the set kept: the top 2 of S^e at the cut
        if str(l) in info["kept_experts"]:
            assert info["kept_experts"][str(l)] == sorted(final[r].topk(2).indices.tolist())
    key = next(k for k in COUNT_KEYS if k in json.loads((out / "model" / "config.json").read_text()))
    assert json.loads((out / "model" / "config.json").read_text())[key] == 2
    exported_logits_match(model, out)


def test_experts_alone_resume_across_the_cut_and_plan(saved, corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    """--experts-keep without --keep keeps every layer; stopped at step 3 (mid-search, T_M = 4) and at
    the cut, each resumed, == the uninterrupted run: the experts kept, the scores, the weights. Its
    --plan counts the export's parameters; a token's FLOPs lose the routers' rows alone."""
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    base = tiny_args(saved("qwen2_moe"), corpus, "OUT", "--experts-keep", "2")
    i = base.index("--keep")
    base = base[:i] + base[i + 2:]

    def args(out, *extra):
        return [str(out) if a == "OUT" else a for a in base] + list(extra)
    whole = tmp_path / "whole"
    model = prune.main(args(whole))
    exported_logits_match(model, whole)
    reference = json.loads((whole / "model" / "pruning.json").read_text())
    assert reference["kept_layers"] == list(range(6)) and reference["experts"] == "4 -> 2"
    # --plan from the config alone: the parameters the export holds, a token's FLOPs unchanged
    from scale.plan import flops_per_token
    capsys.readouterr()
    prune.main(args(tmp_path / "plan", "--plan", "1"))
    planned = json.loads(capsys.readouterr().out.splitlines()[-1])
    exported = AutoModelForCausalLM.from_pretrained(whole / "model")
    assert planned["params_exported"] == sum(p.numel() for p in exported.parameters())
    assert planned["params"] == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(
        saved("qwen2_moe")).parameters()) > planned["params_exported"]
    # the routed experts' FLOPs unchanged (2 of 4 or 2 of 2); the 3 routers' 6 x 4 x 32 -> 6 x 2 x 32
    source = AutoModelForCausalLM.from_pretrained(saved("qwen2_moe"))
    assert flops_per_token(source, 32) - flops_per_token(exported, 32) == 3 * 6 * 2 * 32
    # the run's model itself was cut: the exported shapes, nothing of the removed experts left
    assert {k: v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in exported.state_dict().items()}
    for until in ("3", "cut"):
        out = tmp_path / until
        prune.main(args(out, "--until", until))
        prune.main(args(out, "--resume"))
        got = json.loads((out / "model" / "pruning.json").read_text())
        assert got["kept_experts"] == reference["kept_experts"]
        assert got["final_scores"] == reference["final_scores"]
        a, b = weights(whole), weights(out)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5, msg=key)
        assert events(out, "expert_search")[-1] == events(whole, "expert_search")[-1]


def planned_kl(path, corpus, tmp_path, capsys, ranks):  # noqa: F811
    """prune.py --plan RANKS --experts-keep 2 (--expert-init kl) over 2 calibration sequences of 32
    tokens: its JSON line, and its line on the expert KL importance."""
    import prune
    prune.main(tiny_args(path, corpus, tmp_path / f"plan{ranks}", "--experts-keep", "2", "--n-calib", "2",
                         "--plan", str(ranks)))
    out = capsys.readouterr().out.splitlines()
    return json.loads(out[-1]), next(line for line in out if line.startswith("plan: --expert-init kl"))


def counted_kl(model):
    """kl_expert_importance on 2 sequences of 32 tokens: (scores, the decoder layers whose attention
    really ran, in order (a replayed prefix runs none), the head's calls)."""
    from experts.importance import kl_expert_importance
    ran, heads = [], []
    for i, layer in enumerate(decoder_layers(model)):
        layer.self_attn.register_forward_hook(lambda *a, i=i: ran.append(i))
    model.get_output_embeddings().register_forward_hook(lambda *a: heads.append(1))
    seqs = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    scores, _ = kl_expert_importance(model, [(seqs[i:i + 1], None) for i in range(2)], VOCAB)
    return scores, ran, len(heads)


def test_plan_counts_what_the_expert_kl_importance_runs(saved, corpus, tmp_path, capsys):  # noqa: F811
    """--plan 1's cost of --expert-init kl against the pass itself, on qwen2_moe (6 layers, MoE at 1,
    3 and 5 with a shared expert, dense MLPs between; E = 4): the layer calls, the head's calls, the
    FLOPs those calls make."""
    from scale.plan import flops_per_token
    planned, line = planned_kl(saved("qwen2_moe"), corpus, tmp_path, capsys, 1)
    assert line.startswith("plan: --expert-init kl scores each expert exactly: 13 forwards")
    model = AutoModelForCausalLM.from_pretrained(saved("qwen2_moe"))
    _, ran, heads = counted_kl(model)
    # a sequence: the dense pass (6 layers), then 4 experts x (6 - l) for l = 1, 3, 5: 6 + 4 x 9 = 42
    assert len(ran) == 2 * 42 == 2 * planned["expert_importance_layer_calls"]
    assert heads == 2 * 13 == 2 * planned["expert_importance_forwards"]
    f = [flops_per_token(model, 32, n, train=False) for n in (1, 2)]  # linear in the layers: a + b n
    per_layer, head = f[1] - f[0], 2 * f[0] - f[1]
    assert planned["expert_importance_flops"] == pytest.approx(32 * (len(ran) * per_layer + heads * head))


KL_UNDER_FSDP = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
sys.path.insert(0, sys.argv[2] + "/tests")
import runtime, scale.fsdp
from surgery import decoder_layers
from test_expert_search import counted_kl
import torch
rank, world, device = runtime.init_distributed()
model = scale.fsdp.parallelize(runtime.load_model(sys.argv[1], weights=rank == 0)[0], device)
received, gather = [0], torch.distributed.all_gather_into_tensor  # every gather, FSDP's and the head's
def counted(out, inp, *a, **k):
    if out.is_floating_point():  # weights (fp32 on CPU ranks); the ids' gathers are int64
        received[0] += out.numel() * out.element_size() * (world - 1) // world
    return gather(out, inp, *a, **k)
torch.distributed.all_gather_into_tensor = counted
scores, ran, heads = counted_kl(model)
json.dump({"scores": scores.tolist(), "ran": ran, "heads": heads, "received": received[0]},
          open(f"{sys.argv[3]}/rank{rank}.json", "w"))
"""


def test_expert_kl_importance_shares_the_experts_among_fsdp_ranks(saved, corpus, tmp_path, capsys):  # noqa: F811
    """3 gloo ranks under FSDP2, E = 4: each rank masks its own experts (rank 2 has one, then runs
    the dense model in the second round), the scores those of one process; each rank's layer calls
    and forwards (6 + 2 x 9 and 1 + 2 x 3 a sequence) what --plan 3 states, and the weight bytes it
    received in all-gathers (fp32 here) twice the plan's bf16 figure, within the shards' padding."""
    import os
    import subprocess
    import sys
    from conftest import free_port, torchrun_failure
    path = saved("qwen2_moe")
    one, _, _ = counted_kl(AutoModelForCausalLM.from_pretrained(path))
    script = tmp_path / "kl.py"
    script.write_text(KL_UNDER_FSDP)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port",
                           free_port(), str(script), path, str(root), str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, torchrun_failure(proc.stdout, proc.stderr)
    planned, _ = planned_kl(path, corpus, tmp_path, capsys, 3)
    model = AutoModelForCausalLM.from_pretrained(path)
    weights = [*decoder_layers(model).parameters(), model.get_output_embeddings().weight]
    norm = list(model.model.norm.parameters())

    def padded(params):
        return sum(-(-p.shape[0] // 3) * 3 * p[0].numel() for p in params)
    for r in range(3):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        torch.testing.assert_close(torch.tensor(got["scores"], dtype=torch.float64), one, rtol=1e-5, atol=1e-9)
        assert len(got["ran"]) == 2 * 24 == 2 * planned["expert_importance_layer_calls"]
        assert got["heads"] == 2 * 7 == 2 * planned["expert_importance_forwards"]
        # a forward gathers every decoder layer (the replayed ones too: FSDP2's hooks run on their
        # call), the head's rows and the root's final norm, each parameter padded by FSDP to a
        # multiple of 3 rows; received: 2 / 3 of it, fp32 here, bf16 in the plan
        assert got["received"] == pytest.approx(2 * 7 * (padded(weights) + padded(norm)) * 4 * 2 / 3, rel=1e-4)
        assert planned["expert_importance_gathered_bytes"] == pytest.approx(
            2 * 7 * sum(p.numel() for p in weights) * 2 * 2 / 3, rel=1e-6)


@pytest.mark.parametrize("extra, words", [
    (["--experts-keep", "1"], ["--experts-keep must be between 2", "got 1"]),
    (["--experts-keep", "4"], ["--experts-keep must be between 2", "and 3", "got 4"]),
    (["--experts-keep", "2", "--search", "evo"], ["--search gumbel or none"]),
    (["--experts-keep", "2", "--expert-init", "bogus"], ["--expert-init must be one of", "bogus"]),
    (["--experts-keep", "2", "--guard", "2", "--search-data", "X"], ["--guard", "--experts-keep"]),
])
def test_expert_misuse_is_one_line_before_any_work(extra, words, saved, corpus, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    one_line_error(tiny_args(saved("qwen3_moe"), corpus, out, *extra), capsys, *words)
    assert not out.exists()


def test_deepseek_groups_stay_whole(tmp_path):
    """DeepSeek-V3 with 8 experts in 2 groups (the top-2 among the 4 experts of the best group): the
    search draws and keeps whole groups' shares, and a cut of 2 per group, n_group kept, computes
    what the masked model computes."""
    import argparse

    from experts.search import ExpertSearch
    from prune import GumbelTopKSearch
    config = dict(CONFIGS["deepseek_v3"][1], n_routed_experts=8, n_group=2, topk_group=1)
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("deepseek_v3", vocab_size=VOCAB, max_position_embeddings=64,
                               initializer_range=0.2, num_hidden_layers=4, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-1, 1, 8))
    args = argparse.Namespace(experts_keep=4, keep=4, search_steps=4, seed=0, score_lr=0.1, beta=0.9,
                              masks_per_step=1, score_lr_schedule="constant", expert_init="random",
                              expert_score_scale=1.0, expert_domains="pooled",
                              expert_merge=False)
    search = ExpertSearch(GumbelTopKSearch(torch.zeros(4), args, 4, 8, [], "cpu"), model, args, VOCAB,
                          lambda: [], lambda **e: None)
    search.prepare(model, None, None, None)
    for t in (1, 4):
        search.begin_step(t)
        search.sample_mask(0)
        per_group = search.gates.mask.view(2, 2, 4).sum(-1)  # rows (layers 2, 3) x groups
        assert torch.equal(per_group, torch.full((2, 2), 3.0 if t == 1 else 2.0))
    sets = [[0, 3, 5, 6], [1, 2, 4, 7]]  # 2 of each group of 4
    search.gates.hard = torch.zeros(2, 8).scatter_(1, torch.tensor(sets), 1.0)
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        masked = model(x).logits
        search.gates.remove()
        dense = model(x).logits
        cut = remove_experts(model, {2: sets[0], 3: sets[1]})
        assert (cut.config.n_routed_experts, cut.config.n_group, cut.config.topk_group) == (4, 2, 1)
        torch.testing.assert_close(cut(x).logits, masked, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(masked, dense, atol=1e-4)


def test_a_dense_model_and_uneven_groups_are_refused(saved, corpus, tmp_path, capsys):  # noqa: F811
    one_line_error(tiny_args(saved("llama"), corpus, tmp_path / "a", "--experts-keep", "2"), capsys,
                   "--experts-keep prunes routed experts", "llama")
    from experts.search import check_args
    config = tiny("deepseek_v3").config
    config.n_routed_experts, config.n_group, config.topk_group = 8, 2, 1
    args = type("Args", (), dict(experts_keep=3, search="gumbel", expert_init="kl", guard=None,
                                 expert_domains="pooled", expert_merge=False, calib_data=None,
                                 plan=None))()
    with pytest.raises(E3Error, match="route in 2 groups"):
        check_args(args, config)
    args.experts_keep = 4
    check_args(args, config)


# the default run: one trained method alone (a queue of one run, none of the one-shot ones); -m slow:
# every method, both fractions, the layers' arm
MOE_METHODS = [pytest.param("x-random-50", id="one"), pytest.param("", id="all", marks=pytest.mark.slow)]


@pytest.mark.parametrize("methods", MOE_METHODS)
def test_moe_compare_at_tiny_size(methods, tokenizer, tmp_path):
    """experiments/moe_compare.sh whole at toy size (TINY=1: a random Qwen3-MoE of 4 layers and 8
    experts in place of the trained one, 4 steps): the experts kept are 3E/4 and E/2 of the model's
    own count, the layers' arm keeps half the layers, each run scored on the three held-out texts
    and recorded, the one-shot runs untrained."""
    import os
    import subprocess
    from transformers import Qwen3MoeConfig
    model_dir = tmp_path / "moe"
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=True,
                            max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    env = {**os.environ, "TINY": "1", "OMP_NUM_THREADS": "1", "JOBS": "2", "SEEDS": "0", "MODEL": str(model_dir),
           "RUNS": str(tmp_path / "runs"), "RESULTS": str(tmp_path / "results"),
           "DOMAINS": str(tmp_path / "domains"), "METHODS": methods,
           "E3_TEACHER_CACHE": str(tmp_path / "teacher")}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", "experiments/moe_compare.sh"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expect = (methods or "x-e3-50 x-kl-50 x-reap-50 x-frequency-50 x-random-50 l-kl-50 x-e3-25 x-kl-25 "
              "x-reap-25 x-frequency-25 x-random-25 x-reap-oneshot-50 x-reap-oneshot-25").split()
    assert {p.stem for p in (tmp_path / "results").glob("*.json")} == {f"{m}-s0" for m in expect}
    assert {p.name for p in (tmp_path / "runs" / "claims").iterdir()} == {f"{m}-s0" for m in expect}
    for m in expect:
        r = json.loads((tmp_path / "results" / f"{m}-s0.json").read_text())
        assert set(r["corpora"]) == {"shakespeare", "python-docs", "torch-code"}
        assert r["flags"]["targets"] == "hybrid" and r["step"] == (0 if "oneshot" in m else 4)
        if m.startswith("l-"):
            assert len(r["kept_layers"]) == 2 and not r.get("experts")
        else:
            n = 6 if m.endswith("25") else 4
            assert r["experts"] == f"8 -> {n}" and len(r["kept_layers"]) == 4
            assert all(len(kept) == n for kept in r["kept_experts"].values())
    assert ("random experts + AKD, 50%" if methods else "REAP one-shot, no training") in done.stdout


@pytest.mark.parametrize("search", ["gumbel", "none"])
def test_the_cut_frees_the_removed_experts_and_their_adam_state(search, saved, corpus, tmp_path, monkeypatch):  # noqa: F811
    """--keep 4 --experts-keep 2 on Qwen2-MoE (a shared expert beside the routed ones): from the cut
    on, every tensor of 4 experts (the routed weights, the router) and every tensor of a removed
    layer is referenced by nothing (weak references die), and the weights, gradients and AdamW state
    the fine-tune holds are those of the model built by plain transformers with 2 experts and the 4
    kept layers (its parameters counted here, the moments 2 a weight); the gumbel search first runs
    at 4 experts. Fails where the cut masks the experts and the export alone slices them."""
    import gc
    import weakref

    import prune
    from surgery import pruned_config
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    seen = {}
    found = prune.prune_to_top_k

    def cut(model, opt, search_, args):  # every tensor of the unpruned model, weakly, at the cut
        seen["before"] = [weakref.ref(p) for p in model.parameters()]
        seen["moments"] = {n: {k: v.clone() for k, v in opt.state[p].items()}
                           for n, p in model.named_parameters() if p in opt.state}
        seen["shared"] = {n: weakref.ref(p) for n, p in model.named_parameters() if "shared_expert" in n}
        kept, new = found(model, opt, search_, args)
        seen["model"], seen["opt"] = model, new
        seen["after"] = {n: {k: v.clone() for k, v in new.state[p].items()}
                         for n, p in model.named_parameters() if p in new.state}
        return kept, new
    monkeypatch.setattr(prune, "prune_to_top_k", cut)
    steps = []
    step = prune.train_step

    def counted(model, opt, *a, **k):  # the state the fine-tune's steps hold, after each one
        out = step(model, opt, *a, **k)
        gc.collect()
        steps.append(sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim()))
        return out
    monkeypatch.setattr(prune, "train_step", counted)
    out = tmp_path / "run"
    prune.main(tiny_args(saved("qwen2_moe"), corpus, out, "--experts-keep", "2", "--search", search,
                         "--steps", "6", "--n-calib", "2"))
    model, opt = seen["model"], seen["opt"]
    gc.collect()
    alive = {id(r()) for r in seen["before"] if r() is not None}
    assert alive <= {id(p) for p in model.parameters()}  # nothing of the cut is left alive
    assert all(p.shape[0] == 2 for p in model.parameters() if id(p) not in alive)  # the experts' new
    kept = json.loads((out / "model" / "pruning.json").read_text())["kept_layers"]
    config = pruned_config(copy.deepcopy(AutoModelForCausalLM.from_pretrained(saved("qwen2_moe")).config), kept)
    config.num_experts = 2
    reference = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert sum(p.numel() for p in model.parameters()) == reference
    assert steps[-1] == 2 * reference  # exp_avg and exp_avg_sq of every weight the fine-tune trains
    # the moments carried: a kept expert's rows are its own, the rest the same tensors (Adam's state
    # at the cut: none before a step (--search none), else the search's)
    info = json.loads((out / "model" / "pruning.json").read_text())
    layer_of = {str(new): str(old) for new, old in enumerate(kept)}
    for name, state in seen["after"].items():
        old_name = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{layer_of[m.group(1)]}.", name)
        before = seen["moments"][old_name]
        for k, v in state.items():
            if v.dim() and v.shape != before[k].shape:  # a per-expert tensor: the kept experts' rows
                v0 = before[k].index_select(0, torch.tensor(info["kept_experts"][layer_of[name.split(".")[2]]]))
                torch.testing.assert_close(v, v0, rtol=0, atol=0)
            else:
                torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert len(seen["after"]) == (len(seen["moments"]) and sum(p.requires_grad for p in model.parameters()))
    now = dict(model.named_parameters())  # the shared expert: the same objects, renumbered
    assert all(p() is now[re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{kept.index(int(m.group(1)))}.", n)]
               for n, p in seen["shared"].items() if int(n.split(".")[2]) in kept)
    assert sum(p.grad is not None for p in model.parameters()) == 0 or all(
        p.grad.shape == p.shape for p in model.parameters() if p.grad is not None)


def without_keep(argv):
    i = argv.index("--keep")
    return argv[:i] + argv[i + 2:]


def test_experts_keep_0_alone_blames_experts_keep(saved, corpus, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    one_line_error(without_keep(tiny_args(saved("qwen3_moe"), corpus, out, "--experts-keep", "0")), capsys,
                   "--experts-keep must be between 2", "got 0")
    assert not out.exists()


@pytest.mark.parametrize("model_type, settings", [
    ("jamba", dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                   attn_layer_period=2, attn_layer_offset=1)),
    ("minimax", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("beam", dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1))])
def test_experts_alone_are_no_layer_cut(model_type, settings):
    """--experts-keep without --keep removes no layer: the layer cut's check (a layout the config
    cannot express after a removal) is not asked, where Jamba's periods, MiniMax's and Beam's layer
    lists would refuse a removal; a removal (--keep 3 of 4) is still checked."""
    from transformers import AutoConfig

    import prune
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=32,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  **settings)
    args = prune.parse_args(["--model", "m", "--experts-keep", "2", "--search", "none", "--steps", "2",
                             "--batch-size", "1"])
    prune.resolve_args(args, 1)
    assert prune.check_args(args, config, 4, 1) is not None and args.keep == 4


def test_a_run_saved_before_the_expert_flags_resumes(saved, corpus, tmp_path, monkeypatch):  # noqa: F811
    """A run folder whose run.json predates a flag (experts_keep, expert_init, expert_score_scale
    missing) resumes: a missing key is the flag's default; a flag given otherwise is refused."""
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    out = tmp_path / "run"
    argv = tiny_args(saved("llama"), corpus, out, "--steps", "4", "--ckpt-every", "2")
    prune.main(argv + ["--until", "2"])
    stored = json.loads((out / "run.json").read_text())
    for key in ("experts_keep", "expert_init", "expert_score_scale"):
        stored.pop(key, None)
    (out / "run.json").write_text(json.dumps(stored))
    with pytest.raises(E3Error, match="expert_score_scale: 1.0 -> 2.0"):
        prune.main(argv + ["--resume", "--expert-score-scale", "2"])
    prune.main(argv + ["--resume"])
    assert json.loads((out / "model" / "pruning.json").read_text())["step"] == 4


def test_expert_score_scale_scales_the_experts_and_score_scale_the_layers(saved, corpus, tmp_path, monkeypatch):  # noqa: F811
    """--score-scale c: the layers' S_0 = c x their KL; the experts' S^e_0 unchanged. --expert-score-scale
    c: S^e_0 = c log(s / max_j s), from the logged expert importance s (float64 here)."""
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")

    def initial(out, *extra):
        prune.main(tiny_args(saved("qwen2_moe"), corpus, out, "--experts-keep", "2", "--steps", "2",
                             "--search", "none", *extra))
        info = json.loads((out / "model" / "pruning.json").read_text())
        s = torch.tensor(events(out, "expert_importance")[0]["scores"], dtype=torch.float64)
        return torch.tensor(info["initial_scores"]), torch.tensor(info["initial_expert_scores"]), s
    layers, experts, s = initial(tmp_path / "a")
    ratio = torch.log((s / s.amax(-1, keepdim=True)).clamp_min(1e-6))
    torch.testing.assert_close(experts.double(), ratio, rtol=1e-6, atol=1e-6)
    layers3, experts3, _ = initial(tmp_path / "b", "--score-scale", "3")
    torch.testing.assert_close(layers3, 3 * layers) and torch.testing.assert_close(experts3, experts)
    _, experts2, _ = initial(tmp_path / "c", "--expert-score-scale", "2")
    torch.testing.assert_close(experts2.double(), 2 * ratio, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_the_cut_under_fsdp_is_one_process_and_resumes_on_any_ranks(saved, corpus, tmp_path, monkeypatch):  # noqa: F811
    """--keep 4 --experts-keep 2 on Qwen2-MoE (a shared expert, a dense layer every other): 2 gloo
    ranks under FSDP2, whose cut rebuilds each MoE layer's unit at 2 experts (gathered, cut, sharded
    again) and carries its AdamW moments, == one process: every step's loss within 1e-5, the kept
    sets, the exported weights; stopped at the cut (a checkpoint of the cut's shapes) and resumed on
    2 ranks from one process's checkpoint and on 1 from 2 ranks' == the uninterrupted run."""
    from test_prune import run
    base = lambda out, *extra: tiny_args(saved("qwen2_moe"), corpus, out, "--experts-keep", "2", *extra)  # noqa: E731
    one, two = tmp_path / "one", tmp_path / "two"
    run_here(base(one), tmp_path, monkeypatch)
    run(base(two), tmp_path, nproc=2)
    losses = [[e["loss"] for e in events(o, "train")] for o in (one, two)]
    assert len(losses[0]) == 8 and max(abs(a - b) for a, b in zip(*losses)) < 1e-5, losses
    infos = [json.loads((o / "model" / "pruning.json").read_text()) for o in (one, two)]
    assert infos[0]["kept_experts"] == infos[1]["kept_experts"] and infos[0]["kept_layers"] == infos[1]["kept_layers"]
    reference = weights(one)
    for out, first, then in ((tmp_path / "a", 1, 2), (tmp_path / "b", 2, 1)):
        if first == 1:
            run_here(base(out, "--until", "cut"), tmp_path, monkeypatch)
        else:
            run(base(out, "--until", "cut"), tmp_path, nproc=2)
        if then == 1:
            run_here(base(out, "--resume"), tmp_path, monkeypatch)
        else:
            run(base(out, "--resume"), tmp_path, nproc=2)
        got = weights(out)
        assert got.keys() == reference.keys()
        for key in got:
            torch.testing.assert_close(got[key], reference[key], rtol=0, atol=1e-4, msg=key)
        assert [e["loss"] for e in events(out, "train")][-1] == pytest.approx(losses[0][-1], abs=1e-5)
