"""
Layer surgery on Hugging Face causal LMs, shared by prune.py, cache_teacher.py, evaluate.py and
bench.py:

  decoder_layers(model)           the decoder-layer ModuleList (the paper's "layer")
  LayerGates(model)               the masked forward X_{l+1} = X_l + m_l (f(X_l) - X_l)
                                  (paper Sec. 3.1)
  model_logits(model, h_L)        the model's own logits from the last layer's output: final norm,
                                  LM head, logit_transform (soft-capping / logit scales)
  head_losses(model, ids, fns)    one forward whose LM head returns losses instead of (B, T, V)
                                  logits (the training loss: kd.head_kd_loss, fused and chunked)
  lora_targets(layer)             the nn.Linear maps LoRA adapts (attention, dense/shared MLPs)
  layer_importance(model, ...)    s_l by KL(p_{-l} || p) with prefix reuse, chunked over tokens, or
                                  ShortGPT's BI (paper Sec. 3.2)
  check_removable(config, kept)   refuse before any work a layer layout the config cannot express
  remove_layers(model, keep)      physical removal: ModuleList, layer_idx, per-layer settings and
                                  MoE layouts of the config (pruned_config)
  export_pruned(source, state..)  the trained state as the user gave the source: dtype, generation
                                  config, tokenizer files, chat template; pruning.json

HF decoder layers already add their own residuals, so f(X_l) in the paper's eq. 1 is
`layer(x) - x`.
"""
import copy
import json
import os
import re
import shutil
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common import E3Error, all_reduce_sum, load_model

# where the families keep their decoder layers: Llama-likes, multimodal wrappers (Gemma3), OPT,
# GPT-2/Falcon/Bloom, GPT-NeoX, MPT
_LAYER_PATHS = ("model.layers", "model.language_model.layers", "model.decoder.layers",
                "transformer.h", "gpt_neox.layers", "transformer.blocks")


def _layers_owner(model):
    """(module holding the decoder-layer list, attribute name)."""
    for path in _LAYER_PATHS:
        *parents, attr = path.split(".")
        owner = model
        for p in parents:
            owner = getattr(owner, p, None)  # None on a miss: the isinstance below then fails
        if isinstance(getattr(owner, attr, None), nn.ModuleList):
            return owner, attr
    raise E3Error(f"{type(model).__name__} has no decoder-layer list "
                  f"(looked for {', '.join(_LAYER_PATHS)}); add its path to surgery._LAYER_PATHS")


def decoder_layers(model):
    owner, attr = _layers_owner(model)
    return getattr(owner, attr)


def _hidden(args, kwargs):
    # the families differ in whether the hidden state is passed by position or by keyword
    return args[0] if args else kwargs["hidden_states"]


def _replace_hidden(output, new):
    """Decoder layers return a tensor (transformers >= 5) or a tuple whose first item is the hidden
    state."""
    return new if torch.is_tensor(output) else (new, *output[1:])


class LayerGates:
    """Forward hooks that turn every decoder layer l into   out = x + m_l * (layer(x) - x).

    Computed by torch.lerp(x, layer(x), m): the same function and gradient
    d out / d m = layer(x) - x in one fused kernel, and exact at the ends (lerp returns the layer's
    output bit-exactly when m = 1 and the input when m = 0), so a hard-masked model and the
    physically pruned model agree exactly. A layer with m_l = 0 still runs: its delta is the
    gradient signal for its score (the straight-through estimator of Sec. 3.2).
    `mask = None` switches the gates off. Hooks keep the state-dict keys and FSDP units untouched.
    """

    def __init__(self, model):
        self.mask = None
        self.handles = [layer.register_forward_hook(self._hook(i), with_kwargs=True)
                        for i, layer in enumerate(decoder_layers(model))]

    def _hook(self, i):
        def gate(module, args, kwargs, output):
            if self.mask is None:
                return None  # a forward hook returning None leaves the output as it is
            x = _hidden(args, kwargs)
            y = output if torch.is_tensor(output) else output[0]
            # the mask in the activations' dtype: lerp needs one dtype, and autograd casts back
            return _replace_hidden(output, torch.lerp(x, y, self.mask[i].to(y.dtype)))
        return gate

    def remove(self):
        for h in self.handles:
            h.remove()


