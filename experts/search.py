"""
The expert search (prune.py --experts-keep N): the paper's Gumbel-TopK search of Sec. 3.2, run over
each MoE layer's routed experts beside (or instead of) the layers, in the same T_M training steps.

    S^e [M, E]        a score per (MoE layer, routed expert); S^e_0 = c log(s / max_j s), s the
                      expert importance (--expert-init: kl, reap, frequency, random; experts/
                      importance.py): Plackett-Luce draws an expert with probability proportional
                      to its importance (to its c-th power, c = --expert-score-scale; the layers'
                      --score-scale multiplies their KL, S_0 = c s, and leaves S^e_0 as it is)
    step t <= T_M     the same tau_t as the layers', k'^e_t = E - ceil((E - N) t / T_M) experts,
                      M^e = Gumbel-TopK(S^e, tau_t, k'^e_t) per MoE layer (sampler.py as it is: one
                      row a layer), applied in routing (routing.ExpertGates): a masked expert is
                      never chosen, the top-k among the others renormalised as the family does; the
                      kept ones' gates times m_j: dL/dS^e by the straight-through estimator, an Adam
                      step of --score-lr, as S's
    the cut           the top-N of S^e in every MoE layer stays (the same N everywhere: llama.cpp and
                      vLLM hold one expert count for a whole model); the others are removed there
                      (experts/cut.py): the fine-tune, its AdamW state and the export hold N experts
                      a layer, and a resume after the cut rebuilds those shapes from the source

DeepSeek's group-limited routing (n_group G > 1: the top-k among the experts of the best topk_group
groups of E / G consecutive ones) stays exact only if every group keeps as many: the search runs per
group, N / G of each group's E / G, and the pruned config keeps n_group.

--search none: the top-N of S^e_0 (one-shot, as REAP prunes); gumbel: the above. The others refuse.
"""
import copy

import torch

from experts.importance import domain_scores, score_experts
from experts.routing import COUNT_KEYS, ExpertGates, expert_count, experts_per_layer, moe_layers
from runtime import E3Error, mean_over_ranks, print0
from sampler import gumbel_noise, gumbel_topk, k_schedule, score_lr_schedule, tau_schedule

