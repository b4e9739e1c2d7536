"""
Layer surgery on Hugging Face causal LMs, shared by prune.py, evaluate.py and bench.py:

  decoder_layers(model)          the decoder-layer ModuleList (SPEC notation: "a layer")
  LayerGates(model)              the masked forward  X_{l+1} = X_l + m_l * (f(X_l) - X_l)   (paper 3.1, SPEC 2)
  layer_importance(model, ...)   s_l by KL(p_{-l} || p) with prefix reuse, or ShortGPT's BI   (paper 3.2, SPEC 1)
  remove_layers(model, keep)     physical removal: ModuleList, layer_idx, per-layer config lists (SPEC 5)
  export(model, tok, out, ...)   a plain HF checkpoint + pruning.json, written atomically        (SPEC 5)

HF decoder layers already add their own residuals, so f(X_l) in the paper's eq. 1 is `layer(x) - x` here.
"""
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common import E3Error, all_reduce_sum

_LAYER_PATHS = ("model.layers", "model.language_model.layers", "model.decoder.layers", "transformer.h",
                "gpt_neox.layers", "transformer.blocks")


def _layers_owner(model):
    """(module holding the decoder-layer list, attribute name)."""
    for path in _LAYER_PATHS:
        *parents, attr = path.split(".")
        owner = model
        for p in parents:
            owner = getattr(owner, p, None)
        if isinstance(getattr(owner, attr, None), nn.ModuleList):
            return owner, attr
    raise E3Error(f"{type(model).__name__} has no decoder-layer list (looked for {', '.join(_LAYER_PATHS)}); "
                  f"add its path to surgery._LAYER_PATHS")


def decoder_layers(model):
    owner, attr = _layers_owner(model)
    return getattr(owner, attr)


