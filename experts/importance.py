"""
Expert importance: a score per (MoE layer, expert), larger = more important, from one pass over the
calibration set (KL: one pass and E partial forwards per MoE layer, shared out among the ranks).
The registry, beside the layers' (prune.IMPORTANCE), one signature for all:

  EXPERT_IMPORTANCE[name](model, batches, vocab, generator=None) -> (scores, layers)

scores a float64 tensor [the MoE layers' count, E], layers the decoder-layer index of each row;
batches (input_ids, attention_mask or None), as surgery.kl_importance reads them: pad positions never
count. In eval mode: a router's jitter noise (Mixtral's, when training) never moves a score.

  reap        REAP (Lasby et al., arXiv 2510.13999, eq. 9): S_j = mean over the tokens routed to j
              of g_j(x) ||f_j(x)||_2, g_j the gate the family applies to expert j (the router's
              top-k gates as the family computes them: renormalised where it renormalises,
              DeepSeek's scaled by routed_scaling_factor), f_j(x) the expert's output. An expert
              no token reached scores 0: each expert is scored by what it adds where it is used,
              not by how often. Llama-4 scales an expert's input by its gate (it adds f_j(g_j x));
              S_j still reads f_j on the token's own x, as REAP's code does for that family.
  frequency   the share of the valid tokens whose top-k holds j (a row sums to k)
  random      uniform draws from the run's seeded generator: a random set, the baseline
  kl          the paper's Sec. 3.2 for an expert: s_{l,j} = E_x KL(p_{-(l,j)} || p), p the model's
              next-token distribution and p_{-(l,j)} that of the model whose layer-l router can
              never choose j (routing.expert_unroutable: its top-k among the other E - 1). Exact:
              one dense forward records every layer's output (surgery.LayerRecorder), then each
              masked model starts at its layer (the layers before it return what was recorded:
              nothing before layer l reads its router), E partial forwards per MoE layer, about
              E sum_l (L - l) layer calls a batch over the MoE layers l, against E M L without the
              reuse; the KL in fp32 over the tokenizer's ids, summed in float64 (surgery._kl_sum,
              the layers' own). On R ranks (FSDP) the experts are shared out: rank r masks r, r + R,
              ... in the same forwards (the ranks gather the same layers in step; only the router's
              mask differs), ceil(E / R) partial forwards a MoE layer and rank, the scores gathered
              after (kl_forwards: what a rank runs).

Per domain (--expert-domains, with a --calib-data mixture): one of these on each domain's
calibration sequences apart, each normalised within its domain, then combined (domain_scores).

score_experts(name, model, batches, vocab, log) runs one, writes it to the run's log as the layers'
importance is written (event "expert_importance": the method, the MoE layers, the scores a row a
layer) and prints a line a layer.
"""
import itertools
import math
from contextlib import contextmanager

import torch

from experts.routing import RoutingReader, expert_unroutable, experts_per_layer, moe_layers
from runtime import E3Error, all_gather, print0, rank_and_world
from surgery import LayerRecorder, _kl_sum, decoder_layers


def _batches(model, batches):
    """(ids, attention mask, valid [B S] bool) on the model's device, one a batch."""
    dev = next(model.parameters()).device
    for ids, attn in batches:
        ids, attn = ids.to(dev), None if attn is None else attn.to(dev)
        yield ids, attn, (torch.ones_like(ids) if attn is None else attn).bool().flatten()


@torch.no_grad()
def routing_counts(model, batches, outputs=True):
    """One dense pass: (routed [M, E], weighted [M, E], tokens, layers): per MoE layer and expert,
    the valid tokens routed to it, and (outputs) the sum over them of g_j(x) ||f_j(x)||_2, float64;
    tokens: the valid tokens."""
    moes = moe_layers(model)
    E, training = experts_per_layer(moes), model.training
    routed = torch.zeros(len(moes), E, dtype=torch.float64)
    weighted = torch.zeros_like(routed)
    now = {}  # the batch in flight: its valid positions

    def on_call(m, chosen, gates, norms):
        valid = now["valid"]
        if chosen.shape[0] != valid.numel():
            raise E3Error(f"layer {moes[m].index}: the experts saw {chosen.shape[0]} tokens in a batch "
                          f"of {valid.numel()}; experts/importance.py cannot tell the pad positions")
        routed[m] += chosen[valid].sum(0).double().cpu()
        if norms is not None:
            weighted[m] += (gates * norms)[valid].sum(0).cpu()
    tokens = 0
    model.eval()
    try:
        with RoutingReader(moes, on_call, outputs):
            for ids, attn, valid in _batches(model, batches):
                now["valid"] = valid
                model(input_ids=ids, attention_mask=attn, use_cache=False)
                tokens += int(valid.sum())
    finally:
        model.train(training)
    return routed, weighted, tokens, [m.index for m in moes]