# -----------------------------------------------------------------------------
# The model's own logits from the last decoder layer's output (importance, teacher cache)

_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")


def final_norm(model):
    """What the decoder applies to the last layer's output before the LM head: its final norm,
    `norm` (Llama and most), `ln_f` (GPT-2, Falcon, Bloom), `final_layer_norm` (GPT-NeoX, OPT),
    `final_layernorm` (Phi) or `norm_f` (MPT), then OPT's `project_out` where the embedding is
    narrower than the layers. OPT-350m has no final norm; check_logits_path catches a name this list
    misses."""
    owner, _ = _layers_owner(model)
    norms = [getattr(owner, n) for n in _FINAL_NORMS if getattr(owner, n, None) is not None]
    # at most one norm: the names above are alternatives, never applied in sequence
    steps = norms[:1] + [m for m in [getattr(owner, "project_out", None)] if m is not None]
    return nn.Sequential(*steps)  # empty: the identity


def model_logits(model, hidden):
    """The model's own logits from the last decoder layer's output h_L (any leading shape):

        z = post(W_out norm(h_L))

    with post what the model's forward applies after the LM head (logit_transform). So that the
    KL importance, the teacher cache and the student all see log_softmax(model(x).logits), not a
    near relative."""
    return logit_transform(model)(model.get_output_embeddings()(final_norm(model)(hidden)))


def logit_transform(model):
    """post(z): what the model's forward applies after the LM head, elementwise: Gemma-2/3's
    soft-capping c tanh(z / c), Granite's z / logits_scaling, Cohere's z * logit_scale; identity
    for the others."""
    cfg = model.config.get_text_config()
    cap = getattr(cfg, "final_logit_softcapping", None)
    scaling = getattr(cfg, "logits_scaling", None)  # Granite (MoE) divides
    # Cohere multiplies by a float attribute (CLIP-like models hold a tensor of that name)
    scale = getattr(model, "logit_scale", None)
    scale = None if torch.is_tensor(scale) else scale

    def post(z):
        if cap is not None:
            z = torch.tanh(z / cap) * cap
        if scaling is not None:
            z = z / scaling
        if scale is not None:
            z = z * scale
        return z
    return post


def head_losses(model, input_ids, losses, attention_mask=None):
    """One forward of the model whose LM head, instead of the (B, T, V) logits, returns the losses
    `losses` ask for: each fn(x, W, b, post) -> a scalar, with x the head's input norm(h_L) at every
    position, W and b the head's weight and bias, post = logit_transform(model). A tensor of them.

    The head module is the one that runs, once, as in a plain forward: under FSDP2 its hooks gather
    W for it and reduce-scatter the gradient the losses return for W (a vocabulary-parallel head,
    parallel.vocab_parallel, is no FSDP unit: W arrives as this rank's rows, a DTensor, and the
    losses work on the rows). What the model's forward does
    after its head (soft-capping, a logit scale) then runs on the returned losses and is dropped:
    the losses apply post themselves."""
    head, post = model.get_output_embeddings(), logit_transform(model)
    out = {}

    def forward(self, x):
        # the head's output, as FSDP2 registered its backward hook on it: kept, not a copy (and no
        # view, which FSDP2 warns about)
        out["losses"] = torch.stack([fn(x, self.weight, getattr(self, "bias", None), post)
                                     .reshape(1, 1) for fn in losses], dim=-1)
        return out["losses"]
    before = head.__dict__.get("forward")  # an instance-level forward someone set (hooks): kept
    head.forward = types.MethodType(forward, head)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        if before is None:
            del head.forward  # the class's forward again
        else:
            head.forward = before
    return out["losses"].view(-1)


def last_layer_output(model, input_ids, attention_mask=None):
    """(h_L, the model's own logits at the last position) from one forward that computes the LM head
    for the last position only (logits_to_keep=1), so no (T, V) tensor is made here."""
    out = {}
    # a hook on the last layer, not output_hidden_states: that would keep all L + 1 hidden states
    hook = decoder_layers(model)[-1].register_forward_hook(
        lambda module, args, output: out.update(h=output if torch.is_tensor(output) else output[0]))
    try:
        last = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                     logits_to_keep=1).logits
    finally:
        hook.remove()
    return out["h"], last[:, -1]


