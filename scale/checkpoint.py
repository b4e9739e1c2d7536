"""
The run folder, and the checkpoints a killed run resumes from (nanochat's checkpoint manager):

  OUT/run.json             the arguments that define the run (a folder holding another is refused)
  OUT/log.jsonl            one JSON event a line: importance, search steps, train steps, val, ...
  OUT/checkpoints/step_N/  torch.distributed.checkpoint (DCP): each rank writes and reads only its
                           own shards of the weights and of AdamW's moments; a resume on another
                           number of ranks reshards on load; extra.pt beside them holds the small
                           state (step, kept layers, the search's state, the summary so far)

One process writes the same format (no_dist), so that 1 process and N ranks resume each other.
Multi-node: OUT is one shared folder, seen by every node at the same path.
"""
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from cache_teacher import E3Error, print0

# in one process DCP warns that it "assumes the intent is to save in a single process": it is
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


class Run:
    def __init__(self, out, identity, rank, resume):
        self.out, self.identity, self.rank, self.resume = Path(out), identity, rank, resume
        self.ckpt_dir, run_file = self.out / "checkpoints", self.out / "run.json"
        # every rank checks before rank 0 writes; a folder that is not this run is left untouched
        if run_file.exists():
            if json.loads(run_file.read_text()) != identity:
                raise E3Error(f"'{self.out}' already holds a different run; pass another --out (or "
                              f"the same arguments with --resume)")
            if not resume:
                raise E3Error(f"'{self.out}' already holds this run; pass --resume to continue it "
                              f"or another --out")
        elif self.out.exists() and any(self.out.iterdir()):
            raise E3Error(f"'{self.out}' exists and is not an E3-Pruner run folder; pass another --out")

    def create(self):
        """run.json, once every input has been checked: a run that could not start leaves none."""
        barrier()
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "run.json").write_text(json.dumps(self.identity, indent=1))

    def log(self, **event):
        if self.rank == 0:
            with open(self.out / "log.jsonl", "a") as f:
                f.write(json.dumps(event) + "\n")

    def truncate_log(self, step):
        """On resume: the events after the checkpoint are about to be redone."""
        path = self.out / "log.jsonl"
        if self.rank == 0 and path.exists():
            keep = [e for e in path.read_text().splitlines() if json.loads(e).get("step", 0) <= step]
            path.write_text("".join(e + "\n" for e in keep))

    def latest(self):
        """The small state of the newest complete checkpoint, or None (a `.tmp` folder is a save
        that never finished): read before the model is built, it says which layers the model has."""
        done = [p for p in self.ckpt_dir.glob("step_*") if not p.name.endswith(".tmp")]
        if not self.resume or not done:
            return None
        path = max(done, key=lambda p: int(p.name.split("_")[1]))
        extra = torch.load(path / "extra.pt", map_location="cpu", weights_only=True)
        return {**extra, "path": str(path)}

    def save(self, step, model, opt, extra):
        """Every rank writes its shards into step_N.tmp/, rank 0 the small `extra` state, then
        renames the folder once all are done: a crash never leaves one that looks complete."""
        final, tmp = self.ckpt_dir / f"step_{step}", self.ckpt_dir / f"step_{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                 no_dist=not torch.distributed.is_initialized())
        if self.rank == 0:
            torch.save({**extra, "step": step}, tmp / "extra.pt")
        barrier()
        if self.rank == 0:
            tmp.rename(final)
            for old in self.ckpt_dir.glob("step_*"):
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
            print0(f"checkpoint saved: {final}")
        barrier()

    @staticmethod
    def load_into(path, model, opt):
        """The checkpoint's weights and optimizer state into `model` (already of its shape)."""
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

