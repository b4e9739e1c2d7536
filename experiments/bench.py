"""
Benchmarks with a goal each (issue: "performance targets go in benchmarks, never in timed unit
tests"). Every benchmark times two things side by side in one run, alternating, after a warm-up
round, and prints one line `name: ratio (goal ...)` with the median of the per-round ratios.

    python experiments/bench.py               # all ten (SmolLM2-135M, packaged; a small MoE) (minutes)
    python experiments/bench.py search init   # some, by name
    python experiments/bench.py search --repeats 15   # more paired rounds

    search    a Gumbel-TopK search step (all L layers run, masked) / a plain KD step of the same
              model
    finetune  a fine-tuning step after pruning L -> k / a step of a fresh k-layer model of the same
              shape
    offline   an offline KD step (cached teacher targets) / an online one that runs the teacher
    caching   teacher-caching throughput / plain teacher-forward throughput; bytes per token
    init      KL importance with prefix reuse / the naive L+1 full forwards
    speedup   the exported k-layer model's prefill and decode speedup / the matmul-FLOP ideal
    fused     a training step with the LM head and the loss fused, chunked / the plain logits path
    targets   a training step with top-K + tail, sampled (N = 12) and hybrid (K = 8, N = 12; K = 16,
              N = 24) targets / the top-K step
    sampling  a sampled (N = 12) and the hybrid caches' build throughput / a top-K cache's
    experts   an expert search step (prune.py --experts-keep 8: every MoE layer's 16 experts masked
              in routing, the layers' gates at k = L) / a plain KD step of the same MoE model (a
              Qwen3-MoE of 6 layers, 16 experts, top-2, hidden 256, random weights)

Every step is prune.py's own: its losses (prune.plain_losses, scale.fused_loss.FusedLoss), its
optimizer, its search and cut; nothing here reaches into a function's insides.
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the scripts live at the repo root
import evaluate  # noqa: E402
import prune  # noqa: E402
from cache_teacher import compute_shards, corpus_blocks, teacher_targets, vocab_size  # noqa: E402
from demo import default_model  # noqa: E402
from runtime import E3Error, load_model, run_main  # noqa: E402
from scale.fused_loss import FusedLoss  # noqa: E402
from surgery import (LayerGates, LayerSearch, decoder_layers, export_pruned,  # noqa: E402
                     kl_importance, remove_layers)

KEEP = 20  # the demo's 30 -> 20


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device):
    if device.type == "cuda":  # CUDA kernels run asynchronously: wait before reading the clock
        torch.cuda.synchronize()


def side_by_side(a, b, repeats, device):
    """Run a() and b() alternately, one warm-up round first. Returns the medians of a's and b's
    seconds and every round's a-time / b-time (paired, so a slow moment mostly cancels; report()
    prints their median and spread)."""
    # Alternating a, b, a, b (not all a's then all b's) pairs each a with a b taken moments later:
    # on a noisy machine both see the same background load, so the per-round ratio is steadier than
    # either time.
    ta, tb = [], []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        a()
        _sync(device)
        t1 = time.perf_counter()
        b()
        _sync(device)
        t2 = time.perf_counter()
        if r:  # round 0 is the warm-up: allocator, kernel selection, first-touch page faults
            ta.append(t1 - t0)
            tb.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb), [x / y for x, y in zip(ta, tb)]


def report(name, ratios, goal, what, detail):
    """One line: the median ratio, then (rounds: min / median / max) when there are several rounds,
    so a reader can tell a real cost from the machine's noise."""
    ratios = ratios if isinstance(ratios, list) else [ratios]  # speedup reports one number
    median = statistics.median(ratios)
    spread = ""
    if len(ratios) > 1:
        spread = f" (rounds: {min(ratios):.3f} / {median:.3f} / {max(ratios):.3f})"
    print(f"{name}: {median:.3f} {what} (goal {goal}){spread} [{detail}]", flush=True)


def _corpus_blocks(tok, seq_len, n):
    """The first n blocks of the packaged corpus: the first play's start."""
    return corpus_blocks(tok, None, seq_len, n * seq_len)["train"][:n]