def check_logits_path(model, h, last_logits):
    """Refuse, with one line, an architecture whose forward does something after its last decoder
    layer that model_logits does not (a final norm under another name, another logit scale): the
    recomputed logits of the last position must be the model's own."""
    z = model_logits(model, h[:, -1]).float()
    ref = last_logits.float()
    # loose and relative: rounding may differ between the two paths; a missing norm or logit
    # scale is off by far more
    if (z - ref).abs().max() > 1e-2 * (1 + ref.abs().max()):
        raise E3Error(f"{type(model).__name__}: logits recomputed from the last layer's output "
                      f"differ from the model's own by {(z - ref).abs().max():.3g}; teach "
                      f"surgery.model_logits this architecture's final norm or logit scale")


# -----------------------------------------------------------------------------
# LoRA targets (paper App. D)

# MoE routers: Mixtral/Qwen/DeepSeek `gate`, Llama-4 and GPT-OSS `router`, Qwen-MoE shared gate
_ROUTERS = ("gate", "router", "shared_expert_gate")


def lora_targets(layer):
    """The nn.Linear maps of a decoder layer that LoRA adapts (paper App. D): attention and the
    dense or shared-expert MLP. Routers are left out: a low-rank change to a router reroutes tokens
    between experts the adapters never see. Routed experts are fused 3-D tensors in
    transformers >= 5 (not nn.Linear) and stay frozen: their LoRA would be one adapter per expert,
    optional in the paper."""
    return [mod for name, mod in layer.named_modules()
            if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] not in _ROUTERS]


# -----------------------------------------------------------------------------
# Layer importance (paper Sec. 3.2)

class _Recorder:
    """Records every decoder layer's call (args, kwargs) and output during one forward pass."""

    def __init__(self, layers):
        self.calls, self.outputs = {}, {}
        self.active = True  # off while the skip-l runs call the same layers again
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post(i)))

    def _pre(self, i):
        def hook(module, args, kwargs):
            if self.active:
                self.calls[i] = (args, kwargs)
        return hook

    def _post(self, i):
        def hook(module, args, output):
            if self.active:
                self.outputs[i] = output if torch.is_tensor(output) else output[0]
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def layer_importance(model, batches, method="kl", vocab=None, generator=None, chunk=1024):
    """Per-layer importance s (float64, length L; larger = more important), paper Sec. 3.2.

    batches: iterable of (input_ids, attention_mask or None, weight) with weight 0 for the padding
    batches that keep every FSDP rank running the same number of forwards. Pad positions never
    count.
      kl:     s_l = mean_tokens KL(p_{-l} || p), p the full model, p_{-l} the model with layer l
              bypassed. Prefix reuse: the input of layer l is the same in both models, so the
              skip-l run starts there and calls only layers l+1..L-1 (about L^2/2 layer calls
              instead of L(L+1)). The LM head and softmax run on `chunk` tokens at a time
              (_chunked_kl): peak memory ~ chunk x V, not T x V.
      bi:     ShortGPT's Block Influence, s_l = mean_tokens 1 - cos(x_l, x_{l+1}), read with
              hooks.
      random: i.i.d. N(0, 1) scores from `generator`, for ablations.
    Under torchrun every rank calls this with its own share of batches; totals are all-reduced.
    """
    layers = decoder_layers(model)
    L = len(layers)
    if method == "random":
        return torch.randn(L, generator=generator, dtype=torch.float64)
    if method not in ("kl", "bi"):
        raise ValueError(f"unknown importance method {method!r}")
    dev = next(model.parameters()).device
    total = torch.zeros(L + 1, dtype=torch.float64, device=dev)  # L sums, then the token count
    rec = _Recorder(layers)
    try:
        for n, (ids, attn, weight) in enumerate(batches):
            ids, attn = ids.to(dev), None if attn is None else attn.to(dev)
            # one full forward records every layer's input (kl's prefix reuse, bi's x_l) and output
            rec.active = True
            valid = torch.ones_like(ids, dtype=torch.bool) if attn is None else attn.bool()
            valid &= bool(weight)  # a weight-0 padding batch still runs (FSDP) but counts no tokens
            h_full, last_logits = last_layer_output(model, ids, attn)
            rec.active = False
            # the root unit (final norm, LM head) stays gathered through this batch's L skip runs
            with root_unsharded(model):
                if n == 0 and method == "kl":
                    check_logits_path(model, h_full, last_logits)
                total[:L] += _batch_scores(model, layers, rec, method, h_full, vocab, chunk, valid)
            total[L] += valid.sum()
    finally:
        rec.remove()
    all_reduce_sum(total)  # one collective for the L sums and the count: exact token means
    return (total[:L] / total[L].clamp(min=1)).cpu()


