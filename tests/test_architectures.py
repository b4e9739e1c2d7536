"""Every architecture users prune, on tiny random configs (hidden 32, 4 experts): the model's own
logits from the last layer's output, MoE layouts rewritten at removal, and the export round trip (no
missing or unexpected weights, logits == the source with the removed layers bypassed, KV-cache
generation, the source's generation config, dtype, tokenizer files and chat template)."""
import copy
import json
import re
import types

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from architectures.logits import model_logits
from runtime import E3Error
from scale.fused_loss import check_logits_path, last_layer_output
from scale.lora import lora_targets
from surgery import (LayerGates, check_removable, decoder_layers, export_pruned, kl_importance,
                     pruned_config, remove_layers)
from test_prune import (corpus, events, one_line_error, run, run_here,  # noqa: F401
                        tiny_args, weights)  # (corpus: a fixture)

L, KEEP = 6, [0, 2, 3, 5]  # removes layers 1 and 4: a dense and a sparse one in every MoE below
VOCAB = 49152  # the demo tokenizer's: its files and chat template travel with the export
ATTN = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=64)
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=2,
           n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
           qk_nope_head_dim=8, v_head_dim=8)  # DeepSeek: dense 0, 1

# arch -> (model_type, settings). The MoE layouts are the issue's: which layers are sparse hangs on
# the index.
CONFIGS = {
    "llama": ("llama", dict(ATTN)),
    "mixtral": ("mixtral", dict(ATTN, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(ATTN, **EXPERTS, num_experts=4, decoder_sparse_step=2,
                                    shared_expert_intermediate_size=32)),  # sparse: 1, 3, 5
    "qwen3_moe": ("qwen3_moe", dict(ATTN, **EXPERTS, num_experts=4,
                                    mlp_only_layers=[1, 3])),  # dense: 1, 3
    "deepseek_v3": ("deepseek_v3", dict(ATTN, **EXPERTS, **MLA)),
    "deepseek_v2": ("deepseek_v2", dict(ATTN, **EXPERTS, **MLA)),
    "gpt_oss": ("gpt_oss", dict(ATTN, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=4)),
    "llama4_text": ("llama4_text", dict(ATTN, num_local_experts=4, num_experts_per_tok=1,
                                        intermediate_size_mlp=64, interleave_moe_layer_step=2,
                                        no_rope_layer_interval=2, attention_chunk_size=8)),
    #                                                  sparse: 1, 3, 5; no rope: 1, 3, 5
    "olmoe": ("olmoe", dict(ATTN, num_experts=4, num_experts_per_tok=2)),
    "granitemoe": ("granitemoe", dict(ATTN, num_local_experts=4, num_experts_per_tok=2,
                                      logits_scaling=4.0)),
    "granite": ("granite", dict(ATTN, logits_scaling=4.0)),  # the model divides its logits
    "cohere": ("cohere", dict(ATTN, logit_scale=0.5)),  # the model multiplies its logits
    "hyperclovax": ("hyperclovax", dict(ATTN, logits_scaling=0.5)),  # ... by logits_scaling
    "gemma3_text": ("gemma3_text", dict(ATTN, sliding_window=4, final_logit_softcapping=3.0,
                                        query_pre_attn_scalar=8)),
    "gpt2": ("gpt2", dict(n_embd=32, n_head=4, n_inner=64)),  # ln_f
    "gpt_neox": ("gpt_neox", dict(hidden_size=32, num_attention_heads=4, intermediate_size=64)),
    "opt": ("opt", dict(hidden_size=32, num_attention_heads=4, ffn_dim=64,
                        word_embed_proj_dim=16)),  # final_layer_norm, then project_out
}
# ... and those tested for their logits alone (Falcon-H1's Mamba layers run slowly here), GLM-4-MoE
# for its logits and its experts (tests/test_expert_search.py)
LOGITS_ONLY = {"falcon_h1": ("falcon_h1", dict(ATTN, lm_head_multiplier=0.5, mamba_d_ssm=64, mamba_n_heads=8,
                                               mamba_d_state=16, mamba_chunk_size=16)),  # multiplies
               "glm4_moe": ("glm4_moe", dict(ATTN, **EXPERTS, n_routed_experts=4, n_shared_experts=1,
                                             first_k_dense_replace=1, n_group=1, topk_group=1))}


def tiny(arch, layers=L, seed=0, dtype=torch.float32):
    model_type, settings = {**CONFIGS, **LOGITS_ONLY}[arch]
    n = "n_layer" if arch == "gpt2" else "num_hidden_layers"
    cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, max_position_embeddings=64,
                               initializer_range=0.2, **{n: layers}, **settings)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def ids(seed=0, shape=(2, 12)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def bypass(model, removed):
    """Independent reference: the removed layers return their input unchanged (in a tuple where the
    layer returns one: GPT-Neo's)."""
    for i in removed:
        layer = decoder_layers(model)[i]

        def skip(self, hidden_states, *a, _forward=layer.forward, **k):
            out = _forward(hidden_states, *a, **k)
            return (hidden_states, *out[1:]) if isinstance(out, tuple) else hidden_states
        layer.forward = types.MethodType(skip, layer)
    return model


@pytest.mark.parametrize("arch", list(CONFIGS) + list(LOGITS_ONLY))
def test_model_logits_are_the_models_own(arch):
    model = tiny(arch)
    x = ids()
    with torch.no_grad():
        h, last = last_layer_output(model, x)
        torch.testing.assert_close(model_logits(model, h), model(x).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, model(x).logits[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["granite", "cohere", "gemma3_text", "opt"])
def test_teacher_cache_is_log_softmax_of_the_models_logits(arch):
    """The cached top-K log-probs and entropy are those of log_softmax(model(x).logits), whatever
    the model does after its LM head (Granite divides, Cohere scales, Gemma soft-caps, OPT
    projects): from the plain logits and from the chunked head of the last layer's output."""
    from cache_teacher import teacher_targets
    model, x = tiny(arch), ids(5)
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits.double(), -1)
    values, indices = logp.topk(5, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    for chunk in (0, 7):
        got = teacher_targets(model, x, VOCAB, topk=5, logit_chunk=chunk)
        torch.testing.assert_close(got["topk_logprobs"].double(), values, rtol=0, atol=1e-5)
        assert torch.equal(got["topk_ids"], indices)
        torch.testing.assert_close(got["entropy"].double(), entropy, rtol=0, atol=1e-4)


def test_unknown_logit_transform_is_refused():
    """A forward that changes its logits after the LM head in a way model_logits does not know."""
    model = tiny("llama")
    model.register_forward_hook(lambda m, a, out: out.__setitem__("logits", out.logits * 3) or out)
    with torch.no_grad(), pytest.raises(E3Error, match="differ from the model's own"):
        check_logits_path(model, *last_layer_output(model, ids()))


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "opt", "granite", "cohere", "qwen2_moe"])
def test_kl_importance_and_gates_without_llama_norm(arch):
    """KL importance with prefix reuse == L+1 full forwards with one layer physically removed, and
    the hard-masked forward == the bypassed model, on decoders whose final norm is not `norm`."""
    x = ids(1, (2, 10))
    with torch.no_grad():
        logp = torch.log_softmax(tiny(arch)(x).logits.double(), -1)
        ref = []
        for l in range(L):
            without_l = remove_layers(tiny(arch), [i for i in range(L) if i != l])
            logq = torch.log_softmax(without_l(x).logits.double(), -1)
            ref.append((logq.exp() * (logq - logp)).sum(-1).mean())
        got = kl_importance(tiny(arch), [(x, None)], VOCAB)
    torch.testing.assert_close(got, torch.stack(ref), rtol=1e-4, atol=1e-7)
    model = tiny(arch)
    LayerGates(model).mask = torch.tensor([float(i in KEEP) for i in range(L)])
    with torch.no_grad():
        reference = bypass(tiny(arch), {1, 4})(x).logits
        torch.testing.assert_close(model(x).logits, reference, rtol=0, atol=0)


