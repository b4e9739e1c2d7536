"""The layer-set searches of baselines/evo.py: children keep k layers and the protected ones and follow
EvoPress's law (enumerated here), the
fitness equals a float64 KL written out here, the evolutionary search and the random control find
the optimum of an additive objective found by enumeration, and on a planted teacher (two layers
made the identity on purpose) the evolutionary search and prune.py's Gumbel search both remove
exactly those two; 2 FSDP ranks search exactly as one process does."""
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from fractions import Fraction

import baselines.evo as baselines
from baselines.evo import (evo_search, first_tokens, fitness, new_offspring, random_genome,
                           random_search, swap)
from cache_teacher import TeacherCache, build_cache
from conftest import free_port, tiny_config, torchrun_failure
from prune import plain_losses
from surgery import decoder_layers
from test_prune import corpus, events, kill_after_first_checkpoint, run_here  # noqa: F401  (corpus: a fixture)

V = 49152


# -----------------------------------------------------------------------------
# Genomes

def test_children_keep_k_layers_and_every_protected_one():
    gen = torch.Generator().manual_seed(0)
    L, k, protected = 12, 7, [0, 1, 11]
    parent = random_genome(L, k, protected, gen)
    for n in range(300):
        (child,) = new_offspring(parent, 1, L, protected, gen)
        assert len(child) == k == len(set(child)) and set(protected) <= set(child) <= set(range(L))
        assert child != parent
        parent = random_genome(L, k, protected, gen) if n % 50 == 0 else parent
    # one flip reaches every one-swap neighbour: count them by enumeration
    fixed = random_genome(L, k, protected, gen)
    into = [i for i in range(L) if i not in fixed]
    neighbours = {tuple(sorted(set(fixed) - {a} | {b})) for a in fixed for b in into}
    got = {tuple(swap(fixed, L, gen)) for _ in range(3000)}
    assert got == neighbours and len(got) == k * len(into)
    assert new_offspring([0, 1, 11], 1, L, protected, gen) == []  # only the protected kept: none


def evopress_children(parent, L, protected, max_swaps=3):
    """The exact law of EvoPress's whole-block child (evo_drop_search.py, --drop_entire_block),
    enumerated: n = min(U{1..m}, U{1..m}) flips; a flip is the attention's or the MLP's with
    probability 1/2 (the MLP's are overwritten by the attention's); the attention's flip drops a
    uniformly random kept block and restores a uniformly random removed one; a child equal to its
    parent or dropping an illegal (protected) block is drawn again."""
    m = max_swaps
    law = {}

    def flips(child, left, p):
        if left == 0:
            law[tuple(child)] = law.get(tuple(child), 0) + p
            return
        flips(child, left - 1, p / 2)  # the MLP's flip
        removed = [i for i in range(L) if i not in child]
        for out in child:
            for enters in removed:
                flips(sorted(set(child) - {out} | {enters}), left - 1,
                      p / 2 / len(child) / len(removed))
    for n in range(1, m + 1):
        p_n = Fraction(sum(min(a, b) == n for a in range(1, m + 1) for b in range(1, m + 1)), m * m)
        flips(sorted(parent), n, p_n)
    legal = {c: p for c, p in law.items() if c != tuple(parent) and set(protected) <= set(c)}
    total = sum(legal.values())
    return {c: float(p / total) for c, p in legal.items()}


def test_children_follow_evopress_law():
    """The children of a parent, drawn many times, against the exact law of EvoPress's whole-block
    mutation loop enumerated above (the old mutation drew 1-3 swaps of unprotected layers with
    probability 5/9, 3/9, 1/9: a different law)."""
    L, protected, parent = 7, [0, 6], [0, 2, 3, 6]
    exact = evopress_children(parent, L, protected)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = {}
    for _ in range(n):
        (child,) = new_offspring(parent, 1, L, protected, gen)
        counts[tuple(child)] = counts.get(tuple(child), 0) + 1
    assert set(counts) == set(exact)
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    assert tv < 0.02, tv


def test_random_genome_is_uniform_over_k_subsets():
    gen = torch.Generator().manual_seed(1)
    L, k, protected = 6, 4, [0, 5]
    counts = {}
    for _ in range(6000):
        g = tuple(random_genome(L, k, protected, gen))
        counts[g] = counts.get(g, 0) + 1
    assert set(counts) == {(0, *c, 5) for c in itertools.combinations(range(1, 5), 2)}
    assert all(abs(n - 1000) < 150 for n in counts.values())  # 6 subsets, sd of each count ~ 29


