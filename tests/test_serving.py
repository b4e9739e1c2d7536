"""The pruned model in the engines people serve it with, where no engine is needed: the GGUF keys
architectures/gguf.py adds to what llama.cpp's converter wrote (read back with gguf's own reader),
the warnings for what no file can say (architectures/engines.py), and the config rewrites that keep
vLLM's period-reading code consistent (architectures/layouts.py). llama.cpp itself runs in
experiments/llama_cpp.py (its build takes minutes)."""
import copy
import json

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from architectures.gguf import rewrite
from conftest import tiny_config
from surgery import export_pruned, remove_layers, serving_notes

gguf = pytest.importorskip("gguf")


def converted(path, arch, layers, tensors=None):
    """A GGUF as llama.cpp's converter writes one for these families: the layer count and the window
    size, no per-layer pattern (gemma.py, gpt_oss.py, command_r.py)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_sliding_window(4)
    for name, value in (tensors or {"token_embd.weight": np.ones((4, 8), np.float32)}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def export(tmp_path, tokenizer, arch, layers, keep, **settings):
    """A tiny random model of `arch`, pruned to `keep` and exported as prune.py does."""
    cfg = tiny_config(arch, layers)
    for k, v in settings.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    src = tmp_path / "src"
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    remove_layers(model, keep)
    out = tmp_path / "export"
    export_pruned(str(src), {k: v.detach() for k, v in model.state_dict().items()}, keep, layers,
                  tokenizer, out, {"source_model": str(src)})
    return out


def field(path, key):
    f = gguf.GGUFReader(str(path)).get_field(key)
    return None if f is None else f.contents()


@pytest.mark.parametrize("arch, gguf_arch, layers, keep", [
    ("gemma3_text", "gemma3", 12, [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11]),  # layer 6 gone: 11 -> 10 full
    ("gemma2", "gemma2", 6, [0, 2, 3, 4, 5]),  # layer 1 gone: the even / odd order flips
])
def test_an_off_period_order_is_written_per_layer(arch, gguf_arch, layers, keep, tmp_path, tokenizer):
    """llama.cpp takes Gemma's sliding layers from a fixed period (6, 2) unless the file has a
    per-layer array: written from the export's layer_types, true where the layer slides."""
    out = export(tmp_path, tokenizer, arch, layers, keep)
    types = AutoConfig.from_pretrained(out).get_text_config().layer_types
    src = converted(tmp_path / "converted.gguf", gguf_arch, len(keep))
    arch_name, keys, _ = rewrite(src, tmp_path / "fixed.gguf", out)
    key = f"{gguf_arch}.attention.sliding_window_pattern"
    assert arch_name == gguf_arch and list(keys) == [key]
    assert field(tmp_path / "fixed.gguf", key) == [t == "sliding_attention" for t in types]
    assert field(src, key) is None  # what the converter wrote had none
    assert field(tmp_path / "fixed.gguf", f"{gguf_arch}.block_count") == len(keep)


def test_an_on_period_export_is_left_as_converted(tmp_path, tokenizer):
    """Gemma-3 18 -> 12 with layers 6-11 removed keeps the 5-sliding-1-full order: nothing to add."""
    keep = [0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17]
    out = export(tmp_path, tokenizer, "gemma3_text", 18, keep)
    src = converted(tmp_path / "converted.gguf", "gemma3", len(keep))
    _, keys, scale = rewrite(src, tmp_path / "fixed.gguf", out)
    assert keys == {} and scale is None
    fields = lambda p: {k: f.contents() for k, f in gguf.GGUFReader(str(p)).fields.items()}  # noqa
    assert fields(tmp_path / "fixed.gguf") == fields(src)


def test_gemma_query_scale_is_folded_into_q_norm(tmp_path, tokenizer):
    """transformers scales Gemma's q k^T by query_pre_attn_scalar^-1/2, llama.cpp by head_dim^-1/2
    except at the 27B layer count: the ratio goes into the q_norm weights (F32, the 1 added)."""
    out = export(tmp_path, tokenizer, "gemma3_text", 6, [0, 1, 2, 3, 5], query_pre_attn_scalar=32)
    q_norm = np.full(8, 1.5, np.float32)
    src = converted(tmp_path / "c.gguf", "gemma3", 5, {"blk.0.attn_q_norm.weight": q_norm,
                                                      "blk.0.attn_k_norm.weight": q_norm})
    _, _, scale = rewrite(src, tmp_path / "fixed.gguf", out)
    assert scale == pytest.approx((8 / 32) ** 0.5)  # head_dim 8
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "fixed.gguf")).tensors}
    np.testing.assert_allclose(tensors["blk.0.attn_q_norm.weight"], 1.5 * scale, rtol=1e-6)
    np.testing.assert_array_equal(tensors["blk.0.attn_k_norm.weight"], q_norm)


