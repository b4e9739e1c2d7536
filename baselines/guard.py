"""
A guard of the cut against the search's training text (prune.py --guard N). The Gumbel-TopK search
moves S wherever its training text's gradient points; at the paper's 120 steps the scores travel
2-3 nats against S_0's gap of ~0.004 at the cut, so the set it keeps is the one its text (and its
seed's noise) liked last, and off that text it loses to KL one-shot (experiments/RESULTS.md).

The guard keeps the search as it is and changes only the choice at the cut. It records the top-k of
S after every search step (the sets the cut would have kept then) and, when the T_M steps are done,
scores each distinct set among

    the last N steps' top-k sets,   and S_0's top-k (KL one-shot's set, where the search began)

by the top-K KL to the teacher on HELD-OUT text (the cache's own "kd" loss, mean over the held-out
positions, in eval mode, the weights as they are at the cut: measured by prune.validate, as the
run validates), and keeps the lowest: the final set on a tie. The held-out text is the end of
--search-data (of each source of a mixture, in its proportions: scale/data.py), which the search
never reads; prune.check_args refuses a guard without --search-data, or with a file of the text the
run validates on: the choice is never made on the split the run reports.

So a search that found a set better than KL's on text it was not trained on keeps it, and one that
drifted to its own text's taste falls back, at the cost of one forward of the held-out blocks per
distinct candidate (a few: the set changes rarely in the last steps).
"""
import json
from pathlib import Path

from runtime import E3Error, default_corpus, print0
from surgery import LayerGates, keep_mask, top_k_layers


def check_args(args, config=None):
    """prune.check_args' part for --guard N, before any work: N >= 1, a search in the training steps,
    and --search-data other than the text the run validates on (the --cache's, else --data's): the
    guard never chooses on the split the run reports."""
    if args.guard < 1:
        raise E3Error(f"--guard N scores the last N sets the search visited, N at least 1; got {args.guard}")
    if not args.search_steps:
        raise E3Error(f"--guard guards the cut of a search that takes training steps (--search gumbel or "
                      f"l0, --search-frac and --steps above 0); --search {args.search} here takes none")
    validated = json.loads((Path(args.cache) / "meta.json").read_text())["data"] if args.cache else args.data
    if not args.search_data or shared_text(args.search_data, validated):
        raise E3Error("--guard chooses on the held-out end of --search-data, which must be text other "
                      "than the run's validation text (--data, or the --cache's): the split the run reports")


def shared_text(data, other):
    """Whether two text flags' values read a file in common: their sources (a mixture's each, scale/
    data.py; no value: the packaged corpus), resolved, the same or one a folder holding the other."""
    def sources(text):
        from scale.data import is_mixture, mixture_sources
        if is_mixture(text):
            return [Path(path).resolve() for path, _ in mixture_sources(text)]
        return [Path(text or default_corpus()).resolve()]
    return any(a == b or a in b.parents or b in a.parents for a in sources(data) for b in sources(other))


class CutGuard:
    """Wraps an in-loop search (surgery.LayerSearch's protocol, every call passed on) and changes
    only kept() at the cut."""

    def __init__(self, search, model, cache, losses, log, validate):
        """search: the wrapped one, in the loop (its args.guard: N >= 1); model, losses: the training
        loop's; cache: --search-data's (its held-out split is scored); log: the run's log(**event);
        validate: prune.validate (the held-out means the run reports, measured the same way).
        check_args above has refused, before any work, every run it could not guard."""
        self.search, self.last, self.model, self.cache, self.losses, self.log, self.validate = (
            search, search.args.guard, model, cache, losses, log, validate)
        self.visited = [top_k_layers(search.S, search.args.keep, search.protected)]  # S_0's top-k
        self.choice, self.scores = None, {}

    def __getattr__(self, name):  # the rest of the protocol: the wrapped search's
        return getattr(self.__dict__["search"], name)

    def step(self):
        self.search.step()
        self.visited.append(self.search.kept())

    def candidates(self):
        """The distinct sets of the last N steps, the final first, then S_0's."""
        out = []
        for s in self.visited[:0:-1][:self.last] + self.visited[:1]:
            if s not in out:
                out.append(s)
        return out

    def kept(self):
        if self.choice is None and len(self.visited) > self.search.steps:  # the search is over
            self.scores = {tuple(s): held_out_kl(self, s)
                           for s in self.candidates()}
            self.choice = list(min(self.scores, key=self.scores.get))  # ties: the first, the final
            self.log(event="guard", step=self.search.steps, kept=self.choice,
                     scores=[[list(s), v] for s, v in self.scores.items()])
            print0("guard: held-out KL " + ", ".join(f"{v:.4f}" for v in self.scores.values())
                   + f" -> kept {self.choice}")
        return self.choice or self.search.kept()

    def summary(self):
        return {**self.search.summary(), **({"guard": [[list(s), v] for s, v in self.scores.items()]}
                                            if self.scores else {})}

    def state_dict(self):  # the record too: a run resumed after the cut exports what it chose and why
        return {**self.search.state_dict(), "guard_visited": self.visited, "guard_choice": self.choice,
                "guard_scores": [[list(s), v] for s, v in self.scores.items()]}

    def load_state_dict(self, state):
        self.search.load_state_dict(state)
        self.visited, self.choice = state["guard_visited"], state.get("guard_choice")
        self.scores = {tuple(s): v for s, v in state.get("guard_scores", [])}


def held_out_kl(guard, kept):
    """The mean "kd" loss (top-K KL to the cached teacher) over the counted positions of the search
    cache's held-out split, the model running only `kept` (the gates of eq. 1 at a hard mask),
    measured by prune.validate."""
    gates = LayerGates(guard.model)
    gates.mask = keep_mask(kept, guard.search.L, guard.search.S.device)
    try:
        return guard.validate(guard.model, guard.cache, guard.losses, guard.search.args)[0]
    finally:
        gates.remove()