def _batch_scores(model, layers, rec, method, h_full, vocab, chunk, valid):
    """Sum over the valid tokens of one batch of each layer's score, (L,) float64."""
    # one chunk holds every token: the full model's log p is made once, not once per layer
    single = method == "kl" and valid.numel() <= chunk
    logp_full = _log_probs(model, h_full.flatten(0, -2), vocab) if single else None
    sums = []
    for i in range(len(layers)):
        if method == "bi":
            x, y = _hidden(*rec.calls[i]), rec.outputs[i]
            score = 1 - F.cosine_similarity(x.float(), y.float(), dim=-1)
        else:
            h_skip = _skip_layer_hidden(layers, rec, i)
            score = _chunked_kl(model, h_skip, h_full, vocab, chunk, logp_full)
        sums.append((score.double() * valid).sum())  # float64: summed over every batch
    return torch.stack(sums)


def _skip_layer_hidden(layers, rec, skip):
    """The last layer's output of the model with layer `skip` bypassed, from that layer's recorded
    input."""
    args, kwargs = rec.calls[skip]
    h = _hidden(args, kwargs)  # x_skip: identical in the full and the skip-l model (prefix reuse)
    # replay layers skip+1.. with the recorded kwargs (position embeddings, masks), swapping in the
    # new h
    for j in range(skip + 1, len(layers)):
        a, kw = rec.calls[j]
        a = (h, *a[1:]) if a else a
        kw = kw if a else {**kw, "hidden_states": h}
        out = layers[j](*a, **kw)
        h = out if torch.is_tensor(out) else out[0]
    return h


def _log_probs(model, h, vocab):
    """log p from last-layer outputs h (N, H), in fp32: bf16 logits lose the small probabilities
    that KL sums over. Columns past the tokenizer's vocabulary (embedding padding rows) go."""
    return F.log_softmax(model_logits(model, h)[..., :vocab].float(), dim=-1)


def _chunked_kl(model, h_skip, h_full, vocab, chunk, logp_full=None):
    """KL(p_{-l} || p) = sum_v q_v (log q_v - log p_v) per token, q = p_{-l}, (B, T), from the two
    models' last-layer outputs, `chunk` tokens at a time: each chunk's logits are made, used and
    freed before the next.

    The full model's log p is recomputed per chunk (one more LM head per skipped layer: a few % of a
    paper-scale model's L^2/2 layer calls) unless the caller passes it (`logp_full`, when one chunk
    holds every token); keeping it for all tokens is the T x V tensor this avoids."""
    B, T, _ = h_skip.shape
    q, p = h_skip.reshape(B * T, -1), h_full.reshape(B * T, -1)
    out = []
    for c in range(0, B * T, chunk):
        # log p of this chunk, recomputed unless it was given for all tokens (see the docstring)
        logp = logp_full if logp_full is not None else _log_probs(model, p[c:c + chunk], vocab)
        logq = _log_probs(model, q[c:c + chunk], vocab)
        out.append((logq.exp() * (logq - logp)).sum(-1))
    return torch.cat(out).view(B, T)


class root_unsharded:
    """Under FSDP2 the root unit (the final norm; the embeddings and LM head where they are FSDP's)
    is sharded outside the root's own forward; calling the head directly needs it gathered first.
    A vocabulary-parallel head would gather its rows at every call: gathered once here instead
    (no-grad calls). A no-op without FSDP."""

    def __init__(self, model):
        # duck-typed: FSDP2 adds unshard/reshard to the module's own class; a vocabulary-parallel
        # head (parallel.vocab_parallel) has gather_rows
        self.fsdp = hasattr(model, "unshard") and hasattr(model, "reshard")
        self.model = model
        self.head = model.get_output_embeddings()
        self.rows = hasattr(self.head, "gather_rows")

    def __enter__(self):
        if self.fsdp:
            self.model.unshard()
        if self.rows:
            self.head.gather_rows()

    def __exit__(self, *exc):
        if self.rows:
            self.head.gather_rows(False)
        if self.fsdp:
            self.model.reshard()


