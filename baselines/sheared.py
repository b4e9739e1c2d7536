"""
Sheared-LLaMA's mask search (Xia et al. 2024) restricted to whole layers, as the paper's comparison
does (--search l0): one hard-concrete gate z_l per layer (Louizos et al. 2018), trained with the
weights, the kept count steered in expectation to E3's k'_t schedule by a Lagrangian whose
multipliers ascend. Unlike Gumbel-TopK the mask is soft in the forward pass, so the trained weights
do not match the pruned network (the paper's point).
"""
import math

import torch
from torch import nn

from sampler import k_schedule, score_lr_schedule
from surgery import LayerSearch

# temperature and stretch interval (gamma, zeta) of the hard concrete (Louizos et al.'s values)
HC_BETA, HC_GAMMA, HC_ZETA = 2 / 3, -0.1, 1.1
L0_INIT_LOG_ALPHA = 3.0  # every gate starts on: P(z > 0) ~ 0.98, the whole model


def hard_concrete(log_alpha, u):
    """z in [0, 1] per layer from uniform noise u: a stretched, clamped binary-concrete sample
    (exact 0 and 1 have probability mass, so z can switch a layer fully off or on)."""
    u = u.clamp(1e-6, 1 - 1e-6)
    s = torch.sigmoid((torch.log(u / (1 - u)).to(log_alpha.device) + log_alpha) / HC_BETA)
    return (s * (HC_ZETA - HC_GAMMA) + HC_GAMMA).clamp(0.0, 1.0)


def expected_kept(log_alpha):
    """E[number of z != 0] = sum_l P(z_l > 0), the L0 norm in expectation."""
    return torch.sigmoid(log_alpha - HC_BETA * math.log(-HC_GAMMA / HC_ZETA)).sum()


def lagrangian(expected, target, lambdas):
    """lambda_1 (E - t) + lambda_2 (E - t)^2: minimised by the masks, maximised by the lambdas."""
    gap = expected - target
    return lambdas[0] * gap + lambdas[1] * gap * gap


class HardConcreteSearch(LayerSearch):
    """--search l0, a layer search of prune.py (surgery.LayerSearch). S holds the log-alphas of the
    L gates, all starting on (Sheared-LLaMA starts from the whole model: S_0 is not used); the cut
    keeps the top-k of S."""
    in_loop = True

    def __init__(self, S0, args, L, T, protected, device):
        super().__init__(torch.full((L,), L0_INIT_LOG_ALPHA), args, L, T, protected, device)
        self.free = [i for i in range(L) if i not in protected]
        self.opt = torch.optim.Adam([self.S], lr=args.score_lr)
        # Lagrange multipliers (lambda_1, lambda_2): maximised, so the constraint gap is pushed to 0
        self.lambdas = nn.Parameter(torch.zeros(2, device=device))
        self.lambda_opt = torch.optim.Adam([self.lambdas], lr=args.score_lr, maximize=True)
        self.gen = torch.Generator().manual_seed(args.seed)  # the same draws on every rank

    def begin_step(self, t):
        """The target kept count k'_t (E3's schedule) and this step's uniform noise u (as for E3:
        --masks-per-step N draws, global micro-batch j using draw j mod N; lr of S per
        --score-lr-schedule)."""
        self.k_t = k_schedule(t, self.steps, self.L, self.args.keep)
        # CPU generator, as for the Gumbel noise: one draw per step, shared by its micro-batches
        self.noise = [torch.rand(self.L, generator=self.gen)
                      for _ in range(self.args.masks_per_step)]
        for group in self.opt.param_groups:
            group["lr"] = score_lr_schedule(t, self.steps, self.args.score_lr,
                                              self.args.score_lr_schedule)

    def sample_mask(self, j=0):
        """z_l in [0, 1] per free layer (soft in the forward pass too); protected layers 1."""
        noise = self.noise[j % len(self.noise)]
        z = hard_concrete(self.S[self.free], noise[self.free])
        index = (torch.tensor(self.free, device=self.S.device),)
        return torch.ones(self.L, device=self.S.device).index_put(index, z)

    def step(self):
        """The gates follow the loss; lambda_1 (E - k') + lambda_2 (E - k')^2 pulls the expected
        kept count E = sum_l P(z_l > 0) to k'_t: minimised by the log-alphas, maximised by the
        lambdas."""
        self.average_grad()  # the loss's gradient, averaged before the penalty's joins it
        gap = expected_kept(self.S[self.free]) + len(self.protected)  # E, protected layers counted
        # adds the penalty's gradient to S.grad and gives the lambdas theirs (alike on every rank)
        lagrangian(gap, self.k_t, self.lambdas).backward()
        self.lambda_opt.step()
        self.lambda_opt.zero_grad(set_to_none=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def log_fields(self):
        return {"k": self.k_t}  # the target of the expected kept count

    def state_dict(self):
        return {"S": self.S.detach().cpu(), "opt": self.opt.state_dict(),
                "gen": self.gen.get_state(), "lambdas": self.lambdas.detach().cpu(),
                "lambda_opt": self.lambda_opt.state_dict()}

    def load_state_dict(self, state):
        self.S.data.copy_(state["S"])
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"])
        self.lambdas.data.copy_(state["lambdas"])
        self.lambda_opt.load_state_dict(state["lambda_opt"])
