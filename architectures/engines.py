"""
Where a serving engine would compute a pruned model differently from transformers, said before the
run. Engines derive some per-layer behaviour from fixed periods of the layer index unless the model
file says otherwise; transformers reads the exported config's per-layer lists. The differences that
no file can fix (read from the engines' sources: docs/architectures.md cites the lines):

  llama.cpp  SmolLM3     no RoPE iff (j + 1) % 4 == 0, hard-coded (src/models/smollm3.cpp)
             Llama-4     no RoPE and full (not chunked) attention iff (j + 1) % 4 == 0,
                         hard-coded; MoE iff (j + 1) % step == 0 (src/models/llama4.cpp)
             Qwen2/3-MoE every layer must have experts (src/models/qwen2moe.cpp, qwen3moe.cpp)
             DeepSeek    a model with q_lora_rank pruned to 26 or 27 layers is taken for V2-Lite
                         (src/models/deepseek2.cpp; GLM-4.7-Flash too, which llama.cpp runs so)
             AFMoE       no RoPE iff (j + 1) % 4 == 0, hard-coded (src/models/afmoe.cpp); its
                         transformers model has RoPE on the sliding layers alone
             EXAONE-4    sliding windows, and no RoPE on the full layers, only at 64 layers
                         (src/models/exaone4.cpp): a pruned one attends in full everywhere
  vLLM       GPT-OSS     sliding window iff j % 2 == 0, hard-coded (models/gpt_oss.py)
             Llama-4     MoE iff (j + 1) % interleave_moe_layer_step == 0 (models/llama4.py)
  mlx-lm     Gemma-3     full attention iff (j + 1) % sliding_window_pattern == 0, the period alone
                         (mlx_lm/models/gemma3_text.py; layouts.py rewrites it when the kept order
                         has a period, so only an order without one is named)

and, dense and pruned alike, settings llama.cpp hard-codes where a config may say otherwise (the
released checkpoints agree with llama.cpp except GPT-OSS's):

  llama.cpp  GPT-OSS     YaRN's correction range always rounded (ggml_rope_yarn_corr_dims), where
                         its config says "truncate": false (gpt-oss-20b's too)
             OLMoE       k_norm as wide as the model: grouped key-value heads do not load
                         (src/models/olmoe.cpp)
             Qwen3-MoE   the top-k routing weights always normalised (src/models/qwen3moe.cpp)
             Llama-4     attention chunks of 8192 tokens whatever attention_chunk_size says
                         (src/models/llama4.cpp)

The sliding-window order of Gemma-2/3, GPT-OSS, Cohere2 and AFMoE in llama.cpp is no such case: the GGUF
command (architectures/gguf.py) writes it per layer. surgery.serving_notes imports this module only
for the families above (surgery.SERVING_FAMILIES).
"""
def _period_mismatch(flags, keep, rule):
    """The new indices j where the kept layers' own flags differ from rule(j)."""
    return [j for j, i in enumerate(keep) if bool(flags[i]) != bool(rule(j))]


