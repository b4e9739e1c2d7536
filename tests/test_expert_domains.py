"""Which experts for every served text (issue 67): the expert importance of each domain of a
--calib-data mixture apart, combined by the largest share (max) or by the set whose worst domain
loses the least share (minimax: enumerated, or greedy past MINIMAX_SETS), against sums and
enumerations written out here in float64; merging the dropped experts into the kept ones against the
weighted means recomputed from the source model; prune.py end to end with each; the refusals."""
import itertools
import json
from pathlib import Path

import pytest
import torch

from experts import importance
from runtime import E3Error
from test_architectures import saved  # noqa: F401  (a fixture)
from test_prune import corpus, events, run_here, tiny_args  # noqa: F401  (corpus: a fixture)


@pytest.fixture
def given(monkeypatch):
    """An importance that returns the batches it is given as its scores: each domain's by hand."""
    monkeypatch.setitem(importance.EXPERT_IMPORTANCE, "given",
                        lambda model, batches, vocab, generator: (batches, [1, 3]))
    return "given"


def shares(rows):  # each layer's row of a domain divided by its sum, in Python floats
    return [[x / sum(row) for x in row] for row in rows]


def test_max_is_each_experts_largest_share_over_the_domains(given):
    a = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    b = torch.tensor([[0.1, 0.1, 0.1, 9.7], [2.0, 0.0, 0.0, 2.0]], dtype=torch.float64)
    got, layers = importance.domain_scores(given, None, {"a": a, "b": b}, None, "max", 2)
    want = [[max(x, y) for x, y in zip(ra, rb)] for ra, rb in zip(shares(a.tolist()), shares(b.tolist()))]
    assert layers == [1, 3]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)
    # pooled scoring (their sum) drops domain b's one expert in layer 0; max keeps it
    assert set((a + b)[0].topk(2).indices.tolist()) == {0, 3}
    assert 3 in got[0].topk(2).indices.tolist()


def worst_removed(rows_by_domain, layer, kept):
    """The largest share of any domain's importance that the experts outside `kept` hold."""
    return max(sum(s for e, s in enumerate(rows[layer]) if e not in kept) for rows in rows_by_domain)


def test_minimax_keeps_what_the_worst_domain_needs(monkeypatch):
    """Two domains whose experts split: prose relies on 0-3, code on 4-7, each with one expert that
    both use, prose's scores ten times code's (its KL larger in nats). Keeping 4 of 8: the pooled top
    4 (the sum) gives code's experts away; the minimax set's worst removed share equals the best of
    all C(8, 4) sets', enumerated here; the greedy choice beats the pooled set too."""
    prose = [[300, 200, 150, 100, 10, 10, 10, 220]]
    code = [[1, 1, 1, 20, 30, 20, 12, 15]]
    importance.EXPERT_IMPORTANCE["given2"] = lambda model, batches, vocab, generator: (batches, [0])
    try:
        doms = {"prose": torch.tensor(prose, dtype=torch.float64), "code": torch.tensor(code, dtype=torch.float64)}
        got, _ = importance.domain_scores("given2", None, doms, None, "minimax", 4)
    finally:
        del importance.EXPERT_IMPORTANCE["given2"]
    kept = set(got[0].topk(4).indices.tolist())
    by = [shares(prose), shares(code)]
    best = min(worst_removed(by, 0, set(s)) for s in itertools.combinations(range(8), 4))
    assert worst_removed(by, 0, kept) == pytest.approx(best, abs=1e-12)
    pooled = set(torch.tensor([[p + c for p, c in zip(prose[0], code[0])]]).topk(4).indices[0].tolist())
    assert worst_removed(by, 0, pooled) > best + 0.3  # the pooled set leaves code far behind
    assert sum(x >= 1 for x in got[0].tolist()) == 4  # the set's scores above every other's
    # the greedy choice (past MINIMAX_SETS): never worse here than the pooled set
    monkeypatch.setattr(importance, "MINIMAX_SETS", 0)
    greedy, cost = importance.minimax_set(torch.tensor([shares(prose)[0], shares(code)[0]], dtype=torch.float64), 4)
    assert cost == pytest.approx(worst_removed(by, 0, set(greedy)), abs=1e-12)
    assert cost < worst_removed(by, 0, pooled) - 0.3