def _kd_batch(teacher, tok, seq_len, batch, topk=10):
    """A batch with real teacher targets, as cache_teacher.py stores them (but kept in memory)."""
    # real text, not random ids: the KD loss' top-K gather and the entropy weights then look like
    # training
    ids = _corpus_blocks(tok, seq_len, batch).to(next(teacher.parameters()).device)
    with torch.no_grad():
        logp = F.log_softmax(teacher(input_ids=ids, use_cache=False).logits.float(), -1)
    top_lp, top_ids = logp.topk(topk, -1)
    entropy = -(logp.exp() * logp).sum(-1)  # H_t over the full softmax, as the cache stores it
    return {"input_ids": ids, "topk_ids": top_ids, "topk_logprobs": top_lp, "entropy": entropy}


def _train_step(model, opt, batch, vocab, device, losses=None, kind="akd"):
    # prune.py's own loss (bf16 autocast on a GPU), so that the step is the real one
    losses = losses or prune.plain_losses(vocab, autocast=device.type == "cuda")
    (loss,) = losses(model, batch, [kind])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def prune_args(L=30, *flags, search_steps=None):
    """prune.py's settings, parsed and resolved by prune.py itself (every field its search and cut
    read, at the demo's defaults) for an L-layer model, so the benchmarks never miss a flag."""
    args = prune.parse_args(["--keep", str(KEEP), *flags])
    prune.resolve_args(args, 1)
    if search_steps is not None:  # T_M
        args.search_steps = search_steps
    return args


def _optimizer(model, L=30):
    """prune.py's optimizer (the fused AdamW, its betas), at an lr that barely moves the weights."""
    return prune.make_optimizer(model, prune_args(L, "--lr", "1e-6"))


def _trainable(name=None, device=None):
    model, tok = load_model(name, device)
    model.config.use_cache = False  # as prune.build_student: no KV cache is built while training
    return model.train(), tok


def bench_search(seq_len=128, batch=4, repeats=5):
    """1. The paper calls the sampler's overhead negligible (Sheared-LLaMA's reaches 5x)."""
    device = _device()
    model, tok = _trainable(device=device)
    L, vocab = len(decoder_layers(model)), vocab_size(tok)
    b = _kd_batch(model, tok, seq_len, batch)
    opt = _optimizer(model, L)
    args = prune_args(L, search_steps=2)  # beta, score lr, seed, one mask a step: prune.py's
    search = prune.GumbelTopKSearch(torch.randn(L), args, L, 20, [0, L - 1], device)

    # Both sides take a full optimizer step on the same L-layer model and batch; the search side
    # adds what the method adds: hooks on every layer, one Gumbel-TopK sample (t = 1 of T_M = 2:
    # k' = 25 of 30, mid-search) and the score update. Gates are attached per step so the plain
    # step runs without hooks.
    def plain_step():
        _train_step(model, opt, b, vocab, device)

    t_s, t_p, ratio = side_by_side(lambda: _search_step(model, search, opt, b, vocab, device),
                                   plain_step, repeats, device)
    report("search", ratio, "<= 1.03", "x a plain KD step",
           f"{t_s * 1e3:.0f} vs {t_p * 1e3:.0f} ms; {L} layers, k'=25, "
           f"{batch}x{seq_len} tokens, {device}")


def _search_step(model, search, opt, b, vocab, device):
    """prune.py's search step t = 1: the layers' gates on, the draw, the step, the scores' update."""
    gates = LayerGates(model)
    search.begin_step(1)
    gates.mask = search.sample_mask()
    _train_step(model, opt, b, vocab, device)
    search.step()
    gates.remove()


