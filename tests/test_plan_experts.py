"""prune.py --plan with --experts-keep N counts each phase at its size (scale.plan.phases): the search's
T_M steps at E experts and all L layers, the fine-tune after the cut at N experts and k layers (prune.py
removes the dropped experts and layers there: their weights, gradients and AdamW moments go); with
--search none the whole run at N and k. The references are independent of the code under test: the
fine-tune's model is built here by plain transformers from an edited config (the expert count set to
N, the layer count to k: every layer of this config is alike) on the meta device and its parameters
counted here; the search phase is the plan of the same run without --experts-keep. The configs are
written as dicts: nothing downloads, no tokenizer (a plan reads config.json alone)."""
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import prune
from scale import plan as P

# a Qwen3-MoE of 16 layers, 128 experts (top-8) a layer: ~10B parameters, 2B at 32 experts and 12 layers
MOE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
           head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
           num_experts_per_tok=8, vocab_size=32000, tie_word_embeddings=False, mlp_only_layers=[],
           decoder_sparse_step=1)
L, K, E, N, RANKS = 16, 12, 128, 32, 8
T, T_M = 1200, 120  # the paper's schedule, prune.py's defaults
KINDS = ("H100", "H200", "A100")


def write(folder, **changes):
    folder.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model("qwen3_moe", **{**MOE, **changes}).save_pretrained(folder)
    return folder


def reference(**changes):
    """The model of MOE with `changes`, built here by plain transformers on the meta device."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **{**MOE, **changes}))


def params(model):
    return sum(p.numel() for p in model.parameters())


def planned(folder, capsys, *flags):
    """prune.py --plan RANKS in this process: (its lines, its JSON: the last line)."""
    capsys.readouterr()
    prune.main(["--model", str(folder), "--plan", str(RANKS), "--expert-init", "reap", *flags])
    out = capsys.readouterr().out.strip().splitlines()
    return out, json.loads(out[-1])


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The folder of MOE's config.json, written once."""
    return write(tmp_path_factory.mktemp("moe"))


def run(folder, capsys, *flags):
    """--plan 8 --keep 12 and flags (prune.py's defaults: T 1200, seq-len 4096, compiled)."""
    return planned(folder, capsys, "--keep", str(K), *flags)


def test_the_finetune_is_planned_at_n_experts_and_k_layers(plans, capsys):
    """--keep 12 --experts-keep 32: the fine-tune phase's parameters are those of the 32-expert,
    12-layer model transformers builds; its state 16 B a parameter over the ranks; the search phase
    the source's 128 experts and 16 layers; the steps T_M and T - T_M; the run needs the most of the
    phases' fewest ranks, here the search's (it holds 5x the parameters)."""
    lines, s = run(plans, capsys, "--experts-keep", str(N))
    search, finetune = s["phases"]["search"], s["phases"]["finetune"]
    source, cut = params(reference()), params(reference(num_experts=N, num_hidden_layers=K))
    assert source == s["params"] > 4 * cut
    assert (search["steps"], search["layers"], search["experts"], search["params"]) == (T_M, L, E, source)
    assert (finetune["steps"], finetune["layers"], finetune["experts"], finetune["params"]) == (
        T - T_M, K, N, cut)
    assert finetune["trainable"] == cut
    assert finetune["state_gb_per_rank"] == round(16 * cut / RANKS / 1e9, 2)
    assert search["state_gb_per_rank"] == round(16 * source / RANKS / 1e9, 2)
    assert f"{16 * cut / RANKS / 1e9:.3g} GB/rank after the cut ({L} -> {K} layers, {E} -> {N} experts" in (
        "\n".join(lines))
    for kind in KINDS:
        a, b = search["by_kind"][kind], finetune["by_kind"][kind]
        assert a["fits"] and b["fits"] and b["fewest_ranks"] < a["fewest_ranks"], kind
        assert s["fewest_ranks"][kind] == a["fewest_ranks"], kind
        # the run's top-level pick is its largest phase's: the search's
        assert {k: s["by_kind"][kind][k] for k in a if k != "fewest_ranks"} == {
            k: v for k, v in a.items() if k != "fewest_ranks"}, kind
    line = next(x for x in lines if x.startswith("plan: experts"))
    assert "unchanged" not in line and f"the {T - T_M} fine-tune steps train {N}" in line, line


def test_the_search_phase_is_the_plan_without_the_expert_cut(plans, capsys):
    """The search phase of --keep 12 --experts-keep 32 is, field for field, the search phase of
    --keep 12 alone (every expert, every layer, the gates on), and so are the run's top-level picks
    (micro-batch, checkpointing, chunk, bytes a rank) and the activations a token and layer. The
    training FLOPs differ by the routers' rows alone: (E - N) x d multiply-adds a token in each of
    the k MoE layers, over the T - T_M fine-tune steps' tokens (a token visits top-8 experts of E or
    of N alike)."""
    _, experts = run(plans, capsys, "--experts-keep", str(N))
    _, layers = run(plans, capsys)
    assert experts["phases"]["search"] == layers["phases"]["search"]
    for key in ("params", "micro_batch", "activation_checkpointing", "logit_chunk", "gb_per_rank", "fits",
                "activation_bytes", "cache_flops"):
        assert experts[key] == layers[key], key
    timed = ("mfu", "cache_mfu", "peak_flops", "hours", "gpu_hours")
    for kind in KINDS:
        assert {k: v for k, v in experts["by_kind"][kind].items() if k not in timed} == {
            k: v for k, v in layers["by_kind"][kind].items() if k not in timed}, kind
    tokens_after = (T - T_M) * 128 * 4096  # batch 128 x seq-len 4096 a step
    assert layers["train_flops"] - experts["train_flops"] == pytest.approx(
        tokens_after * 6 * K * (E - N) * MOE["hidden_size"], rel=1e-6)
    # the layers alone: the fine-tune at 128 experts and 12 layers
    assert layers["phases"]["finetune"]["params"] == params(reference(num_hidden_layers=K))
    assert layers["phases"]["finetune"]["experts"] == E


def test_search_none_runs_at_n_experts_from_step_0(plans, capsys):
    """--search none cuts at step 0: one phase, the fine-tune, of all T steps at N experts and k
    layers; no phase at E; the run's picks and activations are the cut model's without gates (the
    activations of transformers' own 32-expert, 12-layer model); its plan needs fewer cards."""
    lines, s = run(plans, capsys, "--experts-keep", str(N), "--search", "none")
    _, searched = run(plans, capsys, "--experts-keep", str(N))
    assert list(s["phases"]) == ["finetune"]
    phase = s["phases"]["finetune"]
    cut = reference(num_experts=N, num_hidden_layers=K)
    assert (phase["steps"], phase["layers"], phase["experts"], phase["params"]) == (T, K, N, params(cut))
    assert s["params"] == params(reference())  # the source's, as before
    assert phase["by_kind"] == searched["phases"]["finetune"]["by_kind"]  # the same model and step
    assert s["activation_bytes"] == {
        mode: round(P.activation_bytes(cut, mode, True, True, search=False, seq_len=4096))
        for mode in P.MODES}
    for kind in KINDS:
        assert s["fewest_ranks"][kind] == phase["by_kind"][kind]["fewest_ranks"]
        assert s["fewest_ranks"][kind] < searched["fewest_ranks"][kind], kind
        assert s["by_kind"][kind]["gb_per_rank"] == phase["by_kind"][kind]["gb_per_rank"]
    text = "\n".join(lines)
    assert "the whole run after the cut at step 0" in text and "GB/rank in the search" not in text
    assert "no search: the cut at step 0, all 1200 steps train 32" in text
