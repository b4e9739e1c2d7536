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