# -----------------------------------------------------------------------------
# The searches on an additive objective: enumeration gives the optimum

def additive_score(cost, calls):
    """score = the summed cost of the removed layers; records every call (genome, n_tokens)."""
    def score(kept, n_tokens):
        calls.append((tuple(kept), n_tokens))
        return float(sum(c for i, c in enumerate(cost) if i not in kept))
    return score


def brute_force_best(cost, L, k, protected):
    free = [i for i in range(L) if i not in protected]
    best = min(itertools.combinations(free, k - len(protected)),
               key=lambda c: sum(cost[i] for i in free if i not in c))
    return sorted(set(protected) | set(best))


def test_evo_search_finds_the_optimum_and_counts_its_forward_tokens():
    L, k, protected = 14, 9, [0, 13]
    cost = torch.rand(L, generator=torch.Generator().manual_seed(2)).tolist()
    calls = []
    gen = torch.Generator().manual_seed(3)
    out = evo_search(additive_score(cost, calls), L, k, protected, gen, generations=40, offspring=8,
                     stages=[(16, 2), (64, 1)])
    assert out["kept"] == brute_force_best(cost, L, k, protected)
    assert out["history"][0]["fitness"] > out["fitness"]  # started from a random, worse genome
    fits = [h["fitness"] for h in out["history"]]
    assert fits == sorted(fits, reverse=True)  # elitist: never worse than the parent
    assert len(calls) == len(set(calls))  # each (genome, tokens) scored once
    # no generation wastes its children on genomes scored before: 8 new ones each
    assert sum(n == 16 for _, n in calls) == 40 * 8
    assert out["forward_tokens"] == sum(n for _, n in calls)
    # a generation scores 8 children on 16 tokens and at most the 2 survivors on 64
    assert out["forward_tokens"] <= 64 + 40 * (8 * 16 + 2 * 64)


def test_random_search_is_the_best_of_its_candidates():
    L, k, protected = 8, 5, [0, 7]
    cost = torch.rand(L, generator=torch.Generator().manual_seed(4)).tolist()
    calls = []
    gen = torch.Generator().manual_seed(5)
    out = random_search(additive_score(cost, calls), L, k, protected, gen, 20, n_tokens=32)
    assert len(calls) == len(set(calls)) == 20 and out["forward_tokens"] == 20 * 32
    fit = {g: sum(c for i, c in enumerate(cost) if i not in g) for g, _ in calls}
    assert tuple(out["kept"]) == min(fit, key=fit.get)
    # all C(6, 3) = 20 subsets drawn: the best of them is the optimum
    assert out["kept"] == brute_force_best(cost, L, k, protected)


def test_bad_search_settings_fail_with_one_clear_error():
    score = additive_score([0.0] * 6, [])
    gen = torch.Generator()
    assert baselines.parse_stages("512:2,4096:1") == [(512, 2), (4096, 1)]
    for bad in ("512", "512:2,x:1", "512:2:1", ""):
        with pytest.raises(baselines.E3Error, match="TOKENS:SURVIVORS"):
            baselines.parse_stages(bad)
    with pytest.raises(baselines.E3Error, match="survivor"):
        evo_search(score, 6, 4, [0, 5], gen, 1, 4, stages=[(16, 2)])
    with pytest.raises(baselines.E3Error, match="keep"):
        random_search(score, 6, 1, [0, 5], gen, 4, 16)


# -----------------------------------------------------------------------------
# Fitness against a float64 reference

def float64_model_of(path, kept):
    """Independent reference: a fresh float64 HF model with only the kept layers, their weights
    copied from the checkpoint by name, the per-layer config lists sliced by hand."""
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    cfg = full.config
    cfg.num_hidden_layers = len(kept)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in kept]
    small = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    state = {}
    for key, value in full.state_dict().items():
        parts = key.split(".")
        if parts[:2] == ["model", "layers"]:
            if int(parts[2]) not in kept:
                continue
            parts[2] = str(kept.index(int(parts[2])))
        state[".".join(parts)] = value
    small.load_state_dict(state)
    return small.eval()


