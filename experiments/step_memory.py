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
    python experiments/step_memory.py --arch llama --modes full --compile
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
        def hook(module, args):
            if torch.is_grad_enabled():
                if i == 0:
                    marks.clear()
                marks.append(host_bytes())
        return hook

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
    for the backward, each from the last step of its phase (a compiled layer compiles in its first)."""
    import prune
    from surgery import decoder_layers
    seen, step = {}, prune.train_step

    def measured_step(model, opt, losses, batches, kind, t, args, gates=None, draw=None):
        record = []
        with layer_growth(decoder_layers(model), record):
            out = step(model, opt, losses, batches, kind, t, args, gates, draw)
        seen["search" if gates is not None else "finetune"] = per_layer(record[0])
        return out
    prune.train_step = measured_step
    try:
        prune.main(argv)
    finally:
        prune.train_step = step
    return seen


def bytes_a_token(argv, out, seq_len, micro_batches=(1, 2)):
    """Bytes a token and layer in each phase: the slope of measure_run's bytes a layer between two
    micro-batch sizes (a layer's fixed cost, its autograd nodes and weight copies, cancels; runs
    in out/mb1, out/mb2)."""
    (a, b) = micro_batches
    runs = [measure_run([*argv, "--micro-batch", str(m), "--out", str(Path(out) / f"mb{m}")])
            for m in micro_batches]
    return {phase: (runs[1][phase] - runs[0][phase]) / ((b - a) * seq_len) for phase in runs[0]}
