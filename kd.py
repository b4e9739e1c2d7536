"""
Distillation from the teacher's cached top-K (paper Sec. 3.3), as plain functions of the student's
logits, differentiated by autograd: the reference a fork edits. A new loss is a function here and an
entry in LOSSES; prune.py's --loss picks one by name.

For token i, the teacher's top-K ids c with their log-probabilities log p_t,c under the teacher's
FULL softmax (cache_teacher.py), and the student's log p_s = log_softmax(z_s), in fp32:

    L_token(i) = sum_{c in top-K} p_t,c (log p_t,c - log p_s,c)         (eq. 12, left)
    kd:   L = 1/N sum_i L_token(i)                                      (eq. 12, right)
    akd:  L = 1/N sum_i H_t(i) L_token(i),  H_t the teacher's entropy   (eq. 13)
    sft:  L = 1/N sum_i -log p_s,i(x_{i+1})                             next-token cross-entropy

N counts the valid (non-padding) tokens. With K = V, L_token is the full KL(p_t || p_s). Each token's
sum runs over the teacher's top K only: the loss has no term for the student's mass on the other
V - K tokens, and its minimum, p_s,c = p_t,c / sum_K p_t, puts none there.

Under torchrun (or --logit-chunk) prune.py computes these losses with the LM head fused in, chunk by
chunk over tokens (scale/fused_loss.py), and checks at its first call that it agrees with the
function here: a loss the fused path does not implement is refused, never replaced by eq. 12.
"""
import torch.nn.functional as F


def masked_mean(x, mask=None):
    """Mean over the positions where mask is True (all when None): padding gets no loss."""
    if mask is None:
        return x.mean()
    mask = mask.bool()
    return (x * mask).sum() / mask.sum().clamp(min=1)


def token_kl(student_logits, topk_ids, topk_logprobs):
    """L_token of eq. 12 at every position: logits (..., V), ids and log-probs (..., K) -> (...)."""
    logp_s = F.log_softmax(student_logits.float(), dim=-1).gather(-1, topk_ids)
    logp_t = topk_logprobs.float()
    return (logp_t.exp() * (logp_t - logp_s)).sum(-1)


def topk_kd_loss(student_logits, topk_ids, topk_logprobs, entropy=None, mask=None):
    """Eq. 12 (entropy None: kd), or eq. 13 (entropy = H_t, (B, T): akd, each token weighted by how
    uncertain the teacher is), a scalar. Shapes (B, T, V), (B, T, K), (B, T, K), mask (B, T) bool."""
    per_token = token_kl(student_logits, topk_ids, topk_logprobs)
    if entropy is not None:
        per_token = per_token * entropy.float()
    return masked_mean(per_token, mask)


def next_token_loss(logits, input_ids, mask=None):
    """Cross-entropy of position t on token t + 1 (the last position has no next token)."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, input_ids[:, 1:, None])[..., 0]
    return masked_mean(nll, None if mask is None else mask[:, :-1].bool() & mask[:, 1:].bool())


# --loss NAME: a function of the student's logits (B, T, V) and a batch of the teacher cache
LOSSES = {
    "akd": lambda logits, b: topk_kd_loss(logits, b["topk_ids"], b["topk_logprobs"],
                                          b["entropy"], b.get("mask")),
    "kd": lambda logits, b: topk_kd_loss(logits, b["topk_ids"], b["topk_logprobs"],
                                         mask=b.get("mask")),
    "sft": lambda logits, b: next_token_loss(logits, b["input_ids"], b.get("mask")),
}
