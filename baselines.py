"""
Layer-set searches that E3-Pruner is compared with. Each returns the k layers to keep; prune.py then
fine-tunes that set exactly as it fine-tunes E3's.

  fitness(model, batches, kept)    F(G) = 1/N sum_i sum_{c in top-K} p_t,c (log p_t,c - log p_G,c):
                                   the unweighted top-K KD loss (kd.py, eq. 12) of the model that
                                   runs only the layers of G, on cached teacher targets
  cache_score(model, cache)        score(kept, n_tokens): F on the first n_tokens of the cache's
                                   training split, shared over the ranks
  evo_search(score, L, k, ...)     EvoPress's depth search (Sieberling et al. 2024; IST-DASLab/
                                   EvoPress, evo_drop_search.py): mutation, successive halving
  random_search(score, L, k, ...)  the best of N random k-subsets: the control that shows what a
                                   search buys over chance at the same forward-token budget
  HardConcreteSearch               Sheared-LLaMA (Xia et al. 2024) restricted to whole layers: one
                                   hard-concrete gate z_l per layer (sampler.hard_concrete), trained
                                   with the weights; the kept count is steered, in expectation, to
                                   the same k'_t schedule by a Lagrangian whose multipliers ascend

A genome G is a sorted list of the k kept layers (original indices), the protected layers always
among them. The searches are deterministic given their torch.Generator: under torchrun every rank
seeds it alike, draws the same candidates and runs the same forwards, and the all-reduced fitness
is the same on every rank.

One departure from EvoPress, which draws fresh calibration tokens for every selection: here every
stage scores on the same first tokens (ranks and reruns agree, a genome's score can be memoised),
and children are never genomes scored before (they would only score the same again). So the last
stage must hold enough tokens not to be overfitted: on the demo model a 1024-token last stage
preferred a set that is worse on held-out text; at 4096 tokens it did not (issue 17).
"""
import math
from contextlib import contextmanager

import torch
from torch import nn

import parallel
from common import E3Error, all_reduce_sum, rank_and_world
from kd import head_kd_loss
from sampler import expected_kept, hard_concrete, k_schedule, lagrangian, score_lr_schedule
from surgery import _layers_owner, head_losses, layer_configs, remove_layers


# -----------------------------------------------------------------------------
# Fitness: the top-K KL to the teacher of the model running only the kept layers

@contextmanager
def only_layers(model, kept):
    """Inside the block the model runs only the decoder layers `kept` (original indices): it is
    pruned in place by surgery.remove_layers, and on exit its full ModuleList, its per-layer config
    lists and every layer_idx are put back, so nothing is copied and every weight stays shared."""
    owner, attr = _layers_owner(model)
    full = getattr(owner, attr)
    configs = layer_configs(model.config, len(full))
    saved_configs = [dict(vars(cfg)) for cfg in configs]  # remove_layers replaces lists, edits none
    # remove_layers renumbers every kept layer's layer_idx (its KV-cache slot) from 0
    saved_idx = {m: m.layer_idx for m in full.modules()
                 if isinstance(getattr(m, "layer_idx", None), int)}
    remove_layers(model, kept)  # a new ModuleList of the same layer objects: no weight is copied
    try:
        yield model
    finally:
        setattr(owner, attr, full)  # the original list, every layer back at its own index
        for cfg, saved in zip(configs, saved_configs):
            vars(cfg).update(saved)
        for m, idx in saved_idx.items():
            m.layer_idx = idx


@torch.no_grad()
def fitness(model, batches, kept, vocab=None):
    """F(G) = mean over the valid tokens of all ranks of the top-K KL to the teacher,

        F(G) = 1/N sum_i sum_{c in top-K(i)} p_t,c (log p_t,c - log p_G,c),

    p_G the model running only the layers G = `kept`. Lower is better. batches: this rank's dicts of
    input_ids (B,T), topk_ids and topk_logprobs (B,T,K) and optionally mask (B,T) bool (False = not
    counted; a batch with no valid token still runs, so that FSDP ranks run the same forwards).
    Under torchrun the sums over tokens are all-reduced: every rank returns the same number."""
    dev = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=dev)  # sum of per-token KL, token count
    training = model.training
    model.eval()  # no dropout: a layer set must score the same every time it is asked
    try:
        with only_layers(model, kept):
            for b in batches:
                b = {key: v.to(dev) for key, v in b.items()}
                mask = b.get("mask")
                n = b["topk_ids"].shape[:2].numel() if mask is None else int(mask.sum())

                def kl_fn(x, weight, bias, post):  # the head + top-K KL fused: no (B, T, V) logits
                    return head_kd_loss(x, weight, bias, b["topk_ids"], b["topk_logprobs"],
                                        mask=mask, post=post, vocab=vocab)
                with parallel.compute_context(model, dev):  # bf16 on one GPU, as in training
                    # the mean over the batch's valid tokens: times n, their sum
                    kl = head_losses(model, b["input_ids"], [kl_fn])[0]
                total[0] += kl.double() * n
                total[1] += n
    finally:
        model.train(training)  # the caller's mode: prune.py trains the model right after
    all_reduce_sum(total)  # the token-weighted mean over all ranks, not a mean of rank means
    return (total[0] / total[1].clamp(min=1)).item()