def bench_finetune(seq_len=128, batch=4, repeats=5):
    """2. After the search the pruned layers must cost nothing: not run, not in the optimizer."""
    device = _device()
    pruned, tok = _trainable(device=device)
    vocab = vocab_size(tok)
    b = _kd_batch(pruned, tok, seq_len, batch)
    L = len(decoder_layers(pruned))
    kept = [i for i in range(L) if i % 3 != 1][:KEEP]  # every third layer removed
    # The cut exactly as prune.py makes it (prune_to_top_k: removal, the optimizer rebuilt with the
    # kept moments), after one step of the L-layer model so that there are moments to carry
    # over. The kept layers stay at their old addresses; a ratio near 1 says nothing of the
    # pruning leaks.
    args = prune_args(L, "--lr", "1e-6")
    opt_p = prune.make_optimizer(pruned, args)  # prune.py's AdamW (fused), on both sides
    _train_step(pruned, opt_p, b, vocab, device)
    search = LayerSearch(torch.zeros(L).index_fill_(0, torch.tensor(kept), 1.0), args, L, 0, [],
                         device)
    kept_by_cut, opt_p = prune.prune_to_top_k(pruned, opt_p, search, args)
    assert kept_by_cut == kept
    fresh = type(pruned)(pruned.config).to(device).train()  # same k-layer shape, never pruned
    opt_f = prune.make_optimizer(fresh, args)
    t_p, t_f, ratio = side_by_side(lambda: _train_step(pruned, opt_p, b, vocab, device),
                                   lambda: _train_step(fresh, opt_f, b, vocab, device),
                                   repeats, device)
    report("finetune", ratio, "<= 1.05", "x a fresh k-layer model's step",
           f"{t_p * 1e3:.0f} vs {t_f * 1e3:.0f} ms; "
           f"{L} -> {len(kept)} layers, {batch}x{seq_len} tokens, {device}")


def bench_offline(seq_len=128, batch=4, repeats=5):
    """3. Offline KD needs no teacher forward: compare with the FLOP ideal 3 F_s / (3 F_s + F_t)."""
    device = _device()
    teacher, tok = load_model(default_model(), device)
    teacher.eval()
    student, _ = _trainable(device=device)
    L = len(decoder_layers(student))
    remove_layers(student, list(range(KEEP)))  # which layers does not matter for the step's cost
    vocab = vocab_size(tok)
    b = _kd_batch(teacher, tok, seq_len, batch)
    opt = _optimizer(student, L)

    # forward+backward of the student costs ~3 F_s, a teacher forward F_t: offline KD saves
    # exactly the teacher term, so offline/online should sit at 3 F_s / (3 F_s + F_t), not at
    # some fixed goal
    def online():
        with torch.no_grad():  # the teacher is only read: no graph, as in cache_teacher.py
            logits = teacher(input_ids=b["input_ids"], use_cache=False).logits[..., :vocab]
            logp = F.log_softmax(logits.float(), -1)
            top_lp, top_ids = logp.topk(10, -1)
            entropy = -(logp.exp() * logp).sum(-1)
            targets = {**b, "topk_ids": top_ids, "topk_logprobs": top_lp, "entropy": entropy}
        _train_step(student, opt, targets, vocab, device)

    def offline():  # the targets are already in `b`, as if read from the cache
        _train_step(student, opt, b, vocab, device)

    t_off, t_on, ratio = side_by_side(offline, online, repeats, device)
    fs, ft = sum(evaluate.linear_flops(student)), sum(evaluate.linear_flops(teacher))
    ideal = 3 * fs / (3 * fs + ft)
    report("offline", ratio, f"~ the FLOP ideal {ideal:.3f}", "x an online KD step",
           f"{t_off * 1e3:.0f} vs {t_on * 1e3:.0f} ms; student {KEEP} of {L} layers, "
           f"{batch}x{seq_len} tokens")


def _teacher_and_shards(seq_len, shards, shard_seqs):
    """The teacher in eval mode (bf16 on a GPU) and `shards` shards of corpus blocks to cache."""
    device = _device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tok = load_model(default_model(), device, dtype)
    blocks = _corpus_blocks(tok, seq_len, shards * shard_seqs)
    # compute_shards' jobs: (split, shard), its sequences, and nothing stored beside them
    jobs = [(("train", j), blocks[j * shard_seqs:(j + 1) * shard_seqs], {}) for j in range(shards)]
    return model.eval(), tok, blocks, jobs, device


