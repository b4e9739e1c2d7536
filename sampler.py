"""
The Gumbel-TopK sampler with a straight-through estimator (paper Sec. 3.2, eq. 6-7, Algorithm 2),
and the two schedules of the search phase (temperature tau_t and kept-layer count k'_t).

    S_1 = S + g,  g ~ Gumbel(0, 1)                 (Alg. 2 line 1)
    for i = 1..k':  p_i = softmax(S_i / tau)
                    M~ += p_i                      (eq. 6, left)
                    S_{i+1} = S_i + log(1 - p_i)   (eq. 6, right: "remove" what was just picked)
    H = TopK(S + g, k')                            hard 0/1 mask: the k' largest perturbed scores
    M = H + (M~ - stopgrad(M~))                    straight-through: value H, gradient dM~/dS

Which layers H keeps is distributed as drawing k' layers without replacement with probabilities
proportional to exp(S) (Plackett-Luce, the Gumbel-top-k trick) at every tau; tau only shapes the
gradient.
(The paper writes H = TopK(M~). The two agree while M~ keeps the order of S + g, but at small tau M~
underflows to exact 0 for several layers and its top-k then breaks the tie arbitrarily: in ~2.6% of
draws at L = 6, k' = 3, tau = 0.1. The top-k of S + g is the exact sample at no cost.)
"""
import math

import torch


def gumbel_noise(shape, generator=None):
    """g = -log(-log(u)), u ~ U(0, 1), drawn on the CPU in fp32: the same generator state gives the
    same numbers on every rank and every device type. prune.py draws one g a step from one seeded
    generator on every rank, so that the step is ONE sample M of the law, its gradient averaged
    over the whole global batch, and N ranks compute what one process computes. (Nothing would hang
    if the ranks drew differently: during the search every layer runs on every rank.)"""
    u = torch.rand(shape, generator=generator, dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    return -torch.log(-torch.log(u.clamp_min(tiny)))


def soft_topk(perturbed, k, tau):
    """The relaxed k-hot mask M~ of eq. 6: k rounds of softmax, each damping what it picked."""
    s = perturbed
    soft = torch.zeros_like(s)
    tiny = torch.finfo(s.dtype).tiny
    for _ in range(k):
        p = torch.softmax(s / tau, dim=-1)
        soft = soft + p
        s = s + torch.log((1 - p).clamp_min(tiny))  # clamped: p can round to 1 and log 0 = -inf
    return soft


def gumbel_topk(scores, k, tau, generator=None, noise=None):
    """A k-hot layer mask sampled from the scores, shape of `scores`, values exactly 0.0 or 1.0,
    with gradient d mask / d scores = d M~ / d scores (straight-through estimator).
    `noise` (optional) reuses one Gumbel draw, e.g. for every micro-batch of an optimizer step."""
    s = scores.float()
    if noise is None:
        noise = gumbel_noise(s.shape, generator)
    perturbed = s + noise.to(s.device)
    soft = soft_topk(perturbed, k, tau)
    # the sample itself: the k largest S + g (not of M~, whose zeros can tie after underflow)
    hard = torch.zeros_like(soft).scatter_(-1, perturbed.detach().topk(k, dim=-1).indices, 1.0)
    # `soft - soft.detach()` is exactly 0.0 in the forward pass, so the value is exactly `hard`
    # (the textbook `hard + soft - soft.detach()` can round to 0.99999994 or 5.96e-08).
    return hard + (soft - soft.detach())


def tau_schedule(t, search_steps, beta=0.9):
    """tau_t = 1 - beta * t / T_M for t = 1..T_M: from ~1 down to 1 - beta when the search ends."""
    return 1.0 - beta * t / search_steps


def k_schedule(t, search_steps, L, k):
    """k'_t = L - ceil((L - k) * t / T_M): progressive pruning, reaching k when the search ends."""
    return L - math.ceil((L - k) * t / search_steps)


def score_lr_schedule(t, search_steps, lr, schedule="constant"):
    """The scores' lr at search step t: lr_S throughout (paper: the lr of S is not given), or
    (schedule "linear") lr_S (T_M - t + 1) / T_M, from lr_S down to lr_S / T_M: large moves while
    tau is high and k'_t large, small ones once the draws have settled."""
    if schedule == "linear":
        return lr * (search_steps - t + 1) / search_steps
    return lr
