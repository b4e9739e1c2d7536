"""
Offline top-K knowledge distillation and its entropy-weighted ("adaptive") form (paper Sec. 3.3).

For token i, with the teacher's top-K ids c, their log-probabilities log p_t,c under the
teacher's FULL softmax (pre-computed by cache_teacher.py) and the student's
log p_s = log_softmax(z_s) in fp32:

    L_token(i) = sum_{c in top-K} p_t,c * (log p_t,c - log p_s,c)           (eq. 12, left)
    kd:   L = 1/N sum_i L_token(i)                                          (eq. 12, right)
    akd:  L = 1/N sum_i H_t(i) * L_token(i),   H_t the teacher's entropy    (eq. 13)

N counts valid (non-pad) tokens only. With K = V, L_token is the full KL(p_t || p_s). Next-token
cross-entropy is the same sum with K = 1, c = the next token and log p_t,c = 0 (a one-hot teacher).

head_kd_loss computes the same losses from the last hidden states h and the LM head (W, b), with
z = post(W h + b) made `chunk_tokens` tokens at a time and dL/dz turned into dL/dh and dL/dW at
once: no (T, V) tensor ever exists (Qwen's V = 152K at 4096 tokens: 2.5 GB a copy in fp32).
"""
import torch
import torch.nn.functional as F


def _token_losses(logits, topk_ids, topk_logprobs):
    """L_token for a chunk of tokens: logits (n, V) any float dtype, ids/logprobs (n, K); the
    log-softmax in fp32 (bf16 logits are upcast)."""
    logp_s = F.log_softmax(logits.float(), dim=-1).gather(-1, topk_ids)
    logp_t = topk_logprobs.float()
    return (logp_t.exp() * (logp_t - logp_s)).sum(-1)


# -----------------------------------------------------------------------------
# The LM head and the loss fused, chunk by chunk over tokens (no (T, V) logits)

def _chunk_grads(h, weight, bias, post, ids, logprobs, w, need_grad):
    """For one chunk: sum_i w_i L_token(i) with z = post(W h + b), and, when need_grad, dL/dz_lin
    (z_lin = W h + b, in the head's dtype). Local autograd through post (soft-capping, a logit
    scale: elementwise) and the fp32 log-softmax; the chunk's temporaries die here."""
    z_lin = F.linear(h, weight, bias)
    if not need_grad:
        return (w * _token_losses(post(z_lin), ids, logprobs)).sum(), None
    with torch.enable_grad():
        z_lin = z_lin.detach().requires_grad_(True)
        loss = (w * _token_losses(post(z_lin), ids, logprobs)).sum()
        (dz,) = torch.autograd.grad(loss, z_lin)
    return loss.detach(), dz


def _head_losses(h, weight, bias, post, ids, logprobs, w, chunk, need=(False, False, False)):
    """sum_i w_i L_token(i), z_i = post(W h_i + b), `chunk` tokens at a time (h: (n, d), W: (V, d)),
    and the gradients `need` asks for (of h, W, b), made chunk by chunk: dL/dh = dz W,
    dL/dW = sum dz^T h, dL/db = sum dz. Three matmuls, as the unfused head + loss has."""
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if need[0] else None
    # accumulated in place, one V x d buffer (autograd summing per-chunk products would hold two),
    # in at least fp32: a bf16 sum over many chunks drifts; autograd rounds it to W's dtype once
    acc = torch.promote_types(weight.dtype, torch.float32)
    dW = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need[1] else None
    db = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need[2] else None
    if torch.is_autocast_enabled(h.device.type):  # one GPU: cast W to bf16 once, not per chunk
        cast = torch.get_autocast_dtype(h.device.type)
        weight, bias = weight.to(cast), bias.to(cast) if bias is not None else None
    for a in range(0, h.shape[0], chunk):
        sl = slice(a, a + chunk)
        loss, dz = _chunk_grads(h[sl], weight, bias, post, ids[sl], logprobs[sl], w[sl], any(need))
        total += loss
        if dh is not None:
            dh[sl] = dz @ weight
        if dW is not None and dz.dtype == dW.dtype:  # fp32: in place, no V x d temporary
            dW.addmm_(dz.t(), h[sl].to(dz.dtype))
        elif dW is not None:  # bf16: the chunk's product in bf16 (half a V x d), summed in fp32
            dW += dz.t() @ h[sl].to(dz.dtype)
        if db is not None:
            db += dz.sum(0)
    return total, dh, dW, db


