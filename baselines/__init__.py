"""
The methods E3-Pruner is compared with, off its path. prune.py's registries name them by
"module:attribute" (prune.IMPORTANCE, prune.SEARCHES) and import a module only when a flag names it:

  shortgpt.py   ShortGPT's Block Influence (--init bi; with --search none --steps 0: ShortGPT,
                with --loss kd: Minitron-style) and random scores (--init random)
  sheared.py    Sheared-LLaMA's hard-concrete layer masks with a Lagrangian (--search l0)
  evo.py        EvoPress's evolutionary search (--search evo) and the random-search control
                (--search random)

An importance is a function (model, batches, vocab, generator) -> (L,) scores, as
surgery.kl_importance; a search is a surgery.LayerSearch, as prune.GumbelTopKSearch.
"""
