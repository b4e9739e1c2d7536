"""
The evolutionary depth search of EvoPress (Sieberling et al. 2024; IST-DASLab/EvoPress,
evo_drop_search.py with --drop_entire_block: whole layers, as here), and the random-search control:
each chooses a k-layer set before training (--search evo | random), which prune.py then fine-tunes
exactly as it fine-tunes E3's.

  fitness(model, batches, kept)    F(G) = 1/N sum_i sum_{c in top-K} p_t,c (log p_t,c - log p_G,c):
                                   the unweighted top-K KD loss (kd.py, eq. 12) of the model that
                                   runs only the layers of G, on cached teacher targets
  cache_score(model, cache)        score(kept, n_tokens): F on the first n_tokens of the cache's
                                   training split
  evo_search(score, L, k, ...)     mutation as EvoPress's (offspring_of), successive halving
  random_search(score, L, k, ...)  the best of N random k-subsets at evo's forward-token budget:
                                   what a search buys over chance
  EvoSearch, RandomSearch          both as prune.py's layer searches (surgery.LayerSearch)

A genome G is a sorted list of the k kept layers (original indices), the protected layers always
among them. The searches are deterministic given their torch.Generator: under torchrun every rank
seeds it alike, draws the same candidates and scores them on the same tokens.

One departure from EvoPress, which draws fresh calibration tokens for every selection: here every
stage scores on the same first tokens (ranks and reruns agree, a genome's score can be memoised),
and children are never genomes scored before (they would only score the same again). So the last
stage must hold enough tokens not to be overfitted: on the demo model a 1024-token last stage
preferred a set that is worse on held-out text; at 4096 tokens it did not.
"""
import math
from contextlib import contextmanager

import torch

import kd
from runtime import E3Error, print0
from surgery import (INDEX_NAMES, LayerSearch, layer_configs, layers_owner, remove_layers,
                     top_k_layers)


# -----------------------------------------------------------------------------
# Fitness: the top-K KL to the teacher of the model running only the kept layers

@contextmanager
def only_layers(model, kept):
    """Inside the block the model runs only the decoder layers `kept` (original indices): it is
    pruned in place by surgery.remove_layers, and on exit its full ModuleList, its per-layer config
    lists and every layer index are put back, so nothing is copied and every weight stays shared."""
    owner, attr = layers_owner(model)
    full = getattr(owner, attr)
    configs = layer_configs(model.config, len(full))
    saved_configs = [dict(vars(cfg)) for cfg in configs]  # remove_layers replaces or adds, edits none
    # remove_layers renumbers every kept layer's index (its KV-cache slot: layer_idx, GPT-Neo's
    # layer_id, ...) from 0
    saved_idx = {(m, n): getattr(m, n) for m in full.modules() for n in INDEX_NAMES
                 if isinstance(getattr(m, n, None), int)}
    remove_layers(model, kept)  # a new ModuleList of the same layer objects: no weight is copied
    try:
        yield model
    finally:
        setattr(owner, attr, full)  # the original list, every layer back at its own index
        for cfg, saved in zip(configs, saved_configs):  # a key the cut added goes too
            vars(cfg).clear()
            vars(cfg).update(saved)
        for (m, n), idx in saved_idx.items():
            setattr(m, n, idx)


@torch.no_grad()
def fitness(model, batches, kept, losses):
    """F(G) = mean over the valid tokens of the top-K KL to the teacher,

        F(G) = 1/N sum_i sum_{c in top-K(i)} p_t,c (log p_t,c - log p_G,c),

    p_G the model running only the layers G = `kept`; lower is better (over a sampled cache: the KL
    from its draws). batches: dicts of input_ids (B,T), the cache's targets (topk_ids and
    topk_logprobs (B,T,K), or its samples) and mask (B,T) bool (False: not counted); losses:
    prune.py's (kd.py's plain loss, or the fused head's), kind "kd". In eval mode: a layer set
    scores the same every time. Under torchrun every rank scores the same tokens."""
    dev = next(model.parameters()).device
    total, count, training = 0.0, 0, model.training
    model.eval()
    try:
        with only_layers(model, kept):
            for b in batches:
                n = int(kd.positions(b).sum())  # the tokens the mean is over
                (kl,) = losses(model, {key: v.to(dev) if torch.is_tensor(v) else v
                                       for key, v in b.items()}, ["kd"])
                total, count = total + kl.double().item() * n, count + n  # the mean, times n
    finally:
        model.train(training)  # prune.py trains the model right after
    return total / max(count, 1)


