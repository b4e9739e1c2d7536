"""
The MoE families whose config says by a RULE on the layer index which layers are sparse. After a
cut the rule no longer holds for the renumbered layers, so surgery.rewrite_layer_settings reads the
sparse set with `sparse_layers` before it rewrites anything, and writes the kept layout back with
`write_layout`, in the same family's own keys:

  first_k_dense_replace / num_dense_layers   layers [0, n) dense: DeepSeek-V2/V3, GLM-4-MoE, dots1
                                             / AFMoE, LFM2-MoE -> the number of kept dense layers
  decoder_sparse_step (+ mlp_only_layers)    Qwen2/3-MoE: sparse iff (i + 1) % step == 0 and i not
                                             listed -> step 1, the kept dense layers listed
  moe_layer_interval / start_index / end     ERNIE-4.5-MoE: sparse iff (i + 1) % interval == 0 in
                                             [start, end] -> one range, or an error if the kept
                                             sparse layers are not one
"""
from cache_teacher import E3Error

DENSE_PREFIX = ("first_k_dense_replace", "num_dense_layers")


def sparse_layers(cfg, L):
    """{rule key: what it says} for each index rule `cfg` has, read before any rewriting."""
    found = {}
    for key in DENSE_PREFIX:
        if isinstance(getattr(cfg, key, None), int):
            found[key] = getattr(cfg, key)  # the dense prefix's length
    if isinstance(getattr(cfg, "decoder_sparse_step", None), int):
        step, dense = cfg.decoder_sparse_step, set(getattr(cfg, "mlp_only_layers", None) or ())
        found["decoder_sparse_step"] = {i for i in range(L) if i not in dense and (i + 1) % step == 0}
    if isinstance(getattr(cfg, "moe_layer_interval", None), int):
        start, every = cfg.moe_layer_start_index, cfg.moe_layer_interval
        end = L - 1 if cfg.moe_layer_end_index == -1 else cfg.moe_layer_end_index
        found["moe_layer_interval"] = {i for i in range(L) if (i + 1) % every == 0
                                       and start <= i <= end}
    return found


def write_layout(cfg, keep, found):
    """Write the layout of the kept layers `keep` (original indices, sorted) back into `cfg`."""
    for key in DENSE_PREFIX:
        if key in found:  # the kept dense layers stay a prefix
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
