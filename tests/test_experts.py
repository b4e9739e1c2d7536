"""Expert importance (experts/) on a tiny random model of every MoE family the project tests (3
layers, 4 experts, routers drawn peaked, DeepSeek-V3's score correction and GPT-OSS's router bias
non-zero), each against a reference written here: the masked model against the model rebuilt by hand
with the expert deleted; REAP and frequency against a per-token loop over the router's own outputs
with the experts computed from the fused weights; the KL against float64 forwards of the models
with the expert deleted, pad positions excluded. The error lines, the log event, the import graph."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from experts.importance import (EXPERT_IMPORTANCE, frequency_importance, kl_expert_importance,
                                reap_importance, score_experts)
from experts.routing import expert_unroutable, moe_layers
from runtime import E3Error, run_main
from surgery import decoder_layers
from test_architectures import CONFIGS, VOCAB, tiny

COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # the configs' expert counts
MOE = [arch for arch, (_, settings) in CONFIGS.items() if any(k in settings for k in COUNT_KEYS)]
LAYERS = 3


def test_every_moe_family_is_here():
    assert sorted(MOE) == sorted(["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2",
                                  "gpt_oss", "llama4_text", "olmoe", "granitemoe"])


def moe_model(arch, dtype=torch.float32):
    """tiny(arch) with routers that choose decisively (logits of sd ~5, few near-ties between
    float32 and float64) and, where the family has one, a score correction and a router bias that
    matter: without -inf there too, a masked DeepSeek-V3 expert would keep its top-k slot."""
    model = tiny(arch, layers=LAYERS, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"\.(gate|router)\.(weight|bias)$", name) and p.shape[0] == 4:
                p.copy_(torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.tensor([0.2, -0.3, 1.5, 0.6]))
    return model


def batches():
    """Two batches: one whose second row ends in 3 pad positions (random ids there too: they are
    routed, and must not count), one without a mask."""
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, VOCAB, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    return [(a, mask), (torch.randint(0, VOCAB, (1, 6), generator=g), None)]


def expert_deleted(model, j):
    """Independent reference: the family's model built from a copy of the config with one expert
    fewer, every weight copied from `model` but expert j's (its router row, its fused weights and
    biases, its score correction: each tensor whose size E became E - 1 loses row j)."""
    config = copy.deepcopy(model.config)
    key = next(k for k in COUNT_KEYS if getattr(config, k, None) == 4)
    setattr(config, key, 3)
    small = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype).eval()
    target = small.state_dict()
    state = {}
    for name, t in model.state_dict().items():
        if t.shape != target[name].shape:
            assert t.shape[0] == 4 and t.shape[1:] == target[name].shape[1:], name
            t = torch.cat([t[:j], t[j + 1:]])
        state[name] = t
    small.load_state_dict(state)
    return small


def with_layer_of(model, other, l, *args, **kwargs):
    """model's logits with its decoder layer l replaced by other's layer l."""
    layers = decoder_layers(model)
    mine = layers[l]
    layers[l] = decoder_layers(other)[l]
    try:
        with torch.no_grad():
            return model(*args, **kwargs).logits
    finally:
        layers[l] = mine


@pytest.mark.parametrize("arch", MOE)
def test_unroutable_expert_is_the_expert_deleted(arch):
    """Masked (expert j unroutable in layer l) == the model whose layer l was built without expert
    j, for every MoE layer and expert; the MoE layers are those holding fused expert weights and the
    experts module holds no shared expert's weight."""
    model, (x, mask) = moe_model(arch), batches()[0]
    moes = moe_layers(model)
    sparse = sorted({int(n.split(".")[2]) for n in model.state_dict() if ".experts." in n})
    assert [m.index for m in moes] == sparse and all(m.E == 4 for m in moes)
    assert not [n for m in moes for n, _ in m.experts.named_parameters() if "shared" in n]
    with torch.no_grad():
        dense = model(x, attention_mask=mask).logits
    changed = 0
    for j in range(4):
        small = expert_deleted(model, j)
        for moe in moes:
            reference = with_layer_of(model, small, moe.index, x, attention_mask=mask)
            with torch.no_grad(), expert_unroutable(moe, j):
                masked = model(x, attention_mask=mask).logits
            torch.testing.assert_close(masked, reference, rtol=1e-5, atol=1e-5)
            changed += not torch.allclose(reference, dense)
    assert changed >= 2  # the comparison can fail: deleting an expert changes the model
    with torch.no_grad():  # and once out of the block the model is itself again
        torch.testing.assert_close(model(x, attention_mask=mask).logits, dense, rtol=0, atol=0)


# -----------------------------------------------------------------------------
# REAP and frequency: a per-token loop