class _HeadTokenLosses(torch.autograd.Function):
    """_head_losses as an autograd node. The gradients are made in the forward (the loss is the
    graph's end, so dL/dz is known there up to the one scalar the backward brings) and nothing of
    size (n, V) is kept: the backward only scales them (Liger-Kernel's fused linear cross-entropy
    does the same for CE). No weight is saved either: under FSDP the head's unit may reshard."""

    @staticmethod
    def forward(ctx, h, weight, bias, post, ids, logprobs, w, chunk):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        total, *ctx.grads = _head_losses(h, weight, bias, post, ids, logprobs, w, chunk, need)
        return total

    @staticmethod
    def backward(ctx, g):
        if ctx.grads is None:
            raise RuntimeError("head_kd_loss supports one backward (its gradients were made in the "
                               "forward, and no graph is kept for a second or higher-order one)")
        grads, ctx.grads = ctx.grads, None
        # g: dObjective/dLoss, a scalar (1 / N, 1 / the micro-batch count...); in place, no copy
        scaled = [t.mul_(g.to(t.dtype)) if t is not None else None for t in grads]
        return (*scaled, None, None, None, None, None)


def head_kd_loss(hidden, weight, bias, topk_ids, topk_logprobs, entropy=None, mask=None,
                 post=None, vocab=None, chunk_tokens=256):
    """The top-K KD loss, a scalar: eq. 12 (entropy None: kd) or eq. 13 (entropy (B, T) = H_t: akd)
    of the student logits z = post(hidden W^T + b)[..., :vocab], which are never made whole.
    hidden (B, T, d); the head's weight (V, d) and bias (V) or None; topk_ids, topk_logprobs
    (B, T, K); mask (B, T) bool or None (False = padding: no loss, no gradient); post the model's
    logit transform (None: identity); vocab: the head's first rows only (a padded embedding's extra
    rows get no gradient). At most `chunk_tokens` x V logits exist at once: lower it when memory
    is tight, raise it for GPU throughput (each chunk reads W once). Logits given directly: pass
    them as `hidden` with an identity `weight`."""
    d = hidden.shape[-1]
    h = hidden.reshape(-1, d)
    ids = topk_ids.reshape(-1, topk_ids.shape[-1]).long()
    logprobs = topk_logprobs.reshape(ids.shape).float()
    w = torch.ones(ids.shape[0], device=h.device, dtype=torch.float32)
    if entropy is not None:  # akd: token i weighs H_t(i) (eq. 13); kd: every token weighs 1
        w = w * entropy.reshape(-1).float()
    if mask is not None:  # padding leaves first: no memory, no loss, no gradient
        keep = mask.reshape(-1).bool()
        h, ids, logprobs, w = h[keep], ids[keep], logprobs[keep], w[keep]
    if vocab is not None and vocab < weight.shape[0]:
        weight, bias = weight[:vocab], bias[:vocab] if bias is not None else None
    post = post or (lambda z: z)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (h, weight, bias)):
        total = _HeadTokenLosses.apply(h, weight, bias, post, ids, logprobs, w, chunk_tokens)
    else:  # no backward will follow (validation, a search's fitness): the loss alone
        total = _head_losses(h, weight, bias, post, ids, logprobs, w, chunk_tokens)[0]
    return total / max(h.shape[0], 1)  # 1/N over the valid tokens; none (all padding) gives 0


def next_token_targets(input_ids, mask=None):
    """Cross-entropy as a top-1 KD target: c = the next token, log p_t,c = 0 (ids, log-probs, and
    which positions count: not the last, which has no next token, nor padding)."""
    ids = input_ids.roll(-1, dims=1)[..., None]
    valid = torch.ones_like(input_ids, dtype=torch.bool)
    valid[:, -1] = False
    if mask is not None:
        valid &= mask.bool() & mask.bool().roll(-1, dims=1)
    return ids, torch.zeros(ids.shape, dtype=torch.float32, device=ids.device), valid
