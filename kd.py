"""
Offline top-K knowledge distillation and its entropy-weighted ("adaptive") form (paper Sec. 3.3).

For token i, with the teacher's top-K ids c, their log-probabilities log p_t,c under the
teacher's FULL softmax (pre-computed by cache_teacher.py) and the student's
log p_s = log_softmax(z_s) in fp32:

    L_token(i) = sum_{c in top-K} p_t,c * (log p_t,c - log p_s,c)           (eq. 12, left)
    kd:   L = 1/N sum_i L_token(i)                                          (eq. 12, right)
    akd:  L = 1/N sum_i H_t(i) * L_token(i),   H_t the teacher's entropy    (eq. 13)

N counts valid (non-pad) tokens only. With K = V, L_token is the full KL(p_t || p_s).
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _token_losses(logits, topk_ids, topk_logprobs):
    """L_token for a chunk of tokens: logits (n, V) any float dtype, ids/logprobs (n, K)."""
    logp_s = F.log_softmax(logits.float(), dim=-1).gather(-1, topk_ids)
    logp_t = topk_logprobs.float()
    return (logp_t.exp() * (logp_t - logp_s)).sum(-1)


def topk_kd_loss(student_logits, topk_ids, topk_logprobs, entropy=None, mask=None,
                 chunk_tokens=2048):
    """Top-K KD loss, scalar. student_logits (B,T,V); topk_ids, topk_logprobs (B,T,K); entropy (B,T)
    or None (given = akd, eq. 13); mask (B,T) bool or None (False = padding: no loss, no gradient).

    The fp32 log-softmax over a 152K vocabulary is the memory hog (4 bytes x V per token), so tokens
    are processed in chunks, each under activation checkpointing: only one chunk's fp32 copy ever
    exists, in the forward pass and again when the backward pass recomputes it.
    """
    V = student_logits.shape[-1]
    logits = student_logits.reshape(-1, V)
    ids = topk_ids.reshape(-1, topk_ids.shape[-1]).long()
    logprobs = topk_logprobs.reshape(ids.shape)
    weight = torch.ones(ids.shape[0], device=logits.device, dtype=torch.float32)
    if entropy is not None:  # akd: token i weighs H_t(i) (eq. 13); kd: every token weighs 1
        weight = weight * entropy.reshape(-1).float()
    if mask is not None:  # padding leaves before the log-softmax: no memory, no loss, no gradient
        keep = mask.reshape(-1).bool()
        logits, ids, logprobs, weight = logits[keep], ids[keep], logprobs[keep], weight[keep]
    n = ids.shape[0]
    total = logits.new_zeros((), dtype=torch.float32)
    for a in range(0, n, chunk_tokens):
        args = (logits[a:a + chunk_tokens], ids[a:a + chunk_tokens], logprobs[a:a + chunk_tokens])
        # no backward will follow (validation, a search's fitness): nothing to recompute for
        if torch.is_grad_enabled() and logits.requires_grad:
            per_token = checkpoint(_token_losses, *args, use_reentrant=False)
        else:
            per_token = _token_losses(*args)
        total = total + (weight[a:a + chunk_tokens] * per_token).sum()
    return total / max(n, 1)  # 1/N over the valid tokens; a batch with none gives 0, not NaN


def sft_loss(student_logits, input_ids, mask=None):
    """Next-token cross-entropy on the data (the `--loss sft` baseline), fp32, pads ignored."""
    logits = student_logits[:, :-1].float()
    labels = input_ids[:, 1:].clone()  # position t predicts token t + 1
    if mask is not None:
        labels[~mask[:, 1:].bool()] = -100  # cross_entropy's ignore_index
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100)
