"""
What each family does between its last decoder layer and its logits, for the code that computes the
logits itself from the last layer's output, a chunk of tokens at a time (the fused head + loss and
the chunked teacher of scale/). The plain path never needs it: it reads model(x).logits.

  final_norm(model)       the final norm (`norm`, `ln_f`, `final_layer_norm`, ...) and OPT's
                          project_out
  logit_transform(model)  what the forward applies after the LM head: Cohere's z * logit_scale
                          (Falcon-H1's, HyperCLOVA X's multipliers), Granite's z / logits_scaling,
                          Gemma-2/3's soft-capping c tanh(z / c)
  model_logits(model, h)  post(W_out norm(h_L)): the model's own logits
A family with another name or transform is caught by scale/fused_loss.check_logits_path before it
caches or scores a near relative of its distribution.
"""
import torch
from torch import nn

from surgery import layers_owner

FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")


def final_norm(model):
    """What the decoder applies to the last layer's output before the LM head: its final norm,
    `norm` (Llama and most), `ln_f` (GPT-2, Falcon, Bloom), `final_layer_norm` (GPT-NeoX, OPT),
    `final_layernorm` (Phi) or `norm_f` (MPT), then OPT's `project_out` where the embedding is
    narrower than the layers. OPT-350m has no final norm; check_logits_path catches a name this list
    misses."""
    owner, _ = layers_owner(model)
    norms = [getattr(owner, n) for n in FINAL_NORMS if getattr(owner, n, None) is not None]
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
    """post(z): what the model's forward applies after the LM head, elementwise: a multiplier
    (Cohere's logit_scale, Falcon-H1's lm_head_multiplier, HyperCLOVA X's logits_scaling), Granite's
    division by logits_scaling, then Gemma-2/3's soft-capping c tanh(z / c); identity for the
    others."""
    cfg = model.config.get_text_config()
    cap = getattr(cfg, "final_logit_softcapping", None)
    scaling = getattr(cfg, "logits_scaling", None)  # Granite (MoE) divides by it ...
    mult = getattr(cfg, "lm_head_multiplier", None)
    if cfg.model_type.startswith("hyperclovax"):  # ... HyperCLOVA X multiplies by it
        mult, scaling = scaling, None
    # Cohere multiplies by a float attribute (CLIP-like models hold a tensor of that name)
    scale = getattr(model, "logit_scale", None)
    scale = None if torch.is_tensor(scale) else scale

    def post(z):
        for m in (scale, mult):
            z = z if m is None else z * m
        if scaling is not None:
            z = z / scaling
        if cap is not None:
            z = torch.tanh(z / cap) * cap
        return z
    return post
