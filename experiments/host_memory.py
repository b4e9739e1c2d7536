"""
Peak host memory of every phase of prune.py, per rank, at 1, 2 and 4 gloo ranks: the evidence
that the headline run fits its machines. Each phase's peak is measured on its own (Linux: the
resident peak VmHWM is reset through /proc/self/clear_refs when the phase starts and read when it
ends):

  import       python + torch + transformers + the project, before any work (every rank's floor)
  cache        building the teacher cache (the teacher forward, data-parallel; freed before the
               student)
  student      building and sharding the student (rank 0 reads the weights, the others get shards)
  importance   the KL layer scores on the calibration sequences
  search step  one optimizer step of the search (all L layers through their gates, AdamW on all)
  finetune     one optimizer step after the cut (k layers)
  save         a sharded DCP checkpoint (each rank writes its own shards)
  resume       loading that checkpoint into a fresh run (each rank reads its own shards)
  export       gathering the weights to rank 0 and writing the HF checkpoint

    python experiments/host_memory.py                      # random ~108M Llama, 1, 2 and 4 ranks
    python experiments/host_memory.py --nproc 2 --model DIR
    python experiments/host_memory.py --nproc 1 --profile  # + torch.profiler's allocations of the
                                                           # second search step, largest first
    python experiments/host_memory.py --logit-chunk 32     # prune.py's --logit-chunk

The goal it checks (issue 14): every phase's per-rank peak <= import + 16 B/param / ranks + 0.5 GB.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["import", "cache", "student", "importance", "search step", "finetune", "save", "resume",
          "export"]


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # "5": reset the peak resident set size (VmHWM) to the current one


def status_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB


def peak_mb():
    return status_mb("VmHWM")


def rank_main(argv):
    """Inside each torchrun rank: prune.main with every phase wrapped, peaks appended to a JSON
    file."""
    sys.path.insert(0, str(ROOT))
    import torch  # the import floor; and the profiler below
    import transformers  # noqa: F401
    import prune
    import runtime
    from prune import Run
    rank = os.environ.get("RANK", "0")
    report = Path(os.environ["E3_MEMORY_REPORT"]) / f"rank{rank}.jsonl"
    start = {}  # resident memory when each phase began

    def note(phase):
        with open(report, "a") as f:
            f.write(json.dumps({"phase": phase, "peak_mb": round(peak_mb()),
                                "start_mb": round(start.get(phase, 0))}) + "\n")

    note("import")

    def measured(phase, fn):
        def wrapper(*a, **k):
            reset_peak()
            start[phase] = status_mb("VmRSS")
            out = fn(*a, **k)
            note(phase)
            return out
        return wrapper

    prune.build_teacher_cache = measured("cache", prune.build_teacher_cache)
    prune.build_student = measured("student", prune.build_student)
    prune.initial_scores = measured("importance", prune.initial_scores)
    prune.export_pruned = measured("export", prune.export_pruned)
    Run.save = measured("save", Run.save)
    Run.load_into = staticmethod(measured("resume", Run.load_into))
    # one training step: from the lr lookup that starts it to the "train" event that ends it
    schedule, log = prune.lr_schedule, Run.log

    profile = {"steps": 0, "on": os.environ.get("E3_MEMORY_PROFILE") == "1"}

    def step_start(*a, **k):
        reset_peak()
        start["step"] = status_mb("VmRSS")
        profile["steps"] += 1
        if profile["on"] and profile["steps"] == 2:  # the second step: Adam's moments exist
            profile["prof"] = torch.profiler.profile(profile_memory=True, record_shapes=True)
            profile["prof"].__enter__()
        return schedule(*a, **k)

    def step_end(self, **event):
        if event.get("event") == "train":
            start["search step"] = start["finetune"] = start["step"]
            note("search step" if event["phase"] == "search" else "finetune")
            if "prof" in profile and profile["steps"] == 2:
                profile["prof"].__exit__(None, None, None)
                print(profile["prof"].key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_memory_usage", row_limit=12), flush=True)
        return log(self, **event)

    prune.lr_schedule, Run.log = step_start, step_end
    runtime.run_main(lambda: prune.main(argv))


def random_llama(path, tied=True):
    """A random Llama, 10 layers, 768 wide, SmolLM2's 49K vocabulary: 108.5M parameters with tied
    embeddings (SmolLM2's, Qwen's small models' layout), 146.3M with a separate LM head (Llama-2's,
    the headline model's)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(ROOT))
    import demo
    cfg = LlamaConfig(vocab_size=49152, hidden_size=768, intermediate_size=2048,
                      num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=12,
                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(demo.default_model()).save_pretrained(path)


def measure(model, nproc, tmp, profile=False, extra_args=()):
    """Peaks (MB) of each phase, the max over ranks: a fresh run, then --resume of its last
    checkpoint."""
    report = Path(tmp) / f"report-{nproc}"
    report.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "E3_MEMORY_REPORT": str(report),
           "E3_MEMORY_PROFILE": "1" if profile else "0",
           "E3_TEACHER_CACHE": str(Path(tmp) / f"teacher-{nproc}")}
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    launcher = [sys.executable]
    if nproc > 1:
        # a port per process and rank count, so that measurements side by side rarely collide
        port = 29800 + (os.getpid() + 10 * nproc) % 500
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                     "--master_port", str(port)]
    # 4 steps, half of them search: a checkpoint at step 3 (after the cut at T_M = 2) to resume from
    argv = ["--model", model, "--keep", str(layers // 2), "--steps", "4", "--search-frac", "0.5",
            "--seq-len", "128", "--batch-size", "4", "--micro-batch", "1", "--n-calib", "4",
            "--warmup", "1", "--eval-every", "100", "--ckpt-every", "3",
            "--out", str(Path(tmp) / f"run-{nproc}"), *extra_args]
    # the resume redoes step 4 from the step-3 checkpoint and re-exports
    for extra in ([], ["--resume"]):
        proc = subprocess.run(launcher + [__file__, "--rank-main", *argv, *extra], env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stdout[-2000:] + proc.stderr[-3000:])
        if profile and not extra:
            print(proc.stdout[proc.stdout.find("----"):proc.stdout.find("Self CPU time total")])
    peaks = {}
    for f in sorted(report.glob("rank*.jsonl")):
        for e in map(json.loads, f.read_text().splitlines()):
            peaks[e["phase"]] = max(peaks.get(e["phase"], 0), e["peak_mb"])
            print(f"  {nproc} rank(s), {f.stem}: {e['phase']:<12} resident at start "
                  f"{e['start_mb']:>6} MB, peak {e['peak_mb']:>6} MB", flush=True)
    return peaks


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (default: a random ~108M Llama)")
    p.add_argument("--untied", action="store_true",
                   help="the random Llama with a separate LM head (146M; Llama-2's layout)")
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--json", help="also write the table here")
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler's allocations of the second search step")
    p.add_argument("--logit-chunk", type=int,
                   help="prune.py's --logit-chunk (tokens per chunk of the fused head + loss)")
    a = p.parse_args()
    extra = ["--logit-chunk", str(a.logit_chunk)] if a.logit_chunk else []
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(Path(tmp) / "llama")
        if a.model is None:
            random_llama(model, tied=not a.untied)
        sys.path.insert(0, str(ROOT))
        from safetensors import safe_open
        params = 0
        for f in Path(model).glob("*.safetensors"):
            with safe_open(f, "pt") as st:
                params += sum(_numel(st.get_slice(k).get_shape()) for k in st.keys())
        print(f"model: {model}, {params / 1e6:.1f}M parameters "
              f"({4 * params / 2**20:.0f} MB fp32)", flush=True)
        table = {n: measure(model, n, tmp, a.profile, extra) for n in a.nproc}
    header = "".join(f"{f'{n} rank(s)':>12}" for n in a.nproc)
    print(f"{'phase':<12}" + header + "   (peak MB per rank)")
    for phase in PHASES:
        row = "".join(f"{table[n].get(phase, float('nan')):>12.0f}" for n in a.nproc)
        print(f"{phase:<12}" + row)
    # a rank's floor + its 1/n of fp32 weights, grads and AdamW (16 B/param) + 512 MB of slack
    goal = "".join(f"{table[n]['import'] + 16 * params / n / 2**20 + 512:>12.0f}" for n in a.nproc)
    print(f"{'goal':<12}" + goal + "   (import + 16 B/param / ranks + 0.5 GB)")
    if a.json:
        Path(a.json).write_text(json.dumps({"params": params, "peaks_mb": table}, indent=1))


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    if "--rank-main" in sys.argv:
        rank_main([x for x in sys.argv[1:] if x != "--rank-main"])
    else:
        main()
