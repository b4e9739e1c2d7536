"""
Teacher targets beside the paper's top-K (kd.TARGETS names them; each batch's "targets" its kind),
off the plain path: eq. 12's sum over the teacher's top K has no term for the student's mass on the
other V - K tokens, and its minimum, p_s,c = p_t,c / sum_K p_t, puts none there. These add the term:

  tail     K + 1 classes: the top-K and the rest lumped, 1 - sum_K p_t against the student's own
           mass off those K (prune.py --kd-tail, any top-K cache)
  sampled  N raw draws a position x_j ~ p_t, repeats kept (cache_teacher.py --targets sampled):
           the KL from their empirical distribution, whose gradient is the full KL's in
           expectation, as in Anshumann et al.'s "Sparse Logit Sampling" (arXiv 2503.16870), which
           stores the distinct tokens of more draws with their weights instead
  hybrid   the top-K exactly, N draws from the rest (--targets hybrid): eq. 12's sum + r_t times the
           rest's sampled KL, r_t = 1 - sum_K p_t; unbiased, the variance ~r_t^2 times sampled's
  full     the teacher's whole distribution, run beside the student (--kd-full, one process)

The cache's side (draws) and the loss's side (each kind's term beyond eq. 12's sum) are here; kd.py
adds eq. 12's sum where a kind has one. AKD's weight H_t is the teacher's full-softmax entropy
whichever targets (eq. 13).
"""
import hashlib

import torch
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# The cache: draws from the teacher's softmax

def draw(logp, topk_ids, samples, generator):
    """sample_ids (n, samples): x_j ~ p_t (topk_ids None), or ~ its rest, the softmax with the top-K
    set to 0 (hybrid); with replacement: an unbiased picture of it."""
    p = logp.exp().scatter_(-1, topk_ids, 0) if topk_ids is not None else logp.exp()
    p[p.sum(-1) == 0] = 1  # no rest left (all mass in the top-K): its weight is 0
    return torch.multinomial(p, samples, True, generator=generator)


def shard_generator(identity, split_name, j, device):
    """A sampled cache's draws for shard j, seeded by the cache and the shard: a shard recomputed
    after a kill, or on another rank, draws the same tokens."""
    key = f"{identity['sample_seed']}/{split_name}/{j}".encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return torch.Generator(device).manual_seed(seed)


# -----------------------------------------------------------------------------
# The loss: each kind's L_token, or its term beyond eq. 12's sum (kd.TARGETS adds the sum)

def rest_mass(topk_logprobs):  # r_t = 1 - the teacher's top-K mass, from the stored (rounded) top-K
    return (1 - topk_logprobs.float().exp().sum(-1)).clamp(min=0)


def tail_term(logp_s, topk_ids, topk_logprobs):
    """tail's L_token less eq. 12's sum: r_t (log r_t - log r_s) for the V - K tokens off the
    teacher's top-K lumped, r = 1 - the top-K's mass. The student's r_s is fp32's 1 - Q, exact to
    ~1e-7 and stopped at 1e-7 (16 nats per unit of r_t): summing the V - K tokens themselves would
    cost a second pass over the logits (10% of a training step)."""
    rest_s = torch.log1p(-logp_s.gather(-1, topk_ids).exp().sum(-1).clamp(max=1 - 1e-7))
    rest_t = rest_mass(topk_logprobs)
    return torch.xlogy(rest_t, rest_t) - rest_t * rest_s


def sampled_token_kl(logp_s, sample_ids):
    """L_token against the empirical distribution of N draws x_j: KL = 1/N sum_j (log(m_j / N) -
    log p_s(x_j)), m_j how many of the N draws are x_j (a token drawn m times counts m times)."""
    m = (sample_ids[..., :, None] == sample_ids[..., None, :]).sum(-1)
    return ((m / sample_ids.shape[-1]).log() - logp_s.gather(-1, sample_ids)).mean(-1)


def hybrid_term(logp_s, topk_logprobs, sample_ids):
    """hybrid's L_token less eq. 12's sum, the rest by its draws x_j ~ p_t(. | off the top-K):
    r_t/N sum_j (log(r_t m_j / N) - log p_s(x_j))."""
    rest_t = rest_mass(topk_logprobs)
    return torch.xlogy(rest_t, rest_t) + rest_t * sampled_token_kl(logp_s, sample_ids)


def full_token_kl(logp_s, teacher_logits):
    """L_token over the whole vocabulary: KL(p_t || p_s) = sum_v p_t,v (log p_t,v - log p_s,v); a
    masked teacher entry (logit -inf) adds 0 log 0 = 0."""
    logp_t = F.log_softmax(teacher_logits.float(), dim=-1)
    return (logp_t.exp() * (logp_t.clamp(min=torch.finfo(logp_t.dtype).min) - logp_s)).sum(-1)