def test_minimax_keeps_each_groups_share(given):
    """DeepSeek's n_group: each group of E / G experts keeps n / G, chosen within the group."""
    torch.manual_seed(0)
    a, b = torch.rand(2, 8, dtype=torch.float64), torch.rand(2, 8, dtype=torch.float64)
    got, _ = importance.domain_scores(given, None, {"a": a, "b": b}, None, "minimax", 4, groups=2)
    sa, sb = shares(a.tolist()), shares(b.tolist())
    for m, row in enumerate(got):
        for g in range(2):
            kept = [e for e in range(4 * g, 4 * g + 4) if row[e] >= 1]
            assert len(kept) == 2  # the group's share
            cost = lambda s: max(sum(x[m][e] for e in range(4 * g, 4 * g + 4) if e not in s) for x in (sa, sb))  # noqa: E731
            assert cost(kept) == pytest.approx(min(cost(s) for s in itertools.combinations(
                range(4 * g, 4 * g + 4), 2)), abs=1e-12)


def two_domains(corpus, tmp_path):
    """The play split in two files: two 'domains' for --calib-data."""
    text = Path(corpus).read_text()
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(text[:30_000])
    b.write_text(text[30_000:])
    return f"{a}:1,{b}:1"


@pytest.mark.parametrize("how", ["max", "minimax"])
def test_prune_py_scores_each_domain_apart(how, saved, corpus, tmp_path, monkeypatch):  # noqa: F811
    """--expert-domains: each domain's REAP scores logged apart (over its own calibration sequences),
    the set kept one-shot = the combination of those rows computed here in float64."""
    out = tmp_path / "run"
    argv = tiny_args(saved("qwen2_moe"), corpus, out, "--experts-keep", "2", "--expert-init", "reap",
                     "--search", "none", "--expert-domains", how, "--calib-data", two_domains(corpus, tmp_path))
    i = argv.index("--keep")
    run_here(argv[:i] + argv[i + 2:], tmp_path, monkeypatch)
    per = [e for e in events(out, "expert_importance") if "domain" in e]
    assert [Path(e["domain"]).name for e in per] == ["a.txt", "b.txt"]
    rows = [shares(e["scores"]) for e in per]
    kept = json.loads((out / "model" / "pruning.json").read_text())["kept_experts"]
    for m, layer in enumerate(per[0]["layers"]):
        if how == "max":
            combined = [max(x, y) for x, y in zip(rows[0][m], rows[1][m])]
            want = sorted(sorted(range(4), key=lambda e: -combined[e])[:2])
            assert kept[str(layer)] == want
        else:
            best = min(worst_removed(rows, m, set(s)) for s in itertools.combinations(range(4), 2))
            assert worst_removed(rows, m, set(kept[str(layer)])) == pytest.approx(best, abs=1e-12)


def test_expert_domains_need_a_calibration_mixture(saved, corpus, tmp_path, monkeypatch):  # noqa: F811
    """One line before any work: without a --calib-data mixture there are no domains to score apart;
    with one whose weights leave a domain none of the --n-calib sequences, that domain unscored."""
    out = tmp_path / "run"
    with pytest.raises(E3Error, match="--calib-data as a mixture"):
        run_here(tiny_args(saved("qwen2_moe"), corpus, out, "--experts-keep", "2", "--expert-domains", "max"),
                 tmp_path, monkeypatch)
    mix = two_domains(corpus, tmp_path).replace(":1,", ":0.05,")  # 4 sequences: a gets 0
    with pytest.raises(E3Error, match="no sequence at its weight"):
        run_here(tiny_args(saved("qwen2_moe"), corpus, out, "--experts-keep", "2", "--expert-domains", "max",
                           "--calib-data", mix), tmp_path, monkeypatch)
    assert not out.exists() and not (tmp_path / "teacher").exists()


