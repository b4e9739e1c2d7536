"""Shared fixtures: tiny random-init causal LMs of several architectures, saved like real checkpoints
with the demo model's tokenizer, and the `slow` marker."""
import os
import re
import socket
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the scripts live at the repo root

import demo  # noqa: E402
import kd  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: one thread a worker, subprocesses too
    os.environ["OMP_NUM_THREADS"] = "1"   # (torch jobs sharing the cores' threads run 5-20x slower)
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """The tests marked `first` go first (stably: the rest keep their order)."""
    items.sort(key=lambda item: item.get_closest_marker("first") is None)


def free_port():
    """A port nothing listens on now, for torchrun's --master_port (pytest -n runs several)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def topk_kd_loss(student_logits, topk_ids, topk_logprobs, entropy=None, mask=None):
    """kd.kd_loss over top-K targets given as tensors: eq. 12 (entropy None) or eq. 13."""
    batch = {"topk_ids": topk_ids, "topk_logprobs": topk_logprobs, "entropy": entropy, "mask": mask}
    return kd.kd_loss(student_logits, batch, weighted=entropy is not None)


def tiny_config(arch, layers=6, vocab=49152):
    """A few-layer random config of each architecture the tests cover."""
    from transformers import AutoConfig
    shared = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True, initializer_range=0.2)  # wide: layers matter, outputs peaked
    if arch == "gemma3_text":
        # 5 sliding + 1 full per 6 layers, window shorter than the test sequences
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
        shared.update(head_dim=8, sliding_window=4, layer_types=types, query_pre_attn_scalar=8)
    if arch == "qwen3":
        shared.update(head_dim=8)
    if arch == "mistral":
        shared.update(sliding_window=4)
    if arch == "smollm3":  # its default pad id lies past this vocabulary
        shared.update(pad_token_id=None)
    return AutoConfig.for_model(arch, **shared)


# what a rank prints when it dies: a C++ abort (gloo's device thread, a failed check), a Python error
_RANK_ERROR = re.compile(r"terminate called|what\(\):|Fatal Python error|Aborted|^\[rank\d+\]:|^\w*Error: ")


def torchrun_failure(*outputs):
    """The message for a torchrun that failed: first each line in which a rank says why (a C++ abort's
    `terminate called ... what(): ...` comes early in stderr, long before the launcher's report that
    fills its last 3,000 characters), then the tail."""
    text = "\n".join(o for o in outputs if o)
    why = [line for line in text.splitlines() if _RANK_ERROR.search(line)]
    return "\n".join(why[:60]) + "\n--- the output's end ---\n" + text[-3000:]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(demo.default_model())


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory, tokenizer):
    """make_tiny(arch, layers=6, seed=0) -> folder with a random model and the demo tokenizer."""
    from transformers import AutoModelForCausalLM

    def make(arch="llama", layers=6, seed=0):
        path = tmp_path_factory.getbasetemp() / f"tiny-{arch}-{layers}-{seed}"
        if not (path / "config.json").exists():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_config(arch, layers), dtype=torch.float32)
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
        return str(path)
    return make


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer):
    """Folder of a 2-layer, 64-wide random Llama with SmolLM2's tokenizer (vocabulary 49152). Weights are
    drawn wider than HF's default (std 0.3) so the next-token distributions are peaked, not near-uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=128, initializer_range=0.3,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