def protected_layers(L, n_first=1, n_last=1):
    """Layers that are never pruned (the paper's ablation protects the first and the
    last)."""
    return sorted(set(range(n_first)) | set(range(L - n_last, L)))


def top_k_layers(scores, k, protected=()):
    """The k layers to keep: every protected layer plus the highest-scoring others, sorted."""
    s = torch.as_tensor(scores, dtype=torch.float64).clone()
    s[list(protected)] = float("inf")  # protected layers win every comparison, whatever their score
    return sorted(torch.topk(s, k).indices.tolist())


# -----------------------------------------------------------------------------
# Physical removal and export

# Per-layer settings in the config. Removal renumbers the layers, so every setting keyed by a
# layer's index is rewritten for the kept ones: lists with one value per layer are sliced, index
# lists renumbered, and the index rules of the MoE families turned into an explicit layout and
# written back.

# layers [0, k) dense: DeepSeek-V2/V3, GLM-4-MoE, dots1 (first_k_...), AFMoE, LFM2-MoE (num_...)
_DENSE_PREFIX = ("first_k_dense_replace", "num_dense_layers")
# one value per layer, even where the values read like indices (L <= 2)
_PER_LAYER = ("layer_types", "no_rope_layers")
_INDEX_NAMES = ("layer_idx", "layer_id", "layer_index", "layer_number")  # renumbered, not a layout


def layer_configs(config, L):
    """The config objects that describe these L decoder layers: the model's, or a multimodal
    wrapper's text_config (Gemma3), or both."""
    found = [config] + [v for v in vars(config).values() if hasattr(v, "num_hidden_layers")]
    # a vision tower's config also has num_hidden_layers: only those with L describe these layers
    return [cfg for cfg in found if getattr(cfg, "num_hidden_layers", None) == L]


def _is_index_list(key, value, L):
    """A `*_layers` setting listing layer indices (Qwen-MoE mlp_only_layers, Llama-4
    moe_layers)."""
    return (key.endswith("_layers") and key not in _PER_LAYER and isinstance(value, (list, tuple))
            # bool is an int subclass: a per-layer flag list is no index list
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < L for i in value)
            and len(set(value)) == len(value))


def _qwen_sparse_layers(cfg, L):
    """Qwen2/3-MoE: layer i is sparse iff i is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0."""
    step, dense = cfg.decoder_sparse_step, set(getattr(cfg, "mlp_only_layers", None) or ())
    return {i for i in range(L) if i not in dense and (i + 1) % step == 0}


def _ernie_sparse_layers(cfg, L):
    """ERNIE-4.5-MoE: layer i is sparse iff (i + 1) % interval == 0 and start <= i <= end."""
    start, every = cfg.moe_layer_start_index, cfg.moe_layer_interval
    end = L - 1 if cfg.moe_layer_end_index == -1 else cfg.moe_layer_end_index
    return {i for i in range(L) if (i + 1) % every == 0 and start <= i <= end}