def notes(config, kept=None):
    """Warnings for this family, each 'engine: what differs': with `kept` (original indices), the
    kept layers whose behaviour would change, by their new index; without, the family's rule, for
    the start of a run that has not chosen its layers yet."""
    cfg = config.get_text_config()
    family, L = cfg.model_type, cfg.num_hidden_layers
    keep = sorted(kept) if kept is not None else None
    out = []

    def rule_note(engine, what, flags, rule, text):
        if keep is None:
            out.append(f"{engine}: {family} {text}; a kept order off that period computes "
                       f"differently there")
        elif changed := _period_mismatch(flags, keep, rule):
            out.append(f"{engine}: {family} {text}: the pruned model's layers {changed} (new "
                       f"indices) would get the other {what} there than in transformers")

    rope = None  # which layers have RoPE, where llama.cpp hard-codes none on every 4th
    if family in ("smollm3", "llama4", "llama4_text"):  # no_rope_layers[i] = 1: RoPE
        rope = getattr(cfg, "no_rope_layers", None) or [int((i + 1) % 4 != 0) for i in range(L)]
    elif family == "afmoe" and getattr(cfg, "layer_types", None):  # RoPE iff the layer slides
        rope = [t == "sliding_attention" for t in cfg.layer_types]
    if rope is not None:
        # Llama-4's RoPE layers also attend in chunks, its NoPE layers to everything: one period
        what = "RoPE and attention (chunked or full)" if family.startswith("llama4") else "RoPE"
        rule_note("llama.cpp", what, rope, lambda j: (j + 1) % 4 != 0,
                  "has no RoPE on every 4th layer, hard-coded (no GGUF key)")
    if family in ("llama4", "llama4_text") and getattr(cfg, "moe_layers", None) is not None:
        moe = [i in set(cfg.moe_layers) for i in range(L)]
        step = cfg.interleave_moe_layer_step
        if keep is None or not _periodic([moe[i] for i in keep]):
            for engine in ("llama.cpp", "vLLM"):
                rule_note(engine, "feed-forward (MoE or dense)", moe,
                          lambda j: step > 0 and (j + 1) % step == 0,
                          f"puts MoE on every {step}th layer (interleave_moe_layer_step)")
    if family in ("qwen2_moe", "qwen3_moe"):
        step, dense = cfg.decoder_sparse_step, set(getattr(cfg, "mlp_only_layers", None) or ())
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(L)]
        if not all(sparse[i] for i in (keep if keep is not None else range(L))):
            out.append(f"llama.cpp: {family} needs experts in every layer; the dense layers kept "
                       f"here do not load there")
    if family == "exaone4" and "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        if keep is None or len(keep) != 64:
            n = "fewer" if keep is None else len(keep)
            out.append(f"llama.cpp: exaone4 slides its window (and leaves RoPE out of the full "
                       f"layers) only at 64 layers, hard-coded: with {n} every layer attends in "
                       f"full with RoPE there, whatever the GGUF says")
    if family in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite") and getattr(cfg, "q_lora_rank", None):
        if keep is None or len(keep) in (26, 27):
            out.append(f"llama.cpp: {family} with {'26 or 27' if keep is None else len(keep)} "
                       f"layers is taken for DeepSeek-V2-Lite and does not load; keep another "
                       f"count")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if family == "gpt_oss" and rope.get("rope_type") == "yarn" and rope.get("truncate") is False:
        out.append("llama.cpp: gpt_oss rounds YaRN's correction range, which this config says not "
                   "to (truncate false): its logits differ from transformers', dense and pruned "
                   "alike (0.6-2% perplexity on a tiny random model; no GGUF key says it)")
    if family == "olmoe" and cfg.num_key_value_heads != cfg.num_attention_heads:
        out.append("llama.cpp: olmoe with grouped key-value heads does not load (its k_norm is "
                   "as wide as the model)")
    if family == "qwen3_moe" and not cfg.norm_topk_prob:
        out.append("llama.cpp: qwen3_moe always normalises the top-k routing weights, which this "
                   "config does not (norm_topk_prob false): its logits differ from transformers'")
    if family in ("llama4", "llama4_text") and getattr(cfg, "attention_chunk_size", 8192) != 8192:
        out.append(f"llama.cpp: {family} attends in chunks of 8192 tokens, this config in "
                   f"{cfg.attention_chunk_size}: its logits differ past that many tokens")
    if family == "gemma3_text" and getattr(cfg, "layer_types", None):
        from architectures.layouts import period
        full = [t != "sliding_attention" for t in cfg.layer_types]
        p = getattr(cfg, "sliding_window_pattern", None) or cfg._sliding_window_pattern
        if keep is None or not period([full[i] for i in keep]):  # else written out (layouts.py)
            rule_note("mlx-lm", "attention (sliding or full)", full, lambda j: (j + 1) % p == 0,
                      f"puts full attention on every {p}th layer (sliding_window_pattern)")
    if family == "gpt_oss" and getattr(cfg, "layer_types", None):
        sliding = [t == "sliding_attention" for t in cfg.layer_types]
        if keep is None or not all(sliding[i] for i in keep):  # all sliding: vLLM serves it so
            rule_note("vLLM", "attention (sliding or full)", sliding, lambda j: j % 2 == 0,
                      "slides the window on the even layers, hard-coded")
    return out


def _periodic(flags):
    from architectures.layouts import period
    return period(flags) is not None