def _hidden(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _replace_hidden(output, new):
    """Decoder layers return a tensor (transformers >= 5) or a tuple whose first item is the hidden state."""
    return new if torch.is_tensor(output) else (new, *output[1:])


class LayerGates:
    """Forward hooks that turn every decoder layer l into   out = x + m_l * (layer(x) - x).

    Computed by torch.lerp(x, layer(x), m): the same function and gradient d out / d m = layer(x) - x in
    one fused kernel, and exact at the ends (lerp returns the layer's output bit-exactly when m = 1 and
    the input when m = 0), so a hard-masked model and the physically pruned model agree exactly.
    A layer with m_l = 0 still runs: its delta is the gradient signal for its score (SPEC 2).
    `mask = None` switches the gates off. Hooks keep the state-dict keys and FSDP units untouched.
    """

    def __init__(self, model):
        self.mask = None
        self.handles = [layer.register_forward_hook(self._hook(i), with_kwargs=True)
                        for i, layer in enumerate(decoder_layers(model))]

    def _hook(self, i):
        def gate(module, args, kwargs, output):
            if self.mask is None:
                return None
            x = _hidden(args, kwargs)
            y = output if torch.is_tensor(output) else output[0]
            return _replace_hidden(output, torch.lerp(x, y, self.mask[i].to(y.dtype)))
        return gate

    def remove(self):
        for h in self.handles:
            h.remove()


# -----------------------------------------------------------------------------
# Layer importance (SPEC 1)

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


def lm_head_logits(model, h):
    """Logits from the last decoder layer's output: final norm, LM head, and the final-logit
    soft-capping that Gemma-2/3 apply. Mirrors the model's own forward after its layer loop."""
    owner, _ = _layers_owner(model)
    h = owner.norm(h)
    logits = model.get_output_embeddings()(h)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _kl_per_token(logits_q, logp):
    """KL(q || p) per token, q from logits (upcast to fp32), p given as log-probabilities."""
    logq = F.log_softmax(logits_q.float(), dim=-1)
    return (logq.exp() * (logq - logp)).sum(-1)


@torch.no_grad()
def layer_importance(model, batches, method="kl", vocab=None, generator=None):
    """Per-layer importance s (float64, length L; larger = more important), SPEC 1.

    batches: iterable of (input_ids, attention_mask or None, weight) with weight 0 for the padding
    batches that keep every FSDP rank running the same number of forwards. Pad positions never count.
      kl:     s_l = mean_tokens KL(p_{-l} || p), p the full model, p_{-l} the model with layer l bypassed.
              Prefix reuse: the input of layer l is the same in both models, so the skip-l run starts
              there and calls only layers l+1..L-1 (about L^2/2 layer calls instead of L(L+1)).
      bi:     ShortGPT's Block Influence, s_l = mean_tokens 1 - cos(x_l, x_{l+1}), read with hooks.
      random: i.i.d. N(0, 1) scores from `generator`, for ablations.
    Under torchrun every rank calls this with its own share of batches; totals are all-reduced.
    """
    layers = decoder_layers(model)
    L = len(layers)
    if method == "random":
        return torch.randn(L, generator=generator, dtype=torch.float64)
    dev = next(model.parameters()).device
    total = torch.zeros(L + 1, dtype=torch.float64, device=dev)  # L sums, then the token count
    rec = _Recorder(layers)
    try:
        for ids, attn, weight in batches:
            ids = ids.to(dev)
            # one full forward records every layer's input (for kl's prefix reuse, and x_l for bi) and output
            rec.active = True
            valid = torch.ones_like(ids, dtype=torch.bool) if attn is None else attn.to(dev).bool()
            valid &= bool(weight)  # a weight-0 padding batch still runs (FSDP) but counts no tokens
            logits = model(input_ids=ids, attention_mask=None if attn is None else attn.to(dev), use_cache=False).logits
            if vocab:
                logits = logits[..., :vocab]
            rec.active = False
            # log p of the full model, once per batch: the reference of all L KL terms (fp32: bf16 logits
            # lose the small probabilities that KL sums over)
            logp = F.log_softmax(logits.float(), dim=-1) if method == "kl" else None
            for i in range(L):
                if method == "bi":
                    x, y = _hidden(*rec.calls[i]), rec.outputs[i]
                    score = 1 - F.cosine_similarity(x.float(), y.float(), dim=-1)
                elif method == "kl":
                    score = _kl_per_token(_skip_layer_logits(model, layers, rec, i)[..., : logp.shape[-1]], logp)
                else:
                    raise ValueError(f"unknown importance method {method!r}")
                total[i] += (score.double() * valid).sum()
            total[L] += valid.sum()
    finally:
        rec.remove()
    all_reduce_sum(total)
    return (total[:L] / total[L].clamp(min=1)).cpu()


def _skip_layer_logits(model, layers, rec, skip):
    """Logits of the model with layer `skip` bypassed, starting from the recorded input of that layer."""
    args, kwargs = rec.calls[skip]
    h = _hidden(args, kwargs)  # x_skip: identical in the full and the skip-l model (prefix reuse)
    # replay layers skip+1.. with the recorded kwargs (position embeddings, masks), swapping in the new h
    for j in range(skip + 1, len(layers)):
        a, kw = rec.calls[j]
        a = (h, *a[1:]) if a else a
        kw = kw if a else {**kw, "hidden_states": h}
        out = layers[j](*a, **kw)
        h = out if torch.is_tensor(out) else out[0]
    with _root_unsharded(model):
        return lm_head_logits(model, h)


class _root_unsharded:
    """Under FSDP2 the root unit (embeddings, final norm, LM head) is sharded outside the root's own
    forward; calling the head directly needs it gathered first. A no-op without FSDP."""

    def __init__(self, model):
        self.fsdp = hasattr(model, "unshard") and hasattr(model, "reshard")
        self.model = model

    def __enter__(self):
        if self.fsdp:
            self.model.unshard()

    def __exit__(self, *exc):
        if self.fsdp:
            self.model.reshard()


def protected_layers(L, n_first=1, n_last=1):
    """Layers that are never pruned (the paper's ablation protects the first and the last)."""
    return sorted(set(range(n_first)) | set(range(L - n_last, L)))


def top_k_layers(scores, k, protected=()):
    """The k layers to keep: every protected layer plus the highest-scoring others, sorted."""
    s = torch.as_tensor(scores, dtype=torch.float64).clone()
    s[list(protected)] = float("inf")  # protected layers win every comparison, whatever their score
    return sorted(torch.topk(s, k).indices.tolist())


# -----------------------------------------------------------------------------
# Physical removal and export (SPEC 5)

def layer_configs(model):
    """The model's config and its sub-configs that may count decoder layers: multimodal wrappers
    (Gemma3) keep the decoder's numbers in a sub-config (text_config)."""
    return [model.config] + [v for v in vars(model.config).values() if hasattr(v, "num_hidden_layers")]


def remove_layers(model, keep):
    """Keep only the decoder layers `keep` (original indices), in place, and make the model consistent:
    the ModuleList, every attention module's layer_idx (the KV cache is indexed by it), every per-layer
    list in the config (e.g. Gemma3's `layer_types`), and num_hidden_layers."""
    keep = sorted(keep)
    owner, attr = _layers_owner(model)
    layers = getattr(owner, attr)
    L = len(layers)
    if not keep or keep[-1] >= L or len(set(keep)) != len(keep):
        raise ValueError(f"bad layer list {keep} for {L} layers")
    setattr(owner, attr, nn.ModuleList([layers[i] for i in keep]))
    # the KV cache has k slots after the cut: a kept layer that still says layer_idx 27 would index past
    # the end (or share a slot) once generate() runs with use_cache=True
    for new_idx, layer in enumerate(getattr(owner, attr)):
        for m in layer.modules():
            if isinstance(getattr(m, "layer_idx", None), int):
                m.layer_idx = new_idx
    # Any list of length L in a config that describes these L layers is taken to be per-layer.
    for cfg in layer_configs(model):
        if getattr(cfg, "num_hidden_layers", None) != L:
            continue
        for key, value in list(vars(cfg).items()):
            if isinstance(value, (list, tuple)) and len(value) == L and not key.startswith("_"):
                setattr(cfg, key, type(value)(value[i] for i in keep))
        cfg.num_hidden_layers = len(keep)
    return model


def write_atomically(out_dir, write):
    """Call write(tmp_dir), then rename tmp_dir to out_dir, so a crash never leaves a folder that looks
    done. An existing out_dir (a resumed run re-exporting) is replaced only after the new one is complete."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def export(model, tok, out_dir, keep, layers_before, info):
    """Save `model` (on CPU, unsharded; all `layers_before` original layers, or already pruned to `keep`)
    as a plain HF checkpoint: safetensors, config, tokenizer, generation config, and pruning.json with
    `info` plus the layer lists (original indices)."""
    L = layers_before
    if len(decoder_layers(model)) == L:
        remove_layers(model, keep)
    meta = {**info, "layers_before": L, "kept_layers": sorted(keep),
            "removed_layers": sorted(set(range(L)) - set(keep))}

    def write(tmp):
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "pruning.json").write_text(json.dumps(meta, indent=2) + "\n")

    write_atomically(out_dir, write)
    return meta
