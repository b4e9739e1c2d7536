"""
GPU throughput of prune.py's training step and of the teacher cache's forward at the sizes users
prune: random-initialised models from the configs below (no download), batches shaped as a top-K
teacher cache hands them to the loop (cache_teacher.TeacherCache.get's keys and dtypes), every step
made of prune.py's own pieces: its AdamW (prune.make_optimizer: fused, betas (0.9, 0.95)), its losses
(prune.plain_losses, scale.fused_loss.FusedLoss), scale.fsdp.parallelize, and the loop's order
(micro-batches' backwards, the gradient clip, the step).

    bash experiments/gpu_bench.sh OUT          # the whole bench on one GPU in < 10 minutes
    python experiments/gpu_bench.py --out DIR --runs plain/1b,fused/1b/1,fused/1b/0/none/1024,teacher/1b/1 [--profile]
    torchrun --nproc_per_node 1 experiments/gpu_bench.py --out DIR --runs fsdp/7b8/1,fsdp/7b8/0/full
        [--activations none,selective,full]
    python experiments/gpu_bench.py --collect DIR   # one JSON: stdout's last line, DIR/gpu_bench.json
    ... --tiny                                      # tiny shapes, CPU fp32, a few steps (the tests)

A run is PATH/SHAPE[/COMPILE[/CHECKPOINTING[/CHUNK]]] (a teacher run: teacher/SHAPE[/COMPILE]); the paths:
  plain    one process, model(x).logits and kd.py's loss under bf16 autocast, fp32 master weights
  fused    one process, scale/fused_loss.py's head + loss in chunks of CHUNK tokens (default: the
           plan's pick, scale.plan.chunk_sizes: half a micro-batch's tokens)
  fsdp     FSDP2 over a world of one under torchrun (bf16 compute, fp32 reduce), the fused head as
           prune.py runs it there (its record's fsdp2: the student is FSDP2's)
  teacher  cache_teacher.teacher_targets over build_cache's batch (forward_batch) in the teacher's
           dtype (bf16 on a GPU), no gradient, as build_cache runs it (each slice's log-softmax,
           entropy and top-K compiled on a GPU: scale/teacher.py; COMPILE 1: the teacher's layers
           compiled too); beside it, on the same model and batch, timed one after the other:
             eager  the same code with every compiled function run eagerly
                    (torch.compiler.set_stance("force_eager")): the slices' work an op at a time
             plain  model(x).logits, log_softmax and top-K in the logits' dtype, eager: the least a
                    user would write (no entropy); the record's over_plain is tok_s over its own

A record: tokens a second over `--steps` timed steps after `--warmup` (torch.cuda.synchronize before
and after the timed steps only; the loss read once, after them), MFU, the peak of
torch.cuda.max_memory_allocated, the device's name. Each step is 4 micro-batches (a real run
accumulates 128 / ranks of them), every token trained on (AKD, eq. 13, top-10 targets).

    MFU = flops_per_token x tokens a second / the chip's dense bf16 peak

flops_per_token is scale/plan.py's (its docstring; the one place it is written): 6 N + 12 n s a for
training, N the matmul parameters with the LM head (counted when tied), n layers, s the sequence
length, a = heads x head_dim; the attention term not halved for the causal mask (torchtitan's and
PaLM's convention, so figures compare); 2 N + 4 n s a for the teacher's forward. Recomputation under
activation checkpointing is not counted. The peak by device name (scale.plan.peak_flops): H100 SXM
989 TFLOP/s, H100 PCIe 756, H200 989, A100 312; another device: MFU null.

--activations: the bytes a token and layer keeps for the backward, per checkpointing mode, for the
plan, in the path the process runs (one process: plain; under torchrun: fsdp): the memory one
micro-batch's forward leaves allocated (torch.cuda.memory_allocated after it, less before it) at
two depths of one shape; their difference over (tokens x the layers between them) is the layers'
own, free of the embedding, head, loss and fp32 weights, which both depths hold alike (not of the
bf16 weight copies autocast keeps in one process without checkpointing: scale.plan.probe_bytes,
the "formula" beside it, counts them).
--profile: one more step of each eager run without checkpointing, under torch.profiler: the share of
the step's span the GPU is busy (kernels, copies) and the host syncs (the CUDA runtime's blocking
calls, SYNC_CALLS, by name; device-to-host copies beside them), for docs/scale.md's "where a step's
time goes".
"""
import argparse
import gc
import json
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the scripts live at the repo root
import prune  # noqa: E402
from cache_teacher import forward_batch, teacher_dtype, teacher_targets  # noqa: E402
from runtime import init_distributed  # noqa: E402
from scale.compile import compile_layers  # noqa: E402
from scale.plan import chunk_sizes, flops_per_token, peak_flops, probe_bytes  # noqa: E402