def _rewrite_layer_settings(cfg, keep, L):
    """Rewrite, in place, every per-layer setting of `cfg` (describing L layers) for the layers
    `keep`."""
    new_index = {i: j for j, i in enumerate(keep)}
    has = lambda key: isinstance(getattr(cfg, key, None), int)  # noqa: E731
    # read the MoE layouts BEFORE the loop below rewrites the settings they are computed from
    qwen = _qwen_sparse_layers(cfg, L) if has("decoder_sparse_step") else None
    ernie = _ernie_sparse_layers(cfg, L) if has("moe_layer_interval") else None
    for key, value in list(vars(cfg).items()):
        if key.startswith("_"):
            continue
        if key in _DENSE_PREFIX and isinstance(value, int):
            setattr(cfg, key, sum(i < value for i in keep))  # the kept dense layers stay a prefix
        elif _is_index_list(key, value, L):
            setattr(cfg, key, type(value)(new_index[i] for i in value if i in new_index))
        elif isinstance(value, (list, tuple)) and len(value) == L:
            setattr(cfg, key, type(value)(value[i] for i in keep))
    if qwen is not None:  # any kept layout: every layer may be sparse (step 1), dense ones listed
        cfg.decoder_sparse_step = 1
        cfg.mlp_only_layers = [j for j, i in enumerate(keep) if i not in qwen]
    if ernie is not None:
        sparse = [j for j, i in enumerate(keep) if i in ernie]
        if sparse and sparse != list(range(sparse[0], sparse[-1] + 1)):
            raise E3Error(f"keeping layers {keep} leaves MoE layers {sparse}, which ERNIE's "
                          f"moe_layer_start_index/end_index/interval cannot describe; keep another "
                          f"set")
        cfg.moe_layer_interval = 1
        first, last = (sparse[0], sparse[-1]) if sparse else (len(keep), -1)  # none: an empty range
        cfg.moe_layer_start_index, cfg.moe_layer_end_index = first, last
    cfg.num_hidden_layers = len(keep)


def _layer_signature(layer):
    """What a layer's constructor made of its index: every submodule's type, scalar attributes
    (e.g. `sliding_window`, `use_rope`, `is_moe_layer`) and parameter shapes, the index left out."""
    sig = {}
    for name, mod in layer.named_modules():
        sig[name] = type(mod).__name__
        for k, v in vars(mod).items():
            if (not k.startswith("_") and k not in _INDEX_NAMES + ("training",)
                    and (v is None or isinstance(v, (bool, int, float, str)))):
                sig[f"{name}:{k}"] = v
    for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
        sig[f"{name}:shape"] = tuple(t.shape)
    return sig


def _meta_layers(config):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):  # shapes and types only: no memory, no initialisation cost
        return decoder_layers(AutoModelForCausalLM.from_config(copy.deepcopy(config)))


def pruned_config(config, keep):
    """A copy of `config` for the model that keeps decoder layers `keep` (sorted original indices),
    checked: built on the meta device, its layer j must be what layer keep[j] was
    (_layer_signature). A kept layout that the config cannot express ends with one E3Error line."""
    L = config.get_text_config().num_hidden_layers
    new = copy.deepcopy(config)
    for cfg in layer_configs(new, L):
        _rewrite_layer_settings(cfg, keep, L)
    before, after = _meta_layers(config), _meta_layers(new)
    for j, i in enumerate(keep):
        a, b = _layer_signature(before[i]), _layer_signature(after[j])
        if a != b:
            diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            raise E3Error(f"{config.model_type}: after removal, layer {i} (now {j}) would be built "
                          f"differently ({', '.join(diff[:3])}): its config keys this layer's "
                          f"layout to its index in a way surgery._rewrite_layer_settings does not "
                          f"know; this architecture cannot be pruned")
    return new


def check_removable(config, kept=None):
    """Refuse, before any work, a model whose layers cannot be removed consistently: `kept` checked
    as given, or (kept=None, the search has not chosen yet) two probes that shift every index (drop
    layer 0) and halve it (every other layer), which break any index rule left unrewritten."""
    L = config.get_text_config().num_hidden_layers
    for keep in [sorted(kept)] if kept is not None else [list(range(1, L)), list(range(0, L, 2))]:
        if keep:  # an empty probe (L = 1) has nothing to check
            pruned_config(config, keep)


def remove_layers(model, keep):
    """Keep only the decoder layers `keep` (original indices), in place, and make the model
    consistent: the ModuleList, every attention module's layer_idx (the KV cache is indexed by it),
    every per-layer setting of the config (pruned_config: `layer_types` sliced, MoE layouts
    rewritten), and num_hidden_layers."""
    keep = sorted(keep)
    owner, attr = _layers_owner(model)
    layers = getattr(owner, attr)
    L = len(layers)
    if not keep or keep[-1] >= L or len(set(keep)) != len(keep):
        raise ValueError(f"bad layer list {keep} for {L} layers")
    pruned_config(model.config, keep)  # raises before anything changes
    setattr(owner, attr, nn.ModuleList([layers[i] for i in keep]))
    # the KV cache has k slots after the cut: a kept layer that still says layer_idx 27 would index
    # past the end (or share a slot) once generate() runs with use_cache=True
    for new_idx, layer in enumerate(getattr(owner, attr)):
        for m in layer.modules():
            if isinstance(getattr(m, "layer_idx", None), int):
                m.layer_idx = new_idx
    # in place: the layers' modules hold references to these config objects
    for cfg in layer_configs(model.config, L):
        _rewrite_layer_settings(cfg, keep, L)
    return model