def test_kl_importance_chunked_equals_unchunked():
    model = tiny("qwen3_moe")
    batches = [(ids(2, (2, 9)), None), (ids(3, (2, 9)), None)]
    whole = kl_importance(model, batches, VOCAB, chunk=10 ** 6)
    for chunk in (5, 7):  # 18 tokens per batch: 4 and 3 chunks, the last one short
        chunked = kl_importance(model, batches, VOCAB, chunk=chunk)
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-9)


def sparse_layers(model):
    """Which decoder layers have routed experts, read from the modules themselves."""
    return [i for i, layer in enumerate(decoder_layers(model))
            if any(n.endswith("experts") for n, _ in layer.named_modules())]


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "deepseek_v3", "llama4_text"])
def test_tiny_layouts_mix_dense_and_sparse_layers(arch):
    """The test configs remove a dense AND a sparse layer (1 and 4): an unrewritten layout shows."""
    sparse = sparse_layers(tiny(arch))
    assert 0 < len(sparse) < L and {1, 4} & set(sparse) and {1, 4} - set(sparse)


def file_dtypes(folder, kept=None):
    """name -> dtype of each tensor in a checkpoint's safetensors file, as stored. With `kept`
    (the pruned file's layer i is the source's layer kept[i]) the names are the source's."""
    f = safe_open(str(folder / "model.safetensors"), "pt")
    # "...layers.2." / "...h.2." -> the source's layer index
    rename = (lambda k: k) if kept is None else (
        lambda k: re.sub(r"\b(layers|h)\.(\d+)\.", lambda m: f"{m[1]}.{kept[int(m[2])]}.", k, 1))
    return {rename(k): f.get_slice(k).get_dtype() for k in f.keys()}