def test_a_family_without_a_per_layer_key_is_warned_before_the_run(make_tiny, tmp_path):
    """SmolLM3's no-RoPE layers are every 4th in llama.cpp, hard-coded: a kept order off that period
    is named (engine, family, the layers) before the run; one on it is not."""
    config = tiny_config("smollm3", 8)
    assert any("llama.cpp: smollm3" in n for n in serving_notes(config))  # the rule, at the start
    (note,) = serving_notes(config, [0, 2, 3, 4, 5, 6, 7])  # layer 1 gone: 3 -> 2 loses its place
    assert "llama.cpp" in note and "smollm3" in note and "[2, 3, 6]" in note, note
    assert serving_notes(config, [0, 1, 2, 3, 4, 5, 6]) == []  # the last layer only: on period
    assert serving_notes(tiny_config("llama", 8), [0, 2, 3]) == []


def test_settings_llama_cpp_hard_codes_are_warned_dense_or_pruned():
    """GPT-OSS's unrounded YaRN range, OLMoE's grouped key-value heads, Qwen3-MoE's unnormalised
    top-k weights, Llama-4's attention chunk: llama.cpp hard-codes the other choice; each warned at
    the start and at the cut, and not when the config agrees with llama.cpp."""
    cases = {"gpt_oss": ({}, "YaRN", {"rope_parameters": {"rope_type": "yarn", "factor": 32.0,
                                                           "truncate": True}}),
             "olmoe": ({}, "grouped key-value heads", {"num_key_value_heads": 4}),
             "qwen3_moe": ({}, "normalises", {"norm_topk_prob": True}),
             "llama4_text": ({"attention_chunk_size": 64}, "8192", {"attention_chunk_size": 8192})}
    for family, (base, text, agrees) in cases.items():
        config = tiny_config(family, 8)
        for k, v in base.items():
            setattr(config, k, v)
        for kept in (None, [0, 1, 2, 3, 4, 5, 6, 7]):
            assert any(f"llama.cpp: {family}" in n and text in n for n in serving_notes(config, kept)), \
                (family, serving_notes(config, kept))
        for k, v in agrees.items():
            setattr(config, k, v)
        assert not any(text in n for n in serving_notes(config)), (family, serving_notes(config))


