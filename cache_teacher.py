"""
Pre-compute the teacher's targets for offline top-K knowledge distillation (paper Sec. 3.3).

For every position of every packed sequence the teacher's prediction of the next token is stored:
its top-K token ids, their log-probabilities under the FULL-vocabulary softmax, and the
full-vocabulary entropy (nats), beside the input ids. prune.py reads them back with `TeacherCache`.

    python cache_teacher.py                  # packaged SmolLM2-135M on the Shakespeare plays
    python cache_teacher.py --model M --data D --out DIR [--topk 10 --seq-len 512 --max-tokens N]
    torchrun --nproc_per_node 8 cache_teacher.py --model M --data D --out DIR

--data is a .txt/.md file, a .jsonl file (--text-field, or chat `messages`), a .parquet file, or a
folder of them (data.py). It is tokenised once into a flat token file (data.token_file, reused by
every later run); documents are separated by EOS and packed into --seq-len blocks. The END of the
token stream (--val-frac, data.split) is held out as the validation split, capped at
--max-val-tokens; --max-tokens caps the training split and lets reading stop early on a large
corpus (the rule: data.py's docstring).

What DIR holds:
    train-00000.safetensors, ...   shard j of a split: its sequences [j*S, (j+1)*S),
    val-00000.safetensors, ...     S = --shard-seqs, as input_ids (n,T), topk_ids (n,T,K),
                                   topk_logprobs (n,T,K), entropy (n,T)
    meta.json                      identity (model, tokenizer, vocabulary, K, T, hash of the
                                   tokens), counts, each shard's size and sha256. Written last:
                                   it exists == the cache is complete.
Ids are uint16 when the vocabulary fits (<= 65536 ids), else int32; log-probabilities fp16, entropy
fp32: 46 bytes per token at K=10 (68 with int32 ids). fp16 because the KD-loss error it causes is
negligible: tests/test_cache_teacher.py measures it on the default model (about 2e-5 relative;
asserts < 1e-3).

Scale and restarts: rank r of N computes the shards with index % N == r (plain data-parallel
inference, every rank holds the model; bf16 on GPU, fp32 on CPU, logits upcast to fp32 before the
softmax). Batches never straddle shards, so the cache does not depend on the number of ranks. A
shard is written to a temporary file and renamed, so a killed run leaves only complete shards: rerun
the same command and it verifies and skips them, computes the rest, and ends with the same cache as
an uninterrupted run. A teacher too big for one GPU (or any, with --shard-teacher) is FSDP2-sharded
over the ranks instead of copied to each (load_teacher): only rank 0 reads its weights, every rank
still runs its own batches.
"""
import argparse
import hashlib
import json
import os
import queue
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from common import (E3Error, HelpFormatter, all_gather, default_corpus, init_distributed,
                    load_model, model_fingerprint, print0, rank_and_world, resolve_model, run_main,
                    tokenizer_fingerprint, vocab_size)
from data import DEFAULT_VAL_FRAC, corpus_blocks
from parallel import load_from_rank0, parallelize
from surgery import check_logits_path, last_layer_output, model_logits, root_unsharded

FORMAT = "e3-teacher-cache/1"  # part of the identity: a rerun never resumes another layout
VAL_SEQS = 32  # validation sequences given targets by default: enough for a stable validation loss
DEMO_TOKENS = 40_960
SPLITS = ("train", "val")
FIX_SHARD = ("delete it and rerun the command that built the cache; "
             "it recomputes only the missing shards")


def storage_dtypes(vocab):
    """What each tensor is stored as. Ids fit uint16 for vocabularies up to 65536 (SmolLM2,
    Llama-2)."""
    ids = torch.uint16 if vocab <= 65536 else torch.int32
    # fp16 log-probs: the KD-loss error is ~2e-5 relative (module docstring); entropy stays fp32
    return {"input_ids": ids, "topk_ids": ids, "topk_logprobs": torch.float16,
            "entropy": torch.float32}


def shard_name(split, j):
    return f"{split}-{j:05d}.safetensors"