def float64_kl(path, kept, ids, K, valid=None):
    """mean over the valid tokens of sum_{c in top-K} p_t,c (log p_t,c - log p_s,c) in float64, the
    teacher the dense model and its top-K taken here; also the targets, for the code under test."""
    with torch.no_grad():
        dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        logp_t = F.log_softmax(dense(ids).logits[..., :V], dim=-1)
        logp_s = F.log_softmax(float64_model_of(path, kept)(ids).logits[..., :V], dim=-1)
    top, top_ids = logp_t.topk(K, dim=-1)
    per_token = (top.exp() * (top - logp_s.gather(-1, top_ids))).sum(-1)
    valid = torch.ones_like(per_token, dtype=torch.bool) if valid is None else valid
    return per_token[valid].mean().item(), top_ids, top.float()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])  # gemma3: sliding and full layers
def test_fitness_equals_float64_kl_and_leaves_the_model_whole(arch, make_tiny):
    path = make_tiny(arch, layers=6)
    kept = [0, 2, 3, 5]
    ids = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(0))
    want, top_ids, top = float64_kl(path, kept, ids, K=5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        before = model(ids).logits
    batch = {"input_ids": ids, "topk_ids": top_ids, "topk_logprobs": top,
             "mask": torch.ones(ids.shape, dtype=torch.bool)}
    got = fitness(model, [batch], kept, plain_losses(V))
    assert want > 0.005  # the removed layers matter
    assert got == pytest.approx(want, rel=1e-5)
    assert len(decoder_layers(model)) == 6 and model.config.num_hidden_layers == 6
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # layers, config and layer_idx restored


def test_only_layers_puts_back_every_layer_index():
    """GPT-Neo indexes its KV cache by `layer_id`, not `layer_idx`: after a fitness evaluation the
    model must generate as before (a layer left renumbered shares another's cache slot)."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("gpt_neo", vocab_size=V, hidden_size=32, num_layers=4, num_heads=4,
                               intermediate_size=64, attention_types=[[["global", "local"], 2]],
                               max_position_embeddings=64, window_size=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    x = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(0))
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    before = model.generate(x, **gen)
    with baselines.only_layers(model, [0, 2, 3]):
        assert len(decoder_layers(model)) == 3
    assert [layer.attn.attention.layer_id for layer in decoder_layers(model)] == [0, 1, 2, 3]
    assert torch.equal(model.generate(x, **gen), before)


def test_only_layers_leaves_the_config_as_it_found_it():
    """The cut may add settings (Gemma-3's sliding_window_pattern, written for the kept order by
    architectures/layouts.py); on exit the config must be the one the block found, key for key:
    serving_notes reads the period from it at the cut."""
    cfg = tiny_config("gemma3_text", 6)
    vars(cfg).pop("sliding_window_pattern", None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    before = dict(vars(model.config))
    with baselines.only_layers(model, [0, 2, 3, 4, 5]):
        pass
    assert vars(model.config) == before

class ListCache:
    """A teacher cache held in memory, with TeacherCache's reading interface."""

    def __init__(self, ids, top_ids, top):
        self.rows = {"input_ids": ids, "topk_ids": top_ids, "topk_logprobs": top}
        self.seq_len, self.vocab_size = ids.shape[1], V

    def len_split(self, split):
        return len(self.rows["input_ids"])

    def get(self, indices, split="train"):
        return {key: v[list(indices)] for key, v in self.rows.items()}


def test_score_on_the_first_tokens_equals_float64_kl(make_tiny):
    """n_tokens = 2 sequences and 5 tokens of a third: the fitness is the KL over exactly those
    tokens (every rank scores them all)."""
    path = make_tiny("llama", layers=6)
    kept, T, n = [0, 1, 4, 5], 8, 21
    ids = torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(1))
    valid = torch.arange(4 * T).view(4, T) < n
    want, top_ids, top = float64_kl(path, kept, ids, K=5, valid=valid)
    cache = ListCache(ids, top_ids, top)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    score = baselines.cache_score(model, cache, plain_losses(V), micro_batch=2)
    assert score(kept, n) == pytest.approx(want, rel=1e-5)
    counted = [b["mask"].sum().item() for b in first_tokens(cache, n, micro_batch=1)]
    assert counted == [8, 8, 5]
    with pytest.raises(baselines.E3Error, match="larger cache"):
        first_tokens(cache, 4 * T + 1)


# -----------------------------------------------------------------------------
# A planted teacher: two layers are the identity, the searches must remove exactly those

L_PLANT = 10