def test_prune_py_prints_the_warning_before_any_work(tmp_path, tokenizer, capsys):
    """The warning comes before anything is read or written: here the run stops at once after it
    (its --data does not exist; the command line run in this process, through run_main)."""
    import prune
    import runtime
    AutoModelForCausalLM.from_config(tiny_config("smollm3", 6)).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    argv = ["--model", str(tmp_path / "m"), "--layers", "0,2,3,5", "--steps", "0", "--init", "kl",
            "--data", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        runtime.run_main(lambda: prune.main(argv))
    out = capsys.readouterr().out
    assert "warning: llama.cpp: smollm3" in out and "[2, 3]" in out, out
    assert e.value.code == 2 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("keep, step", [([0, 1, 2, 3, 4, 5], 2), ([0, 3, 4, 5], 2), ([0, 2, 4, 5], 4),
                                        ([1, 3, 5], 1), ([0, 1, 2, 3, 5], None)])
def test_llama4_moe_step_follows_the_kept_layers(keep, step):
    """vLLM (and llama.cpp) place Llama-4's MoE layers by interleave_moe_layer_step, transformers by
    moe_layers: the step is rewritten to the kept MoE layers' period; with none, vLLM is warned."""
    from test_architectures import tiny
    model = tiny("llama4_text")  # 6 layers, MoE every 2nd
    cfg = copy.deepcopy(model.config)  # the source's, for the warnings
    assert cfg.moe_layers == [1, 3, 5]
    remove_layers(model, keep)
    new = model.config
    assert new.moe_layers == [j for j, i in enumerate(keep) if i in (1, 3, 5)]
    notes = [n for n in serving_notes(cfg, keep) if "vLLM" in n]
    if step is None:
        assert new.interleave_moe_layer_step == 2 and notes
    else:
        assert new.interleave_moe_layer_step == step and not notes
        assert new.moe_layers == [j for j in range(len(keep)) if (j + 1) % step == 0]


def test_vllm_period_settings_stay_consistent(tmp_path, tokenizer):
    """Settings a period-reading engine uses, rewritten with the cut: Qwen2's full-attention prefix
    (max_window_layers) counts the kept layers below it; DeepSeek-V3's multi-token-prediction layers,
    which transformers never loads, are 0 in an export that holds none; GPT-OSS off vLLM's hard-coded
    even/odd order is warned."""
    cfg = AutoConfig.for_model("qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, use_sliding_window=True, sliding_window=4,
                               max_window_layers=4)
    model = AutoModelForCausalLM.from_config(cfg)
    before = list(model.config.layer_types)
    assert set(before) == {"full_attention", "sliding_attention"}
    remove_layers(model, [0, 2, 5, 6, 7])
    assert model.config.max_window_layers == 2
    settings = {**model.config.to_dict(), "layer_types": None}
    settings.pop("model_type")
    rebuilt = AutoConfig.for_model("qwen3", **settings)  # the rule of the rewritten prefix
    assert rebuilt.layer_types == [before[i] for i in (0, 2, 5, 6, 7)]
    from test_architectures import tiny
    ds = tiny("deepseek_v3")
    assert ds.config.num_nextn_predict_layers > 0
    remove_layers(ds, [0, 2, 3, 5])
    assert ds.config.num_nextn_predict_layers == 0
    oss = tiny("gpt_oss").config
    vllm = lambda kept: [n for n in serving_notes(oss, kept) if n.startswith("vLLM")]  # noqa: E731
    assert vllm([0, 1, 4, 5]) == []  # the even/odd order kept
    (note,) = vllm([0, 2, 3, 4, 5])
    assert note.startswith("vLLM: gpt_oss") and "[1, 2, 3, 4]" in note, note


@pytest.mark.parametrize("hub_key", [False, True])
def test_gemma3_period_setting_follows_the_kept_order(hub_key, tmp_path, tokenizer):
    """Gemma-3's sliding_window_pattern (mlx-lm reads it instead of layer_types) is rewritten to the
    kept order's period when it has one: 12 -> 8 layers keeping 4-sliding-1-full-like order. Written
    under the name the engines read, whether the source's config.json had it (the hub's do) or not
    (transformers 5 saves only its private _sliding_window_pattern)."""
    keep = [0, 1, 2, 5, 6, 7, 8, 11]  # layers 3, 4, 9, 10 gone: full at 5 and 11 -> new 3 and 7
    out = export(tmp_path, tokenizer, "gemma3_text", 12, keep, **({"sliding_window_pattern": 6}
                                                                   if hub_key else {}))
    saved = json.loads((out / "config.json").read_text())
    assert saved["layer_types"][3] == saved["layer_types"][7] == "full_attention"
    assert saved["sliding_window_pattern"] == 4
    assert saved.get("_sliding_window_pattern", 4) == 4


def test_gemma3_kept_off_any_period_is_named_for_mlx_lm(tokenizer):
    """A kept order with no period: the list alone says it; mlx-lm, which reads the period, is named
    with the layers it would compute with the other attention."""
    cfg = tiny_config("gemma3_text", 12)
    assert [t == "full_attention" for t in cfg.layer_types].count(True) == 2  # full at 5 and 11
    keep = [0, 1, 2, 3, 4, 5, 6, 7, 8, 11]  # full at new 5 and 9: no period; mlx-lm's 6 slides 9
    (note,) = [n for n in serving_notes(cfg, keep) if n.startswith("mlx-lm")]
    assert "layers [9]" in note and "gemma3_text" in note, note
    assert [n for n in serving_notes(cfg, [0, 1, 2, 5, 6, 7, 8, 11]) if n.startswith("mlx-lm")] == []


@pytest.mark.parametrize("source_model", ["absolute", "HuggingFaceTB/SmolLM3-3B", "src"])
def test_convert_warns_whatever_pruning_json_names_as_the_source(source_model, tmp_path, tokenizer,
                                                                 capsys):
    """architectures/gguf.py's convert prints the serving notes prune.py printed, read from the export
    alone: pruning.json's source_model, as the user typed it, may be a hub id or a relative path."""
    from architectures.gguf import convert
    from runtime import E3Error
    keep = [0, 2, 3, 5]  # SmolLM3: no RoPE on every 4th layer; layers 2 and 3 move off the period
    out = export(tmp_path, tokenizer, "smollm3", 6, keep)
    expected = serving_notes(AutoConfig.from_pretrained(tmp_path / "src"), keep)
    assert any("llama.cpp" in note for note in expected)
    info = json.loads((out / "pruning.json").read_text())
    info["source_model"] = str(tmp_path / "src") if source_model == "absolute" else source_model
    (out / "pruning.json").write_text(json.dumps(info))
    tree = tmp_path / "llama.cpp"  # a converter that refuses: the notes come before it runs
    tree.mkdir()
    (tree / "convert_hf_to_gguf.py").write_text("raise SystemExit('stand-in')\n")
    with pytest.raises(E3Error, match="refused"):
        convert(out, llama_cpp=str(tree))
    printed = [line.removeprefix("warning: ") for line in capsys.readouterr().out.splitlines()
               if line.startswith("warning: ")]
    assert printed == expected


def test_the_converter_gets_the_keys_it_reads_under_old_names(tmp_path):
    """llama.cpp's Cohere2 converter reads rotary_pct, which transformers 5 no longer saves: the
    converter is given a config that has it (the export's files linked beside it, the export left
    as it is); a family whose config has all it reads converts from the export itself."""
    from architectures.gguf import converter_input
    export = tmp_path / "cohere2"
    export.mkdir()
    cfg = {"model_type": "cohere2", "hidden_size": 64, "num_hidden_layers": 2}
    (export / "config.json").write_text(json.dumps(cfg))
    (export / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "in").mkdir()
    folder = converter_input(export, tmp_path / "in")
    assert folder == tmp_path / "in"
    assert json.loads((folder / "config.json").read_text()) == {**cfg, "rotary_pct": 1.0}
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((export / "config.json").read_text()) == cfg  # the export untouched
    (export / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    assert converter_input(export, tmp_path / "unused") == export


def test_gpt_neox_rotary_pct_comes_from_its_rope_settings(tmp_path):
    """transformers 5 saves GPT-NeoX's rotary_pct as rope_parameters["partial_rotary_factor"]
    (Pythia's 0.25); the converter's config gets that value back under the old name."""
    from architectures.gguf import converter_input
    export = tmp_path / "gpt_neox"
    export.mkdir()
    cfg = {"model_type": "gpt_neox", "rope_parameters": {"partial_rotary_factor": 0.25}}
    (export / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "in").mkdir()
    folder = converter_input(export, tmp_path / "in")
    assert json.loads((folder / "config.json").read_text())["rotary_pct"] == 0.25


def test_the_converter_reads_the_old_keys_autoconfig_drops(tmp_path):
    """The converter reads the config through AutoConfig, which in transformers 5 drops GPT-NeoX's
    rotary_pct: run as CONVERTER runs it (here a stand-in tree whose reader drops every key), it
    still sees the old keys config.json holds, and only those."""
    import subprocess
    import sys

    from architectures.gguf import CONVERTER, OLD_KEYS
    tree, model = tmp_path / "llama.cpp", tmp_path / "model"
    (tree / "conversion").mkdir(parents=True)
    (tree / "conversion" / "__init__.py").write_text("")
    (tree / "conversion" / "base.py").write_text(
        "class ModelBase:\n    @staticmethod\n    def load_hparams(dir_model, is_mistral_format):\n"
        "        return {'hidden_size': 64}\n")
    (tree / "convert_hf_to_gguf.py").write_text(
        "import json, sys\nfrom pathlib import Path\nfrom conversion.base import ModelBase\n"
        "print(json.dumps(ModelBase.load_hparams(Path(sys.argv[1]), False)))\n")
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"rotary_pct": 0.25, "n_ctx": 8}))
    out = subprocess.run([sys.executable, "-c", CONVERTER, str(tree / "convert_hf_to_gguf.py"),
                          json.dumps(list(OLD_KEYS)), str(model)], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout) == {"rotary_pct": 0.25, "hidden_size": 64}