def first_tokens(cache, n_tokens, rank=0, world=1, micro_batch=4):
    """This rank's batches of the first `n_tokens` tokens of the cache's training split, in order:
    whole sequences, then a prefix of the next one (a causal LM's prefix needs nothing after it).
    The sequences are split evenly over the ranks; a rank short of sequences gets mask-all-False
    batches, so every rank runs ceil(ceil(n / T / world) / micro_batch) forwards."""
    T = cache.seq_len
    available = cache.len_split("train") * T
    if n_tokens > available:
        raise E3Error(f"the search scores candidates on {n_tokens} tokens but the teacher cache's "
                      f"training split holds {available}; lower the search's token counts or build "
                      f"a larger cache")
    lengths = [T] * (n_tokens // T) + ([n_tokens % T] if n_tokens % T else [])
    per_rank = math.ceil(len(lengths) / world)
    # (sequence, tokens counted) for this rank's slots; a slot past the end counts 0 tokens
    mine = [(i, lengths[i] if i < len(lengths) else 0)
            for i in range(rank * per_rank, (rank + 1) * per_rank)]
    batches = []
    for a in range(0, per_rank, micro_batch):
        part = mine[a:a + micro_batch]
        rows = cache.get([i if n else 0 for i, n in part])  # a padding row re-reads sequence 0
        width = max(1, max(n for _, n in part))  # prefixes run only as far as the longest one
        mask = torch.arange(width)[None, :] < torch.tensor([n for _, n in part])[:, None]
        keys = ("input_ids", "topk_ids", "topk_logprobs")
        batches.append({**{key: rows[key][:, :width] for key in keys}, "mask": mask})
    return batches


def cache_score(model, cache, micro_batch=4):
    """score(kept, n_tokens) = fitness of `kept` on the first n_tokens training tokens of `cache`,
    this rank's share of them (rank and world from the process group). The batches of each token
    count are read from the cache once."""
    rank, world = rank_and_world()
    batches = {}

    def score(kept, n_tokens):
        if n_tokens not in batches:  # every genome of a stage is scored on the same tokens
            batches[n_tokens] = first_tokens(cache, n_tokens, rank, world, micro_batch)
        return fitness(model, batches[n_tokens], kept, cache.vocab_size)
    return score


class CountedScore:
    """Wraps score(kept, n_tokens): each (genome, n_tokens) is computed once (the elitist parent is
    re-ranked every generation for free) and the tokens of the forwards actually run are counted."""

    def __init__(self, score):
        self.score, self.memo, self.forward_tokens = score, {}, 0

    def __call__(self, kept, n_tokens):
        key = (tuple(kept), n_tokens)
        if key not in self.memo:
            self.memo[key] = self.score(list(kept), n_tokens)
            self.forward_tokens += n_tokens
        return self.memo[key]


# -----------------------------------------------------------------------------
# Genomes: k-subsets of the L layers that hold every protected layer

def _randint(n, generator):
    """A uniform integer in 0..n-1 from `generator` (torch, so every rank draws the same)."""
    return int(torch.randint(n, (1,), generator=generator))


def check_genome_size(L, k, protected):
    if not len(set(protected)) <= k <= L:
        raise E3Error(f"cannot keep {k} of {L} layers with the protected layers "
                      f"{sorted(protected)} always kept; pass --keep between {len(set(protected))} "
                      f"and {L}")


def random_genome(L, k, protected, generator):
    """A uniformly random k-subset of the L layers that holds every protected layer."""
    check_genome_size(L, k, protected)
    free = [i for i in range(L) if i not in protected]
    # the first k - |protected| of a random permutation: a uniform subset of the free layers
    order = torch.randperm(len(free), generator=generator).tolist()
    return sorted(set(protected) | {free[j] for j in order[: k - len(set(protected))]})


def mutate(kept, L, protected, generator):
    """One swap: a kept unprotected layer leaves and a removed layer enters, so the genome keeps
    exactly k layers and every protected one. Unchanged when no swap exists (k = L or only the
    protected layers kept)."""
    kept_free = [i for i in kept if i not in protected]
    removed = [i for i in range(L) if i not in kept]
    if not kept_free or not removed:
        return sorted(kept)
    out = kept_free[_randint(len(kept_free), generator)]
    enters = removed[_randint(len(removed), generator)]
    return sorted((set(kept) - {out}) | {enters})


def offspring_of(parent, L, protected, generator, max_swaps=3):
    """A child: `s` swaps, s = min of two uniform draws from 1..max_swaps, so one swap is the most
    likely (EvoPress: P(s = 1) = 5/9 at max_swaps 3) and a few let it leave a local optimum."""
    swaps = 1 + min(_randint(max_swaps, generator), _randint(max_swaps, generator))
    child = parent
    for _ in range(swaps):
        child = mutate(child, L, protected, generator)
    return child


def new_offspring(parent, n, L, protected, generator, max_swaps=3, seen=()):
    """Up to n children, all different from each other and from the parent (as in EvoPress) and
    from the genomes in `seen`. Fewer only when the space is too small (tries stop after 100 n)."""
    children = []
    for _ in range(100 * n):
        if len(children) == n:
            break
        child = offspring_of(parent, L, protected, generator, max_swaps)
        # swaps can undo each other: a child may come back as the parent or as a sibling
        if child != sorted(parent) and child not in children and tuple(child) not in seen:
            children.append(child)
    return children


# -----------------------------------------------------------------------------
# The searches

def successive_halving(score, candidates, stages, parent=None):
    """Rank `candidates` on stage after stage of (n_tokens, survivors): each stage scores the
    survivors of the last on more tokens and keeps its best `survivors`. The parent joins the last
    stage only and, listed first, wins ties (elitist: a generation never ends worse than it began).
    Returns the survivors of the last stage with their scores, best first."""
    for j, (n_tokens, survivors) in enumerate(stages):
        if j == len(stages) - 1 and parent is not None:
            candidates = [parent] + [c for c in candidates if c != parent]
        ranked = sorted(candidates, key=lambda c: score(c, n_tokens))  # stable: earlier wins ties
        candidates = ranked[:survivors]
    return [(c, score(c, stages[-1][0])) for c in candidates]


def parse_stages(text):
    """'512:2,4096:1' -> [(512, 2), (4096, 1)]: the (tokens, survivors) stages of a CLI flag."""
    try:
        stages = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    except ValueError:
        stages = [()]
    if any(len(st) != 2 for st in stages):
        raise E3Error(f"search stages '{text}' are not TOKENS:SURVIVORS pairs separated by commas, "
                      f"e.g. 512:2,4096:1")
    return stages


def result(kept, fit, history, counted):
    """What a search returns: the layers to keep, their fitness, the trace, the forward tokens."""
    return dict(kept=kept, fitness=fit, history=history, forward_tokens=counted.forward_tokens)


def evo_search(score, L, k, protected, generator, generations, offspring, stages, init=None,
               max_swaps=3, log=None):
    """EvoPress's evolutionary depth search with a population of one (its depth-pruning setting):

        for g = 1..generations:
            children = `offspring` mutants of the parent never scored before (new_offspring)
            parent   = best of children and parent by successive halving over `stages`

    score(kept, n_tokens) -> fitness (lower is better), e.g. cache_score(...); stages: a list of
    (n_tokens, survivors), e.g. [(512, 2), (4096, 1)], the last with one survivor. init: the first
    parent (e.g. the KL top-k), a random genome if None. Returns dict(kept, fitness, history: one
    entry per generation, forward_tokens: tokens of all the forwards run, each token of a
    k-layer model). log(entry), if given, sees each history entry as it is made."""
    check_genome_size(L, k, protected)
    if not stages or stages[-1][1] != 1 or any(n < 1 or s < 1 for n, s in stages):
        raise E3Error(f"the evolutionary search needs stages of (tokens >= 1, survivors >= 1) "
                      f"ending in one survivor; got {stages}")
    counted = CountedScore(score)
    parent = sorted(init) if init is not None else random_genome(L, k, protected, generator)
    if len(parent) != k or not set(protected) <= set(parent):
        raise E3Error(f"the search's initial layer set {parent} must hold {k} layers, the "
                      f"protected {sorted(protected)} among them")
    best = counted(parent, stages[-1][0])  # the parent only ever competes on the last stage
    history = []
    for g in range(generations + 1):  # g = 0 records the first parent as it is
        if g > 0:
            # The fitness is computed on fixed tokens, so a genome scored before would score the
            # same again: only new ones can tell anything (EvoPress redraws its tokens instead).
            seen = {genome for genome, _ in counted.memo}
            children = new_offspring(parent, offspring, L, protected, generator, max_swaps, seen)
            # the last stage keeps one survivor: the next parent (the old one if nothing beat it)
            (parent, best), = successive_halving(counted, children, stages, parent)
        history.append({"generation": g, "kept": parent, "fitness": best,
                        "forward_tokens": counted.forward_tokens})
        if log:
            log(history[-1])
    return result(parent, best, history, counted)


def evo_budget(generations, offspring, stages):
    """The most forward tokens evo_search can spend: the first parent on the last stage, then per
    generation `offspring` children on stage 1 and each stage's survivors on the next."""
    counts = [offspring] + [survivors for _, survivors in stages[:-1]]
    return stages[-1][0] + generations * sum(c * n for c, (n, _) in zip(counts, stages))


def random_search(score, L, k, protected, generator, candidates, n_tokens, log=None):
    """The best of `candidates` distinct random k-subsets, each scored on n_tokens tokens. At
    candidates = forward_tokens(evo) / n_tokens it spends what the evolutionary search spent.
    Returns the same dict as evo_search (history: the best so far after each candidate; log as
    there)."""
    check_genome_size(L, k, protected)
    counted = CountedScore(score)
    seen, history, best, best_fit = set(), [], None, math.inf
    for _ in range(20 * candidates):  # distinct draws; fewer only when the space is smaller
        if len(seen) == candidates:
            break
        genome = random_genome(L, k, protected, generator)
        if tuple(genome) in seen:  # a repeat would spend no tokens and tell nothing
            continue
        seen.add(tuple(genome))
        fit = counted(genome, n_tokens)
        if fit < best_fit:  # strict: of equal scores the first drawn stays
            best, best_fit = genome, fit
        history.append({"candidate": len(seen), "kept": best, "fitness": best_fit,
                        "forward_tokens": counted.forward_tokens})
        if log:
            log(history[-1])
    return result(best, best_fit, history, counted)


# -----------------------------------------------------------------------------
# Sheared-LLaMA's search (--search l0): in the training loop, with prune.GumbelTopKSearch's methods

L0_INIT_LOG_ALPHA = 3.0  # every gate starts on: P(z > 0) ~ 0.98, the whole model


class HardConcreteSearch:
    """The same methods as prune.GumbelTopKSearch: begin_step(t), sample_mask(), step(),
    state_dict(). S holds the log-alphas of the L gates; the importance scores are not used
    (Sheared-LLaMA starts from the whole model)."""

    def __init__(self, scores, args, L, T_M, protected, device):
        self.args, self.L, self.T_M, self.protected = args, L, T_M, protected
        self.free = [i for i in range(L) if i not in protected]
        self.S = nn.Parameter(torch.full((L,), L0_INIT_LOG_ALPHA, device=device))
        # Adam at --score-lr, as for E3's scores
        self.opt = torch.optim.Adam([self.S], lr=args.score_lr)
        # Lagrange multipliers (lambda_1, lambda_2): maximised, so the constraint gap is pushed to 0
        self.lambdas = nn.Parameter(torch.zeros(2, device=device))
        self.lambda_opt = torch.optim.Adam([self.lambdas], lr=args.score_lr, maximize=True)
        self.gen = torch.Generator().manual_seed(args.seed)  # the same draws on every rank

    def begin_step(self, t):
        """The target kept count k'_t (E3's schedule) and this step's uniform noise u (as for E3:
        --masks-per-step N draws, global micro-batch j using draw j mod N; lr of S per
        --score-lr-schedule)."""
        self.k_t = k_schedule(t, self.T_M, self.L, self.args.keep)
        # CPU generator, as for the Gumbel noise: one draw per step, shared by its micro-batches
        self.noise = [torch.rand(self.L, generator=self.gen)
                      for _ in range(self.args.masks_per_step)]
        for group in self.opt.param_groups:
            group["lr"] = score_lr_schedule(t, self.T_M, self.args.score_lr,
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
        parallel.average_grad(self.S)  # the loss's gradient, averaged before the penalty's joins it
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