def by_hand(arch, config, experts, j, x):
    """f_j(x) in float64 from the fused weights, each family's expert written out."""
    assert config.hidden_act == "silu"
    W = {n: p.detach().double()[j] for n, p in experts.named_parameters()}
    if arch == "gpt_oss":  # transposed [E, H, 2I], gate and up interleaved, clamped, biases
        h = x @ W["gate_up_proj"] + W["gate_up_proj_bias"]
        gate = h[0::2].clamp(max=config.swiglu_limit)
        up = h[1::2].clamp(-config.swiglu_limit, config.swiglu_limit)
        glu = gate * torch.sigmoid(gate * config.swiglu_alpha)
        return ((up + 1) * glu) @ W["down_proj"] + W["down_proj_bias"]
    if arch == "llama4_text":  # transposed [E, H, 2I]
        gate, up = (x @ W["gate_up_proj"]).chunk(2)
        return (up * F.silu(gate)) @ W["down_proj"]
    gate, up = (W["gate_up_proj"] @ x).chunk(2)  # [E, 2I, H], [E, H, I]
    return W["down_proj"] @ (F.silu(gate) * up)


def per_token_scores(arch, model, data):
    """REAP and frequency, [M, E], from hooks on the routers (named gate / router) recording each
    token's input, chosen experts and gates, and a loop over the valid tokens."""
    k, calls = model.config.num_experts_per_tok, []
    routers = {n: m for n, m in model.named_modules()
               if n.rpartition(".")[2] in ("gate", "router") and getattr(m, "weight", None) is not None
               and m.weight.shape[0] == 4}
    hooks = [m.register_forward_hook(lambda m, a, out, n=n: calls.append((n, a[0], out)))
             for n, m in routers.items()]
    names = sorted(routers, key=lambda n: int(n.split(".")[2]))
    routed = torch.zeros(len(names), 4, dtype=torch.float64)
    weighted, tokens = torch.zeros_like(routed), 0
    for ids, mask in data:
        calls.clear()
        with torch.no_grad():
            model(ids, attention_mask=mask)
        valid = (torch.ones_like(ids) if mask is None else mask).flatten().bool()
        tokens += int(valid.sum())
        for name, x, out in calls:
            x = x.reshape(-1, x.shape[-1]).double()
            if arch == "llama4_text":  # (sigmoid of the top-k logits, -inf elsewhere; the logits)
                scores, logits = out
                idx = logits.topk(k, dim=-1).indices
                gates = scores.gather(1, idx)
            else:  # (logits, the gates applied, the experts chosen)
                _, gates, idx = out
            experts = model.get_submodule(name.rpartition(".")[0]).experts
            m = names.index(name)
            for t in valid.nonzero().flatten().tolist():
                for s in range(k):
                    j = int(idx[t, s])
                    y = by_hand(arch, model.config, experts, j, x[t])
                    routed[m, j] += 1
                    weighted[m, j] += float(gates[t, s]) * float(y.norm())
    for h in hooks:
        h.remove()
    return torch.where(routed > 0, weighted / routed.clamp_min(1), 0.0), routed / tokens


@pytest.mark.parametrize("arch", MOE)
def test_reap_and_frequency_match_a_per_token_loop(arch):
    model, data = moe_model(arch), batches()
    reap, layers = reap_importance(model, data, VOCAB)
    freq, layers_f = frequency_importance(model, data, VOCAB)
    ref_reap, ref_freq = per_token_scores(arch, model, data)
    assert layers == layers_f == [m.index for m in moe_layers(model)]
    assert reap.dtype == freq.dtype == torch.float64 and reap.shape == (len(layers), 4)
    torch.testing.assert_close(freq, ref_freq, rtol=0, atol=1e-12)
    torch.testing.assert_close(reap, ref_reap, rtol=1e-5, atol=1e-7)
    k = model.config.num_experts_per_tok
    torch.testing.assert_close(freq.sum(1), torch.full((len(layers),), float(k), dtype=torch.float64))
    assert (reap > 0).sum() >= len(layers) * 2  # not a table of zeros


# -----------------------------------------------------------------------------
# KL: float64 forwards of the models with an expert deleted