def save_source(arch, path, tokenizer):
    """A bf16 source checkpoint with its own generation config (EOS list, sampling settings)."""
    model = tiny(arch, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[2, 7], temperature=0.6, top_p=0.95,
                                               do_sample=True, max_new_tokens=17)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_export_round_trip(arch, tmp_path, tokenizer):
    src = save_source(arch, tmp_path / "src", tokenizer)
    # the pruned model's fp32 master weights, as prune.py gathers them at the end
    pruned = remove_layers(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), KEEP)
    state = {k: v.clone() for k, v in pruned.state_dict().items()}
    out = tmp_path / "pruned"
    export_pruned(str(src), state, KEEP, L, tokenizer, out, {"source_model": str(src)})

    reloaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                          output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    n_layers = reloaded.config.get_text_config().num_hidden_layers
    assert len(decoder_layers(reloaded)) == n_layers == len(KEEP)
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    reference = bypass(source, {1, 4})
    x = ids(4)
    with torch.no_grad():
        got = reloaded.eval()(x).logits
        torch.testing.assert_close(got, reference(x).logits, rtol=1e-4, atol=1e-4)

    # what the user gave: dtype, generation config, tokenizer files and chat template
    # tensor by tensor: bf16, except what the model class keeps in fp32 at bf16 (DeepSeek's router
    # since transformers 5.24), as the source file has them
    src_dtypes = file_dtypes(src)
    assert "BF16" in src_dtypes.values()
    got_dtypes = file_dtypes(out, KEEP)
    # (every exported name is a source name: no key outside the comprehension's filter)
    assert got_dtypes == {k: v for k, v in src_dtypes.items() if k in got_dtypes}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert GenerationConfig.from_pretrained(out).to_dict() == \
        GenerationConfig.from_pretrained(src).to_dict()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    assert json.loads((out / "pruning.json").read_text())["removed_layers"] == [1, 4]

    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    prompt = x[:1, :6]
    with_cache = reloaded.generate(prompt, use_cache=True, **gen)
    without = reloaded.generate(prompt, use_cache=False, **gen)
    assert with_cache.shape[1] == 14 and torch.equal(with_cache, without)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "deepseek_v3", "llama4_text"])
def test_moe_layout_written_back(arch):
    """The pruned config, rebuilt by plain transformers, puts experts where the kept layers had
    them."""
    model = tiny(arch)
    before = sparse_layers(model)
    remove_layers(model, KEEP)
    rebuilt = AutoModelForCausalLM.from_config(model.config)
    expected = [j for j, i in enumerate(KEEP) if i in before]
    assert sparse_layers(rebuilt) == sparse_layers(model) == expected


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_every_tested_family_passes_the_start_check(arch):
    """prune.py's check before any work (no layer set chosen yet: the two probes) lets them all
    through."""
    check_removable(tiny(arch).config)


