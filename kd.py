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

N counts the positions that count: not padding, and in a cache built --assistant-only only those
whose next token is the assistant's (kd.positions). With K = V, L_token is the full KL(p_t || p_s).
Each token's sum runs over the teacher's top K only: the loss has no term for the student's mass
on the other V - K tokens, and its minimum, p_s,c = p_t,c / sum_K p_t, puts none there.

Beyond the paper, targets without that bias (kd.TARGETS: tail, sampled, hybrid, full; each batch's
"targets" names its kind): baselines/targets.py. AKD's weight H_t is the teacher's full-softmax
entropy whichever targets (eq. 13).

Under torchrun (or --logit-chunk) the LM head runs fused with these losses (scale/fused_loss.py),
checked against the functions here at its first call: a loss it does not implement is refused.
"""
import importlib

import torch
import torch.nn.functional as F


def masked_mean(x, mask=None):
    """Mean over the positions where mask is True (all when None): padding gets no loss."""
    if mask is None:
        return x.mean()
    mask = mask.bool()
    return (x * mask).sum() / mask.sum().clamp(min=1)


def positions(batch):
    """Which positions' losses count, (B, T) bool, or None for all: not padding ("mask"), and
    those whose next token the loss predicts ("loss_mask": a chat's assistant turns)."""
    masks = [batch[k].bool() for k in ("mask", "loss_mask") if batch.get(k) is not None]
    return masks[0] & masks[-1] if masks else None


def counted(loss_mask, kind):  # the positions of a row kd.LOSSES[kind] averages over (sft: t + 1)
    return loss_mask[:, :-1] if kind == "sft" else loss_mask


def token_kl(logp_s, topk_ids, topk_logprobs):
    """L_token of eq. 12 at every position: the student's log-probs (..., V), the teacher's ids and
    log-probs (..., K) -> (...). Every target's L_token takes the log-probs (kd_loss makes them)."""
    logp_t = topk_logprobs.float()
    return (logp_t.exp() * (logp_t - logp_s.gather(-1, topk_ids))).sum(-1)


def beyond():  # the targets beside the paper's (baselines/targets.py), imported when a batch has them
    return importlib.import_module("baselines.targets")


# L_token of each kind of teacher targets: fn(the student's log-probs (B, T, V), batch) -> (B, T)
TARGETS = {
    "topk": lambda lp, b: token_kl(lp, b["topk_ids"], b["topk_logprobs"]),
    "tail": lambda lp, b: token_kl(lp, b["topk_ids"], b["topk_logprobs"])
    + beyond().tail_term(lp, b["topk_ids"], b["topk_logprobs"]),
    "sampled": lambda lp, b: beyond().sampled_token_kl(lp, b["sample_ids"]),
    "hybrid": lambda lp, b: token_kl(lp, b["topk_ids"], b["topk_logprobs"])
    + beyond().hybrid_term(lp, b["topk_logprobs"], b["sample_ids"]),
    "full": lambda lp, b: beyond().full_token_kl(lp, b["teacher_logits"][..., :lp.shape[-1]])}


def kd_loss(student_logits, batch, weighted):
    """Eq. 12 (weighted False: kd) or eq. 13 (True: akd) over the batch's targets, a scalar."""
    logp_s = F.log_softmax(student_logits.float(), dim=-1)  # once, whichever the targets (fp32)
    per_token = TARGETS[batch.get("targets", "topk")](logp_s, batch)
    if weighted:
        per_token = per_token * batch["entropy"].float()
    return masked_mean(per_token, positions(batch))


def next_token_loss(logits, input_ids, mask=None, loss_mask=None):
    """Cross-entropy of position t on token t + 1 (the last position has no next token); mask:
    padding (both tokens must be real), loss_mask: the positions that count (kd.positions)."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, input_ids[:, 1:, None])[..., 0]
    return masked_mean(nll, positions({
        "mask": None if mask is None else mask[:, :-1].bool() & mask[:, 1:].bool(),
        "loss_mask": None if loss_mask is None else counted(loss_mask, "sft")}))


# --loss NAME: a function of the student's logits (B, T, V) and a batch of the teacher cache
LOSSES = {
    "akd": lambda logits, b: kd_loss(logits, b, weighted=True),
    "kd": lambda logits, b: kd_loss(logits, b, weighted=False),
    "sft": lambda logits, b: next_token_loss(logits, b["input_ids"], b.get("mask"), b.get("loss_mask"))}