# name: (config, sequence length, micro-batch in sequences)
LLAMA2_7B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                 tie_word_embeddings=False)
SHAPES = {
    "1b": (dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                tie_word_embeddings=True, rope_theta=500000.0), 2048, 2),  # Llama-3.2-1B
    "7b8": (dict(LLAMA2_7B, num_hidden_layers=8), 4096, 1),  # Llama-2-7B cut to 8 layers
    "135m": (dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                  tie_word_embeddings=True), 2048, 4),  # SmolLM2-135M, the demo's
}
# the same configs at other sizes: the micro-batch sweep, a whole 7B on one GPU, the paper's grid
SHAPES.update({
    "1bm8": (SHAPES["1b"][0], 2048, 8),  # 1B at the largest micro-batch an H200 holds
    "7b": (LLAMA2_7B, 4096, 1),  # Llama-2-7B whole: one GPU's run, checkpointed (docs/scale.md)
    "135ms128": (SHAPES["135m"][0], 128, 128),  # the paper-regime grid's seq 128, 128 sequences
})
# --tiny: every shape's name stands for this one (the tests run the lease's command at CPU size)
TINY = (dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
        32, 2)
PROBE_SHAPE, PROBE_DEPTHS = "7b8", (2, 4)  # --activations: the plan's shape (scale.plan.BENCH_SHAPE)
N_MICRO, TOPK = 4, 10
# CUDA runtime calls that block the host until the device is done (.item(), .cpu(), nonzero() and
# boolean-mask indexing each end in one of them)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder: records.jsonl gets one line a run")
    p.add_argument("--runs", help="PATH/SHAPE[/COMPILE[/AC[/CHUNK]]],...: path plain, fused, "
                   "teacher (fsdp under torchrun), shape of " + ", ".join(SHAPES) + ", COMPILE 0 or "
                   "1 (per-layer torch.compile, scale/compile.py), AC none, selective or full, "
                   "CHUNK the fused head's tokens a chunk (default: the plan's pick; plain, fused "
                   "and teacher at every shape, eager)")
    p.add_argument("--activations", help="checkpointing modes (none,selective,full) whose bytes a "
                   "token and layer to measure")
    p.add_argument("--profile", action="store_true", help="profile one more step of each eager "
                   "training run without checkpointing")
    p.add_argument("--steps", type=int, help="timed steps (default 5; --tiny 2)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 2, 3 compiled; --tiny 1)")
    p.add_argument("--deadline", type=float, help="epoch seconds: start no run after it")
    p.add_argument("--tiny", action="store_true",
                   help="every shape tiny, CPU fp32, no compile: the tests")
    p.add_argument("--collect", metavar="DIR", help="merge DIR's records into DIR/gpu_bench.json "
                   "(after the runs, with --out)")
    a = p.parse_args(argv)
    a.shape_table = {name: TINY for name in SHAPES} if a.tiny else SHAPES
    a.runs = [run_spec(text) for text in (a.runs or ",".join(
        f"{path}/{shape}" for shape in SHAPES for path in ("plain", "fused", "teacher"))).split(",")]
    a.steps = a.steps or (2 if a.tiny else 5)
    return a