def bench_caching(seq_len=256, batch_size=4, shards=2, shard_seqs=4, topk=10, repeats=5):
    """4. Caching must not be slower than the teacher forward it wraps: top-K, entropy and writing
    overlap."""
    model, tok, blocks, jobs, device = _teacher_and_shards(seq_len, shards, shard_seqs)
    identity = {"vocab_size": vocab_size(tok), "topk": topk}
    size = {}

    @torch.no_grad()
    def plain():  # the forwards alone, the same batches: what caching cannot avoid
        for batch in blocks.split(batch_size):
            model(input_ids=batch.to(device), use_cache=False).logits  # as compute_shards

    def caching():
        with tempfile.TemporaryDirectory() as out:  # a fresh folder each round: no shard is reused
            compute_shards(model, jobs, out, identity, batch_size)
            size["bytes"] = sum(f.stat().st_size for f in Path(out).iterdir())

    t_cache, t_plain, ratio = side_by_side(caching, plain, repeats, device)
    # reported as throughput (plain time / caching time), so that ">= 0.9" reads as
    # "loses at most 10%"
    n = blocks.numel()
    report("caching", [1 / r for r in ratio], ">= 0.9", "of plain-forward throughput",
           f"{n / t_cache:.0f} vs {n / t_plain:.0f} tok/s; "
           f"{size['bytes'] / n:.1f} bytes/token (goal <= 64 at K={topk}); "
           f"{shards * shard_seqs}x{seq_len} tokens")


def bench_init(seq_len=128, n_calib=2, repeats=3):
    """5. Prefix reuse: the input of layer l is the same with and without layer l, so start
    there."""
    device = _device()
    model, tok = load_model(default_model(), device)
    model.eval()
    L, vocab = len(decoder_layers(model)), vocab_size(tok)
    # L(L+1) layer calls naive vs ~L^2/2 + L with reuse; the LM head runs L+1 times either way, so
    # the ratio sits a little above the layer-call ideal of ~0.5
    seqs = _corpus_blocks(tok, seq_len, n_calib).to(device)
    # (input_ids, attention_mask), as prune.calibration_batches makes them
    batches = [(seqs[i:i + 1], None) for i in range(n_calib)]

    def log_probs(ids):
        logits = model(input_ids=ids, use_cache=False).logits[..., :vocab]
        return F.log_softmax(logits.float(), -1)

    @torch.no_grad()
    def naive():  # L + 1 full forwards: the model, then each layer bypassed by a 0 in the mask
        gates = LayerGates(model)
        for ids, _ in batches:
            logp = log_probs(ids)
            for l in range(L):
                bypassed = torch.tensor([l], device=device)
                gates.mask = torch.ones(L, device=device).index_fill(0, bypassed, 0.0)
                logq = log_probs(ids)
                (logq.exp() * (logq - logp)).sum(-1).mean()  # KL(p_{-l} || p), as the real one
        gates.remove()

    def reuse():
        kl_importance(model, batches, vocab)

    t_reuse, t_naive, ratio = side_by_side(reuse, naive, repeats, device)
    report("init", ratio, "<= 0.6", "x the naive L+1 forwards",
           f"{t_reuse:.1f} vs {t_naive:.1f} s; {L} layers, {n_calib}x{seq_len} tokens")


def bench_speedup(batch=1, prompt_len=512, gen_len=32, repeats=5):
    """6. Layer pruning's promise: the speedup is the FLOP ratio. The pruned model is a real
    export."""
    device = _device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dense, tok = load_model(default_model(), device, dtype)
    L = len(decoder_layers(dense))
    pruned, _ = load_model(default_model(), "cpu")
    keep = list(range(KEEP))  # which layers does not matter for speed; the files must be real
    remove_layers(pruned, keep)
    # the ideal is the ratio of matmul FLOPs (evaluate.speed): the LM head stays, so for 20/30
    # layers prefill (head on the last position only) is ~1.5x but decode (head on every token)
    # only ~1.36x
    with tempfile.TemporaryDirectory() as out:
        export_pruned(default_model(), pruned.state_dict(), keep, L, tok,
                      Path(out) / "model", {"source_model": "bench"})
        pruned, _ = load_model(str(Path(out) / "model"), device, dtype)
    models = {"dense": dense.eval(), "pruned": pruned.eval()}
    times = evaluate.speed(models, vocab_size(tok), batch, prompt_len, gen_len, repeats)
    s = evaluate.speedups(times["dense"], times["pruned"])
    for phase in ("prefill", "decode"):
        speedup, ideal = s[f"{phase}_speedup"], s[f"{phase}_ideal"]
        report(f"speedup-{phase}", speedup / ideal, ">= 0.95", "of the FLOP ideal",
               f"measured {speedup:.3f}x vs ideal {ideal:.3f}x; {L} -> {KEEP} layers, "
               f"batch {batch}, prompt {prompt_len}, {gen_len} new tokens, {device}")


