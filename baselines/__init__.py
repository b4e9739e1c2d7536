"""
The methods E3-Pruner is compared with, off its path. prune.py's registries name them by
"module:attribute" (prune.IMPORTANCE, prune.SEARCHES) and import a module only when a flag names it:

  shortgpt.py   ShortGPT's Block Influence (--init bi; with --search none --steps 0: ShortGPT,
                with --loss kd: Minitron-style) and random scores (--init random)
  sheared.py    Sheared-LLaMA's hard-concrete layer masks with a Lagrangian (--search l0)
  evo.py        EvoPress's evolutionary search (--search evo) and the random-search control
                (--search random)
  reverse.py    Lu et al.'s reverse order (--init reverse --search none --protect-last 0: the last
                layers go) and their partial fine-tune (--train-last 3: the head, the final norm
                and the last three kept layers trained, the rest frozen)
  targets.py    teacher targets beside the paper's top-K (kd.TARGETS): the K + 1-class tail, draws
                from the softmax (sampled) or from the rest of it (hybrid), the full distribution
  guard.py      the guard of the cut (--guard N): of the last N sets the search visited and S_0's,
                the one with the least top-K KL to the teacher on the search text's held-out end

An importance is a function (model, batches, vocab, generator) -> (L,) scores, as
surgery.kl_importance; a search is a surgery.LayerSearch, as prune.GumbelTopKSearch.
"""