def run_spec(text):
    """'fsdp/7b8/1/full' -> {"path": "fsdp", "shape": "7b8", "compile": 1, "ac": "full"};
    'fused/1b/0/none/1024' -> ... "chunk": 1024 (the fused head's, where given); a teacher run has
    no checkpointing, and its compile only when named ('teacher/1b/1')."""
    path, shape, *rest = text.split("/")
    compiled, ac, *chunk = rest + ["0", "none"][len(rest):]
    spec = {"path": path, "shape": shape}
    if path == "teacher":
        return {**spec, "compile": int(compiled)} if rest else spec
    return {**spec, "compile": int(compiled), "ac": ac, **({"chunk": int(chunk[0])} if chunk else {})}


# -----------------------------------------------------------------------------
# Models and batches

def config(shape, table, layers=None):
    from transformers import AutoConfig
    cfg, seq, _ = table[shape]
    cfg = dict(cfg, num_hidden_layers=layers or cfg["num_hidden_layers"])
    return AutoConfig.for_model(cfg.pop("model_type"), max_position_embeddings=seq, **cfg)


def random_model(cfg, device, dtype):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: no host copy of a 7B-shaped model
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def flops(cfg, seq, train=True):
    """scale/plan.py's FLOPs a token, counted on the config's model on the meta device (whatever
    wrapping compile or FSDP2 put around the one that ran)."""
    return flops_per_token(random_model(cfg, "meta", torch.float32), seq, train=train)


def student(cfg, device, settings):
    """A random-initialised student made ready as prune.py makes it (prune.parallelize_student:
    checkpointing, compile, FSDP2 under torchrun or the fused head's one-process form)."""
    model = random_model(cfg, device, torch.float32)
    model.config.use_cache = False
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return prune.parallelize_student(model, settings, device, world)


def run_args(path, device, tokens, compiled=0, ac="none", chunk=None):
    """prune.py's settings for a run (its defaults: the lr, weight decay, gradient clip), resolved
    as prune.py resolves them: the plain head in one process; the fused one (path fused, and FSDP2,
    which runs only with it) in chunks of `chunk` tokens, by default the plan's largest for a
    micro-batch of `tokens` (scale.plan.chunk_sizes)."""
    fused = path in ("fused", "fsdp")
    chunk = (chunk or chunk_sizes(tokens)[0]) if fused else 0
    args = prune.parse_args(["--model", "bench", "--keep", "1", "--logit-chunk", str(chunk)])
    args.device, args.out = device, "(the bench)"
    args.compile, args.activation_checkpointing = bool(compiled), ac
    return args


def cache_batch(cfg, seq, micro, device, seed):
    """A micro-batch as TeacherCache.get returns it: input_ids and top-K ids int64, the top-K's
    log-probs fp32 (sorted, 0.9 of the mass), the teacher's entropy fp32."""
    g = torch.Generator().manual_seed(seed)
    V = cfg.vocab_size
    lp = torch.log_softmax(2 * torch.randn(micro, seq, TOPK, generator=g), -1)
    lp = lp.sort(-1, descending=True)
    return prune.to_device({"input_ids": torch.randint(V, (micro, seq), generator=g),
                            "topk_ids": torch.randint(V, (micro, seq, TOPK), generator=g),
                            "topk_logprobs": lp.values + math.log(0.9),
                            "entropy": 4 * torch.rand(micro, seq, generator=g)}, device)


# -----------------------------------------------------------------------------
# Steps and timing

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step, warmup, steps, device):
    """Seconds a step over `steps` steps after `warmup` untimed ones, and the last step's output."""
    for _ in range(warmup):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step()
    sync(device)
    return (time.perf_counter() - t0) / steps, out