def bench_fused(seq_len=512, batch=1, repeats=5, chunk=256):
    """7. The LM head fused with the loss (scale/fused_loss.py, prune.py under torchrun or with
    --logit-chunk: no (T, V) logits, three head matmuls as the plain path has) / the plain path,
    kd.py's eq. 13 on model(x).logits (prune.plain_losses). A memory saving that should cost no
    time."""
    device = _device()
    model, tok = _trainable(device=device)
    vocab = vocab_size(tok)
    b = _kd_batch(model, tok, seq_len, batch)
    opt = _optimizer(model)
    plain = prune.plain_losses(vocab, autocast=device.type == "cuda")
    fused = FusedLoss(vocab, chunk, reference=plain)

    def fused_step():
        _train_step(model, opt, b, vocab, device, fused)

    def plain_step():
        _train_step(model, opt, b, vocab, device, plain)

    t_fused, t_plain, ratios = side_by_side(fused_step, plain_step, repeats, device)
    report("fused", ratios, "<= 1.05", "x the plain logits + loss step",
           f"{t_fused * 1e3:.0f} vs {t_plain * 1e3:.0f} ms, {batch} x {seq_len} tokens, "
           f"chunks of {chunk} tokens, V = {vocab}")


def bench_targets(seq_len=128, batch=4, repeats=5, samples=12):
    """8. The targets beside the paper's top-K (kd.TARGETS) must cost a KD step next to nothing:
    top-K + tail (one more log-sum-exp over the logits), sampled (N ids instead of K) and hybrid
    (the top-8 and N draws from the rest; the top-16 and 24), each a training step of prune.py's
    plain path against the top-K step, alternating."""
    device = _device()
    model, tok = _trainable(device=device)
    vocab = vocab_size(tok)
    topk = {**_kd_batch(model, tok, seq_len, batch), "targets": "topk"}
    sampled = {"input_ids": topk["input_ids"], "targets": "sampled",
               **teacher_targets(model.eval(), topk["input_ids"], vocab, 10, samples=samples,
                                 generator=torch.Generator(device).manual_seed(0))}
    hybrid = {(k, n): {"input_ids": topk["input_ids"], "targets": "hybrid",
                       **teacher_targets(model.eval(), topk["input_ids"], vocab, k, samples=n,
                                         generator=torch.Generator(device).manual_seed(0))}
              for k, n in ((8, samples), (16, 24))}
    model.train()
    opt = _optimizer(model)
    for name, other in (("tail", {**topk, "targets": "tail"}), (f"sampled{samples}", sampled),
                        *((f"hybrid{k}+{n}", b) for (k, n), b in hybrid.items())):
        t_o, t_k, ratios = side_by_side(lambda: _train_step(model, opt, other, vocab, device),
                                        lambda: _train_step(model, opt, topk, vocab, device),
                                        repeats, device)
        report(f"targets-{name}", ratios, "<= 1.05", "x the top-K AKD step",
               f"{t_o * 1e3:.0f} vs {t_k * 1e3:.0f} ms; {batch}x{seq_len} tokens, {device}")