def checked_blocks(tok, data, text_field, seq_len, max_tokens, val_frac, max_val_tokens):
    """{"train": (N, T), "val": (M, T)} data.Blocks (read lazily): the training budget and the
    held-out end."""
    blocks = corpus_blocks(tok, data, seq_len, max_tokens, val_frac, max_val_tokens, text_field)
    # fail here, naming the flag to raise, rather than write a cache with an empty split
    if len(blocks["train"]) == 0:
        raise E3Error(f"--max-tokens {max_tokens} is less than one --seq-len {seq_len} block; "
                      f"raise it")
    if val_frac > 0 and len(blocks["val"]) == 0:
        raise E3Error(f"--max-val-tokens {max_val_tokens} is less than one --seq-len {seq_len} "
                      f"block; raise it (or pass --val-frac 0 for no validation split)")
    return blocks


# -----------------------------------------------------------------------------
# The targets

@torch.no_grad()
def teacher_targets(model, input_ids, vocab, topk):
    """input_ids (B,T) -> topk_ids (B,T,K), topk_logprobs (B,T,K), entropy (B,T), on the model's
    device: the last decoder layer's output h from one forward (which computes the LM head for the
    last position only), then the model's own logits from h in chunks (head_targets). The model may
    be whole or FSDP2-sharded (load_teacher)."""
    h, last_logits = last_layer_output(model, input_ids)
    # under FSDP2 the final norm and the LM head are called outside the model's forward: gather them
    with root_unsharded(model):
        check_logits_path(model, h, last_logits)  # the cache holds log_softmax(model(x).logits)
        return head_targets(model, h, vocab, topk)


def head_targets(model, h, vocab, topk):
    """Last hidden states (B,T,H) -> the targets of teacher_targets.

    The LM head runs on chunks of tokens, so the logits of a whole batch (4 bytes x vocabulary per
    token in fp32) never exist at once. On CPU the softmax passes then go through each chunk in
    slices small enough to stay in cache, where they would otherwise be bound by memory
    bandwidth."""
    B, T, _ = h.shape
    # CPU: a 64-row slice is 64 x 49152 x 4 B = 12.6 MB for SmolLM2; GPU: a slice is the chunk
    chunk, piece = (1024, 64) if h.device.type == "cpu" else (4096, 4096)
    ids, logprobs, entropy = [], [], []
    for hc in h.reshape(B * T, -1).split(chunk):
        logits = model_logits(model, hc)[:, :vocab]  # padding rows beyond the tokenizer go
        for z in logits.split(piece):
            z = z.float()  # softmax in fp32: bf16 rounding would exceed the fp16 storage's
            logp = F.log_softmax(z, dim=-1)  # over the FULL vocabulary: top-K stay true log-probs
            # H_t = -sum_v p log p (eq. 12), the AKD token weight; it needs every p, so it is
            # taken here, not from the K stored values (which would cap it at ln K)
            entropy.append(-torch.linalg.vecdot(logp.exp(), logp))
            values, indices = logp.topk(topk, dim=-1)
            logprobs.append(values)
            ids.append(indices)
    return {"topk_ids": torch.cat(ids).view(B, T, topk),
            "topk_logprobs": torch.cat(logprobs).view(B, T, topk),
            "entropy": torch.cat(entropy).view(B, T)}