def profile(step, device):
    """One step under torch.profiler: the GPU-busy share of its span and the host syncs by name."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync(device)  # ours: one cudaDeviceSynchronize, not counted below
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = [e for e in json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
                  if e.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    syncs = Counter(e["name"] for e in events if e["name"] in SYNC_CALLS)
    syncs["cudaDeviceSynchronize"] -= device.type == "cuda"
    return {"gpu_busy": round(busy(gpu) / span, 3) if gpu else None,
            "host_syncs": sum(syncs.values()), "syncs_by_name": {k: v for k, v in syncs.items() if v},
            "dtoh_copies": sum(e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"] for e in events),
            "span_ms": round(span / 1e3, 1)}


def busy(intervals):
    """The length of the union of sorted (start, end) intervals."""
    total, end = 0.0, -math.inf
    for a, b in intervals:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def peak_memory(device):
    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if device.type == "cuda" else None


def free(device):
    gc.collect()
    torch._dynamo.reset()  # compiled layers hold their modules
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# -----------------------------------------------------------------------------
# The runs

def train_run(args, shape, path, compiled, ac, device, chunk=None):
    cfg, (seq, micro) = config(shape, args.shape_table), args.shape_table[shape][1:]
    settings = run_args(path, device, micro * seq, compiled, ac, chunk)
    model = student(cfg, device, settings)
    opt = prune.make_optimizer(model, settings)
    losses = prune.make_losses(settings, cfg.vocab_size, 1)  # autocast on a GPU, as prune.py's
    # prune.py's training step itself: each micro-batch's AKD loss at weight 1 / micro-batches,
    # its backward, the loss summed on the device and read once, the clip, AdamW
    batches = [{**cache_batch(cfg, seq, micro, device, seed=m), "weight": 1 / N_MICRO}
               for m in range(N_MICRO)]
    step = lambda: prune.train_step(model, opt, losses, batches, "akd", 1, settings)  # noqa: E731
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2 + compiled)
    seconds, _ = timed(step, warmup, args.steps, device)  # a NaN loss stops it (E3Error)
    tokens = N_MICRO * micro * seq
    record = {"tokens_per_step": tokens, "seconds_per_step": round(seconds, 4),
              "tok_s": round(tokens / seconds), "peak_gb": peak_memory(device),
              "autocast": device.type == "cuda", "flops_per_token": flops(cfg, seq),
              "chunk": settings.logit_chunk, "fsdp2": isinstance(model, FSDPModule)}
    if args.profile and not compiled and ac == "none":
        record["profile"] = profile(step, device)
    return record


def teacher_run(args, shape, compiled, device):
    cfg, seq = config(shape, args.shape_table), args.shape_table[shape][1]
    model = random_model(cfg, device, teacher_dtype(device)).eval()
    ids = cache_batch(cfg, seq, forward_batch(seq, 64, device), device, seed=0)["input_ids"]
    step = lambda: teacher_targets(model, ids, cfg.vocab_size, TOPK)  # noqa: E731

    @torch.no_grad()
    def plain():
        return torch.log_softmax(model(input_ids=ids, use_cache=False).logits, -1).topk(TOPK)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2 + compiled)
    with torch.compiler.set_stance("force_eager"):  # the compiled slice function runs as written
        plain_s, eager_s = (timed(fn, warmup, args.steps, device)[0] for fn in (plain, step))
    if compiled:
        compile_layers(model)
    seconds, _ = timed(step, warmup, args.steps, device)
    tokens = ids.numel()
    return {"tokens_per_step": tokens, "seconds_per_step": round(seconds, 4),
            "tok_s": round(tokens / seconds), "eager_tok_s": round(tokens / eager_s),
            "plain_tok_s": round(tokens / plain_s), "over_plain": round(plain_s / seconds, 3),
            "over_eager": round(eager_s / seconds, 3), "peak_gb": peak_memory(device),
            "dtype": str(teacher_dtype(device)).removeprefix("torch."),
            "flops_per_token": flops(cfg, seq, train=False)}


def saved_bytes(args, shape, depth, mode, path, device):
    """What one micro-batch's forward (and loss) leaves allocated for its backward, at `depth`
    layers, after a step that set up the lazy state; None on a CPU (no allocator to read)."""
    cfg, (seq, micro) = config(shape, args.shape_table, depth), args.shape_table[shape][1:]
    settings = run_args(path, device, micro * seq, ac=mode)
    model = student(cfg, device, settings)
    losses = prune.make_losses(settings, cfg.vocab_size, 1)
    batch = cache_batch(cfg, seq, micro, device, seed=0)
    for measure in (False, True):
        sync(device)
        before = torch.cuda.memory_allocated() if device.type == "cuda" else None
        (loss,) = losses(model, batch, ["akd"])
        sync(device)
        after = torch.cuda.memory_allocated() if device.type == "cuda" else None
        loss.backward()
        model.zero_grad(set_to_none=True)
    return None if before is None else after - before


def activations_run(args, mode, path, device):
    """Bytes a token and layer, from two depths of PROBE_SHAPE, beside scale/plan.py's model of the
    same difference (probe_bytes: the residual stream bf16 under FSDP2, fp32 in one process, and
    there the bf16 weight copies autocast keeps for the backward)."""
    seq, micro = args.shape_table[PROBE_SHAPE][1:]
    saved = [saved_bytes(args, PROBE_SHAPE, n, mode, path, device) for n in PROBE_DEPTHS]
    measured = None if saved[0] is None else (saved[1] - saved[0]) / (
        micro * seq * (PROBE_DEPTHS[1] - PROBE_DEPTHS[0]))
    model = random_model(config(PROBE_SHAPE, args.shape_table), "meta", torch.float32)
    formula = probe_bytes(model, mode, path == "fsdp", micro * seq)
    return {"shape": PROBE_SHAPE, "depths": list(PROBE_DEPTHS), "tokens": micro * seq,
            "saved_bytes": saved, "measured": measured and round(measured),
            "formula": round(formula)}


def record(args, **fields):
    """One line of DIR/records.jsonl, and a progress line."""
    line = json.dumps(fields)
    print(f"gpu_bench: {line}", flush=True)
    with open(Path(args.out) / "records.jsonl", "a") as f:
        f.write(line + "\n")


def attempt(args, device, what, fn, *fn_args):
    """fn's record, or its error: one failed run (out of memory, a compile error) ends no other."""
    if args.deadline and time.time() > args.deadline:
        return record(args, **what, skipped="past the deadline")
    if args.tiny and what.get("compile"):  # inductor's C++ build on a CPU: minutes, not the tests'
        return record(args, **what, skipped="--tiny runs eager")
    t0 = time.time()
    try:
        fields = fn(*fn_args)
    except Exception as e:  # noqa: BLE001 (a bench goes on to its next run)
        fields = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    free(device)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = peak_flops(device_name)
    for key in [k for k in fields if k.endswith("tok_s")]:  # tok_s -> mfu, plain_tok_s -> plain_mfu
        fields[key.replace("tok_s", "mfu")] = peak and round(
            fields["flops_per_token"] * fields[key] / peak, 4)
    record(args, **{**what, **fields}, device=device_name, wall_s=round(time.time() - t0, 1))


