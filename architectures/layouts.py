"""
The families whose config says by a RULE on the layer index how each layer is built or served.
After a cut the rule no longer holds for the renumbered layers, so surgery.rewrite_layer_settings
reads what each rule says with `read_rules` before it rewrites anything, and writes the kept layout
back with `write_rules`, in the family's own keys:

  first_k_dense_replace / num_dense_layers   layers [0, n) dense: DeepSeek-V2/V3, GLM-4-MoE, dots1
                                             / AFMoE, LFM2-MoE -> the number of kept dense layers
  max_window_layers                          Qwen2/3: layers [0, n) full attention, the rest sliding
                                             (when use_sliding_window) -> the number kept below n
  decoder_sparse_step (+ mlp_only_layers)    Qwen2/3-MoE: sparse iff (i + 1) % step == 0 and i not
                                             listed -> step 1, the kept dense layers listed
  moe_layer_interval / start_index / end     ERNIE-4.5-MoE: sparse iff (i + 1) % interval == 0 in
                                             [start, end] -> one range, or an error if the kept
                                             sparse layers are not one
  interleave_moe_layer_step (+ moe_layers)   Llama-4: transformers reads the list, vLLM the step ->
                                             the step of the kept MoE layers, if they have one
  sliding_window_pattern (Gemma-3's period)  transformers reads layer_types, mlx-lm the period
                                             -> the kept layers' period, if they have one, under
                                             its public name (transformers 5 saves a private one)
  num_nextn_predict_layers                   DeepSeek-V3's multi-token-prediction layers, which
                                             transformers never loads (so no export holds) -> 0

Where the kept layers have no period, the list alone says it (transformers reads it): the serving
engines that read the period instead are named by architectures/engines.py before the run.
"""
from runtime import E3Error

PREFIX_COUNTS = ("first_k_dense_replace", "num_dense_layers", "max_window_layers")


def period(flags):
    """The p >= 1 with flags[j] == ((j + 1) % p == 0) for every j, or None (0: no flag set)."""
    if not any(flags):
        return 0
    p = flags.index(True) + 1
    return p if all(f == ((j + 1) % p == 0) for j, f in enumerate(flags)) else None


def read_rules(cfg, L):
    """{rule key: what it says} for each index rule `cfg` has, read before any rewriting."""
    found = {}
    for key in PREFIX_COUNTS:
        if isinstance(getattr(cfg, key, None), int):
            found[key] = getattr(cfg, key)  # the prefix's length
    if isinstance(getattr(cfg, "decoder_sparse_step", None), int):
        step, dense = cfg.decoder_sparse_step, set(getattr(cfg, "mlp_only_layers", None) or ())
        found["decoder_sparse_step"] = {i for i in range(L) if i not in dense and (i + 1) % step == 0}
    if isinstance(getattr(cfg, "moe_layer_interval", None), int):
        start, every = cfg.moe_layer_start_index, cfg.moe_layer_interval
        end = L - 1 if cfg.moe_layer_end_index == -1 else cfg.moe_layer_end_index
        found["moe_layer_interval"] = {i for i in range(L) if (i + 1) % every == 0
                                       and start <= i <= end}
    if isinstance(getattr(cfg, "interleave_moe_layer_step", None), int) and \
            isinstance(getattr(cfg, "moe_layers", None), (list, tuple)):
        found["interleave_moe_layer_step"] = set(cfg.moe_layers)
    if isinstance(getattr(cfg, "_sliding_window_pattern", None), int) and \
            isinstance(getattr(cfg, "layer_types", None), (list, tuple)):
        found["sliding_window_pattern"] = True
    if isinstance(getattr(cfg, "num_nextn_predict_layers", None), int):
        found["num_nextn_predict_layers"] = True
    return found


def write_rules(cfg, keep, found):
    """Write the layout of the kept layers `keep` (original indices, sorted) back into `cfg`, after
    the per-layer lists were sliced and the index lists renumbered."""
    for key in PREFIX_COUNTS:
        if key in found:  # a prefix stays a prefix: the kept layers below its end
            setattr(cfg, key, sum(i < found[key] for i in keep))
    if "decoder_sparse_step" in found:  # any kept layout: every layer may be sparse, dense listed
        cfg.decoder_sparse_step = 1
        cfg.mlp_only_layers = [j for j, i in enumerate(keep) if i not in found["decoder_sparse_step"]]
    if "moe_layer_interval" in found:
        sparse = [j for j, i in enumerate(keep) if i in found["moe_layer_interval"]]
        if sparse and sparse != list(range(sparse[0], sparse[-1] + 1)):
            raise E3Error(f"keeping layers {keep} leaves MoE layers {sparse}, which ERNIE's "
                          f"moe_layer_start_index/end_index/interval cannot describe; keep another "
                          f"set")
        cfg.moe_layer_interval = 1
        first, last = (sparse[0], sparse[-1]) if sparse else (len(keep), -1)  # none: empty range
        cfg.moe_layer_start_index, cfg.moe_layer_end_index = first, last
    if "interleave_moe_layer_step" in found:
        step = period([i in found["interleave_moe_layer_step"] for i in keep])
        if step is not None:  # else the list alone (transformers); engines.py names vLLM's step
            cfg.interleave_moe_layer_step = step
    if "sliding_window_pattern" in found:
        full = period([t != "sliding_attention" for t in cfg.layer_types])
        if full:  # the name the hub's config.json and mlx-lm use, and transformers' own
            cfg.sliding_window_pattern = cfg._sliding_window_pattern = full
    if "num_nextn_predict_layers" in found:
        cfg.num_nextn_predict_layers = 0