def load_teacher(model_name, device, shard):
    """The teacher in eval mode: whole on this device (shard=False), or FSDP2-sharded over the
    ranks, each decoder layer its own unit (parallel.parallelize). Sharded, only rank 0 reads the
    weights; the others build the model on the meta device and receive their shards
    (parallel.load_from_rank0), so host and device memory per rank fall with the number of ranks.
    bf16 on GPU, fp32 on CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not shard:
        return load_model(model_name, device, dtype)[0].eval()
    rank, _ = rank_and_world()
    # only rank 0 touches the checkpoint: N ranks reading it at once would need N copies in RAM
    model, _ = load_model(model_name, "cpu", dtype, weights=rank == 0)
    full_state = model.state_dict() if rank == 0 else {}  # the full tensors, while sharding
    load_from_rank0(parallelize(model, device), full_state, rank, device)
    with torch.no_grad():  # one root forward first: FSDP2 initialises lazily, from the root down
        model.eval()(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                     use_cache=False)
    return model


def fits_one_device(model_name, device, margin=0.8):
    """Whether the teacher's bf16 weights take less than `margin` of one GPU's free memory (the
    rest is for activations and the LM-head chunks). On CPU: yes (host memory; --shard-teacher
    asks)."""
    if device.type != "cuda":
        return True
    meta, _ = load_model(model_name, weights=False)  # the config alone: no reads, no memory
    weights = 2 * sum(p.numel() for p in meta.parameters())  # 2 bytes per bf16 parameter
    return weights < margin * torch.cuda.mem_get_info(device)[0]


class ShardWriter:
    """Saves shards on a background thread so the forward passes never wait for the disk. The
    bounded queue holds at most two finished shards. Each shard goes to a temporary file renamed
    into place, so a killed run leaves either the whole shard or none of it."""

    def __init__(self, identity):
        # stored in every shard, so a resumed run can tell a shard of another cache (_shard_done)
        self.metadata = {"e3_identity": json.dumps(identity, sort_keys=True)}
        self.dtypes = storage_dtypes(identity["vocab_size"])
        # lets the kill-and-resume test kill mid-run
        self.delay = float(os.environ.get("E3_CACHE_SHARD_DELAY", 0))
        # maxsize=2 bounds host memory to two shards when the disk is slower than the GPU
        self.queue, self.error = queue.Queue(maxsize=2), None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, path, tensors):
        if self.error:  # a failed save surfaces on the main thread at the next shard
            raise self.error
        self.queue.put((path, tensors))

    def close(self):
        self.queue.put(None)  # sentinel: the thread ends after the shards already queued
        self.thread.join()
        if self.error:
            raise self.error

    def _run(self):
        while (item := self.queue.get()) is not None:
            if self.error:  # keep draining so that put() never blocks forever
                continue
            path, tensors = item
            try:
                tmp = path.with_name(path.name + ".tmp")
                save_file({k: v.to(self.dtypes[k]).contiguous() for k, v in tensors.items()},
                          tmp, self.metadata)
                os.replace(tmp, path)  # atomic on POSIX: the shard appears whole or not at all
                time.sleep(self.delay)
            except Exception as e:
                self.error = e


def compute_shards(model, jobs, out, identity, batch_size, bar=None):
    """Compute and save the shards `jobs`, pairs ((split, j), input_ids (n, T)) taken one at a time
    (a generator reads each shard's ids only when its turn comes); returns the tokens done."""
    vocab, topk = identity["vocab_size"], identity["topk"]
    device = next(model.parameters()).device
    writer, tokens = ShardWriter(identity), 0
    try:
        for (split, j), seqs in jobs:
            parts = []
            # batches never straddle shards: the cache is the same for any number of ranks
            for batch in seqs.split(batch_size):
                parts.append({k: v.cpu() for k, v in
                              teacher_targets(model, batch.to(device), vocab, topk).items()})
                tokens += batch.numel()
                if bar is not None:
                    bar.update(batch.numel())
            # the forward of the next shard starts while this one is written (ShardWriter's thread)
            writer.put(Path(out) / shard_name(split, j),
                       {"input_ids": seqs,
                        **{k: torch.cat([p[k] for p in parts]) for k in parts[0]}})
    finally:
        writer.close()  # also on error: the shards already queued still reach the disk
    return tokens


# -----------------------------------------------------------------------------
# Building a cache: skip what is done, compute the rest, then meta.json

def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_json_atomically(path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)  # meta.json marks completion, so it must never be seen half-written


def _refuse_other_cache(out, identity, found):
    diff = [k for k in identity if found.get(k) != identity[k]]
    if diff:  # never mix two caches' shards in one folder, nor overwrite someone's cache
        raise E3Error(f"'{out}' already holds a teacher cache made with another "
                      f"{', '.join(diff)}; pass a different --out or delete that folder")


def _complete(out, identity):
    """True when meta.json says the same cache is complete and every shard has its recorded
    size."""
    meta_path = out / "meta.json"
    if not meta_path.exists():
        return False
    meta = json.loads(meta_path.read_text())
    _refuse_other_cache(out, identity, meta)
    # sizes only, a cheap stat: TeacherCache verifies the sha256 when the cache is read
    return all((out / s["file"]).exists() and (out / s["file"]).stat().st_size == s["bytes"]
               for split in SPLITS for s in meta["shards"][split])


def _shard_done(path, identity, input_ids):
    """A shard left by an earlier run counts when it opens, was made for this cache, and holds
    these inputs."""
    if not path.exists():
        return False
    try:
        with safe_open(path, "pt") as f:
            found = json.loads(f.metadata()["e3_identity"])
            _refuse_other_cache(path.parent, identity, found)
            return torch.equal(f.get_tensor("input_ids").long(), input_ids)
    except (SafetensorError, KeyError, json.JSONDecodeError):
        return False  # unreadable: compute it again


def build_cache(model_name=None, data=None, out="out/teacher_cache", topk=10, seq_len=512,
                max_tokens=None, val_frac=DEFAULT_VAL_FRAC, max_val_tokens=None, text_field="text",
                batch_size=8, shard_seqs=64, device=None, shard_teacher=False):
    """Build (or finish) the teacher cache in `out` and return its path. Does nothing when a
    complete cache for the same model, tokenizer, data and settings is there; refuses (E3Error)
    when `out` holds a different one. Under torchrun every rank calls it; it uses the process group
    that common.init_distributed set up and leaves it in place. The teacher is FSDP2-sharded over
    the ranks when shard_teacher is set or when it does not fit one GPU (load_teacher); every rank
    still runs its own batches, and the cache is the same either way."""
    from transformers import AutoTokenizer
    rank, world = rank_and_world()
    if device is None:
        device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                              else "cpu")
    out = Path(out)
    # the tokenizer alone tells whether there is work: the teacher is loaded only when there is
    try:
        tok = AutoTokenizer.from_pretrained(resolve_model(model_name))
    except (OSError, ValueError):
        load_model(model_name)  # raises the one-line error for a missing or unloadable model
        raise
    vocab = vocab_size(tok)
    max_val_tokens = max_val_tokens or VAL_SEQS * seq_len
    blocks = checked_blocks(tok, data, text_field, seq_len, max_tokens, val_frac, max_val_tokens)
    # rank 0 hashes the token blocks (a slice at a time); the others take its result and read only
    # their own shards
    hashes = all_gather({s: b.sha256() for s, b in blocks.items()} if rank == 0 else None)[0]
    # everything the shards depend on: any difference makes `out` another cache
    identity = {
        "format": FORMAT, "model": model_fingerprint(model_name),
        "tokenizer": tokenizer_fingerprint(tok),
        "vocab_size": vocab, "topk": topk, "seq_len": seq_len, "shard_seqs": shard_seqs,
        "dtypes": {k: str(v).removeprefix("torch.") for k, v in storage_dtypes(vocab).items()},
        "sequences": {s: len(b) for s, b in blocks.items()},
        "tokens_sha256": hashes}
    if _complete(out, identity):
        print0(f"teacher cache '{out}' is complete; nothing to do")
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    # -(-a // b) is ceil(a / b): the last shard of a split may be short
    shards = {(s, j): range(j * shard_seqs, min((j + 1) * shard_seqs, len(blocks[s])))  # its rows
              for s in SPLITS for j in range(-(-len(blocks[s]) // shard_seqs))}

    def read(job):  # a shard's input ids, from the token file
        return blocks[job[0]][shards[job]]

    mine = list(shards)[rank::world]  # round-robin: the ranks' loads differ by one shard at most
    todo = [job for job in mine if not _shard_done(out / shard_name(*job), identity, read(job))]
    t0, tokens = time.time(), 0
    shard = world > 1 and (shard_teacher or not fits_one_device(model_name, device))
    # a sharded teacher runs collectives in every forward: every rank loads it if any has work, all
    # run as many forwards as the busiest (the others' extra ones on a dummy batch, discarded)
    batches = all_gather(sum(-(-len(shards[job]) // batch_size) for job in todo))
    if todo or (shard and max(batches) > 0):
        model = load_teacher(model_name, device, shard)
        total = sum(len(shards[job]) for job in todo) * seq_len
        jobs = ((job, read(job)) for job in todo)  # each shard read when its turn comes
        with tqdm(total=total, unit="tok", unit_scale=True, desc="teacher targets",
                  disable=rank != 0) as bar:
            tokens = compute_shards(model, jobs, out, identity, batch_size, bar)
        for _ in range(max(batches) - batches[rank] if shard else 0):
            teacher_targets(model, blocks["train"][0:1].to(device), vocab, topk)
        del model  # free the teacher: prune.py trains the student in this same process next
    # every rank hashes its own shards; rank 0 writes meta.json once all are there
    report = ({shard_name(*job): (os.path.getsize(out / shard_name(*job)),
                                  _sha256(out / shard_name(*job)))
               for job in mine}, tokens, time.time() - t0)
    reports = all_gather(report)
    files = {name: v for r in reports for name, v in r[0].items()}
    total_bytes = sum(size for size, _ in files.values())
    n_tokens = sum(identity["sequences"].values()) * seq_len
    listing = {s: [] for s in SPLITS}
    for (s, j), rows in shards.items():
        size, sha = files[shard_name(s, j)]
        listing[s].append({"file": shard_name(s, j), "sequences": len(rows), "bytes": size,
                           "sha256": sha})
    if rank == 0:
        _write_json_atomically(out / "meta.json", {
            **identity, "data": str(data or default_corpus()), "max_tokens": max_tokens,
            "val_frac": val_frac, "max_val_tokens": max_val_tokens,
            "teacher_dtype": "bfloat16" if device.type == "cuda" else "float32",
            "bytes_per_token": round(total_bytes / n_tokens, 2), "shards": listing})
    if world > 1:
        torch.distributed.barrier()  # no rank returns before meta.json is there
    # throughput over all ranks: the slowest rank's wall time bounds the whole job
    computed, seconds = sum(r[1] for r in reports), max(r[2] for r in reports)
    print0(f"teacher cache '{out}': {identity['sequences']['train']} train + "
           f"{identity['sequences']['val']} val sequences of {seq_len} tokens, "
           f"{total_bytes / n_tokens:.1f} bytes/token; computed {computed} tokens "
           f"in {seconds:.1f}s ({computed / max(seconds, 1e-9):.0f} tok/s on {world} rank(s))")
    return str(out)


# -----------------------------------------------------------------------------
# Reading a cache

class TeacherCache:
    """A complete teacher cache, checked against the student's tokenizer (and K and the sequence
    length when given) and for intact shards (size and sha256, once, here; split over the ranks
    under torchrun). Reads lazily: `get` memory-maps only the rows it is asked for."""

    # what `get` returns: indices as int64 for embedding/gather, values widened to fp32 for the loss
    OUT_DTYPES = {"input_ids": torch.int64, "topk_ids": torch.int64,
                  "topk_logprobs": torch.float32, "entropy": torch.float32}

    def __init__(self, path, tokenizer, seq_len=None, topk=None):
        self.path = Path(path)
        if not (self.path / "meta.json").exists():  # meta.json is written last (module docstring)
            raise E3Error(f"'{path}' holds no complete teacher cache (no meta.json); build or "
                          f"finish it with python cache_teacher.py --out {path}")
        self.meta = json.loads((self.path / "meta.json").read_text())
        self.seq_len, self.topk, self.vocab_size = (self.meta["seq_len"], self.meta["topk"],
                                                    self.meta["vocab_size"])
        made = f"teacher cache '{path}' was made"
        # KD compares the student's and the teacher's token ids: the vocabularies must be one
        if vocab_size(tokenizer) != self.vocab_size:
            raise E3Error(f"{made} with a vocabulary of {self.vocab_size} tokens, the student's "
                          f"tokenizer has {vocab_size(tokenizer)}; rebuild it with "
                          f"cache_teacher.py --model <the student's model>")
        if tokenizer_fingerprint(tokenizer) != self.meta["tokenizer"]:
            raise E3Error(f"{made} with another tokenizer ({self.meta['model']['model']}); "
                          f"rebuild it with cache_teacher.py --model <the student's model>")
        for name, want, have in (("topk", topk, self.topk), ("seq-len", seq_len, self.seq_len)):
            if want is not None and want != have:
                raise E3Error(f"{made} with --{name} {have}, not {want}; pass --{name} {have} or "
                              f"rebuild the cache with --{name} {want}")
        self._check_shards()

    def _check_shards(self):
        """Raise on the first missing, truncated or corrupt shard. Under torchrun rank r hashes
        shards r, r+N, ... and the ranks share what they found: at the paper's 0.5B tokens the
        cache is ~23 GB, read once in all instead of once per rank. Every rank raises the same
        error, so none is left waiting."""
        rank, world = rank_and_world()
        listed = [s for split in SPLITS for s in self.meta["shards"][split]]
        mine = [p for s in listed[rank::world] if (p := self._shard_problem(s))]
        problems = [p for found in all_gather(mine) for p in found]
        if problems:
            raise E3Error(problems[0])

    def _shard_problem(self, s):
        f = self.path / s["file"]
        size = f.stat().st_size if f.exists() else 0
        if size != s["bytes"]:  # the cheap check first: a size mismatch needs no hashing
            return (f"teacher cache shard '{f}' is missing or truncated "
                    f"({size} of {s['bytes']} bytes); {FIX_SHARD}")
        if _sha256(f) != s["sha256"]:
            return f"teacher cache shard '{f}' is corrupt (sha256 differs); {FIX_SHARD}"
        return None

    def len_split(self, split):
        return self.meta["sequences"][split]

    def get(self, indices, split="train"):
        """Rows `indices` (global sequence indices of `split`, any order) as a dict of tensors:
        input_ids (n,T) int64, topk_ids (n,T,K) int64, topk_logprobs (n,T,K) float32,
        entropy (n,T) float32."""
        indices = torch.as_tensor(indices, dtype=torch.long).reshape(-1).tolist()
        n, T, K, S = len(indices), self.seq_len, self.topk, self.meta["shard_seqs"]
        if any(not 0 <= i < self.len_split(split) for i in indices):
            raise IndexError(f"sequence index out of range for the {self.len_split(split)} "
                             f"'{split}' sequences")
        shapes = {"input_ids": (n, T), "topk_ids": (n, T, K), "topk_logprobs": (n, T, K),
                  "entropy": (n, T)}
        batch = {k: torch.empty(shapes[k], dtype=dtype) for k, dtype in self.OUT_DTYPES.items()}
        # group the rows by shard, so each shard file is opened once per call
        rows_of = {}
        for pos, i in enumerate(indices):
            rows_of.setdefault(i // S, []).append((pos, i % S))
        for j, rows in rows_of.items():
            with safe_open(self.path / self.meta["shards"][split][j]["file"], "pt") as f:
                for k in batch:
                    stored = f.get_slice(k)  # a lazy view: only the sliced rows are read
                    for pos, r in rows:
                        # the copy widens uint16/fp16 to int64/fp32
                        batch[k][pos] = stored[r:r + 1][0]
        return batch


# -----------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    # teacher and data
    p.add_argument("--model", default="default",
                   help="teacher: HF folder or hub id (default: packaged SmolLM2-135M)")
    p.add_argument("--data", default=None, help=".txt/.md, .jsonl or .parquet file, or a folder of "
                   "them (default: the packaged plays)")
    p.add_argument("--text-field", default="text", help="field (.jsonl) or column (.parquet) with "
                   "the text; a .jsonl line without it and with a 'messages' list is a chat")
    # what to cache
    p.add_argument("--topk", type=int, default=10, help="K teacher tokens kept per position")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"cap on training tokens (default: the whole split; {DEMO_TOKENS} for "
                        f"the packaged demo)")
    p.add_argument("--val-frac", type=float, default=DEFAULT_VAL_FRAC,
                   help="end of the corpus held out")
    p.add_argument("--max-val-tokens", type=int, default=None,
                   help=f"cap on validation tokens given targets (default {VAL_SEQS} sequences)")
    # output and throughput
    p.add_argument("--out", default="out/teacher_cache", help="cache folder (a rerun resumes it)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass, per rank")
    p.add_argument("--shard-seqs", type=int, default=64,
                   help="sequences per shard: the unit of resumption")
    p.add_argument("--shard-teacher", action="store_true", help="under torchrun, FSDP2-shard the "
                   "teacher over the ranks (automatic when it does not fit one GPU)")
    args = p.parse_args()
    if args.model == "default" and args.max_tokens is None:
        args.max_tokens = DEMO_TOKENS  # a few minutes on a CPU, the budget of `python prune.py`
    for name in ("topk", "seq_len", "batch_size", "shard_seqs"):
        if getattr(args, name) < 1:
            raise E3Error(f"--{name.replace('_', '-')} must be at least 1")
    _, _, device = init_distributed()
    build_cache(args.model, args.data, args.out, args.topk, args.seq_len, args.max_tokens,
                args.val_frac, args.max_val_tokens, args.text_field, args.batch_size,
                args.shard_seqs, device, args.shard_teacher)


if __name__ == "__main__":
    run_main(main)