def reap_importance(model, batches, vocab=None, generator=None):
    """REAP's saliency S_j = mean over the tokens routed to j of g_j(x) ||f_j(x)||_2 (0 where none
    was): (scores [M, E] float64, the MoE layers)."""
    routed, weighted, _, layers = routing_counts(model, batches, outputs=True)
    return torch.where(routed > 0, weighted / routed.clamp_min(1), 0.0), layers


def frequency_importance(model, batches, vocab=None, generator=None):
    """The share of the valid tokens whose top-k holds expert j: (scores [M, E] float64, layers)."""
    routed, _, tokens, layers = routing_counts(model, batches, outputs=False)
    return routed / max(tokens, 1), layers


@torch.no_grad()
def kl_expert_importance(model, batches, vocab, generator=None, chunk=1024):
    """s_{l,j} = mean over the valid tokens of KL(p_{-(l,j)} || p), exact: (scores [M, E] float64,
    the MoE layers). Deterministic: `generator` (the registry's signature) is not used. Every rank
    reads every batch; rank r scores experts r, r + R, ... (a rank past E in the last round masks
    expert j mod E again, unscored: FSDP's gathers need every rank in every forward, and every rank
    then runs the same code, errors included)."""
    layers, moes = decoder_layers(model), moe_layers(model)
    E, training = experts_per_layer(moes), model.training
    rank, world = rank_and_world()
    rounds = -(-E // world)  # ceil(E / R) forwards a MoE layer on every rank
    sums, count = torch.zeros(len(moes), E, dtype=torch.float64), 0
    model.eval()
    try:
        for ids, attn, valid in _batches(model, batches):
            with LayerRecorder(layers) as rec:
                logits_p = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            logp = None  # one chunk holds every token: log p made once, not once an expert
            if valid.numel() <= chunk:
                logp = torch.log_softmax(logits_p.flatten(0, -2)[:, :vocab].float(), dim=-1)
            for m, moe in enumerate(moes):
                with prefix_reused(layers, rec, moe.index):
                    for j in range(rank, rounds * world, world):
                        with expert_unroutable(moe, j % E):
                            logits_q = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
                        if j < E:
                            sums[m, j] += _kl_sum(logits_q, logits_p, valid, vocab, chunk, logp)
            count += int(valid.sum())
    finally:
        model.train(training)
    sums = torch.stack(all_gather(sums)).sum(0)  # each expert's sum is one rank's, 0 on the others
    return sums / max(count, 1), [m.index for m in moes]


def kl_forwards(model, ranks=1):
    """The forwards kl_expert_importance runs a calibration batch on each of `ranks` ranks, each as
    the decoder layers it computes: L (the dense pass), then L - l for each of the ceil(E / R) rounds
    of each MoE layer l. Their sum, L + ceil(E / R) sum_l (L - l), is the pass's cost in layer calls
    (prune.py --plan states it)."""
    L, moes = len(decoder_layers(model)), moe_layers(model)
    return [L] + [L - moe.index for moe in moes for _ in range(-(-experts_per_layer(moes) // ranks))]


@contextmanager
def prefix_reused(layers, rec, start):
    """Inside the block the layers before `start` return what `rec` recorded: nothing before them
    reads what changes at `start`, so a forward computes layers start, start + 1, ... only (the
    embedding, the masks, the final norm and the head still run: the logits are the model's own).
    surgery.layer_bypassed's prefix, without its bypass."""
    found = [vars(layers[i]).get("forward") for i in range(start)]  # checkpointing's wrapper
    for i in range(start):
        layers[i].forward = lambda *a, _out=rec.outputs[i], **k: _out
    try:
        yield
    finally:  # each layer's forward as found: its own (a wrapper's), else the class's again
        for layer, forward in zip(layers, found):
            vars(layer).update(forward=forward) if forward else vars(layer).pop("forward")


def random_expert_scores(model, batches=None, vocab=None, generator=None):
    """Uniform random scores (the random-set baseline): (scores [M, E] float64, the MoE layers)."""
    moes = moe_layers(model)
    return torch.rand(len(moes), experts_per_layer(moes), generator=generator,
                      dtype=torch.float64), [m.index for m in moes]


EXPERT_IMPORTANCE = {"reap": reap_importance, "frequency": frequency_importance,
                     "kl": kl_expert_importance, "random": random_expert_scores}


def score_experts(method, model, batches, vocab, log=None, generator=None):
    """EXPERT_IMPORTANCE[method] on the calibration batches, written to the run's log (`log`, e.g.
    prune.RunFolder.log) as the layers' importance is, and printed a line a MoE layer:
    (scores [M, E], layers)."""
    if method not in EXPERT_IMPORTANCE:
        raise E3Error(f"no expert importance '{method}'; one of {', '.join(sorted(EXPERT_IMPORTANCE))}")
    scores, layers = EXPERT_IMPORTANCE[method](model, batches, vocab, generator)
    if log is not None:
        log(event="expert_importance", method=method, layers=layers, scores=scores.tolist(), step=0)
    for l, row in zip(layers, scores.tolist()):
        print0(f"expert importance ({method}), layer {l}: " + " ".join(f"{s:.3g}" for s in row))
    return scores, layers


def domain_scores(method, model, domains, vocab, how, n, groups=1, log=None, generator=None):
    """Per-domain importance: EXPERT_IMPORTANCE[method] on each domain's calibration batches apart
    (`domains`: {name: batches}), each domain's row of a layer divided by its sum (the share of the
    domain's importance each expert holds: a domain whose KL is small in nats counts as much as one
    whose KL is large), then combined so that every domain keeps what it needs:

      max      an expert's largest share over the domains (pooled scoring is nearer their sum)
      minimax  per layer (per group of DeepSeek's n_group, each its share of the n), the set whose
               worst domain loses the least: min over sets of max over domains of the share the
               removed experts hold; every set enumerated up to MINIMAX_SETS of them, else a greedy
               choice (remove, one at a time, the expert whose removal least raises the worst
               domain's removed share); an expert's score is its max share, + 1 if in the set

    Returns (scores [M, E] float64, layers); each domain's scores are logged as score_experts
    logs the pooled ones, with its name."""
    rows = []
    for name, batches in domains.items():
        domain_log = None if log is None else (lambda name=name, **event: log(**event, domain=name))
        scores, layers = score_experts(method, model, batches, vocab, domain_log, generator)
        rows.append(scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny))
    shares = torch.stack(rows)  # [D, M, E]
    best = shares.amax(0)
    if how == "max":
        return best, layers
    if how != "minimax":
        raise E3Error(f"--expert-domains must be pooled, max or minimax; got '{how}'")
    D, M, E = shares.shape
    kept = torch.zeros(M, E, dtype=torch.float64)
    for m, g in itertools.product(range(M), range(groups)):
        group = list(range(g * E // groups, (g + 1) * E // groups))
        chosen, _ = minimax_set(shares[:, m, group], n // groups)
        kept[m, [group[j] for j in chosen]] = 1.0
    return best + kept, layers


MINIMAX_SETS = 200_000  # sets enumerated a layer (or group) at most; beyond: the greedy choice


def minimax_set(shares, n):
    """shares [D, E']: the n of E' experts whose removal costs the worst domain least (its removed
    share), and that cost: by enumeration when C(E', n) <= MINIMAX_SETS, else greedily."""
    D, E = shares.shape
    total = shares.sum(-1)  # 1 a domain, up to rounding
    if math.comb(E, n) <= MINIMAX_SETS:
        sets = torch.tensor(list(itertools.combinations(range(E), n)), dtype=torch.long)  # [C, n]
        removed = total[None, :] - shares.T[sets].sum(1)  # [C, D]
        worst = removed.amax(-1)
        i = int(torch.argmin(worst))  # ties: the first in enumeration order
        return sets[i].tolist(), worst[i].item()
    left, removed = list(range(E)), torch.zeros(D, dtype=torch.float64)
    while len(left) > n:
        _, _, e = min(((removed + shares[:, e]).max().item(), shares[:, e].sum().item(), e) for e in left)
        removed += shares[:, e]
        left.remove(e)
    return left, removed.max().item()