@pytest.fixture(scope="module")
def planted(make_tiny, tmp_path_factory):
    """A 10-layer tiny Llama in which the two free layers that `--init random` (seed 0) ranks
    highest are made the identity (o_proj and down_proj zeroed: the layer adds nothing to its
    residual). The other layers' weights are scaled by 2.5 (std 0.5) so that they matter more."""
    src = make_tiny("llama", layers=L_PLANT, seed=1)
    init = torch.randn(L_PLANT, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    free = list(range(1, L_PLANT - 1))
    identity = sorted(sorted(free, key=lambda i: -init[i])[:2])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(decoder_layers(model)):
            for linear in (m for m in layer.modules() if isinstance(m, torch.nn.Linear)):
                linear.weight.mul_(0.0 if i in identity and linear in (layer.self_attn.o_proj,
                                                                      layer.mlp.down_proj) else 2.5)
    path = tmp_path_factory.mktemp("planted") / "model"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(src).save_pretrained(path)
    return str(path), identity


@pytest.fixture(scope="module")
def planted_cache(planted, corpus, tmp_path_factory):  # noqa: F811
    """The planted model's teacher cache: 32 training sequences of 32 tokens, top-5."""
    out = tmp_path_factory.mktemp("planted-cache") / "cache"
    return build_cache(planted[0], corpus, out, topk=5, seq_len=32, max_tokens=1024)


def planted_score(path, cache):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return baselines.cache_score(model, TeacherCache(cache, AutoTokenizer.from_pretrained(path)),
                                 plain_losses(V), 2)


def test_evo_search_removes_the_planted_identity_layers(planted, planted_cache):
    path, identity = planted
    protected, k = [0, L_PLANT - 1], L_PLANT - 2
    gen = torch.Generator().manual_seed(0)
    out = evo_search(planted_score(path, planted_cache), L_PLANT, k, protected, gen,
                     generations=12, offspring=6, stages=[(64, 2), (512, 1)])
    want = [i for i in range(L_PLANT) if i not in identity]
    assert out["history"][0]["kept"] != want  # the random start was not the answer
    assert out["kept"] == want and out["fitness"] < 1e-3  # only fp16 rounding of the targets left
    assert out["history"][0]["fitness"] > 1e-3  # the planted layers are the only free lunch


def test_prune_py_gumbel_search_finds_the_planted_layers(planted, corpus, tmp_path, monkeypatch):  # noqa: F811
    """prune.py as it is: random init (the planted layers start ranked highest among the free ones),
    weights frozen (--lr 0, so the identity layers stay the identity), the whole run a search."""
    path, identity = planted
    out = tmp_path / "run"
    run_here(["--model", path, "--keep", str(L_PLANT - 2), "--init", "random", "--search", "gumbel",
              "--data", corpus, "--seq-len", "32", "--batch-size", "4", "--micro-batch", "4",
              "--steps", "60", "--search-frac", "1", "--lr", "0", "--warmup", "1", "--score-lr", "0.1",
              "--n-calib", "2", "--eval-every", "100", "--ckpt-every", "100", "--out", str(out)],
             tmp_path, monkeypatch)
    init = events(out, "importance")[0]["scores"]
    assert sorted(sorted(range(1, L_PLANT - 1), key=lambda i: -init[i])[:2]) == identity
    kept = json.loads((out / "model" / "pruning.json").read_text())["kept_layers"]
    assert kept == [i for i in range(L_PLANT) if i not in identity]


# random end to end: slow (its logic: test_random_search_is_the_best_of_its_candidates)
@pytest.mark.parametrize("method", ["evo", pytest.param("random", marks=pytest.mark.slow)])
def test_prune_py_evo_and_random_search_find_the_planted_layers(method, planted, corpus, tmp_path,  # noqa: F811
                                                                 monkeypatch):
    """prune.py --search evo|random: the layer set is chosen before training (scored against the cache
    prune.py builds), then fine-tuned; the forward tokens it spent are in pruning.json. Random draws
    more candidates than the 28 sets there are, so it sees them all: the best is the planted answer."""
    path, identity = planted
    out = tmp_path / method
    run_here(["--model", path, "--keep", str(L_PLANT - 2), "--init", "random", "--search", method,
              "--evo-generations", "12", "--evo-offspring", "6", "--evo-stages", "64:2,512:1",
              "--random-candidates", "40", "--data", corpus, "--seq-len", "32", "--batch-size", "4",
              "--micro-batch", "4", "--steps", "4", "--lr", "0", "--warmup", "1", "--n-calib", "2",
              "--eval-every", "100", "--ckpt-every", "100", "--out", str(out)], tmp_path, monkeypatch)
    meta = json.loads((out / "model" / "pruning.json").read_text())
    assert meta["kept_layers"] == [i for i in range(L_PLANT) if i not in identity]
    found = events(out, "layer_search")
    assert found and found[-1]["kept"] == meta["kept_layers"]
    assert meta["search_forward_tokens"] == found[-1]["forward_tokens"] > 0
    assert not events(out, "search")  # nothing searched inside the training loop
    if method == "random":
        assert meta["search_forward_tokens"] == 28 * 512  # every one of the C(8, 6) sets, once


@pytest.mark.slow  # by default: evo in one process, and kill + resume
def test_evo_run_killed_and_resumed_reports_its_search_tokens_and_plans_them(planted, corpus, tmp_path,  # noqa: F811
                                                                            monkeypatch, capsys):
    """--plan states evo's forward-token budget before anything runs, and the search keeps within it;
    a run killed after its first checkpoint and resumed still reports the forward tokens its search
    spent before the kill (the old code wrote 0: the count was not in the checkpoint), the same as
    the uninterrupted run."""
    path, _ = planted
    args = ["--model", path, "--keep", str(L_PLANT - 2), "--search", "evo", "--evo-generations", "3",
            "--evo-offspring", "4", "--evo-stages", "64:2,256:1", "--data", corpus, "--seq-len", "32",
            "--batch-size", "4", "--micro-batch", "4", "--steps", "4", "--warmup", "1", "--n-calib", "2",
            "--eval-every", "100", "--ckpt-every", "2"]
    run_here(args + ["--plan", "1"], tmp_path, monkeypatch)
    # the first parent on 256 tokens, then 3 generations of 4 children x 64 + 2 survivors x 256
    assert "plan: evo search <= 2,560 forward tokens" in capsys.readouterr().out
    run_here(args + ["--out", str(tmp_path / "whole")], tmp_path, monkeypatch)
    kill_after_first_checkpoint(args + ["--out", str(tmp_path / "killed")], tmp_path, 1)
    run_here(args + ["--out", str(tmp_path / "killed"), "--resume"], tmp_path, monkeypatch)
    spent = [json.loads((tmp_path / r / "model" / "pruning.json").read_text())["search_forward_tokens"]
             for r in ("whole", "killed")]
    assert spent[0] == spent[1] == events(tmp_path / "whole", "layer_search")[-1]["forward_tokens"]
    assert 0 < spent[0] <= 2560


EVO_ON_RANKS = """
import json, sys
import torch
import baselines.evo as baselines, runtime
from cache_teacher import TeacherCache
from prune import plain_losses
from scale.fsdp import parallelize
rank, world, device = runtime.init_distributed()
model, tok = runtime.load_model(sys.argv[1], "cpu", torch.float32, weights=rank == 0)
model = parallelize(model, device)  # rank 0's weights, sent as shards
score = baselines.cache_score(model, TeacherCache(sys.argv[2], tok), plain_losses(49152), 2)
out = baselines.evo_search(score, 10, 8, [0, 9], torch.Generator().manual_seed(0), generations=4,
                           offspring=4, stages=[(80, 2), (300, 1)])
# one file a rank: two ranks printing long lines into one pipe can interleave them
open(f"{sys.argv[3]}/rank{rank}.json", "w").write(json.dumps(out))
torch.distributed.barrier()  # no rank closes its connections while another still uses them
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow  # more ranks or processes than the default run's one of each
def test_evo_search_on_two_fsdp_ranks_matches_one_process(planted, planted_cache, tmp_path):
    """300 tokens = 9 sequences and 12 tokens, a prefix, scored by both ranks of a sharded model: both
    must take the same path and the fitness must be the one-process one."""
    path, cache = planted[0], planted_cache
    one = evo_search(planted_score(path, cache), 10, 8, [0, 9], torch.Generator().manual_seed(0),
                     generations=4, offspring=4, stages=[(80, 2), (300, 1)])
    script = tmp_path / "evo_on_ranks.py"
    script.write_text(EVO_ON_RANKS)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", free_port()]
    proc = subprocess.run(launcher + [str(script), path, cache, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, torchrun_failure(proc.stderr)
    results = [(r, (tmp_path / f"rank{r}.json").read_text()) for r in ("0", "1")]
    for _, text in results:
        two = json.loads(text)
        assert [h["kept"] for h in two["history"]] == [h["kept"] for h in one["history"]]
        assert two["forward_tokens"] == one["forward_tokens"]
        for a, b in zip(two["history"], one["history"]):
            assert a["fitness"] == pytest.approx(b["fitness"], rel=1e-5, abs=1e-7)