def bench_sampling(seq_len=256, batch_size=4, shards=2, shard_seqs=4, samples=12, repeats=5):
    """9. A sampled cache (N draws a position from the full softmax) and hybrid ones (the top-8 and
    N draws from the rest; the top-16 and 24) against a top-K cache: the same forwards, then a
    multinomial draw instead of (or beside) a top-K, each written as cache_teacher.py writes them."""
    model, tok, blocks, jobs, device = _teacher_and_shards(seq_len, shards, shard_seqs)
    vocab, size = vocab_size(tok), {}
    kinds = {"topk": {"vocab_size": vocab, "topk": 10},
             "sampled": {"vocab_size": vocab, "topk": None, "targets": "sampled",
                         "samples": samples, "sample_seed": 0},
             "hybrid": {"vocab_size": vocab, "topk": 8, "targets": "hybrid", "samples": samples,
                        "sample_seed": 0},
             "hybrid16": {"vocab_size": vocab, "topk": 16, "targets": "hybrid", "samples": 24,
                          "sample_seed": 0}}

    def build(kind):
        with tempfile.TemporaryDirectory() as out:
            compute_shards(model, jobs, out, kinds[kind], batch_size)
            size[kind] = sum(f.stat().st_size for f in Path(out).iterdir())

    n = blocks.numel()
    for kind, what in (("sampled", f"N = {samples}"), ("hybrid", f"K = 8, N = {samples}"),
                       ("hybrid16", "K = 16, N = 24")):
        t_s, t_k, ratio = side_by_side(lambda: build(kind), lambda: build("topk"), repeats, device)
        report(f"sampling-{kind}", [1 / r for r in ratio], ">= 0.9", "of a top-K cache's throughput",
               f"{n / t_s:.0f} vs {n / t_k:.0f} tok/s; {size[kind] / n:.1f} vs "
               f"{size['topk'] / n:.1f} bytes/token ({what}; top-K: K = 10); "
               f"{shards * shard_seqs}x{seq_len} tokens")


def _moe_model(device):
    """A small Qwen3-MoE with the demo's tokenizer: 6 layers, 16 experts of width 256, top-2."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    tok = load_model(default_model(), weights=False)[1]
    config = Qwen3MoeConfig(vocab_size=vocab_size(tok), hidden_size=256, num_hidden_layers=6,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
                            norm_topk_prob=True, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    model.config.use_cache = False
    return model.train(), tok


def bench_experts(seq_len=128, batch=4, repeats=5):
    """10. The expert search (experts/search.py) adds a mask in routing, no pass over the experts."""
    from experts.search import ExpertSearch
    device = _device()
    model, tok = _moe_model(device)
    L, vocab = len(decoder_layers(model)), vocab_size(tok)
    b = _kd_batch(model, tok, seq_len, batch)
    opt = _optimizer(model, L)
    args = prune.parse_args(["--model", "X", "--experts-keep", "8", "--expert-init", "random",
                             "--keep", str(L), "--steps", "20"])
    prune.resolve_args(args, 1)
    search = ExpertSearch(prune.GumbelTopKSearch(torch.zeros(L), args, L, 20, [0, L - 1], device),
                          model, args, vocab, lambda: [], lambda **e: None)
    search.prepare(model, None, None, None)

    # prune.py's search step with --experts-keep, t = 1 of T_M = 2 (k'^e = 12 of 16 experts): the
    # layers' gates (every layer kept) and the experts' gates on, the draws, both score updates
    def plain_step():
        mask, hard = search.gates.mask, search.gates.hard
        search.gates.mask = search.gates.hard = None  # every expert, as the unpruned model routes
        _train_step(model, opt, b, vocab, device)
        search.gates.mask, search.gates.hard = mask, hard

    t_s, t_p, ratio = side_by_side(lambda: _search_step(model, search, opt, b, vocab, device),
                                   plain_step, repeats, device)
    report("experts", ratio, "<= 1.05", "x a plain KD step",
           f"{t_s * 1e3:.0f} vs {t_p * 1e3:.0f} ms; {L} MoE layers, 16 experts, k'^e = 12, "
           f"{batch}x{seq_len} tokens, {device}")


BENCHES = {"search": bench_search, "finetune": bench_finetune, "offline": bench_offline,
           "caching": bench_caching, "init": bench_init, "speedup": bench_speedup,
           "fused": bench_fused, "targets": bench_targets, "sampling": bench_sampling,
           "experts": bench_experts}


def main():
    args = sys.argv[1:]
    repeats = None
    if "--repeats" in args:  # more paired rounds: a steadier median on a noisy machine
        i = args.index("--repeats")
        repeats, args = int(args[i + 1]), args[:i] + args[i + 2:]
    names = args or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise E3Error(f"unknown benchmark {', '.join(unknown)}; pick from {', '.join(BENCHES)}")
    for name in names:
        BENCHES[name](**({"repeats": repeats} if repeats else {}))


if __name__ == "__main__":
    run_main(main)