def test_layout_the_config_cannot_express_is_refused():
    """ERNIE-4.5-MoE describes its MoE layers by a range and an interval: here every other layer
    (1, 3, 5); keeping 1 and 3 without 2 cannot be said, keeping 1, 3, 5 without 2 and 4 can (a
    range of three)."""
    cfg = AutoConfig.for_model("ernie4_5_moe", vocab_size=64, num_hidden_layers=L,
                               moe_num_experts=4, moe_k=2, moe_layer_start_index=1,
                               moe_layer_interval=2, moe_intermediate_size=32, **ATTN)
    check_removable(cfg, [0, 1, 3, 5])
    with pytest.raises(E3Error, match="cannot describe"):
        check_removable(cfg, [0, 1, 2, 3])
    # a hybrid: attention or Mamba, MoE or dense, by a period and an offset of the index
    jamba = AutoConfig.for_model("jamba", vocab_size=64, num_hidden_layers=4, num_experts=2,
                                 attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                 expert_layer_offset=1, **ATTN)
    with pytest.raises(E3Error, match="cannot be pruned"):
        check_removable(jamba)


def test_layer_state_the_cut_would_get_wrong_is_refused():
    """Refused before any work, where the pruned model in memory would silently differ from the
    source with those layers bypassed: Zamba2's shared blocks pick each hybrid layer's adapter from
    a map of layer indices built with the model; Zaya's layers, and GLM-MoE-DSA's shared indexers,
    hand the next layer more than its hidden state (a removed layer would pass on another's)."""
    zamba2 = AutoConfig.for_model("zamba2", vocab_size=64, num_hidden_layers=L, num_mem_blocks=1,
                                  layers_block_type=["mamba", "hybrid", "hybrid", "hybrid", "mamba",
                                                     "mamba"], mamba_d_state=8, mamba_headdim=8,
                                  mamba_ngroups=1, n_mamba_heads=8, adapter_rank=4,
                                  use_shared_attention_adapter=True, use_shared_mlp_adapter=True,
                                  attention_hidden_size=64, attention_head_dim=16, **ATTN)
    zaya = AutoConfig.for_model("zaya", vocab_size=64, num_hidden_layers=L, **ATTN)
    glm = AutoConfig.for_model("glm_moe_dsa", vocab_size=64, num_hidden_layers=L, index_topk=4,
                               indexer_types=["full", "full", "shared", "full", "shared", "shared"],
                               **dict(ATTN, **MLA))
    for cfg in (zamba2, zaya, glm):
        with pytest.raises(E3Error, match="cannot be pruned"):
            check_removable(cfg)


def test_index_lists_by_other_names_are_renumbered():
    """LFM2 names its attention layers full_attn_idxs (mlx-lm builds the model from it alone)."""
    cfg = AutoConfig.for_model("lfm2", vocab_size=64, num_hidden_layers=L, full_attn_idxs=[1, 3, 4],
                               **ATTN)
    new = pruned_config(cfg, KEEP)  # removes 1 and 4: layer 3 is now layer 2
    assert new.full_attn_idxs == [2]
    assert new.layer_types == [cfg.layer_types[i] for i in KEEP]