def write_atomically(out_dir, write):
    """Call write(tmp_dir), then rename tmp_dir to out_dir, so a crash never leaves a folder that
    looks done. An existing out_dir (a resumed run re-exporting) is replaced only after the new one
    is complete."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    # beside out_dir, so the rename stays on one filesystem; the pid keeps two exports apart
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier crash
    tmp.mkdir()
    write(tmp)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


# copied byte for byte from a local source: what the user gave, not a re-serialisation
_SOURCE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
                 "merges.txt", "chat_template.jinja", "chat_template.json")


def export(model, tok, out_dir, keep, layers_before, info, source=None):
    """Save `model` (on CPU, unsharded; all `layers_before` original layers, or already pruned to
    `keep`) as a plain HF checkpoint: safetensors, config, tokenizer, generation config, and
    pruning.json with `info` plus the layer lists (original indices). With `source` (a local
    checkpoint folder), its generation config, tokenizer files and chat template are copied over
    those written here."""
    L = layers_before
    if len(decoder_layers(model)) == L:  # still whole: export_pruned hands it in already cut
        remove_layers(model, keep)
    meta = {**info, "layers_before": L, "kept_layers": sorted(keep),
            "removed_layers": sorted(set(range(L)) - set(keep))}

    def write(tmp):
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        # a hub id is no folder: then the files saved just above are all there is
        for name in _SOURCE_FILES if source is not None and Path(source).is_dir() else ():
            if (Path(source) / name).exists():
                shutil.copyfile(Path(source) / name, tmp / name)
        (tmp / "pruning.json").write_text(json.dumps(meta, indent=2) + "\n")

    write_atomically(out_dir, write)
    return meta


def source_dtype(config):
    """The dtype the source checkpoint was saved in (config `dtype`, `torch_dtype` before
    transformers 5); fp32 when it does not say."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def cast_as_saved(model, dtype):
    """Cast the model to `dtype` as from_pretrained(dtype=...) would hold it, and so as
    save_pretrained wrote the source: all of it, except the tensors its class keeps in fp32 at that
    dtype. transformers' rule (PreTrainedModel._get_dtype_plan): `_keep_in_fp32_modules_strict` at
    fp16 and bf16 (DeepSeek-V2/V3's router weight and score-correction bias since transformers
    5.24), `_keep_in_fp32_modules` at fp16 only; each entry a glob searched in the tensor's name."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) \
        if dtype in (torch.float16, torch.bfloat16) else set()
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    pattern = re.compile("|".join(f"(?:{g.replace('*', '.*')})" for g in sorted(keep))) \
        if keep else None
    # each tensor cast once, straight to its own dtype (fp32 -> bf16 -> fp32 would round it)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(torch.float32 if pattern and pattern.search(name) else dtype)
    return model


def export_pruned(source, state, kept, layers_before, tok, out_dir, info):
    """Export the pruned model as the user gave the source, with no second full copy of the weights:

    the source model is built on the meta device from its config, pruned to `kept`, handed the
    gathered full `state` (fp32 master weights, keys of the pruned model) with assign=True, re-tied,
    cast back to the SOURCE checkpoint's dtype (bf16 stays bf16), given the source's generation
    config, and written atomically with its tokenizer files, chat template and pruning.json
    (export)."""
    from transformers import AutoConfig, GenerationConfig
    dtype = source_dtype(AutoConfig.from_pretrained(source))  # before from_config writes fp32
    model, _ = load_model(source, "cpu", torch.float32, weights=False)
    remove_layers(model, kept)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign replaced the shared embedding/LM-head tensor by two copies
    cast_as_saved(model, dtype)  # bf16 stays bf16, and what the class keeps in fp32 stays fp32
    model.config.dtype = dtype
    try:  # the source's EOS list, temperature, top_p...; defaults only when it has none
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        pass
    return export(model, tok, out_dir, kept, layers_before, info, source=source)