def check_args(args, config):
    """prune.check_args' part for --experts-keep N, before any work: an MoE model, 1 <= N < E, N
    at least the experts a token is routed to, whole groups for DeepSeek's group-limited routing, a
    search that runs on experts, an expert importance that exists; and the model's MoE layers, built
    on the meta device: found by structure, each per-expert tensor one the mask and the cut place
    (routing.check_placeable), else the family is refused here, in one line."""
    from transformers import AutoModelForCausalLM

    from experts.importance import EXPERT_IMPORTANCE
    from experts.routing import check_placeable
    key, E = expert_count(config)
    text = config.get_text_config()
    k, G = getattr(text, "num_experts_per_tok", None) or 1, getattr(text, "n_group", None) or 1
    if E is None:
        raise E3Error(f"--experts-keep prunes routed experts: {text.model_type}'s config names no expert "
                      f"count ({', '.join(COUNT_KEYS)})")
    if not k <= args.experts_keep < E:
        raise E3Error(f"--experts-keep must be between {k} (the experts a token is routed to, "
                      f"num_experts_per_tok) and {E - 1} for this model's {E} experts; got {args.experts_keep}")
    per, topk_group = args.experts_keep // G, getattr(text, "topk_group", None) or G
    if G > 1 and (args.experts_keep % G or per < 2 or per * topk_group < k):
        raise E3Error(f"--experts-keep {args.experts_keep}: the experts route in {G} groups (n_group), "
                      f"{topk_group} of them a token, so each group keeps as many, at least 2, and the "
                      f"{topk_group} groups {k} experts: a multiple of {G} from {G * max(2, -(-k // topk_group))}")
    if args.search not in ("gumbel", "none"):
        raise E3Error(f"--experts-keep searches with --search gumbel or none; --search {args.search} "
                      f"chooses layers only")
    if args.expert_init not in EXPERT_IMPORTANCE:
        raise E3Error(f"--expert-init must be one of {', '.join(sorted(EXPERT_IMPORTANCE))}; got "
                      f"'{args.expert_init}'")
    if args.guard:
        raise E3Error("--guard chooses among layer sets; with --experts-keep it is not available")
    if args.expert_domains != "pooled":
        from scale.data import allot, is_mixture, mixture_sources
        sources = mixture_sources(args.calib_data) if is_mixture(args.calib_data) else []
        if len({path for path, _ in sources}) < max(2, len(sources)):  # two or more, each named once
            raise E3Error(f"--expert-domains {args.expert_domains} scores each domain of the calibration "
                          f"text apart: pass --calib-data as a mixture of two or more, each once, A:W,B:W")
        if min(allot(args.n_calib, [w for _, w in sources])) == 0:
            raise E3Error(f"--expert-domains {args.expert_domains}: --n-calib {args.n_calib} gives some "
                          f"domain of --calib-data no sequence at its weight; raise --n-calib or the weight")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    moes = moe_layers(model)
    if experts_per_layer(moes) != E:
        raise E3Error(f"the MoE layers hold {moes[0].E} experts where the config's {key} says {E}: "
                      f"experts/routing.py cannot tell which are routed")
    for moe in moes:
        check_placeable(moe)
    if args.expert_merge:
        from experts.merge import check_args as check_merge
        check_merge(args)
    from experts.cut import cut_experts
    try:  # the cut rehearsed on the meta device: the family's own N-expert blocks take the slices
        cut_experts(model, {m.index: list(range(args.experts_keep)) for m in moes})
    except E3Error:
        raise
    except Exception as e:  # noqa: BLE001 (transformers' own, building the N-expert model)
        raise E3Error(f"transformers cannot build {text.model_type} with {args.experts_keep} experts a layer "
                      f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def initial_scores(scores, c=1.0):
    """S^e_0 = c log(s / max_j s) per layer: exp(S^e_0) proportional to s^c (floored at 1e-6 of the
    layer's best: an expert no token reached is drawn that rarely, not never)."""
    s = scores.double().clamp_min(0)
    top = s.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return (c * torch.log((s / top).clamp_min(1e-6))).float()


class ExpertSearch:
    """Wraps the run's layer search (surgery.LayerSearch's protocol, every call passed on: with
    --keep = L it keeps every layer) and searches the experts in the same steps: sample_mask(j) puts
    micro-batch j's expert draw on the gates and returns the layers' mask; step() moves both scores;
    cut() freezes the experts' set. S (the layers' scores) stays the wrapped search's."""

    def __init__(self, search, model, args, vocab, calibration, log, prepare_layers=None):
        """calibration(): the batches of the expert importance; log: the run's log(**event);
        prepare_layers(layers): what prune.py's parallelize_student does to a layer before FSDP2
        shards it, for the layers the cut rebuilds (LoRA, checkpointing, compile)."""
        self.search, self.model, self.args, self.vocab = search, model, args, vocab
        self.calibration, self.log = calibration, log
        self.prepare_layers = prepare_layers or (lambda layers: layers)
        self.n, self.t, self.done, self.gates, self.noise = args.experts_keep, 0, False, None, []
        self.G = getattr(model.config.get_text_config(), "n_group", None) or 1
        self.gen = torch.Generator().manual_seed(args.seed + 1)  # its own draws, the same on every rank

    def __getattr__(self, name):  # the rest of the protocol: the wrapped search's
        return getattr(self.__dict__["search"], name)

    def _start(self, S0, layers, gates=True):
        """S^e from S^e_0, its Adam, and (gates) the gates on the model's MoE layers."""
        self.S0, self.layers = S0, layers
        self.S_experts = torch.nn.Parameter(S0.clone().to(self.search.S.device))
        self.opt = torch.optim.Adam([self.S_experts], lr=self.args.score_lr)
        self.E = self.S_experts.shape[1]
        self.gates = ExpertGates(moe_layers(self.model), list(range(len(layers)))) if gates else None

    def prepare(self, model, cache, losses, log):
        """Before training: the expert importance (logged), S^e_0, the gates (every expert routable
        until a step has moved S^e, or the cut)."""
        generator, how = torch.Generator().manual_seed(self.args.seed), self.args.expert_domains
        if how == "pooled":  # one score over the calibration text, whatever its domains
            scores, layers = score_experts(self.args.expert_init, model, self.calibration(), self.vocab,
                                           self.log, generator)
        else:  # each domain of the --calib-data mixture scored apart, then combined
            scores, layers = domain_scores(self.args.expert_init, model, self.calibration(by_source=True),
                                           self.vocab, how, self.n, self.G, self.log, generator)
            self.log(event="expert_importance", method=f"{self.args.expert_init}-{how}", layers=layers,
                     scores=scores.tolist(), step=0)
        self._start(initial_scores(scores, self.args.expert_score_scale), layers)
        self.search.prepare(model, cache, losses, log)

    def _grouped(self, x):
        return x.view(x.shape[0], self.G, self.E // self.G)

    def begin_step(self, t):
        """tau_t as the layers', k'^e_t experts a layer (a group: its share), this step's draws."""
        self.search.begin_step(t)
        self.tau = tau_schedule(t, self.steps, self.args.beta)
        self.k_t = self.G * k_schedule(t, self.steps, self.E // self.G, self.n // self.G)
        self.noise = [gumbel_noise(self.S_experts.shape, self.gen).to(self.S_experts.device)
                      for _ in range(self.args.masks_per_step)]
        self.opt.param_groups[0]["lr"] = score_lr_schedule(t, self.steps, self.args.score_lr,
                                                           self.args.score_lr_schedule)

    def sample_mask(self, j=0):
        """Micro-batch j's draws: M^e = Gumbel-TopK(S^e, tau_t, k'^e_t) on the gates (each layer,
        each group its share), the layers' M returned."""
        noise = self._grouped(self.noise[j % len(self.noise)])
        self.gates.mask = gumbel_topk(self._grouped(self.S_experts), self.k_t // self.G, self.tau,
                                      noise=noise).view(self.S_experts.shape)
        return self.search.sample_mask(j)

    def kept_mask(self):
        """The top-N of S^e in each layer (each group its share), 0/1 [M, E]."""
        S = self._grouped(self.S_experts.detach())
        top = S.topk(self.n // self.G, dim=-1).indices
        return torch.zeros_like(S).scatter_(-1, top, 1.0).view(self.S_experts.shape)

    def step(self):
        """Both scores' Adam steps, dL/dS^e averaged over the ranks; between steps (validation,
        eval mode) the gates route with the set the cut would keep now."""
        self.search.step()
        if self.S_experts.grad is None:
            self.S_experts.grad = torch.zeros_like(self.S_experts)
        mean_over_ranks(self.S_experts.grad)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.t += 1
        self.gates.hard = self.kept_mask()
        self.log(event="expert_search", step=self.t, layers=self.layers, k=self.k_t,
                 scores=self.S_experts.detach().cpu().tolist())

    def cut(self, model):
        """The search is over: the top-N experts of every MoE layer are the set; the gates go (the
        layers they held may be removed next, their experts with them)."""
        self.search.cut(model)
        self.done = True
        self.gates.remove()
        self.gates = None
        print0(f"experts: kept {self.n} of {self.E} in each of the {len(self.layers)} MoE layers")

    def reshape(self, model, moments=None):
        """After the layer cut (remove_layers), the model becomes the N-expert model (experts/cut.py),
        its optimizer state `moments` carried; the same on a model built anew (the export)."""
        from experts.cut import cut_experts
        kept = self.search.kept()
        if self.args.expert_merge and moments is not None:  # the training's cut (the export loads
            from experts.merge import merge_experts           # the merged weights after it)
            merge_experts(model, self.kept_experts(), self.calibration(), self.G, self.log, kept, moments)
        return cut_experts(model, self.kept_experts(), kept, moments,
                           lambda layer: self.prepare_layers([layer])[0])

    def kept_experts(self):
        """{original layer index (str): the experts kept}, for the MoE layers the layer cut keeps."""
        rows = self.kept_mask().bool().cpu()
        kept = set(self.search.kept())
        return {str(l): torch.nonzero(rows[r]).flatten().tolist()
                for r, l in enumerate(self.layers) if l in kept}

    def log_fields(self):
        return {**self.search.log_fields(), **({"experts": self.k_t} if self.steps else {})}

    def summary(self):
        return {**self.search.summary(), "experts": f"{self.E} -> {self.n}", "expert_init": self.args.expert_init,
                **({"expert_domains": self.args.expert_domains} if self.args.expert_domains != "pooled" else {}),
                **({"expert_merge": True} if self.args.expert_merge else {}),
                "initial_expert_scores": self.S0.tolist(), "kept_experts": self.kept_experts()}

    def state_dict(self):
        return {**self.search.state_dict(), "experts": {
            "S": self.S_experts.detach().cpu(), "S0": self.S0, "layers": self.layers, "t": self.t,
            "done": self.done, "opt": self.opt.state_dict(), "gen": self.gen.get_state(),
            "kept": self.kept_experts() if self.done else None}}  # the shapes a resume rebuilds

    def load_state_dict(self, state):
        """A resumed search; after the cut the model is already the N-expert model: no gates."""
        self.search.load_state_dict(state)
        e = state["experts"]
        self._start(e["S0"], e["layers"], gates=not e["done"])
        self.S_experts.data.copy_(e["S"])
        self.opt.load_state_dict(e["opt"])
        self.gen.set_state(e["gen"])
        self.t, self.done = e["t"], e["done"]
        if self.gates is not None:
            self.gates.hard = self.kept_mask() if self.t else None


def plan_line(args, model, L):
    """prune.py --plan's line for --experts-keep (model: the student on the meta device): the routed
    experts' parameters a MoE layer before and after, the parameters the export holds (every MoE layer
    kept: --keep = L; else per MoE layer kept), and the phases: the search's T_M steps train all E
    experts, the cut removes the others (their weights, gradients and AdamW moments freed), the
    fine-tune's T - T_M steps train N (--search none: every step; scale.plan.phases sizes each); a
    token's FLOPs the same but for the router's E rows that become N (it visits num_experts_per_tok
    experts of E or of N alike). Returns (line, {summary fields}); the cost of --expert-init kl is
    scale.plan.expert_kl_cost's."""
    moes = moe_layers(model)
    E, n = experts_per_layer(moes), args.experts_keep
    routed = [sum(p.numel() for m in (moe.experts, moe.router)
                  for p in m.parameters(recurse=False) if p.shape[0] == E) for moe in moes]
    removed = sum(routed) / len(routed) * (E - n) / E  # a MoE layer's, the mean over them
    total = sum(p.numel() for p in model.parameters())
    fields = {"experts": f"{E} -> {n}", "moe_layers": len(moes), "expert_params_removed_a_layer": round(removed)}
    if args.keep == L:
        fields["params_exported"] = round(total - removed * len(moes))
    where = (f"{fields['params_exported'] / 1e6:,.1f}M params exported (of {total / 1e6:,.1f}M)"
             if args.keep == L else f"{removed / 1e6:,.2f}M fewer params a MoE layer kept")
    T, T_M = args.steps, args.search_steps
    when = (f"the {T_M} search steps train all {E}, the cut removes the others (their weights, gradients "
            f"and AdamW moments freed), the {T - T_M} fine-tune steps train {n}" if T_M else
            f"no search: the cut at step 0, all {T} steps train {n}")
    return (f"plan: experts {E} -> {n} in each of {len(moes)} MoE layers: {where}; {when}; a token's "
            f"FLOPs the same but for the router's E rows, which become N"), fields