def test_prune_py_merges_each_dropped_expert_into_its_most_alike_kept(saved, corpus, tmp_path, monkeypatch):  # noqa: F811
    """--expert-merge, one-shot: each kept expert of the export = the routing-share-weighted mean of
    itself and the dropped experts whose router logits are most like its own (cosine over the
    calibration tokens), all recomputed here in float64 from the source model: the router's input
    captured at the MoE block, the logits x W^T, the top-k counted; the router's rows sliced only."""
    import prune
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    argv = tiny_args(saved("qwen3_moe"), corpus, out, "--experts-keep", "2", "--expert-init", "reap",
                     "--search", "none", "--steps", "0", "--expert-merge")
    i = argv.index("--keep")
    argv = argv[:i] + argv[i + 2:]
    run_here(argv, tmp_path, monkeypatch)
    kept = json.loads((out / "model" / "pruning.json").read_text())["kept_experts"]
    args = prune.parse_args(argv)
    prune.resolve_args(args, 1)
    from transformers import AutoTokenizer
    batches = prune.calibration_batches(args, AutoTokenizer.from_pretrained(args.model), None)
    source = AutoModelForCausalLM.from_pretrained(args.model).eval()
    exported = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    k = source.config.num_experts_per_tok
    seen = {}
    hooks = [layer.mlp.register_forward_hook(lambda mod, inp, o, i=i: seen.setdefault(i, []).append(inp[0]))
             for i, layer in enumerate(source.model.layers) if str(i) in kept]
    with torch.no_grad():
        for ids, _ in batches:
            source(input_ids=ids)
    for h in hooks:
        h.remove()
    assert sorted(seen) == sorted(int(l) for l in kept) and seen
    for l, xs in seen.items():
        mlp, keep = source.model.layers[l].mlp, kept[str(l)]
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).double()
        z = x @ mlp.gate.weight.double().T  # [tokens, E]
        top = z.topk(k, dim=-1).indices
        f = [(top == j).any(-1).double().mean().item() for j in range(4)]
        cos = [[(z[:, a] @ z[:, b] / (z[:, a].norm() * z[:, b].norm())).item() for b in range(4)] for a in range(4)]
        into = {d: max(keep, key=lambda c: (cos[d][c], -c)) for d in range(4) if d not in keep}
        for r, c in enumerate(keep):
            members = [c] + [d for d, t in into.items() if t == c]
            w = [f[j] / sum(f[j] for j in members) for j in members]
            for name in ("gate_up_proj", "down_proj"):
                src = getattr(mlp.experts, name).double()
                want = sum(wj * src[j] for wj, j in zip(w, members))
                got = getattr(exported.model.layers[l].mlp.experts, name)[r].double()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"layer {l} {name} {c}")
        torch.testing.assert_close(exported.model.layers[l].mlp.gate.weight, mlp.gate.weight[keep])
        if len(into) and any(len([d for d, t in into.items() if t == c]) for c in keep):
            assert not torch.equal(exported.model.layers[l].mlp.experts.down_proj, mlp.experts.down_proj[keep])


def test_expert_merge_refused_under_torchrun_and_in_a_plan_for_ranks(saved, monkeypatch):  # noqa: F811
    """One line before any work: under torchrun (even one rank: FSDP2 shards the rows), or --plan 8."""
    import prune
    from transformers import AutoConfig

    from experts.search import check_args
    config = AutoConfig.from_pretrained(saved("qwen3_moe"))
    args = prune.parse_args(["--model", saved("qwen3_moe"), "--experts-keep", "2", "--expert-merge"])
    prune.resolve_args(args, 1)
    check_args(args, config)  # one process: merged
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(E3Error, match="one process"):
        check_args(args, config)
    monkeypatch.delenv("RANK")
    args.plan = 8
    with pytest.raises(E3Error, match="one process"):
        check_args(args, config)
