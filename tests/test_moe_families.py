"""Every MoE family transformers ships (enumerated from its causal-LM mapping: every text config with
an expert count, experiments/moe_families.py), as --experts-keep meets it: a tiny instance (8
experts, top-2, 3 layers, every layer MoE where the config allows, DeepSeek's groups 2 of 4, random
routers, score corrections and router biases) is either refused by experts.search.check_args in one
line before any work, or exact: the mask on the gates (ExpertGates) and the cut (experts/cut.py)
each equal the model built by plain transformers with 4 experts, its tensors sliced by shape here
(a tensor whose size changed with the count loses the dropped experts' rows), and the cut's
save_pretrained reloads with nothing missing. `python tests/test_moe_families.py` prints the table
of docs/architectures.md."""
import argparse
import copy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]
import moe_families  # noqa: E402
from experts.cut import remove_experts  # noqa: E402
from experts.routing import ExpertGates, expert_count, moe_layers  # noqa: E402
from experts.search import check_args  # noqa: E402
from runtime import E3Error  # noqa: E402

E, N = 8, 4
FAMILIES = sorted(moe_families.families()[0])


def instance(mt):
    """The family's tiny model (eval, fp32, eager experts) and its config, or (None, why)."""
    moe_families.SMALL.update(n_group=2, topk_group=1, num_expert_group=2)  # groups of 4, 2 kept each
    moe_families.SMALL.update(unpadded_vocab_size=256)  # Inkling-2's head: the tiny vocabulary
    model, cfg, attempts, _ = moe_families.build(mt)
    if model is None:
        return None, attempts[-1]["error"]
    model.config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if (t.is_floating_point() and E in t.shape and t.dim() <= 2 and "shared" not in name
                    and any(w in name for w in ("gate", "router", "correction", "expert_bias", "statics"))):
                t.copy_(torch.randn(t.shape, generator=g))  # routers and score corrections
    return model.eval(), cfg


def reference(model, kept):
    """Independent: the family's model built with N experts a layer, every tensor of `model` whose
    shape differs there losing the rows of the experts not kept (layer by layer, from its name)."""
    config = copy.deepcopy(model.config)
    key, _ = expert_count(config)
    setattr(config.get_text_config(), key, N)
    small = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    small.config._experts_implementation = "eager"
    target, state = small.state_dict(), {}
    for name, t in model.state_dict().items():
        if t.shape != target[name].shape:
            layer = int(next(p for p in name.split(".") if p.isdigit()))
            dim = next(d for d in range(t.dim()) if t.shape[d] != target[name].shape[d])
            t = t.index_select(dim, torch.tensor(kept[layer]))
        state[name] = t
    small.load_state_dict(state)
    return small


def outcome(mt, tmp_path):
    """('exact', '') or ('refused', the error line) or ('not built', why); asserts exactness."""
    model, cfg = instance(mt)
    if model is None:
        return "not built", cfg
    args = argparse.Namespace(experts_keep=N, search="none", expert_init="kl", guard=None, expert_domains="pooled",
                              expert_merge=False, calib_data=None, plan=None)
    try:
        check_args(args, cfg)
    except E3Error as e:
        return "refused", str(e)
    moes = moe_layers(model)
    kept = {m.index: sorted((r + j) % E for j in range(N)) if getattr(cfg.get_text_config(), "n_group", 1) in (None, 1)
            else [0, 1, 4, 5] for r, m in enumerate(moes)}
    x = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        dense = model(x, use_cache=False).logits
        want = reference(model, kept)(x, use_cache=False).logits
        assert not torch.allclose(want, dense, atol=1e-4), f"{mt}: the reference is the dense model"
        gates = ExpertGates(moes, list(range(len(moes))))
        gates.hard = torch.zeros(len(moes), E).scatter_(1, torch.tensor([kept[m.index] for m in moes]), 1.0)
        torch.testing.assert_close(model(x, use_cache=False).logits, want, rtol=1e-4, atol=1e-4, msg=f"{mt}: the mask")
        gates.remove()
        cut = remove_experts(model, kept)
        torch.testing.assert_close(cut(x, use_cache=False).logits, want, rtol=1e-4, atol=1e-4, msg=f"{mt}: the cut")
    cut.save_pretrained(tmp_path / mt)
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / mt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], (mt, info)
    back.config._experts_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x, use_cache=False).logits, want, rtol=1e-4, atol=1e-4, msg=f"{mt}: reloaded")
    return "exact", ""


def test_the_families_are_enumerated_from_transformers():
    assert len(FAMILIES) >= 60 and {"qwen3_moe", "deepseek_v3", "gpt_oss", "ernie4_5_moe", "minimax_m2"} <= set(FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("mt", FAMILIES)
def test_every_moe_family_is_exact_or_refused_before_work(mt, tmp_path):
    kind, why = outcome(mt, tmp_path)
    assert kind in ("exact", "refused"), f"{mt}: {kind}: {why}"
    if kind == "refused":
        assert "\n" not in why and why


if __name__ == "__main__":  # the table of docs/architectures.md
    import tempfile
    print("| family | --experts-keep | why |\n|---|---|---|")
    for mt in FAMILIES:
        try:
            kind, why = outcome(mt, Path(tempfile.mkdtemp()))
        except Exception as e:  # noqa: BLE001
            kind, why = "WRONG", f"{type(e).__name__}: {str(e).splitlines()[0]}"
        print(f"| {mt} | {kind} | {why[:200]} |", flush=True)


def test_a_router_s_linear_child_gets_no_lora_and_masks_with_finite_gradients():
    """Hunyuan's router computes its logits in a child nn.Linear (gate.wg): LoRA leaves it alone (no
    adapter rerouting tokens), the mask finds it, and a masked training step's gradients are finite
    (an adapter's rows set to -inf as if a score correction would make them NaN)."""
    from scale.lora import add_lora
    model, _ = instance("hunyuan_v1_moe")
    add_lora(model, 2, 4.0, 0)
    assert not [n for n, _ in model.named_parameters() if ".gate." in n and "lora" in n.lower()]
    assert not [n for n, _ in model.named_parameters() if "gate.wg.parametrizations" in n]
    moes = moe_layers(model)
    assert all(type(m.linear).__name__ == "Linear" for m in moes)
    gates = ExpertGates(moes, list(range(len(moes))))
    gates.mask = torch.ones(len(moes), E).index_fill_(1, torch.tensor([1, 5]), 0.0).requires_grad_()
    model.train()
    x = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    model(x, use_cache=False).logits.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None] + [gates.mask.grad]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    gates.remove()


def test_a_block_that_never_calls_its_router_is_refused_not_unmasked():
    """A block that makes its logits from the router's weight without calling the router (its own
    F.linear): the mask cannot act there, and says so in one line instead of routing unmasked."""
    from experts.routing import expert_unroutable
    model, _ = instance("qwen3_moe")
    moe = moe_layers(model)[0]
    block = moe.block

    def forward(h):  # the family's block, its router's work inlined
        x = h.reshape(-1, h.shape[-1])
        top = torch.nn.functional.linear(x, block.gate.weight).softmax(-1).topk(2, dim=-1)
        return block.experts(x, top.indices, top.values / top.values.sum(-1, keepdim=True)).view_as(h)
    block.forward = forward
    x = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), expert_unroutable(moe, 0), pytest.raises(E3Error, match="never called"):
        model(x, use_cache=False)
