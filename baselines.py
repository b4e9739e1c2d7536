"""
The baselines' layer searches, kept off E3's path in prune.py. Each is selected with `prune.py --search`
and ends, like E3's, in the same fine-tuning on the same cached teacher targets.

  HardConcreteSearch   --search l0   Sheared-LLaMA (Xia et al. 2024) restricted to whole layers: one
                                     hard-concrete gate z_l per layer (sampler.hard_concrete), trained
                                     with the weights; the kept count is steered, in expectation, to the
                                     same k'_t schedule by a Lagrangian whose multipliers ascend
"""
import torch
from torch import nn

import parallel
from sampler import expected_kept, hard_concrete, k_schedule, lagrangian

L0_INIT_LOG_ALPHA = 3.0  # every gate starts on: P(z > 0) ~ 0.98, the whole model


class HardConcreteSearch:
    """The same methods as prune.GumbelTopKSearch: begin_step(t), sample_mask(), step(), state_dict().
    S holds the log-alphas of the L gates; the importance scores are not used (Sheared-LLaMA starts
    from the whole model)."""

    def __init__(self, scores, args, L, T_M, protected, device):
        self.args, self.L, self.T_M, self.protected = args, L, T_M, protected
        self.free = [i for i in range(L) if i not in protected]
        self.S = nn.Parameter(torch.full((L,), L0_INIT_LOG_ALPHA, device=device))
        self.opt = torch.optim.Adam([self.S], lr=args.score_lr)
        # Lagrange multipliers (lambda_1, lambda_2): maximised, so the constraint gap is pushed to 0
        self.lambdas = nn.Parameter(torch.zeros(2, device=device))
        self.lambda_opt = torch.optim.Adam([self.lambdas], lr=args.score_lr, maximize=True)
        self.gen = torch.Generator().manual_seed(args.seed)  # the same draws on every rank

    def begin_step(self, t):
        """The target kept count k'_t (E3's schedule) and this step's uniform noise u."""
        self.k_t = k_schedule(t, self.T_M, self.L, self.args.keep)
        self.noise = torch.rand(self.L, generator=self.gen)

    def sample_mask(self):
        """z_l in [0, 1] per free layer (soft in the forward pass too); protected layers 1."""
        z = hard_concrete(self.S[self.free], self.noise[self.free])
        index = (torch.tensor(self.free, device=self.S.device),)
        return torch.ones(self.L, device=self.S.device).index_put(index, z)

    def step(self):
        """The gates follow the loss; lambda_1 (E - k') + lambda_2 (E - k')^2 pulls the expected kept
        count E = sum_l P(z_l > 0) to k'_t: minimised by the log-alphas, maximised by the lambdas."""
        parallel.average_grad(self.S)
        gap = expected_kept(self.S[self.free]) + len(self.protected)
        lagrangian(gap, self.k_t, self.lambdas).backward()
        self.lambda_opt.step()
        self.lambda_opt.zero_grad(set_to_none=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def log_fields(self):
        return {"k": self.k_t}  # the target of the expected kept count

    def state_dict(self):
        return {"S": self.S.detach().cpu(), "opt": self.opt.state_dict(), "gen": self.gen.get_state(),
                "lambdas": self.lambdas.detach().cpu(), "lambda_opt": self.lambda_opt.state_dict()}

    def load_state_dict(self, state):
        self.S.data.copy_(state["S"])
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"])
        self.lambdas.data.copy_(state["lambdas"])
        self.lambda_opt.load_state_dict(state["lambda_opt"])