def test_keys_the_converter_leaves_out_or_writes_from_a_constant():
    """DeepSeek-V3 routes by sigmoid in transformers 5 whatever its config says (llama.cpp takes
    softmax unless told); GPT-2's MLP width is n_inner where set (the converter: 4 x n_embd)."""
    from architectures.gguf import gguf_keys
    v3 = {"model_type": "deepseek_v3", "num_hidden_layers": 8, "q_lora_rank": 32}
    assert gguf_keys("deepseek2", v3) == {"deepseek2.expert_gating_func": 2}
    assert gguf_keys("deepseek2", {**v3, "model_type": "deepseek_v2"}) == {}
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_inner": 128}
    assert gguf_keys("gpt2", gpt2) == {"gpt2.feed_forward_length": 128}
    assert gguf_keys("gpt2", {**gpt2, "n_inner": None}) == {}
    assert gguf_keys("gpt2", {**gpt2, "n_inner": 256}) == {}


def afmoe_config():
    return AutoConfig.for_model("afmoe", num_hidden_layers=8, hidden_size=32, intermediate_size=64,
                                moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                                vocab_size=64)


def test_afmoe_windows_are_written_per_layer_and_its_rope_period_warned():
    """AFMoE in llama.cpp: layer il slides iff il % 4 < 3 (load_swa_pattern(ml, 4), no array from the
    converter) and has RoPE iff (il + 1) % 4 != 0, hard-coded; transformers gives RoPE to the sliding
    layers alone. Layer 1 of 8 gone: the full layers move to new indices 2 and 6."""
    from architectures.gguf import gguf_keys
    from surgery import pruned_config
    config, keep = afmoe_config(), [0, 2, 3, 4, 5, 6, 7]
    cfg = pruned_config(config, keep).get_text_config().to_dict()
    sliding = [t == "sliding_attention" for t in cfg["layer_types"]]
    assert sliding == [True, True, False, True, True, True, False]  # the kept layers' own order
    assert gguf_keys("afmoe", cfg) == {"afmoe.attention.sliding_window_pattern": sliding}
    llama_cpp_rope = [(j + 1) % 4 != 0 for j in range(len(keep))]
    differ = [j for j in range(len(keep)) if llama_cpp_rope[j] != sliding[j]]  # [2, 3, 6]
    (note,) = serving_notes(config, keep)
    assert "llama.cpp: afmoe" in note and "RoPE" in note and str(differ) in note, note
    assert serving_notes(config, [0, 1, 2, 3]) == []  # the first four: on llama.cpp's period
    assert gguf_keys("afmoe", pruned_config(config, [0, 1, 2, 3]).get_text_config().to_dict()) == {}


