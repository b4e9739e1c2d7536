"""
What prune.py's training step keeps for the backward, measured on a CPU: bytes a token and decoder
layer, in the step that trains (search and fine-tune, after KL importance), beside the plan's
activation model (scale/plan.py), for each activation-checkpointing mode, eager and compiled, fp32
and bf16 autocast.

How: glibc's allocator counts every byte torch holds on the host (mallinfo2: the heap's blocks in
use + the mmap-ed ones; torch's CPU allocator caches nothing). A forward pre-hook on each decoder
layer reads that count as the layer starts; what layer l left alive for the backward is the growth
from its start to layer l + 1's (its saved tensors, a checkpoint's input, autocast's weight copies,
the search's gate output), and the middle layers' mean over the micro-batch's tokens is the figure
(the first layer's growth holds the embedding's, the last's the head's). prune.train_step is wrapped
(monkeypatched) in a real prune.main run, so the figure is of what the run trains with, whatever
came before it (importance, the cut, a resume).

    python experiments/step_memory.py                   # the table, tiny models of four families
    python experiments/step_memory.py --arch llama --modes full --compile 1
    python experiments/step_memory.py --arch gpt_neox,qwen2_moe --compile 0   # any family of the tests
    python experiments/step_memory.py --table experiments/step_memory.jsonl   # the records' table
"""
import argparse
import contextlib
import ctypes
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def host_bytes():
    """Bytes the process holds from malloc now (heap blocks in use + mmap-ed blocks)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


@contextlib.contextmanager
def layer_growth(layers, record):
    """Inside the block, each training forward (grad enabled) appends to `record` the host bytes at
    the start of every layer in `layers`, and at the end of the last one."""
    import torch
    marks = []

    def pre(i):
        @torch.compiler.disable  # run as written beside a compiled layer, never traced into it
        def hook(module, args):
            if torch.is_grad_enabled():
                if i == 0:
                    marks.clear()
                marks.append(host_bytes())
        return hook

    @torch.compiler.disable
    def post(module, args, output):
        if torch.is_grad_enabled() and len(marks) == len(layers):
            record.append(marks + [host_bytes()])
    handles = [layer.register_forward_pre_hook(pre(i)) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def per_layer(marks):
    """Bytes a layer kept from one forward's marks: the middle layers' mean growth."""
    growth = [b - a for a, b in zip(marks[:-1], marks[1:])][1:-1]
    return sum(growth) / len(growth)


def measure_run(argv):
    """prune.main(argv), its train_step wrapped: {"search": bytes, "finetune": bytes} a layer kept
    for the backward, each from the last step of its phase (a compiled layer compiles in its first),
    and {"search_head": ..., "finetune_head": ...}: what the LM head and the loss keep (from the last
    layer's end to the loss, the micro-batch's first)."""
    import torch
    import prune
    from surgery import decoder_layers
    seen, step = {}, prune.train_step
    torch._dynamo.reset()  # a run compiles afresh: the graphs of earlier runs count to no limit

    def measured_step(model, opt, losses, batches, kind, t, args, gates=None, draw=None):
        record, after = [], []

        def measured_losses(*a, **k):
            out = losses(*a, **k)
            after.append(host_bytes())
            return out
        with layer_growth(decoder_layers(model), record):
            out = step(model, opt, measured_losses, batches, kind, t, args, gates, draw)
        phase = "search" if gates is not None else "finetune"
        seen[phase], seen[phase + "_head"] = per_layer(record[0]), after[0] - record[0][-1]
        return out
    prune.train_step = measured_step
    try:
        prune.main(argv)
    finally:
        prune.train_step = step
    return seen


def bytes_a_token(argv, out, seq_len, micro_batches=(1, 2)):
    """Bytes a token and layer in each phase (and a token, the head's): the slope of measure_run's
    bytes between two micro-batch sizes (a layer's fixed cost, its autograd nodes and weight
    copies, cancels; runs in out/mb1, out/mb2)."""
    (a, b) = micro_batches
    runs = [measure_run([*argv, "--micro-batch", str(m), "--out", str(Path(out) / f"mb{m}")])
            for m in micro_batches]
    return {key: (runs[1][key] - runs[0][key]) / ((b - a) * seq_len) for key in runs[0]}


def modelled(model, mode, r, c, compiled, search, seq_len):
    """scale.plan's bytes a token, the mean over the layers this script measures (all but the first
    and the last: Gemma-3's sixth, full attention, has no sliding window's mask), + the gate's."""
    from scale.plan import activation_formula
    from surgery import decoder_layers
    return activation_formula(model, mode, r, c, compiled, search, seq_len,
                              which=range(1, len(decoder_layers(model)) - 1))