def main(argv=None):
    args = parse_args(argv)
    if args.collect and not args.out:
        return print(json.dumps(collect(args.collect)))
    rank, world, device = init_distributed()  # under torchrun: the process group FSDP2 needs
    if args.tiny:
        device = torch.device("cpu")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = "fsdp" if torch.distributed.is_initialized() else "plain"
    if any(run["path"] == "fsdp" for run in args.runs) and path != "fsdp":
        raise SystemExit("fsdp runs run under torchrun --nproc_per_node 1")
    for mode in (args.activations.split(",") if args.activations else []):
        attempt(args, device, {"activations": mode, "path": path}, activations_run, args, mode,
                path, device)
    for run in args.runs:
        if run["path"] == "teacher":
            attempt(args, device, run, teacher_run, args, run["shape"], run.get("compile", 0),
                    device)
        else:
            attempt(args, device, run, train_run, args, run["shape"], run["path"], run["compile"],
                    run["ac"], device, run.get("chunk"))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if args.collect:  # the last stage of gpu_bench.sh: the JSON of every stage's records
        print(json.dumps(collect(args.collect)))


# -----------------------------------------------------------------------------
# The JSON

def collect(folder):
    """Every record of DIR/records.jsonl in one object, with issue 47's goals read off them (a goal
    whose runs are missing or failed: None)."""
    import transformers
    lines = [json.loads(line) for line in (Path(folder) / "records.jsonl").read_text().splitlines()]
    runs = [r for r in lines if "activations" not in r]
    keys = ("shape", "depths", "tokens", "measured", "formula", "error")
    acts = {}  # path -> checkpointing mode -> the probe's record
    for r in (r for r in lines if "activations" in r):
        acts.setdefault(r["path"], {})[r["activations"]] = {k: r.get(k) for k in keys}
    devices = sorted({r["device"] for r in lines if "device" in r})

    def run(shape, path, compiled=0, ac="none", chunk=None):
        """The run's record; for the fused head by default the one at the plan's chunk."""
        for r in runs:
            if (r["shape"], r["path"], r.get("compile", 0), r.get("ac", "none")) == (
                    shape, path, compiled, ac) and "tok_s" in r and (chunk is None or path not in (
                    "fused", "fsdp") or r["chunk"] == chunk):
                return r
        return {}

    def ratio(a, b, key="tok_s"):
        return round(a[key] / b[key], 3) if a.get(key) and b.get(key) else None
    plain = run("1b", "plain")
    fused = run("1b", "fused", chunk=plain and chunk_sizes(plain["tokens_per_step"] // N_MICRO)[0])
    peak = peak_flops(devices[0]) if devices else None
    goals = {
        "compiled_1b_mfu (>= 0.40)": run("1b", "plain", 1).get("mfu"),
        "fsdp_over_plain_1b (>= 0.9)": ratio(run("1b", "fsdp"), plain),
        "fsdp_compiled_7b8_mfu (>= 0.40)": run("7b8", "fsdp", 1).get("mfu"),
        "teacher_1b_mfu (>= 0.50)": run("1b", "teacher").get("mfu"),
        "teacher_7b8_mfu (>= 0.55)": run("7b8", "teacher").get("mfu"),
        "teacher_over_plain_1b (>= 1.3)": run("1b", "teacher").get("over_plain"),
        # the same with the teacher's layers compiled (not build_cache's default)
        "teacher_compiled_1b_mfu": run("1b", "teacher", 1).get("mfu"),
        "teacher_compiled_7b8_mfu": run("7b8", "teacher", 1).get("mfu"),
        "teacher_compiled_over_plain_1b": run("1b", "teacher", 1).get("over_plain"),
        "fused_over_plain_1b (>= 0.95)": ratio(fused, plain),
        "fused_1b_chunk, peak_gb fused/plain": [fused.get("chunk"), fused.get("peak_gb"),
                                                plain.get("peak_gb")],
        "micro_batch_8_over_2_1b_compiled (> 1)": ratio(run("1bm8", "plain", 1), run("1b", "plain", 1),
                                                        "mfu"),
        "7b_whole_one_gpu_peak_gb eager/compiled": [run("7b", "plain", c, "full").get("peak_gb")
                                                    for c in (0, 1)],
        "135m_compiled_over_eager (>= 2)": ratio(run("135m", "plain", 1), run("135m", "plain")),
        "135ms128_compiled_over_eager (>= 2)": ratio(run("135ms128", "plain", 1),
                                                     run("135ms128", "plain")),
        "activations_measured_over_model (0.9-1.1)": {
            f"{path}/{mode}": a["measured"] and round(a["measured"] / a["formula"], 3)
            for path, modes in acts.items() for mode, a in modes.items()},
    }
    summary = {"command": f"bash experiments/gpu_bench.sh {folder}", "device": ", ".join(devices),
               "peak_tflops": peak and peak / 1e12,
               "torch": torch.__version__, "transformers": transformers.__version__,
               "goals": goals, "activations": acts, "runs": runs}
    (Path(folder) / "gpu_bench.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