def test_exaone4_pruned_from_64_layers_is_warned():
    """EXAONE-4 in llama.cpp has sliding windows (and no RoPE on the full layers) only at 64 layers,
    hard-coded; a pruned model gets full attention and RoPE everywhere whatever the file says."""
    config = AutoConfig.for_model("exaone4", num_hidden_layers=64, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  vocab_size=64, sliding_window=4096, sliding_window_pattern=4)
    for kept in (None, list(range(60))):  # the last four gone: on the period, still 60 layers
        assert any("llama.cpp: exaone4" in n and "64" in n for n in serving_notes(config, kept)), \
            serving_notes(config, kept)
    assert serving_notes(config, list(range(64))) == []  # not pruned: llama.cpp's own case


def test_glm4_moe_lite_routes_by_sigmoid_in_the_gguf():
    """GLM-4.7-Flash (glm4_moe_lite, llama.cpp's deepseek2) routes by sigmoid in transformers, and its
    config names no scoring function: llama.cpp takes sigmoid only at 47 or 48 layers and the
    154,880-token vocabulary, softmax otherwise, so a pruned one needs the key."""
    from architectures.gguf import gguf_keys
    glm = {"model_type": "glm4_moe_lite", "num_hidden_layers": 40, "q_lora_rank": 768}
    assert gguf_keys("deepseek2", glm) == {"deepseek2.expert_gating_func": 2}
    config = AutoConfig.for_model("glm4_moe_lite", num_hidden_layers=28, q_lora_rank=16)
    assert any("V2-Lite" in n for n in serving_notes(config, list(range(27))))
