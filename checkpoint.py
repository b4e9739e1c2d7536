"""
The run folder, off prune.py's main path (nanochat's checkpoint manager): the arguments
(run.json), the event log (log.jsonl), and sharded checkpoints that a killed run resumes from.

  OUT/run.json             the arguments that define the run (a different run is refused)
  OUT/log.jsonl            one JSON event a line: importance, search steps, train steps, val, ...
  OUT/checkpoints/step_N/  torch.distributed.checkpoint (DCP): each rank writes and reads only its
                           own shards of the weights and of AdamW's moments, and a resume on another
                           number of ranks reshards on load; `extra.pt` beside them holds the small
                           state (step, phase, kept layers, scores S and their Adam, RNG states)

A checkpoint is written into `step_N.tmp/` and renamed to `step_N/` by rank 0 once every rank has
finished writing: a crash never leaves a folder that looks complete. Multi-node: OUT must be one
shared folder, seen by every node at the same path.
"""
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from common import E3Error, print0

# in one process DCP warns that it "assumes the intent is to save in a single process": it is
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


class Run:
    """A run folder. `identity` is the dict of arguments that define the run (run.json); `resume`
    says whether an existing run of the same identity may be continued. Made, it only checks the
    folder; create() writes it."""

    def __init__(self, out, identity, rank, resume):
        self.out, self.identity, self.rank, self.resume = Path(out), identity, rank, resume
        self.ckpt_dir = self.out / "checkpoints"
        run_file = self.out / "run.json"
        # every rank checks (so every rank raises the same one-line error) before rank 0 writes
        # anything; a folder that is not this run is refused and left untouched
        if run_file.exists():
            if json.loads(run_file.read_text()) != identity:
                raise E3Error(f"'{self.out}' already holds a different run; pass another --out (or "
                              f"the same arguments with --resume)")
            if not resume:
                raise E3Error(f"'{self.out}' already holds this run; pass --resume to continue it "
                              f"or another --out")
        elif self.out.exists() and any(self.out.iterdir()):
            raise E3Error(f"'{self.out}' exists and is not an E3-Pruner run folder; pass another "
                          f"--out")

    def create(self):
        """Write run.json: called once every input has been checked and the run can start, so that a
        run that could not start leaves nothing behind."""
        _barrier()  # every rank has checked OUT before rank 0 writes to it
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "run.json").write_text(json.dumps(self.identity, indent=1))

    # ---- the event log -------------------------------------------------------------------------
    def log(self, **event):
        """Append one event to log.jsonl (rank 0 writes; the other ranks' calls are no-ops)."""
        if self.rank == 0:
            with open(self.out / "log.jsonl", "a") as f:
                f.write(json.dumps(event) + "\n")

    def truncate_log(self, step):
        """On resume: drop the events after the checkpoint's step (they are about to be redone)."""
        path = self.out / "log.jsonl"
        if self.rank == 0 and path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if json.loads(line).get("step", 0) <= step]
            path.write_text("".join(line + "\n" for line in keep))

    # ---- checkpoints ---------------------------------------------------------------------------
    def latest(self):
        """The small state of the newest complete checkpoint (a dict with 'step', 'phase', 'kept',
        ...) or None. Read before the model is built: it says which layers the model has."""
        # a `.tmp` folder is a save that never finished (its rank-0 rename did not happen)
        done = [p for p in self.ckpt_dir.glob("step_*")
                if p.is_dir() and not p.name.endswith(".tmp")]
        if not self.resume or not done:
            return None
        path = max(done, key=lambda p: int(p.name.split("_")[1]))  # by number: step_9 < step_10
        extra = torch.load(path / "extra.pt", map_location="cpu", weights_only=True)
        return {**extra, "path": str(path)}

    def save(self, step, model, opt, extra):
        """Every rank writes its shards of model + optimizer (DCP), rank 0 the small `extra` state;
        then rank 0 renames the folder to its final name and removes the older checkpoints."""
        final = self.ckpt_dir / f"step_{step}"
        tmp = self.ckpt_dir / f"step_{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what a crash mid-write left behind
            tmp.mkdir(parents=True)
        _barrier()  # the folder exists before any rank writes into it
        # DTensors under FSDP (each rank its own shard), plain tensors in one process
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                 no_dist=not torch.distributed.is_initialized())
        if self.rank == 0:
            torch.save({**extra, "step": step}, tmp / "extra.pt")
        _barrier()  # every rank's shards are on disk before the folder takes its final name
        if self.rank == 0:
            tmp.rename(final)
            for old in self.ckpt_dir.glob("step_*"):  # --resume only ever reads the newest
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
            print0(f"checkpoint saved: {final}")
        _barrier()  # no rank moves on (or exits) while rank 0 still renames

    @staticmethod
    def load_into(path, model, opt):
        """Load a checkpoint's weights and optimizer state into `model` and `opt`, which must
        already have the checkpoint's shape (its kept layers). Each rank reads the pieces of its own
        shards."""
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
