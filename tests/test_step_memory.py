"""Memory settings tested where they act: what prune.py's own training step keeps for the backward
(experiments/step_memory.py: the host bytes each decoder layer leaves alive, a real prune.main run
with its train_step wrapped), against byte counts written out here, never against a loss."""
import pytest

from test_prune import corpus  # noqa: F401  (the fixture)
from experiments.step_memory import bytes_a_token

SEQ = 256


def run_args(model, corpus, *extra):
    return ["--model", model, "--keep", "4", "--data", corpus, "--seq-len", str(SEQ), "--batch-size", "4",
            "--steps", "4", "--search-frac", "0.5", "--warmup", "1", "--n-calib", "2", "--eval-every", "4",
            "--ckpt-every", "100", *extra]


def test_full_checkpointing_keeps_a_layers_input_alone_after_importance(make_tiny, corpus, tmp_path,
                                                                        monkeypatch):
    """--activation-checkpointing full: a layer keeps its fp32 input alone, 4 d bytes a token, in the
    fine-tune; in the search one more residual-stream tensor, the gate's output for d out / d m. KL
    importance (the default --init) bypasses layers by swapping their forwards: the checkpoint must
    be back on every layer when the training starts."""
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    d = 32  # tests/conftest.py's tiny_config
    got = bytes_a_token(run_args(make_tiny("llama", 6), corpus,
                                 "--activation-checkpointing", "full"), tmp_path, SEQ, (1, 4))
    assert got["finetune"] == pytest.approx(4 * d, rel=0.05)
    assert got["search"] == pytest.approx(2 * 4 * d, rel=0.05)


# Every family's layer in every mode; the compiled and bf16 paths on Llama and Qwen3 (a GPU run's:
# compiled, bf16 autocast over fp32 weights)
CASES = ([(arch, mode, False, "fp32") for arch in ("llama", "qwen3", "gemma3_text", "qwen3_moe")
          for mode in ("none", "selective", "full")]
         + [(arch, mode, True, "bf16") for arch in ("llama", "qwen3") for mode in ("none", "selective")])


@pytest.mark.slow
@pytest.mark.parametrize("arch, mode, compiled, dtype", CASES)
def test_the_plans_activation_model_within_10_percent(make_tiny, corpus, tmp_path, monkeypatch,
                                                      arch, mode, compiled, dtype):
    """scale.plan's activation bytes a token and layer (fitted to no measurement) against what the
    training step keeps, measured, in the search (the gates' outputs too) and in the fine-tune."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import prune
    from experiments.step_memory import autocast_here
    from scale.plan import activation_formula
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    model = make_tiny(arch, 6)
    with autocast_here(dtype == "bf16"):
        got = bytes_a_token(run_args(model, corpus, "--activation-checkpointing", mode,
                                     "--compile" if compiled else "--no-compile"), tmp_path, SEQ, (1, 4))
    with torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    c = 2 if dtype == "bf16" else 4
    for phase in ("search", "finetune"):
        want = activation_formula(shape, mode, 4, c, compiled, search=phase == "search")
        assert got[phase] == pytest.approx(want, rel=0.1), phase
