"""
The GPU check: the README's GPU commands run for real on the card at hand, in one command of a few
minutes on one H100 or H200. Every GPU window opens with it, before any experiment: what it says
is what a user's first hour on a GPU would meet.

    python experiments/gpu_check.py --out OUT [--work DIR]   # OUT/gpu_check.json (stdout's last line)
                                                             # and each part's log.jsonl; the runs in DIR
    python experiments/gpu_check.py --out OUT --parts 7b     # one part (first, 7b)
    python experiments/gpu_check.py --out OUT --tiny         # CPU size: the tests

The parts:
  first  README's "Your first run on a GPU" with the packaged model: `python prune.py --model
         SmolLM2-135M --keep 20 --tokens N --search-frac 0.5` at the paper's other defaults (128 x
         4,096 tokens a step) and the GPU's (the plan's micro-batch and checkpointing, each layer
         compiled, bf16 autocast), end to end: the teacher cache, KL importance, the search, AKD,
         the export; then the export loaded by transformers alone, its logits finite and its
         layers k.
  7b     Llama-2-7B's shape from its config (random weights, seeded; all 32 layers; a 32,000-token
         BPE tokenizer trained here on torch's own source, which is also the text it trains on):
         `prune.py --plan 1` for this card, then prune.py at the plan's own pick (where nothing
         fits one card: the --lora-rank the plan names), KL importance first, then 3 search and 3
         fine-tune steps of 2 x 4,096 tokens. Read: no OOM; the search steps' peak of
         torch.cuda.max_memory_allocated against the plan's GB a rank (the goal: within 10%); each
         phase's tok/s against the rate the plan's hours assume (its MFU x the chip's peak / the
         FLOPs a token, scale/plan.py).

The runs are prune.main in this process (7b: the model loader swapped for a seeded random one) or
prune.py as a user types it (first); nothing here changes how they train.
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA2_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float16",
                 bos_token_id=1, eos_token_id=2)
TINY = dict(LLAMA2_7B, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=4, intermediate_size=128, vocab_size=512)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder: gpu_check.json and each run's log.jsonl")
    p.add_argument("--work", help="the runs' folders, exports included (default: a temporary one)")
    p.add_argument("--parts", default="first,7b", help="first, 7b (comma-separated)")
    p.add_argument("--tiny", action="store_true", help="CPU size: a tiny Llama, short sequences")
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# 7b: Llama-2-7B's shape, random weights, through prune.main

def torch_source(out, chars):
    """`chars` characters of torch's own Python source as one .txt file: text every machine with
    torch has (no download), for the tokenizer and the run."""
    text, files = [], sorted((Path(torch.__file__).parent / "nn").rglob("*.py"))
    for f in files:
        text.append(f.read_text(errors="ignore"))
        if sum(map(len, text)) >= chars:
            break
    out.write_text("".join(text)[:chars])
    return out


def shape_folder(folder, config, corpus):
    """A checkpoint folder without weights: config.json and a BPE tokenizer of the config's
    vocabulary trained on `corpus` (Llama-2's own tokenizer is not on the machine; the shape, which
    decides memory and speed, is Llama-2's exactly)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train([str(corpus)], trainers.BpeTrainer(vocab_size=config["vocab_size"],
                                                 special_tokens=["<unk>", "<s>", "</s>"],
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


def random_loader(load_model, folder):
    """runtime.load_model, except that `folder` (config.json, no weights) loads with random weights
    drawn in fp32 on the device asked under one seed, then cast: the teacher and the student get
    the same ones."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    def load(name, device="cpu", dtype=torch.float32, weights=True):
        if Path(str(name)) != folder or not weights:
            return load_model(name, device, dtype, weights)
        device = "cuda" if torch.cuda.is_available() else device  # drawn where they will run
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder),
                                                     dtype=torch.float32)
        return model.to(dtype), AutoTokenizer.from_pretrained(folder)
    return load


def this_gpu(summary):
    """A plan's entry for the card at hand ("this GPU (name)"), None on a CPU."""
    return next((v for k, v in summary["by_kind"].items() if k.startswith("this GPU")), None)


def plan_summary(argv):
    """prune.py --plan's last line (one JSON object), run in this process."""
    import contextlib
    import io
    import prune
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        prune.main(argv)
    return json.loads(text.getvalue().strip().splitlines()[-1])


def run_7b(out, tiny):
    """Part 7b: the plan for one card of this kind, then a run at its pick; a record. `out`: a
    work folder (the shape, the corpus, the run and its export)."""
    import cache_teacher
    import prune
    from scale import plan as plan_mod
    cuda = torch.cuda.is_available()
    corpus = torch_source(out / "torch-source.txt", 200_000 if tiny else 2_000_000)
    folder = shape_folder(out / "llama2-7b-shape", TINY if tiny else LLAMA2_7B, corpus)
    seq = 64 if tiny else 4096
    keep = ["--keep", "3" if tiny else "13"]
    argv = ["--model", str(folder), *keep, "--data", str(corpus),
            "--seq-len", str(seq), "--batch-size", "2" if tiny else "8", "--steps", "6", "--search-frac", "0.5",
            "--warmup", "1", "--n-calib", "1", "--eval-every", "6", "--ckpt-every", "100"]
    plan = plan_summary([*argv, "--plan", "1"])
    here = this_gpu(plan)
    record = {"part": "7b", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "plan_readme": plan_summary(["--model", str(folder), *keep, "--plan", "1"]),
              "plan": here or plan, "argv": argv}
    extra = []
    if here and not here["fits"] and here.get("lora"):  # what the plan names instead: LoRA
        lora = here["lora"]
        extra = ["--lora-rank", str(lora["lora_rank"]), "--micro-batch", str(lora["micro_batch"]),
                 "--activation-checkpointing", lora["activation_checkpointing"]]
        record["plan_lora"] = plan_summary([*argv, *extra, "--plan", "1"])
        here = this_gpu(record["plan_lora"]) or here
    record["argv"] = argv = [*argv, *extra, "--out", str(out / "run-7b")]

    peaks, reserved, step = {}, [0.0], prune.train_step

    def measured_step(model, opt, losses, batches, kind, t, args, gates=None, draw=None):
        phase = "search" if gates is not None else "finetune"
        if cuda:
            torch.cuda.synchronize()
            reserved[0] = max(reserved[0], torch.cuda.max_memory_reserved() / 1e9)
            torch.cuda.reset_peak_memory_stats()
        result = step(model, opt, losses, batches, kind, t, args, gates, draw)
        if cuda:
            peaks.setdefault(phase, []).append(torch.cuda.max_memory_allocated() / 1e9)
        return result
    loaders = {m: m.load_model for m in (prune, cache_teacher)}
    for m, load in loaders.items():
        m.load_model = random_loader(load, folder)
    prune.train_step, t0 = measured_step, time.time()
    try:
        prune.main(argv)
        record["ok"] = True
    except Exception as e:  # an OOM, or anything else: what was measured so far still counts
        record.update(ok=False, oom=isinstance(e, torch.OutOfMemoryError),
                      error=traceback.format_exc()[-3000:])
    finally:
        prune.train_step = step
        for m, load in loaders.items():
            m.load_model = load
    record["seconds"] = round(time.time() - t0, 1)
    record["peak_gb"] = {k: round(max(v), 2) for k, v in peaks.items()}
    if cuda:
        record["reserved_peak_gb"] = round(max(reserved[0], torch.cuda.max_memory_reserved() / 1e9), 2)
    log = [json.loads(x) for x in (out / "run-7b" / "log.jsonl").read_text().splitlines()] \
        if (out / "run-7b" / "log.jsonl").exists() else []
    train = [e for e in log if e["event"] == "train"]
    # tok/s of each phase's steps but its first (compilation, Adam's state allocated)
    for phase, layers in (("search", None), ("finetune", int(keep[1]))):
        rates = [e["tok_per_s"] for e in train if e["phase"] == phase][1:]
        if not rates:
            continue
        measured = statistics.median(rates)
        used = (here or {}).get("mfu")
        planned = None
        if used and cuda and plan_mod.peak_flops(torch.cuda.get_device_name()):
            shape = plan_mod.meta_model(prune.parse_args(argv[:-2]))[0]
            fpt = plan_mod.flops_per_token(shape, seq, layers)
            planned = used * plan_mod.peak_flops(torch.cuda.get_device_name()) / fpt
        record[f"{phase}_tok_s"] = round(measured)
        record[f"{phase}_tok_s_planned"] = planned and round(planned)
        record[f"{phase}_vs_plan"] = planned and round(measured / planned, 3)
    gb = (here or {}).get("gb_per_rank")
    if gb and record["peak_gb"].get("search"):
        record["search_peak_vs_plan"] = round(record["peak_gb"]["search"] / gb, 3)
    return record


# -----------------------------------------------------------------------------
# first: the README's first GPU command, as a user types it

def run_first(out, tiny):
    """Part first: prune.py on the packaged model at the paper's defaults, a short budget; the
    export loaded by transformers alone. `out`: a work folder (the run and its export)."""
    from demo import default_model
    model = default_model()  # on a lent GPU: experiments/stash.sh's wheels (the GGUF, gguf, the plays)
    flags = (["--batch-size", "4", "--seq-len", "64", "--tokens", str(4 * 64 * 4), "--n-calib", "2"] if tiny
             else ["--tokens", str(4 * 128 * 4096)])
    cmd = [sys.executable, str(ROOT / "prune.py"), "--model", model, "--keep", "20",
           "--search-frac", "0.5", *flags, "--out", str(out / "run-first")]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired as e:
        return {"part": "first", "command": " ".join(cmd[1:]), "rc": None, "error": "timed out",
                "stdout": (e.stdout or b"")[-2000:].decode(errors="ignore")}
    record = {"part": "first", "command": " ".join(cmd[1:]), "rc": proc.returncode,
              "seconds": round(time.time() - t0, 1)}
    lines = proc.stdout.splitlines()
    record["pick"] = next((x for x in lines if x.startswith("micro-batch ")), None)
    done = next((x for x in lines if x.startswith("done: ")), None)
    if proc.returncode or done is None:
        record["error"] = (proc.stderr or proc.stdout)[-2000:]
        return record
    record["done"] = json.loads(done[len("done: "):])
    log = [json.loads(x) for x in (out / "run-first" / "log.jsonl").read_text().splitlines()]
    record["tok_s"] = {p: [round(e["tok_per_s"]) for e in log if e["event"] == "train" and e["phase"] == p]
                       for p in ("search", "finetune")}
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = out / "run-first" / "model"
    exported = AutoModelForCausalLM.from_pretrained(path)
    ids = AutoTokenizer.from_pretrained(path)("To be, or not to be", return_tensors="pt")["input_ids"]
    logits = exported(input_ids=ids).logits
    record["export"] = {"layers": exported.config.num_hidden_layers, "dtype": str(exported.dtype),
                        "finite": bool(torch.isfinite(logits).all())}
    return record


def main(argv=None):
    args = parse_args(argv)
    out, work = Path(args.out), Path(args.work or tempfile.mkdtemp())
    for folder in (out, work):
        folder.mkdir(parents=True, exist_ok=True)
    records = []
    for part in args.parts.split(","):
        t0 = time.time()
        try:
            record = {"first": run_first, "7b": run_7b}[part](work, args.tiny)
        except Exception:  # one part's failure is a finding, not the end of the check
            record = {"part": part, "ok": False, "error": traceback.format_exc()[-3000:]}
        records.append(record)
        log = work / f"run-{part}" / "log.jsonl"
        if log.exists():
            shutil.copy(log, out / f"{part}-log.jsonl")
        print(f"gpu_check: {part} in {time.time() - t0:.0f} s: " + json.dumps(record), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "records": records}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