def first_tokens(cache, n_tokens, micro_batch=4):
    """The first `n_tokens` tokens of the cache's training split as batches, in order: whole
    sequences, then a prefix of the next one (a causal LM's prefix needs nothing after it)."""
    T = cache.seq_len
    available = cache.len_split("train") * T
    if n_tokens > available:
        raise E3Error(f"the search scores candidates on {n_tokens} tokens but the teacher cache's "
                      f"training split holds {available}; lower the search's token counts or build "
                      f"a larger cache")
    lengths = [T] * (n_tokens // T) + ([n_tokens % T] if n_tokens % T else [])
    batches = []
    for a in range(0, len(lengths), micro_batch):
        part = lengths[a:a + micro_batch]
        rows = cache.get(list(range(a, a + len(part))))
        width = max(part)  # a prefix runs only as far as it goes
        mask = torch.arange(width)[None, :] < torch.tensor(part)[:, None]
        batches.append({**{key: v[:, :width] for key, v in rows.items()
                           if torch.is_tensor(v) and key != "entropy"},
                        "targets": rows.get("targets", "topk"), "mask": mask})
    return batches


def cache_score(model, cache, losses, micro_batch=4):
    """score(kept, n_tokens) = fitness of `kept` on the first n_tokens training tokens of `cache`;
    the batches of each token count are read from the cache once."""
    batches = {}

    def score(kept, n_tokens):
        if n_tokens not in batches:  # every genome of a stage is scored on the same tokens
            batches[n_tokens] = first_tokens(cache, n_tokens, micro_batch)
        return fitness(model, batches[n_tokens], kept, losses)
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


def swap(kept, L, generator):
    """One of EvoPress's flips: a uniformly random kept layer leaves, a uniformly random removed one
    enters (drawn among those removed before the flip); k stays k."""
    removed = [i for i in range(L) if i not in kept]
    if not kept or not removed:
        return sorted(kept)
    out = kept[_randint(len(kept), generator)]
    enters = removed[_randint(len(removed), generator)]
    return sorted((set(kept) - {out}) | {enters})


def offspring_of(parent, L, generator, max_swaps=3):
    """A child drawn as EvoPress's whole-block search draws one (evo_drop_search.py,
    --drop_entire_block): n = min of two uniform draws from 1..max_swaps flips (P(n = 1) = 5/9 at 3,
    a bias to small steps); each flip picks the attention or the MLP sub-block with probability 1/2,
    and only the attention's flips survive (the whole-block child copies the attention's mask onto
    the MLPs), so each flip is a swap with probability 1/2. Among the children that differ from
    their parent, 1, 2 and 3 swaps come out with probability 0.778, 0.200, 0.022 (tests/)."""
    n = 1 + min(_randint(max_swaps, generator), _randint(max_swaps, generator))
    child = sorted(parent)
    for _ in range(n):
        if _randint(2, generator) == 0:  # the attention sub-block's flip: a swap
            child = swap(child, L, generator)
    return child


def new_offspring(parent, n, L, protected, generator, max_swaps=3, seen=()):
    """Up to n children, each redrawn, as EvoPress does, while it is the parent, a sibling, or a set
    that drops a protected layer (EvoPress's illegal layers); and here also while it is a genome in
    `seen` (scored before). Fewer only when the space is too small (tries stop after 1000 n)."""
    children = []
    for _ in range(1000 * n):
        if len(children) == n:
            break
        child = offspring_of(parent, L, generator, max_swaps)
        if (child != sorted(parent) and set(protected) <= set(child) and child not in children
                and tuple(child) not in seen):
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
# As prune.py's layer searches (surgery.LayerSearch): the set is chosen in prepare(), before training

def evo_settings(args, L):
    """(generations, stages, the most forward tokens evo can spend): EvoPress's generations for
    depth pruning, r (L - r) / 1.5 with r layers removed, unless --evo-generations."""
    r = L - args.keep
    generations = args.evo_generations or max(1, round(r * (L - r) / 1.5))
    stages = parse_stages(args.evo_stages)
    return generations, stages, evo_budget(generations, args.evo_offspring, stages)


class EvoSearch(LayerSearch):
    """--search evo: EvoPress's search from the top-k of S_0; S becomes the chosen set's indicator,
    so that the cut keeps exactly that set."""

    def __init__(self, S0, args, L, T, protected, device):
        super().__init__(S0, args, L, T, protected, device)
        self.forward_tokens = 0

    @staticmethod
    def tokens_read(args):  # every set is scored on the first tokens of the last stage
        return parse_stages(args.evo_stages)[-1][0]

    @staticmethod
    def plan(args, L):
        generations, _, budget = evo_settings(args, L)
        return (f"{args.search} search <= {budget:,} forward tokens (evo's budget: {generations} "
                f"generations x {args.evo_offspring} children, stages {args.evo_stages})")

    def prepare(self, model, cache, losses, log):
        if cache is None:
            raise E3Error(f"--search {self.args.search} scores layer sets against the teacher "
                          f"cache; give --cache or train (--steps > 0)")
        score = cache_score(model, cache, losses, self.args.micro_batch)
        gen = torch.Generator().manual_seed(self.args.seed)  # the same draws on every rank
        found = self.search(score, gen, log)
        print0(f"{self.args.search} search: kept {found['kept']}, fitness {found['fitness']:.4f}, "
               f"{found['forward_tokens']:,} forward tokens")
        self.S.data = torch.zeros(self.L, device=self.S.device).index_fill_(
            0, torch.tensor(found["kept"], device=self.S.device), 1.0)
        self.forward_tokens = found["forward_tokens"]

    def search(self, score, gen, log):
        generations, stages, _ = evo_settings(self.args, self.L)
        init = top_k_layers(self.S, self.args.keep, self.protected)  # the first parent
        return evo_search(score, self.L, self.args.keep, self.protected, gen, generations,
                          self.args.evo_offspring, stages, init=init, log=log)

    def summary(self):
        return {"search_forward_tokens": self.forward_tokens}

    def state_dict(self):
        return {**super().state_dict(), "forward_tokens": self.forward_tokens}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.forward_tokens = state["forward_tokens"]


class RandomSearch(EvoSearch):
    """--search random: the control, as many random sets as evo's forward tokens pay for, each
    scored on evo's last stage."""

    def search(self, score, gen, log):
        _, stages, budget = evo_settings(self.args, self.L)
        n = self.args.random_candidates or max(1, budget // stages[-1][0])
        return random_search(score, self.L, self.args.keep, self.protected, gen, n, stages[-1][0],
                             log=log)