def kl_brute_force(model, data):
    """s_{l,j}: the mean over the valid tokens of KL(p_{-(l,j)} || p), every model a full forward
    in float64 (layer l built without expert j), the experts' eager loop, no prefix reuse."""
    model64 = copy.deepcopy(model).double()
    model64.config._experts_implementation = "eager"  # torch._grouped_mm has no float64
    smalls = [expert_deleted(model64, j) for j in range(4)]
    sparse = sorted({int(n.split(".")[2]) for n in model.state_dict() if ".experts." in n})
    sums, count = torch.zeros(len(sparse), 4, dtype=torch.float64), 0
    for ids, mask in data:
        valid = (torch.ones_like(ids) if mask is None else mask).bool()
        with torch.no_grad():
            logp = torch.log_softmax(model64(ids, attention_mask=mask).logits, -1)
        for m, l in enumerate(sparse):
            for j in range(4):
                logq = torch.log_softmax(with_layer_of(model64, smalls[j], l, ids, attention_mask=mask), -1)
                sums[m, j] += ((logq.exp() * (logq - logp)).sum(-1) * valid).sum()
        count += int(valid.sum())
    return sums / count


@pytest.mark.parametrize("arch", MOE)
def test_kl_importance_is_the_float64_brute_force(arch):
    model, data = moe_model(arch), batches()
    got, layers = kl_expert_importance(model, data, VOCAB)
    assert layers == [m.index for m in moe_layers(model)] and got.dtype == torch.float64
    reference = kl_brute_force(model, data)
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-6)  # fp32 KL: ~1e-7 off
    assert (reference > 1e-4).sum() >= 2  # the experts matter: the comparison can fail
    if arch == "mixtral":  # the KL in chunks of 5 tokens (log p made per chunk)
        torch.testing.assert_close(kl_expert_importance(model, data, VOCAB, chunk=5)[0], got,
                                   rtol=1e-6, atol=1e-9)


# -----------------------------------------------------------------------------
# The registry, the log, the errors, the imports

def test_the_registry_and_the_log(capsys):
    model, data = moe_model("qwen2_moe"), batches()
    assert set(EXPERT_IMPORTANCE) == {"reap", "frequency", "kl", "random"}
    events = []
    model.train()
    scores, layers = score_experts("frequency", model, data, VOCAB, log=lambda **e: events.append(e))
    assert model.training  # the mode it was given back
    assert events == [{"event": "expert_importance", "method": "frequency", "layers": [1],
                       "scores": scores.tolist(), "step": 0}]
    assert capsys.readouterr().out.splitlines() == [
        "expert importance (frequency), layer 1: " + " ".join(f"{s:.3g}" for s in scores[0].tolist())]
    with pytest.raises(E3Error, match="no expert importance 'bogus'"):
        score_experts("bogus", model, data, VOCAB)


def one_line(fn, capsys):
    """fn() under runtime.run_main: the exit status and stderr's lines (one 'error: ' line)."""
    with pytest.raises(SystemExit) as exit_:
        run_main(fn)
    return exit_.value.code, capsys.readouterr().err.splitlines()


def test_families_not_served_get_one_line(capsys):
    data = batches()
    # a router that makes its logits without F.linear: no logit to mask
    model = moe_model("mixtral")
    router = moe_layers(model)[0].router

    def matmul_router(hidden, r=router):
        logits = hidden.reshape(-1, 32) @ r.weight.T
        weights, idx = torch.topk(logits.softmax(-1), 2, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), idx
    router.forward = matmul_router
    code, err = one_line(lambda: kl_expert_importance(model, data, VOCAB), capsys)
    assert code == 2 and len(err) == 1 and re.match(r"error: layer 0: .* cannot make an expert "
                                                     r"unroutable", err[0]), err
    # a dense model; an experts module whose router is not named gate / router
    code, err = one_line(lambda: reap_importance(tiny("llama", layers=2), data), capsys)
    assert code == 2 and err == ["error: LlamaForCausalLM routes no tokens to experts (no decoder layer "
                                 "holds fused 3-D expert weights beside a router): expert importance "
                                 "needs an MoE model"]
    model = moe_model("olmoe")
    block = decoder_layers(model)[0].mlp
    block.chooser = block.gate
    del block.gate
    code, err = one_line(lambda: frequency_importance(model, data), capsys)
    assert code == 2 and len(err) == 1 and "layer 0: 'mlp.experts' holds 4 experts but no router" in err[0]


def test_the_plain_path_never_imports_the_wing():
    from test_imports import import_graph
    graph = import_graph()
    plain = ("surgery", "cache_teacher", "kd", "runtime", "sampler")
    found = {f: sorted(d for d in graph[f] if d.startswith("experts")) for f in plain}
    assert found == {f: [] for f in plain}
    # prune.py names the wing where an expert flag asks for it, never at its top level
    import ast
    from pathlib import Path
    top = ast.parse((Path(__file__).resolve().parents[1] / "prune.py").read_text()).body
    assert not [n for n in top if isinstance(n, (ast.Import, ast.ImportFrom))
                and any("experts" in (getattr(n, "module", None) or a.name) for a in n.names)]
    assert {"experts.routing", "surgery", "runtime"} <= graph["experts.importance"]