def shape_of(folder):
    """The model of a checkpoint folder on the meta device (config alone)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


ARCHS = ("llama", "qwen3", "gemma3_text", "qwen3_moe")
MODES = ("none", "selective", "full")


def family_config(arch, layers=6):
    """A tiny config of `arch`: tests/conftest.py's tiny_config for ARCHS, else tests/
    test_architectures.py's family of that name (every family the project lists), at 512 positions."""
    sys.path.insert(0, str(ROOT / "tests"))
    if arch in ARCHS:
        from conftest import tiny_config
        return tiny_config(arch, layers)
    from transformers import AutoConfig
    from test_architectures import CONFIGS, VOCAB
    model_type, settings = CONFIGS[arch]
    return AutoConfig.for_model(model_type, vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.2,
                                **{"n_layer" if arch == "gpt2" else "num_hidden_layers": layers}, **settings)


def tiny_folder(arch, out):
    """A 6-layer random model of `arch` (family_config) with the demo's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from demo import default_model
    path = Path(out) / f"model-{arch}"
    if not (path / "config.json").exists():
        cfg = family_config(arch, 6)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        AutoTokenizer.from_pretrained(default_model()).save_pretrained(path)
    return str(path)


@contextlib.contextmanager
def autocast_here(on):
    """prune.py's losses with bf16 autocast on this device (a GPU process's precision on a CPU)."""
    import prune
    make = prune.make_losses
    if on:
        prune.make_losses = lambda args, vocab, world: prune.plain_losses(vocab, autocast=True)
    try:
        yield
    finally:
        prune.make_losses = make


def table(path):
    """The records of a --out run's stdout (one JSON object a line) as a markdown table: measured
    and modelled bytes a token and layer, the search's and the fine-tune's."""
    rows = ["| family | matmuls | compiled | checkpointing | search: measured / modelled | fine-tune: "
            "measured / modelled |", "|---|---|---|---|---|---|"]
    for r in map(json.loads, Path(path).read_text().splitlines()):
        cells = [f"{r[p]:,.0f} / {r[p + '_modelled']:,.0f} ({r[p] / r[p + '_modelled']:.3f})"
                 for p in ("search", "finetune")]
        rows.append(f"| {r['arch']} | {r['dtype']} | {'yes' if r['compiled'] else 'no'} | {r['mode']} | "
                    + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None):
    import runtime
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default=",".join(ARCHS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--compile", default="0,1", help="0 eager, 1 compiled (comma-separated)")
    p.add_argument("--dtype", default="fp32,bf16")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    p.add_argument("--table", metavar="JSONL", help="print the markdown table of these records, run nothing")
    a = p.parse_args(argv)
    if a.table:
        return print(table(a.table))
    work = Path(a.out or tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    plays = sorted(Path(runtime.default_corpus()).rglob("*.md"))
    corpus = work / "play.txt"
    corpus.write_text(plays[0].read_text()[:120_000])
    import prune
    prune.TEACHER_CACHE_DIR = work / "teacher"
    for arch in a.arch.split(","):
        model = tiny_folder(arch, work)
        for dtype in a.dtype.split(","):
            for compiled in a.compile.split(","):
                for mode in a.modes.split(","):
                    argv = ["--model", model, "--keep", "4", "--data", str(corpus), "--seq-len",
                            str(a.seq_len), "--batch-size", "4", "--steps", "4", "--search-frac", "0.5",
                            "--warmup", "1", "--n-calib", "2", "--eval-every", "4", "--ckpt-every", "100",
                            "--activation-checkpointing", mode, "--compile" if compiled == "1" else "--no-compile"]
                    with autocast_here(dtype == "bf16"):
                        got = bytes_a_token(argv, work / f"{arch}-{dtype}-{compiled}-{mode}", a.seq_len, (1, 4))
                    c, shape = (2 if dtype == "bf16" else 4), shape_of(model)
                    plan = {f"{phase}_modelled": modelled(shape, mode, 4, c, compiled == "1", phase == "search",
                                                          a.seq_len) for phase in ("search", "finetune")}
                    print(json.dumps({"arch": arch, "dtype": dtype, "compiled": compiled == "1", "mode": mode,
                                      **{k: round(v, 1) for k, v in {**got, **plan}.items()}}), flush=True)


if __name__ == "__main__":
    main()
