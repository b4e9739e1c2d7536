"""
The methods E3-Pruner is compared with, off its path: prune.py imports this package only when a flag
names one of them (--init bi|random, --search l0|evo|random), under that name:

  shortgpt.py   ShortGPT's Block Influence (--init bi; with --search none --steps 0: ShortGPT,
                with --loss kd: Minitron-style) and random scores (--init random)
  sheared.py    Sheared-LLaMA's hard-concrete layer masks with a Lagrangian (--search l0)
  evo.py        EvoPress's evolutionary search (--search evo) and the random-search control
                (--search random)

A new importance metric is a function (model, batches, generator) -> (L,) scores in IMPORTANCE; a
new search is a surgery.LayerSearch in SEARCHES.
"""
from baselines.evo import EvoSearch, RandomSearch
from baselines.sheared import HardConcreteSearch
from baselines.shortgpt import block_influence, random_scores

IMPORTANCE = {"bi": block_influence, "random": random_scores}
SEARCHES = {"l0": HardConcreteSearch, "evo": EvoSearch, "random": RandomSearch}
