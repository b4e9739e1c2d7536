"""Layer surgery (importance, Sec. 3.2; removal and export) on tiny random Llama, Qwen2, Qwen3, Mistral and Gemma3 models:
masked forward == bypassed original == exported checkpoint; KV-cache generation after reload;
KL importance with prefix reuse == the naive L+1 full forwards, in eval mode whatever the model's mode."""
import json
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from baselines.shortgpt import block_influence
from surgery import LayerGates, decoder_layers, export_pruned, kl_importance, remove_layers

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3_text"]


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def bypass(model, removed):
    """Independent reference: make the removed layers return their input unchanged."""
    for i in removed:
        decoder_layers(model)[i].forward = types.MethodType(lambda self, hidden_states, *a, **k: hidden_states,
                                                            decoder_layers(model)[i])
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_export_equals_masked_and_bypassed_model(arch, make_tiny, tmp_path):
    path = make_tiny(arch, layers=12)
    L, keep = 12, [0, 2, 3, 5, 6, 9, 11]  # Gemma3: keeps sliding layers and the full layer 11
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))  # 16 > window 4

    model = load(path)
    gates = LayerGates(model)
    gates.mask = torch.tensor([1.0 if i in keep else 0.0 for i in range(L)])
    with torch.no_grad():
        masked = model(ids).logits
        gates.mask = None
        dense = model(ids).logits
        bypassed = bypass(load(path), set(range(L)) - set(keep))(ids).logits
    assert not torch.allclose(dense, masked)  # the removed layers mattered
    torch.testing.assert_close(masked, bypassed, rtol=0, atol=0)

    tok = AutoTokenizer.from_pretrained(path)
    out = tmp_path / "pruned"
    pruned = remove_layers(load(path), keep)
    state = {k: v.detach() for k, v in pruned.state_dict().items()}
    meta = export_pruned(path, state, keep, L, tok, out, {"source_model": path, "method": "test"})
    reloaded = load(out)  # plain transformers, no project code
    assert reloaded.config.num_hidden_layers == len(keep) == len(decoder_layers(reloaded))
    if getattr(reloaded.config, "layer_types", None) is not None:
        orig_types = load(path).config.layer_types
        assert reloaded.config.layer_types == [orig_types[i] for i in keep]
    assert [layer.self_attn.layer_idx for layer in decoder_layers(reloaded)] == list(range(len(keep)))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, masked, rtol=1e-5, atol=1e-5)
    assert json.loads((out / "pruning.json").read_text())["removed_layers"] == meta["removed_layers"] == \
        [1, 4, 7, 8, 10]
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").exists()

    prompt = ids[:1, :10]
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    with_cache = reloaded.generate(prompt, use_cache=True, **gen)
    without = reloaded.generate(prompt, use_cache=False, **gen)
    assert with_cache.shape[1] == 22
    assert torch.equal(with_cache, without)


def test_gates_pass_gradient_to_masked_out_layer(make_tiny):
    model = load(make_tiny("llama", layers=4))
    gates = LayerGates(model)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0], requires_grad=True)
    gates.mask = mask
    model(torch.randint(0, 49152, (1, 8))).logits.square().mean().backward()
    assert mask.grad[1] != 0  # the layer with m = 0 ran, and its delta reached the mask
    gates.remove()
    gates.mask = None


def naive_kl_importance(path, ids):
    """L+1 full forwards: the full model, then each layer removed physically (independent code path)."""
    full = load(path)
    logp = F.log_softmax(full(ids).logits.double(), -1)
    L = len(decoder_layers(full))
    out = []
    for l in range(L):
        m = remove_layers(load(path), [i for i in range(L) if i != l])
        logq = F.log_softmax(m(ids).logits.double(), -1)
        out.append((logq.exp() * (logq - logp)).sum(-1).mean())
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_kl_importance_prefix_reuse_equals_naive(arch, make_tiny):
    path = make_tiny(arch, layers=7)
    ids = torch.randint(0, 49152, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = naive_kl_importance(path, ids)
        got = kl_importance(load(path), [(ids[i:i + 1], None) for i in range(3)], 49152, chunk=5)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-7)


def test_importance_ignores_pads(make_tiny):
    path = make_tiny("llama", layers=5)
    model = load(path)
    ids = torch.randint(0, 49152, (1, 10), generator=torch.Generator().manual_seed(2))
    attn = torch.ones(1, 10, dtype=torch.long)
    attn[0, 6:] = 0  # right padding: positions 6.. never count
    a = kl_importance(model, [(ids, attn)], 49152)
    b = kl_importance(model, [(ids[:, :6], None)], 49152)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_importance_is_scored_in_eval_mode(tmp_path):
    """A GPT-2 with dropout 0.1 handed over in train mode (as prune.py holds the student): its KL and
    BI scores are the eval-mode model's, the naive reference's, every time; and it stays in train
    mode. (Scored in train mode, each forward dropped other units: noisy, inflated scores.)"""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=300, n_embd=32, n_layer=5, n_head=4, n_positions=64,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, initializer_range=0.2)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    path = str(tmp_path / "gpt2")
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = naive_kl_importance(path, ids)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        for _ in range(2):
            got = kl_importance(model, [(ids[i:i + 1], None) for i in range(2)], 300)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-7)
        assert model.training
        bi = [block_influence(model, [(ids, None)]) for _ in range(2)]
        torch.testing.assert_close(bi[0], bi[1], rtol=0, atol=0)
        assert model.training


def test_block_influence_matches_hidden_states(make_tiny):
    path = make_tiny("qwen3", layers=5)
    model = load(path)
    ids = torch.randint(0, 49152, (2, 9), generator=torch.Generator().manual_seed(3))
    last_out = []
    decoder_layers(model)[4].register_forward_hook(lambda m, a, out: last_out.append(out))
    with torch.no_grad():
        got = block_influence(model, [(ids, None)])
        hs = model(ids, output_hidden_states=True).hidden_states  # hs[l] = input of layer l, l < L
    # the last layer's output is read from the layer itself: in some transformers versions hs[L] is
    # after the final norm
    xs = list(hs[:5]) + [last_out[-1]]
    ref = [(1 - F.cosine_similarity(xs[l].double(), xs[l + 1].double(), dim=-1)).mean() for l in range(5)]
    torch.testing.assert_close(got, torch.stack(ref), rtol=1e-4, atol=1e-6)


def test_architecture_without_decoder_layer_list_is_refused():
    from transformers import AutoConfig
    from runtime import E3Error
    cfg = AutoConfig.for_model("mamba", vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=4)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(E3Error, match="decoder-layer list"):
        decoder_layers(model)