def test_a_vision_tower_as_deep_as_the_decoder_keeps_its_layers(tmp_path, tokenizer):
    """Gemma-3 with 6 text and 6 vision layers: the cut is the text decoder's alone; the export
    reloads with no unused weights (transformers would drop the tower's last layers, warning) and
    says 6 vision layers."""
    from transformers import Gemma3Config
    cfg = Gemma3Config(text_config=dict(vocab_size=VOCAB, num_hidden_layers=L, sliding_window=4,
                                        query_pre_attn_scalar=8, **ATTN),
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=L,
                                          num_attention_heads=4, image_size=28, patch_size=14),
                       mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2,
                       eoi_token_index=VOCAB - 3)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    pruned = remove_layers(AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32),
                           KEEP)
    assert pruned.config.vision_config.num_hidden_layers == L
    export_pruned(str(tmp_path / "src"), pruned.state_dict(), KEEP, L, tokenizer, tmp_path / "out",
                  {})
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert reloaded.config.vision_config.num_hidden_layers == L
    assert reloaded.config.text_config.num_hidden_layers == len(KEEP)
    # the dtype each config says, the sub-configs' included (the model was trained in fp32)
    dtypes = [{k: v["dtype"] if isinstance(v, dict) else v for k, v in
               json.loads((tmp_path / d / "config.json").read_text()).items()
               if k == "dtype" or isinstance(v, dict) and "dtype" in v} for d in ("src", "out")]
    assert dtypes[0] == dtypes[1] and set(file_dtypes(tmp_path / "out").values()) == {"BF16"}


def test_a_config_naming_no_dtype_exports_the_dtype_of_its_weights(tmp_path, tokenizer):
    """An fp16 checkpoint whose config.json names no dtype (from_pretrained(dtype="auto") reads the
    tensors' then): the export is fp16 too, not fp32 at twice the size."""
    tiny("llama", dtype=torch.float16).save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    pruned = remove_layers(AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32),
                           KEEP)
    export_pruned(str(tmp_path / "src"), pruned.state_dict(), KEEP, L, tokenizer, tmp_path / "out",
                  {})
    assert set(file_dtypes(tmp_path / "out").values()) == {"F16"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float16"


def test_prune_refuses_an_inexpressible_layout_before_any_work(tokenizer, corpus, tmp_path, capsys, monkeypatch):
    """ERNIE with MoE on every other layer: some layer sets the search may pick cannot be written
    back, so prune.py stops at once, with one line, and writes nothing (its command line run in this
    process, through run_main)."""
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    cfg = AutoConfig.for_model("ernie4_5_moe", vocab_size=VOCAB, num_hidden_layers=L,
                               max_position_embeddings=64, moe_num_experts=4, moe_k=2,
                               moe_layer_start_index=1, moe_layer_interval=2,
                               moe_intermediate_size=32, **ATTN)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "ernie")
    tokenizer.save_pretrained(tmp_path / "ernie")
    one_line_error(tiny_args(str(tmp_path / "ernie"), corpus, tmp_path / "out"), capsys, "cannot describe")
    assert not (tmp_path / "out").exists() and not (tmp_path / "teacher").exists()


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3", "llama4_text", "mixtral"])
def test_lora_targets_attention_and_dense_mlps_not_routers(arch):
    model = tiny(arch)
    for layer in decoder_layers(model):
        names = {n for n, m in layer.named_modules() if any(m is t for t in lora_targets(layer))}
        assert {"self_attn.o_proj"} <= names
        assert not {n.rsplit(".", 1)[-1] for n in names} & {"gate", "router", "shared_expert_gate"}
        dense = not any(n.endswith("experts") for n, _ in layer.named_modules())
        if dense:  # its MLP adapts
            assert any("mlp" in n or "feed_forward" in n for n in names)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """saved(arch) -> folder of the tiny fp32 model with the demo tokenizer (for prune.py)."""
    def save(arch):
        path = tmp_path_factory.getbasetemp() / f"arch-{arch}"
        if not (path / "config.json").exists():
            tiny(arch).save_pretrained(path)
            tokenizer.save_pretrained(path)
        return str(path)
    return save


@pytest.mark.slow
@pytest.mark.parametrize("arch, extra", [("deepseek_v3", []), ("qwen2_moe", ["--lora-rank", "4"]),
                                         ("gpt_oss", ["--experts-keep", "2"]),
                                         ("qwen2_moe", ["--lora-rank", "4", "--experts-keep", "2"])])
