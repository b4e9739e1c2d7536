"""Memory settings tested where they act: what prune.py's own training step keeps for the backward
(experiments/step_memory.py: the host bytes each decoder layer leaves alive, a real prune.main run
with its train_step wrapped), against byte counts written out here, never against a loss."""
import pytest

from test_prune import corpus  # noqa: F401  (the fixture)
from experiments.step_memory import bytes_a_token, modelled, shape_of

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


# Each family's layer without checkpointing (the most terms) in fp32; selective on the two with
# other layers (Gemma's norms, the experts) under bf16 autocast; the GPU's default path, compiled with
# bf16 autocast, on Llama and Qwen3 (full: the default run's test above; experiments/step_memory.py
# measures every combination)
CASES = ([(arch, "none", False, "fp32") for arch in ("llama", "qwen3", "gemma3_text", "qwen3_moe")]
         + [(arch, "selective", False, "bf16") for arch in ("gemma3_text", "qwen3_moe")]
         + [(arch, mode, True, "bf16") for arch in ("llama", "qwen3") for mode in ("none", "selective")])


@pytest.mark.slow
@pytest.mark.parametrize("arch, mode, compiled, dtype", CASES)
def test_the_plans_activation_model_within_10_percent(make_tiny, corpus, tmp_path, monkeypatch,
                                                      arch, mode, compiled, dtype):
    """scale.plan's activation bytes a token and layer (fitted to no measurement) against what the
    training step keeps, measured, in the search (the gates' outputs too) and in the fine-tune."""
    import prune
    from experiments.step_memory import autocast_here
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    model = make_tiny(arch, 6)
    with autocast_here(dtype == "bf16"):
        got = bytes_a_token(run_args(model, corpus, "--activation-checkpointing", mode,
                                     "--compile" if compiled else "--no-compile"), tmp_path, SEQ, (1, 4))
    shape, c = shape_of(model), 2 if dtype == "bf16" else 4
    for phase in ("search", "finetune"):
        want = modelled(shape, mode, 4, c, compiled, phase == "search", SEQ)
        assert got[phase] == pytest.approx(want, rel=0.1), phase


@pytest.mark.slow
def test_the_fused_heads_chunk_and_lora_act_in_the_training_step(make_tiny, corpus, tmp_path,
                                                                  monkeypatch):
    """Where they act, in the step that trains: the plain head keeps the micro-batch's logits for
    the backward (at least one fp32 copy, 4 V bytes a token; V = 49,152 here), the fused head in
    chunks (--logit-chunk 64) keeps none of them (under 2% of one copy); LoRA (--lora-rank 4) keeps
    a layer's activations as the full model does but for its frozen norms' normed x (the plan's
    model within 10%), and its AdamW holds moments for the adapters alone."""
    import prune
    from scale.lora import add_lora
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    model, V = make_tiny("llama", 6), 49152
    args = run_args(model, corpus, "--activation-checkpointing", "none")
    plain = bytes_a_token(args, tmp_path / "plain", SEQ, (1, 4))
    fused = bytes_a_token([*args, "--logit-chunk", "64"], tmp_path / "fused", SEQ, (1, 4))
    assert plain["finetune_head"] >= 4 * V and fused["finetune_head"] < 0.02 * 4 * V
    states = []
    step = prune.train_step

    def spy(model, opt, *a, **k):
        out = step(model, opt, *a, **k)
        states.append({n: (p.grad is None, p in opt.state) for n, p in model.named_parameters()})
        return out
    monkeypatch.setattr(prune, "train_step", spy)
    shape = shape_of(model)
    add_lora(shape, 4, 8.0, 0)
    lora = bytes_a_token([*args, "--lora-rank", "4"], tmp_path / "lora", SEQ, (1, 4))
    d = 32  # the frozen norms keep no normed x for their weights' gradient: 2 x 4 d less a layer
    for phase in ("search", "finetune"):
        assert lora[phase] == pytest.approx(plain[phase] - 2 * 4 * d, rel=0.05)
        want = modelled(shape, "none", 4, 4, False, phase == "search", SEQ)
        assert lora[phase] == pytest.approx(want, rel=0.1)
    for state in states:
        assert {n for n, (_, in_adam) in state.items() if in_adam} == {
            n for n in state if ".parametrizations.weight.0." in n}  # the adapters' A and B


# Every family the tests list, without checkpointing (the most terms), in fp32 and under bf16
# autocast: the plan's figure is layer_bytes' where it models the layer, else what autograd saves
# on small instances (scale/saved.py), within 10% of what the step keeps either way
FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3", "deepseek_v2", "gpt_oss", "llama4_text", "olmoe",
            "granitemoe", "granite", "cohere", "hyperclovax", "gpt2", "gpt_neox", "opt"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_every_familys_activations_within_10_percent(corpus, tmp_path, monkeypatch, arch, dtype):
    import prune
    from experiments.step_memory import autocast_here, tiny_folder
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    model = tiny_folder(arch, tmp_path)
    with autocast_here(dtype == "bf16"):
        got = bytes_a_token(run_args(model, corpus, "--activation-checkpointing", "none", "--no-compile"),
                            tmp_path, SEQ, (1, 4))
    shape, c = shape_of(model), 2 if dtype == "bf16" else 4
    for phase in ("search", "finetune"):
        want = modelled(shape, "none", 4, c, False, phase == "search", SEQ)
        assert got[phase] == pytest.approx(want, rel=0.1), phase
