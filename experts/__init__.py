"""
The routed experts of a mixture-of-experts model: which of them matter. Beside the layers' importance
(surgery.kl_importance, prune.IMPORTANCE), off the plain path, imported only when an expert flag or
an MoE config asks:

  routing.py      what an MoE layer is, found by structure in every family: the router (the child
                  named `gate` or `router`, E rows) beside the experts (3-D parameters [E, ., .]);
                  one expert made unroutable (its router logit -inf before the family's own top-k);
                  what the router chose and the gates the family applies, read off the experts' call
  importance.py   a score per (MoE layer, expert), one pass over the calibration set:
                  EXPERT_IMPORTANCE = {"reap": REAP's saliency, "frequency": the share of tokens
                  routed to it, "kl": s_{l,j} = E_x KL(p_{-(l,j)} || p), exact}; per served
                  domain apart, combined (domain_scores: --expert-domains max, minimax)
  search.py       the Gumbel-TopK search over each layer's experts, the cut (--experts-keep)
  cut.py          the N-expert model: every per-expert tensor sliced, the optimizer's moments too
  merge.py        the dropped experts folded into the kept ones at the cut (--expert-merge)

An MoE layer l computes, for a token x, y = sum_{j in TopK_l(x)} g_j(x) f_j(x) (+ a shared expert,
never routed, never scored here): the router makes E logits, the family turns them into a choice of
k experts and their gates (softmax, top-k, renormalise; top-k then softmax; sigmoid with a score
correction and group-limited top-k; sigmoid top-1), the experts f_j are SwiGLUs stored as fused
3-D tensors. The paper's layer importance s_l = E_x KL(p_{-l} || p) asks what the model loses
without layer l; its expert analogue asks what it loses when the router of layer l can never choose
expert j: the top-k taken among the other E - 1, renormalised as the family does, which is exactly
the model whose layer l was built with expert j deleted (tests/test_experts.py builds that model by
hand, for every MoE family the project tests).
"""