def test_moe_two_fsdp_ranks_match_one_process(arch, extra, saved, corpus, tmp_path, monkeypatch):  # noqa: F811
    """prune.py end to end on MoE models (KL importance, Gumbel search, removal, AKD, export): 2
    gloo ranks under FSDP2 == 1 process; Qwen2-MoE with LoRA on attention and the dense/shared MLPs;
    GPT-OSS with its experts searched and cut too (experts/: the scores' gradient averaged over the
    ranks, each MoE layer's unit rebuilt at the cut, shard to shard), and Qwen2-MoE's with LoRA (the
    rebuilt units' adapters and their moments carried). The export reloads
    with every weight in place."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_here(tiny_args(saved(arch), corpus, one, *extra), tmp_path, monkeypatch)
    run(tiny_args(saved(arch), corpus, two, *extra), tmp_path, nproc=2)
    assert events(two, "pruned")[0]["kept"] == events(one, "pruned")[0]["kept"]
    info_one, info_two = (json.loads((o / "model" / "pruning.json").read_text()) for o in (one, two))
    assert info_two.get("kept_experts") == info_one.get("kept_experts")
    assert ("--experts-keep" in extra) == bool(info_one.get("kept_experts"))
    a, b = weights(one), weights(two)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4, msg=lambda m: f"{key}: {m}")
    _, info = AutoModelForCausalLM.from_pretrained(two / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "granite", "cohere", "hyperclovax",
                                  "gpt2", "opt", "qwen3_moe"])
def test_fused_head_loss_equals_plain_logits_path(arch):
    """prune.py's two loss paths, kd.py's plain one and scale/fused_loss.py's (the LM head fused
    with the loss, chunked: no (B, T, V) logits), against the path written out here:
    model(x).logits, a float64 log-softmax, eq. 12/13 and F.cross_entropy. Loss values for akd, kd,
    sft and validation's (kd, ce), and every parameter's gradient; soft-capping, logit scales, OPT's
    project_out and an untied head included."""
    from prune import plain_losses
    from scale.fused_loss import FusedLoss
    model = tiny(arch)  # eval: GPT-2's and OPT's dropout would draw other masks in each path
    x = ids(7, (2, 9))
    teacher = torch.log_softmax(torch.randn(2, 9, VOCAB, generator=torch.Generator().manual_seed(1))
                                * 3, -1)
    lp, top = teacher.topk(5, -1)
    ent = -(teacher.exp() * teacher).sum(-1)
    batch = {"input_ids": x, "topk_ids": top, "topk_logprobs": lp, "entropy": ent}

    def plain(kind):
        z = model(input_ids=x, use_cache=False).logits.double()
        if kind == "sft":
            return torch.nn.functional.cross_entropy(z[:, :-1].reshape(-1, VOCAB),
                                                     x[:, 1:].reshape(-1))
        lpd = lp.double()
        per_tok = (lpd.exp() * (lpd - torch.log_softmax(z, -1).gather(-1, top))).sum(-1)
        return (per_tok * (ent.double() if kind == "akd" else 1)).mean()

    for kind in ("akd", "kd", "sft"):
        model.zero_grad()
        ref = plain(kind)
        ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        for losses in (plain_losses(VOCAB), FusedLoss(VOCAB, 4, reference=plain_losses(VOCAB))):
            model.zero_grad()
            (got,) = losses(model, batch, [kind])
            got.backward()
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
            for n, p in model.named_parameters():
                if n in ref_grads:
                    torch.testing.assert_close(p.grad, ref_grads[n].float(), rtol=1e-3, atol=1e-6,
                                               msg=f"{kind}: {n}")
    with torch.no_grad():
        kd, ce = FusedLoss(VOCAB, 256, reference=plain_losses(VOCAB))(model, batch, ["kd", "sft"])
        torch.testing.assert_close(kd.double(), plain("kd"), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ce.double(), plain("sft"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_neo"])
def test_the_cut_in_memory_generates_with_its_kv_cache(arch):
    """The model prune.py holds after the cut, before any export: its logits are the source's with
    the removed layers bypassed, and it generates the same with the KV cache as without (GPT-Neo
    indexes its cache by `layer_id`: a kept layer still saying 5 would look past the 4 slots)."""
    if arch == "gpt_neo":  # global and local attention in turn, as GPT-Neo's checkpoints
        cfg = AutoConfig.for_model("gpt_neo", vocab_size=VOCAB, max_position_embeddings=64,
                                   hidden_size=32, num_heads=4, intermediate_size=64, num_layers=L,
                                   attention_types=[[["global", "local"], L // 2]], window_size=4)
        torch.manual_seed(0)
        source = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    else:
        source = tiny(arch)
    pruned = remove_layers(copy.deepcopy(source), KEEP)
    reference = bypass(source, {1, 4})
    x = ids(4)
    with torch.no_grad():
        torch.testing.assert_close(pruned(x).logits, reference(x).logits, rtol=1e-4, atol=1e-4)
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with_cache = pruned.generate(x[:1, :6], use_cache=True, **gen)
    assert with_cache.shape[1] == 14
    assert torch.equal(with_cache, pruned.generate(x[:1, :6], use_cache=False, **gen))


# Every function that reads a decoder layer's modules or a config's structure, met by every family
# above the day it is written: a new such function joins READERS. (The export and its reload, the
# costliest, are test_export_round_trip's, over the same CONFIGS.)
def _plan(arch, model, tmp_path, capsys):
    """prune.py --plan 1 and 8 from the family's config.json alone: the last line one JSON object
    whose activation figures are positive."""
    import prune
    model.config.save_pretrained(tmp_path)
    for ranks in ("1", "8"):
        prune.main(["--model", str(tmp_path), "--keep", "3", "--plan", ranks, "--seq-len", "64",
                    "--batch-size", "16"])
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["ranks"] == int(ranks) and min(summary["activation_bytes"].values()) > 0


def _importance_and_gates(arch, model, tmp_path, capsys):
    """KL importance: L finite non-negative scores; the search's gates at a hard mask: the model with
    the other layers bypassed."""
    x = ids(3, (1, 8))
    scores = kl_importance(model, [(x, None)], VOCAB)
    assert scores.shape == (L,) and torch.isfinite(scores).all() and (scores >= -1e-9).all()
    gates = LayerGates(model)
    gates.mask = torch.tensor([1.0 if i in KEEP else 0.0 for i in range(L)])
    with torch.no_grad():
        got = model(x).logits
    gates.remove()
    with torch.no_grad():
        ref = bypass(copy.deepcopy(model), [i for i in range(L) if i not in KEEP])(x).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _cut(arch, model, tmp_path, capsys):
    check_removable(model.config)
    check_removable(model.config, KEEP)
    assert len(decoder_layers(remove_layers(copy.deepcopy(model), KEEP))) == len(KEEP)


def _fused_head(arch, model, tmp_path, capsys):
    with torch.no_grad():
        check_logits_path(model, *last_layer_output(model, ids()))


def _lora(arch, model, tmp_path, capsys):
    """LoRA's targets: nn.Linear maps of every layer (none on GPT-2, whose maps are Conv1D)."""
    from scale.lora import add_lora
    targets = [lora_targets(layer) for layer in decoder_layers(model)]
    assert all(targets) or arch == "gpt2"
    add_lora(copy.deepcopy(model), 2, 4.0, 0)


def _gguf_keys(arch, model, tmp_path, capsys):
    from architectures.gguf import gguf_keys, text_config
    model.config.save_pretrained(tmp_path)
    assert isinstance(gguf_keys(model.config.model_type, text_config(tmp_path)), dict)


def _experts(arch, model, tmp_path, capsys):
    """Expert importance (experts/): the MoE layers are those holding fused expert weights, a REAP
    score each (layer, expert); a family without routed experts refused with one line."""
    from experts.importance import reap_importance
    sparse = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if ".experts." in n})
    batch = [(ids(3, (1, 8)), None)]
    if not sparse:
        with pytest.raises(E3Error, match="routes no tokens to experts"):
            reap_importance(model, batch)
        return
    scores, layers = reap_importance(model, batch)
    assert layers == sparse and scores.shape == (len(sparse), 4) and torch.isfinite(scores).all()


READERS = {"plan": _plan, "importance and gates": _importance_and_gates, "cut": _cut,
           "fused head": _fused_head, "lora": _lora, "gguf keys": _gguf_keys, "experts": _experts}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_every_structure_reader_serves_every_family(arch, reader, tmp_path, capsys):
    READERS[reader](arch, tiny(arch), tmp_path, capsys)
