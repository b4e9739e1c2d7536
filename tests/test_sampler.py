"""Gumbel-TopK sampler (Sec. 3.2, eq. 6-7, Alg. 2): exact k-hot values, straight-through gradients, determinism, the
Plackett-Luce law of the hard mask, and the schedules' endpoints."""
import itertools
import math

import pytest
import torch

from sampler import gumbel_topk, k_schedule, tau_schedule


@pytest.mark.parametrize("L,k", [(2, 1), (5, 2), (8, 7), (16, 5), (30, 20), (32, 13), (64, 1)])
@pytest.mark.parametrize("tau", [1.0, 0.5, 0.1])
def test_mask_is_exactly_k_hot(L, k, tau):
    g = torch.Generator().manual_seed(L * 100 + k)
    for _ in range(50):
        scores = torch.randn(L, generator=g) * 3
        m = gumbel_topk(scores, k, tau, generator=g)
        assert m.shape == scores.shape
        assert set(m.tolist()) <= {0.0, 1.0}, m
        assert m.sum().item() == k


def relaxed_topk_float64(perturbed, k, tau):
    """Eq. 6 written out independently, in float64: k rounds of softmax(S_i / tau), each followed by
    S_{i+1} = S_i + log(1 - p_i)."""
    s, soft = perturbed.double(), torch.zeros_like(perturbed, dtype=torch.float64)
    for _ in range(k):
        p = torch.exp(s / tau - torch.logsumexp(s / tau, dim=-1, keepdim=True))
        soft = soft + p
        s = s + torch.log1p(-p.clamp(max=1 - 1e-15))
    return soft


def test_gradient_is_that_of_the_relaxed_mask_eq6():
    """Straight-through: d(w . M)/dS equals d(w . M~)/dS, M~ of eq. 6 computed in float64 here."""
    scores = torch.randn(10, requires_grad=True)
    m = gumbel_topk(scores, 4, 0.7, generator=torch.Generator().manual_seed(0))
    w = torch.arange(10.0)
    (m * w).sum().backward()
    u = torch.rand(10, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    noise = -torch.log(-torch.log(u)).double()  # the same Gumbel draw, recomputed from the same seed
    s64 = scores.detach().double().requires_grad_(True)
    (relaxed_topk_float64(s64 + noise, 4, 0.7) * w.double()).sum().backward()
    torch.testing.assert_close(scores.grad.double(), s64.grad, rtol=1e-4, atol=1e-6)


def test_hard_mask_is_top_k_of_the_perturbed_scores():
    """The kept layers are the k largest S + g (the Gumbel-top-k trick: exact Plackett-Luce at every tau),
    not the k largest M~: at small tau, M~ underflows to exact 0 for several layers and its top-k then
    breaks the tie arbitrarily (it did in ~2.6% of draws at L = 6, k = 3, tau = 0.1)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        scores = torch.randn(6, generator=g) * 3
        noise = -torch.log(-torch.log(torch.rand(6, generator=g).clamp_min(1e-30)))
        m = gumbel_topk(scores, 3, 0.1, noise=noise)
        expected = torch.zeros(6)
        expected[torch.argsort(scores.double() + noise.double(), descending=True)[:3]] = 1.0
        assert torch.equal(m.detach(), expected), (scores, noise)


def test_same_seed_same_mask():
    scores = torch.randn(30)
    a = [gumbel_topk(scores, 12, 0.5, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert all(torch.equal(a[0], x) for x in a)
    b = gumbel_topk(scores, 12, 0.5, torch.Generator().manual_seed(8))
    assert not torch.equal(a[0], b)  # different noise: with 30 choose 12 sets this is near certain


def plackett_luce_inclusion(scores, k):
    """Exact P(layer i among k draws without replacement, P(j) proportional to exp(s_j))."""
    w = [math.exp(s) for s in scores]
    incl = [0.0] * len(w)
    for perm in itertools.permutations(range(len(w)), k):
        p, left = 1.0, sum(w)
        for j in perm:
            p *= w[j] / left
            left -= w[j]
        for j in perm:
            incl[j] += p
    return torch.tensor(incl)


@pytest.mark.parametrize("tau", [1.0, 0.1])
def test_hard_mask_follows_plackett_luce(tau):
    scores = torch.tensor([1.5, 0.0, -0.5, 0.8, -1.2])
    n = 20000
    g = torch.Generator().manual_seed(123)
    # batched: every row is an independent draw over the 5 layers
    masks = gumbel_topk(scores.expand(n, 5), 2, tau, generator=g)
    assert (masks.sum(-1) == 2).all()
    freq = masks.mean(0)
    exact = plackett_luce_inclusion(scores.tolist(), 2)
    assert (freq - exact).abs().max() < 0.02, (freq, exact)


def test_schedules_reach_targets_when_search_ends():
    T_M, L, k, beta = 120, 32, 13, 0.9
    assert tau_schedule(T_M, T_M, beta) == pytest.approx(1 - beta)
    assert tau_schedule(1, T_M, beta) == pytest.approx(1 - beta / T_M)
    assert k_schedule(T_M, T_M, L, k) == k
    ks = [k_schedule(t, T_M, L, k) for t in range(1, T_M + 1)]
    assert ks[0] == L - 1 and all(a >= b for a, b in zip(ks, ks[1:]))  # progressive, never back up


def test_hard_concrete_expected_l0_matches_monte_carlo():
    """Sheared-LLaMA baseline: E[#(z > 0)] in closed form equals the frequency over many samples."""
    from baselines.sheared import expected_kept, hard_concrete
    log_alpha = torch.tensor([-2.0, -0.5, 0.0, 1.0, 3.0])
    u = torch.rand(200_000, 5, generator=torch.Generator().manual_seed(0))
    z = hard_concrete(log_alpha.expand(200_000, 5), u)
    assert z.min() >= 0 and z.max() <= 1 and (z == 0).any() and (z == 1).any()
    assert (z > 0).float().sum(-1).mean().item() == pytest.approx(expected_kept(log_alpha).item(), abs=0.01)
