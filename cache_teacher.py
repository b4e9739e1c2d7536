"""
The teacher's targets for offline top-K distillation (paper Sec. 3.3), computed once before the
student exists. For every position of every packed sequence: the teacher's top-K next-token ids,
their log-probabilities under the FULL-vocabulary softmax, and the full-vocabulary entropy H_t
(nats, AKD's token weight), beside the input ids. prune.py reads them back with TeacherCache.

    python cache_teacher.py                  # the packaged SmolLM2-135M on the Shakespeare plays
    python cache_teacher.py --model M --data D --out DIR [--topk 10 --seq-len 512 --max-tokens N]
    torchrun --nproc_per_node 8 cache_teacher.py --model M --data D --out DIR [--shard-teacher]

This file is also where a corpus is read (prune.py's and evaluate.py's too):

  the corpus   --data: .txt/.md (one document), .jsonl (a line's --text-field, or a chat's
               `messages` rendered by the tokenizer's chat template), .parquet (a column), or a
               folder of them in path order; each document encoded as its tokenizer does by
               default and followed by EOS (a chat by its own turn ends); --seq-len blocks cut from
               that stream with nothing inserted. SOURCE:WEIGHT,...: a mixture (scale/data.py).
  the split    the LAST n_val = max(floor(val_frac N), 4 (seq_len + 1)) tokens of the N-token stream
               are held out (validation, and evaluate.py's text); training blocks come from its
               start. A budget M stops reading at N = max(2^24, ceil((M + 4 (seq_len + 1)) /
               (1 - val_frac))); a corpus under 2^24 tokens is always read whole.
  token file   tokenised once into TOKEN_DIR/<key>/tokens.bin (uint16 or uint32 ids), then
               memory-mapped a slice at a time (nanoGPT's prepare.py): host memory stays flat.

A cache folder: shards train-00000.safetensors, ... (input_ids, topk_ids, topk_logprobs fp16,
entropy fp32: 46 bytes a token at K = 10; sampled and hybrid targets: sample_ids, kd.py) and
meta.json, written last: the identity (model, tokenizer, K, T, the tokens' hash), each shard's size
and sha256. Rank r of N computes shards r, r + N, ...; each is renamed into place when whole, so a
killed build reruns the same command and computes only the missing shards.
"""
import argparse
import hashlib
import importlib
import itertools
import json
import math
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from runtime import (CACHE_DIR, FORMATS, UNREAD, E3Error, HelpFormatter, all_gather, default_corpus,
                     init_distributed, load_model, print0, rank_and_world, run_main)

# beside the converted demo model (runtime.CACHE_DIR): token files and prune.py's teacher caches
TOKEN_DIR = Path(os.environ.get("E3_TOKEN_CACHE", CACHE_DIR / "tokens"))
TEACHER_CACHE_DIR = Path(os.environ.get("E3_TEACHER_CACHE", CACHE_DIR / "teacher"))
DEMO_TOKENS = 40_960  # `python cache_teacher.py`'s budget: the demo's
FORMAT = "e3-teacher-cache/1"  # part of the identity: a rerun never resumes another layout
VAL_SEQS = 32  # validation sequences given targets by default
SPLITS = ("train", "val")
DEFAULT_VAL_FRAC = 0.05
MIN_VAL_BLOCKS = 4  # the held-out end is at least this many blocks of seq_len + 1 tokens
READ_WHOLE_TOKENS = 1 << 24  # corpora up to this many tokens are always read whole
BATCH_CHARS = 1 << 20  # text tokenised per call: large enough for the tokenizer's batch speed


def resolve_model(name):  # --model, or without it the packaged demo's (demo.py: converted once)
    if name in (None, "", "default"):
        from demo import default_model
        return default_model()
    return name


def model_fingerprint(model_name):
    """A checkpoint's identity for caches: its path, its config.json, its weight files' stats."""
    name = resolve_model(model_name)
    cfg = Path(name) / "config.json"
    weights = [(p.name, p.stat().st_size, p.stat().st_mtime_ns)
               for p in sorted(Path(name).glob("*")) if p.suffix in (".safetensors", ".bin")]
    text = json.dumps([cfg.read_text(), weights]) if cfg.exists() else name  # a hub id: its name
    return {"model": name, "sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}


def tokenizer_fingerprint(tok):
    """A tokenizer's identity: a hash of its vocabulary, special tokens, encoding (BOS, chats)."""
    ident = [sorted(tok.get_vocab().items(), key=lambda kv: kv[1]), tok.bos_token_id,
             tok.eos_token_id, tok("a")["input_ids"], tok.chat_template]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def vocab_size(tok):
    """The real token ids; a model's logits may have padding rows past them (KD compares the
    student's and the teacher's distributions id by id: only these count)."""
    return len(tok)


# -----------------------------------------------------------------------------
# The corpus: documents -> one token stream on disk -> the split -> blocks

def corpus_files(data=None):
    path = Path(data or default_corpus()).expanduser()
    if not path.exists():
        raise E3Error(f"'{path}' does not exist; --data: a {'/'.join(FORMATS)} file or folder")
    if path.is_dir():  # (and the data it cannot read: scale/data.py refuses it, not skipped)
        return sorted(p for p in path.rglob("*") if p.suffix in FORMATS + UNREAD and p.is_file())
    return [path]


def documents(tok, data=None, text_field="text", assistant_only=False):
    """(text, is_plain_text, spans) for every non-blank document of --data, lazily, in reading
    order; spans: a chat's assistant turns (assistant_only, scale/data.py), else None."""
    for path in corpus_files(data):
        if path.suffix not in (".txt", ".md"):  # JSON lines (text or chats), parquet, ...
            from scale import data as formats
            docs = formats.documents(path, text_field, tok, assistant_only)
        else:
            docs = [(path.read_text(encoding="utf-8", errors="replace"), True, None)]
        for text, plain, spans in docs:
            if text and text.strip():
                yield text, plain, spans


def _encode(tok, batch):
    """The ids of each document in order: plain text as its tokenizer encodes it by default, then
    EOS; a chat as its template rendered it, which ends every turn with its own marker (another EOS
    would double the end of every conversation)."""
    out = [None] * len(batch)
    for plain in (True, False):
        if idx := [i for i, doc in enumerate(batch) if doc[1] == plain]:
            encoded = tok([batch[i][0] for i in idx], add_special_tokens=plain)["input_ids"]
            eos = [tok.eos_token_id] if plain and tok.eos_token_id is not None else []
            for i, ids in zip(idx, encoded):
                out[i] = ids + eos
    return out


def corpus_fingerprint(data=None):
    """A corpus's identity without reading it: its path and each file's name, size and mtime."""
    root = Path(data or default_corpus()).expanduser().resolve()
    files = [(str(p.resolve().relative_to(root)) if p.resolve() != root else p.name,
              p.stat().st_size, p.stat().st_mtime_ns) for p in corpus_files(data)]
    return hashlib.sha256(json.dumps([str(root), files]).encode()).hexdigest()[:16]


class TokenFile:
    """A tokenised corpus on disk, read back a slice at a time."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "tokens.json").read_text())
        self.n_tokens, self.dtype = self.meta["tokens"], np.dtype(self.meta["dtype"])

    def read(self, start, stop):
        """Tokens [start, stop) as int64. A fresh memmap per call (nanoGPT's trick): its pages are
        released with it."""
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside the {self.n_tokens} of {self.folder}")
        if stop == start:
            return torch.empty(0, dtype=torch.long)
        mm = np.memmap(self.folder / "tokens.bin", self.dtype, "r", start * self.dtype.itemsize,
                       (stop - start,))
        return torch.from_numpy(mm.astype(np.int64))


def write_token_file(tok, data, text_field, folder, need=None, assistant_only=False):
    """Tokenise --data, ~BATCH_CHARS of text at a time, into folder/tokens.bin (and mask.bin: a byte
    a token, 1 if the loss predicts it, --assistant-only); stop once it holds `need` tokens (None:
    all). tokens.json is written last: it says the ids are whole."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if len(tok) <= 1 << 16 else np.uint32
    tmp_bin, tmp_json, tmp_mask = (folder / f"{name}.tmp{os.getpid()}" for name in (
        "tokens.bin", "tokens.json", "mask.bin"))
    n_tokens, n_docs, complete, batch, chars, t0 = 0, 0, True, [], 0, time.time()
    try:
        with open(tmp_bin, "wb") as f, open(tmp_mask, "wb") as f_mask:
            for doc in itertools.chain(documents(tok, data, text_field, assistant_only), [None]):
                if doc is not None:
                    batch.append(doc)
                    chars += len(doc[0])
                    if chars < BATCH_CHARS:
                        continue
                if not batch:
                    break
                encoded = _encode(tok, batch)
                ids = np.fromiter((t for enc in encoded for t in enc), dtype=np.int64)
                if need is not None and n_tokens + len(ids) >= need:
                    ids, complete = ids[: need - n_tokens], False  # reading stops here
                ids.astype(dtype).tofile(f)
                if assistant_only:  # 1: a token the loss predicts (scale/data.py)
                    from scale.data import loss_targets
                    loss_targets(tok, batch, encoded)[:len(ids)].tofile(f_mask)
                n_tokens, n_docs, batch, chars = n_tokens + len(ids), n_docs + len(batch), [], 0
                if not complete:
                    break
    except BaseException:
        for tmp in (tmp_bin, tmp_mask):  # a bad line, an interrupt: no half-written file stays
            tmp.unlink(missing_ok=True)
        raise
    if n_tokens == 0:
        tmp_bin.unlink(), tmp_mask.unlink()
        raise E3Error(f"no text found in '{data or default_corpus()}'; pass --data with a non-empty corpus")
    meta = {"format": "e3-tokens/1", "tokenizer": tokenizer_fingerprint(tok),
            "corpus": corpus_fingerprint(data), "data": str(data or default_corpus()),
            "text_field": text_field, "dtype": np.dtype(dtype).name, "tokens": n_tokens,
            "documents": n_docs, "complete": complete, "assistant_only": assistant_only}
    tmp_json.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp_bin, folder / "tokens.bin")
    os.replace(tmp_mask, folder / "mask.bin") if assistant_only else tmp_mask.unlink()
    os.replace(tmp_json, folder / "tokens.json")
    print0(f"tokenised {n_tokens} tokens of {n_docs} documents into {folder} ({time.time() - t0:.1f}s)")


def token_file(tok, data=None, text_field="text", need=None, assistant_only=False):
    """The token file of --data for this tokenizer holding the whole corpus or at least `need`
    tokens: reused if there, else written (under torchrun by rank 0 while the others wait)."""
    key = json.dumps([tokenizer_fingerprint(tok), corpus_fingerprint(data), text_field]
                     + ["assistant-only"] * assistant_only)
    folder = TOKEN_DIR / hashlib.sha256(key.encode()).hexdigest()[:16]
    meta = folder / "tokens.json"
    serves = meta.exists() and (json.loads(meta.read_text())["complete"] or need is not None
                                and json.loads(meta.read_text())["tokens"] >= need)
    problem = None
    if rank_and_world()[0] == 0 and not serves:
        try:
            write_token_file(tok, data, text_field, folder, need, assistant_only)
        except E3Error as e:
            problem = str(e)
    if problem := all_gather(problem)[0]:  # rank 0's outcome: every rank stops, or none does
        raise E3Error(problem)
    return TokenFile(folder)


def split(n_tokens, seq_len, val_frac):
    """(n_train, n_val): the first n_train tokens train, the last n_val are held out."""
    n_val = max(int(n_tokens * val_frac), MIN_VAL_BLOCKS * (seq_len + 1)) if val_frac > 0 else 0
    if n_tokens - n_val < seq_len + 1:
        raise E3Error(f"corpus has only {n_tokens} tokens, too few for seq-len {seq_len} with a "
                      f"validation split; pass more --data or a smaller --seq-len")
    return n_tokens - n_val, n_val


class Blocks:
    """n blocks of seq_len tokens from token `start` of a token file; blocks[a:b] reads those."""

    def __init__(self, tokens, start, n, seq_len):
        self.tokens, self.start, self.n, self.seq_len = tokens, start, n, seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, rows):
        rows = slice(rows.start, rows.stop) if isinstance(rows, range) else rows
        a, b, _ = rows.indices(self.n)
        T = self.seq_len
        return self.tokens.read(self.start + a * T, self.start + max(a, b) * T).view(-1, T)

    def sha256(self, rows_per_read=1 << 14):
        """sha256 of the blocks as int64 bytes, streamed."""
        h = hashlib.sha256()
        for a in range(0, self.n, rows_per_read):
            h.update(self[a:a + rows_per_read].numpy().tobytes())
        return h.hexdigest()


def corpus_blocks(tok, data=None, seq_len=512, max_tokens=None, val_frac=DEFAULT_VAL_FRAC,
                  max_val_tokens=None, text_field="text", assistant_only=False):
    """{"train": Blocks, "val": Blocks}: up to max_tokens of training blocks from the start of the
    stream, up to max_val_tokens of held-out blocks from its end (the split above)."""
    if data and ":" in str(data) and not Path(data).exists():  # SOURCE:WEIGHT,...: scale/data.py
        return importlib.import_module("scale.data").mixture_blocks(corpus_blocks, **locals())  # by name
    need = None
    if max_tokens and val_frac < 1:  # reading may stop once the budget and the val end fit
        need = max(READ_WHOLE_TOKENS, math.ceil((max_tokens + MIN_VAL_BLOCKS * (seq_len + 1))
                                                / (1 - val_frac)))
    elif max_tokens:
        need = max_tokens
    tokens = token_file(tok, data, text_field, need, assistant_only)
    n_train, n_val = split(min(tokens.n_tokens, need or tokens.n_tokens), seq_len, val_frac)
    return {"train": Blocks(tokens, 0, min(n_train, max_tokens or n_train) // seq_len, seq_len),
            "val": Blocks(tokens, n_train, min(n_val, max_val_tokens or n_val) // seq_len, seq_len)}


def checked_blocks(tok, data, text_field, seq_len, max_tokens, val_frac, max_val_tokens,
                   assistant_only=False):
    """corpus_blocks, refusing (with the flag to raise) a split that would be empty."""
    blocks = corpus_blocks(tok, data, seq_len, max_tokens, val_frac, max_val_tokens, text_field,
                           assistant_only)
    if len(blocks["train"]) == 0:
        raise E3Error(f"--max-tokens {max_tokens} is less than one --seq-len {seq_len} block; raise it")
    if val_frac > 0 and len(blocks["val"]) == 0:
        raise E3Error(f"--max-val-tokens {max_val_tokens} is less than one --seq-len {seq_len} "
                      f"block; raise it (or pass --val-frac 0 for no validation split)")
    return blocks


# -----------------------------------------------------------------------------
# The targets

def teacher_dtype(device):
    """The teacher's dtype (meta.json records it): bf16 on a GPU, fp32 on a CPU (bf16 is slow)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def storage_dtypes(vocab, targets="topk", assistant_only=False):
    ids = torch.uint16 if vocab <= 65536 else torch.int32
    mask = {"loss_mask": torch.uint8} if assistant_only else {}  # which positions the loss counts
    # fp16 log-probs: the KD loss moves by ~2e-5 relative (tests/test_cache_teacher.py)
    head = {"topk_ids": ids, "topk_logprobs": torch.float16} if targets != "sampled" else {}
    draws = {"sample_ids": ids} if targets != "topk" else {}  # sampled, hybrid: the draws
    return {"input_ids": ids, **head, **draws, "entropy": torch.float32, **mask}



def token_stats(z, topk, with_logp=False):
    """Logits z (n, V) -> {entropy (n,); topk_logprobs, topk_ids (n, K) if topk} of the full softmax
    in fp32, and log p if asked: eager on a CPU, compiled on a GPU (scale/teacher.py)."""
    logp = F.log_softmax(z.float(), dim=-1)
    # H_t = -sum_v p log p, all V of it; a masked entry (logit -inf) adds 0 log 0 = 0, not NaN
    found = {"entropy": -torch.linalg.vecdot(logp.exp(), logp.clamp(min=torch.finfo(logp.dtype).min))}
    if topk:  # z's own top-K: log p is z less a number a row (z orders even what rounding ties)
        ids = found["topk_ids"] = z.topk(topk, dim=-1).indices
        found["topk_logprobs"] = logp.gather(-1, ids)
    return found, logp if with_logp else None


@torch.no_grad()
def teacher_targets(model, input_ids, vocab, topk, logit_chunk=0, samples=0, generator=None):
    """input_ids (B, T) -> topk_ids, topk_logprobs (B, T, K), entropy (B, T): token_stats of the
    model's own logits a slice of tokens at a time. samples > 0: sample_ids (B, T, samples) drawn
    (`generator`, on its device) from the teacher's softmax (topk 0: instead of the top-K), or beside
    a top-K from its rest, the softmax with the top-K set to 0 (hybrid). logit_chunk > 0: the logits
    made from the last layer's output that many tokens at a time, never (B, T, V) at once (the scale
    wing: a 152K vocabulary at 4096 tokens is 2.5 GB a sequence)."""
    (B, T), out, stats = input_ids.shape, [], token_stats
    if input_ids.device.type == "cuda":
        from scale.teacher import compiled
        stats = compiled(token_stats)
    if logit_chunk:
        from scale.fused_loss import chunked_logits
        chunks = chunked_logits(model, input_ids, logit_chunk)
    else:
        chunks = [model(input_ids=input_ids, use_cache=False).logits.flatten(0, 1)]
    if samples:  # x_j ~ p_t, or ~ its rest (baselines/targets.py)
        from baselines.targets import draw
    # 64-token slices on a CPU stay in cache (12.6 MB of fp32 at V = 49K); a GPU takes 4096
    for z in chunks:
        for z in z.split(64 if z.device.type == "cpu" else 4096):
            found, logp = stats(z[:, :vocab], topk, samples > 0)  # padding rows past the tokenizer go
            if samples:
                found["sample_ids"] = draw(logp, found.get("topk_ids"), samples, generator)
            out.append(found)
    return {k: torch.cat([f[k] for f in out]).view(B, T, *v.shape[1:]) for k, v in out[0].items()}


class ShardWriter:
    """Saves shards on a background thread (at most two queued) so that the forwards never wait for
    the disk; each under a temporary name, renamed: a killed run leaves whole shards or none."""

    def __init__(self, identity, dtype):  # each shard records the teacher dtype that made it
        self.metadata = {"e3_identity": json.dumps({**identity, "teacher_dtype": dtype}, sort_keys=True)}
        self.dtypes = storage_dtypes(identity["vocab_size"], identity.get("targets", "topk"),
                                     identity.get("assistant_only", False))
        self.queue, self.error = queue.Queue(maxsize=2), None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, path, tensors):
        if self.error:  # a failed save surfaces on the main thread at the next shard
            raise self.error
        self.queue.put((path, tensors))

    def close(self):
        self.queue.put(None)
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
                os.replace(tmp, path)
            except Exception as e:
                self.error = e


def compute_shards(model, jobs, out, identity, batch_size, bar=None, logit_chunk=0, forwards=0):
    """Compute and save the shards `jobs`, ((split, j), input_ids (n, T), {name: (n, T) tensor}
    stored beside them) triples; returns the tokens done. Batches never straddle shards. forwards:
    the busiest rank's count (a sharded teacher's are collective), the rest on a dummy batch."""
    vocab, topk, samples = identity["vocab_size"], identity["topk"], identity.get("samples", 0)
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    writer, tokens = ShardWriter(identity, str(dtype).removeprefix("torch.")), 0
    try:
        for (split_name, j), seqs, beside in jobs:
            parts, gen = [], None
            if samples:  # the draws' generator, seeded by the cache and the shard
                from baselines.targets import shard_generator
                gen = shard_generator(identity, split_name, j, device)
            for batch in seqs.split(batch_size):
                targets = teacher_targets(model, batch.to(device), vocab, topk, logit_chunk, samples, gen)
                parts.append({k: v.cpu() for k, v in targets.items()})
                tokens, forwards = tokens + batch.numel(), forwards - 1
                if bar is not None:
                    bar.update(batch.numel())
            # the next shard's forwards start while this one is written
            writer.put(Path(out) / shard_name(split_name, j), {"input_ids": seqs, **beside,
                       **{k: torch.cat([p[k] for p in parts]) for k in parts[0]}})
        for _ in range(forwards):  # their targets dropped
            teacher_targets(model, torch.zeros(1, 1, dtype=torch.long, device=device), vocab, topk, logit_chunk)
    finally:
        writer.close()  # also on error: the shards already queued still reach the disk
    return tokens


# -----------------------------------------------------------------------------
# Building a cache: skip what is done, compute the rest, then meta.json

def shard_name(split_name, j):
    return f"{split_name}-{j:05d}.safetensors"


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _refuse_other_cache(out, identity, found):
    # never mix two caches' shards in one folder, nor overwrite someone's cache
    if diff := [k for k in identity if found.get(k) != identity[k]]:
        raise E3Error(f"'{out}' already holds a teacher cache made with another "
                      f"{', '.join(diff)}; pass a different --out or delete that folder")


def _complete(out, identity):
    """meta.json says this cache is complete and every shard has its size (TeacherCache hashes)."""
    if not (out / "meta.json").exists():
        return False
    meta = json.loads((out / "meta.json").read_text())
    _refuse_other_cache(out, identity, meta)
    return all((out / s["file"]).exists() and (out / s["file"]).stat().st_size == s["bytes"]
               for split_name in SPLITS for s in meta["shards"][split_name])


def _shard_done(path, identity, input_ids, dtype):
    """A shard left by an earlier run counts if it opens, is this cache's, holds these inputs, and
    this teacher dtype made it (a build moved from a GPU's bf16 to a CPU's fp32 mixes no shards)."""
    if not path.exists():
        return False
    try:
        with safe_open(path, "pt") as f:
            _refuse_other_cache(path.parent, identity, found := json.loads(f.metadata()["e3_identity"]))
            return (found.get("teacher_dtype", dtype) == dtype
                    and torch.equal(f.get_tensor("input_ids").long(), input_ids))
    except (SafetensorError, KeyError, json.JSONDecodeError):
        return False  # unreadable: computed again


def forward_batch(seq_len, shard_seqs, device):  # a GPU's forward ~16K tokens (at 1K, launch-bound)
    return 8 if device.type == "cpu" else min(shard_seqs, max(8, 16384 // seq_len))  # <= a shard


def build_cache(model_name=None, data=None, out="out/teacher_cache", topk=10, seq_len=512,
                max_tokens=None, val_frac=DEFAULT_VAL_FRAC, max_val_tokens=None, text_field="text",
                batch_size=None, shard_seqs=64, device=None, shard_teacher=False, logit_chunk=0,
                targets="topk", samples=12, sample_seed=0, assistant_only=False):
    """Build (or finish) the teacher cache in `out` and return its path: nothing to do when the
    same complete cache is there; E3Error when `out` holds another. targets: "topk" (K = topk, the
    paper's), "sampled" (`samples` draws a position, seeded by sample_seed) or "hybrid" (the top-K
    and `samples` draws from the rest); assistant_only: a loss mask too (scale/data.py). Under
    torchrun every rank calls it, for its own batches; shard_teacher: FSDP2-shards the teacher."""
    from transformers import AutoTokenizer
    rank, world = rank_and_world()
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch_size = batch_size or forward_batch(seq_len, shard_seqs, device)
    if (world > 1 or logit_chunk) and device.type == "cpu":  # the scale wing: freed memory back
        from scale.fsdp import release_freed_memory
        release_freed_memory()
    out, model_name = Path(out), resolve_model(model_name)
    try:  # the tokenizer alone tells whether there is work: the teacher loads only if there is
        tok = AutoTokenizer.from_pretrained(model_name)
    except (OSError, ValueError):
        load_model(model_name)  # raises the one-line error for a missing or unloadable model
        raise
    vocab = vocab_size(tok)
    max_val_tokens = max_val_tokens or VAL_SEQS * seq_len
    blocks = checked_blocks(tok, data, text_field, seq_len, max_tokens, val_frac, max_val_tokens,
                            assistant_only)
    # rank 0 hashes the token blocks; the others read only their own shards
    hashes = all_gather({s: b.sha256() for s, b in blocks.items()} if rank == 0 else None)[0]
    identity = {  # everything the shards depend on: any difference makes `out` another cache
        "format": FORMAT, "model": model_fingerprint(model_name), "tokenizer": tokenizer_fingerprint(tok),
        "vocab_size": vocab, "topk": topk, "seq_len": seq_len, "shard_seqs": shard_seqs,
        "dtypes": {k: str(v).removeprefix("torch.")
                   for k, v in storage_dtypes(vocab, targets, assistant_only).items()},
        "sequences": {s: len(b) for s, b in blocks.items()}, "tokens_sha256": hashes}
    if targets != "topk":  # (a top-K cache's identity is as it always was)
        identity.update(topk=topk if targets == "hybrid" else None, targets=targets,
                        samples=samples, sample_seed=sample_seed)
    masks = lambda blocks, rows: {}  # nothing stored beside the ids: every position counts
    if assistant_only:  # which do, stored beside the ids
        identity["assistant_only"] = True
        from scale.data import stored_mask as masks
    if _complete(out, identity):
        print0(f"teacher cache '{out}' is complete; nothing to do")
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = {(s, j): range(j * shard_seqs, min((j + 1) * shard_seqs, len(blocks[s])))
              for s in SPLITS for j in range(-(-len(blocks[s]) // shard_seqs))}
    mine = list(shards)[rank::world]  # round-robin: the ranks' loads differ by one shard at most
    dtype = str(teacher_dtype(device)).removeprefix("torch.")
    todo = [job for job in mine if not _shard_done(out / shard_name(*job), identity,
                                                   blocks[job[0]][shards[job]], dtype)]
    t0, tokens, shard, forwards = time.time(), 0, False, 0
    if world > 1:  # a teacher too big for one GPU (or --shard-teacher) is FSDP2-sharded (scale/)
        from scale.teacher import fits_one_device, sharded
        shard = shard_teacher or not fits_one_device(model_name, device)
    if shard:  # its forwards are collective: each rank runs as many as the busiest (0: none loads it)
        forwards = max(all_gather(sum(-(-len(shards[job]) // batch_size) for job in todo)))
    if todo or forwards:  # sharded: rank 0 alone reads the weights, the others get their shards
        model = load_model(model_name, "cpu" if shard else device, teacher_dtype(device),
                           weights=rank == 0 or not shard)[0].eval()
        model = sharded(model, device) if shard else model
        jobs = ((job, blocks[job[0]][shards[job]], masks(blocks[job[0]], shards[job]))
                for job in todo)  # each read when its turn comes
        total = sum(len(shards[job]) for job in todo) * seq_len
        with tqdm(total=total, unit="tok", unit_scale=True, desc="teacher targets",
                  disable=rank != 0) as bar:
            tokens = compute_shards(model, jobs, out, identity, batch_size, bar, logit_chunk, forwards)
        del model  # prune.py trains the student in this same process next
    # every rank hashes its own shards; rank 0 writes meta.json once all are there
    reports = all_gather(({shard_name(*job): (os.path.getsize(out / shard_name(*job)),
                                              _sha256(out / shard_name(*job))) for job in mine},
                          tokens, time.time() - t0))
    files = {name: v for r in reports for name, v in r[0].items()}
    total_bytes, n_tokens = sum(size for size, _ in files.values()), sum(
        identity["sequences"].values()) * seq_len
    listing = {s: [] for s in SPLITS}
    for (s, j), rows in shards.items():
        size, sha = files[shard_name(s, j)]
        listing[s].append({"file": shard_name(s, j), "sequences": len(rows), "bytes": size, "sha256": sha})
    if rank == 0:
        meta = {"targets": "topk", **identity, "data": str(data or default_corpus()),
                "max_tokens": max_tokens, "val_frac": val_frac, "max_val_tokens": max_val_tokens,
                "teacher_dtype": dtype,
                "bytes_per_token": round(total_bytes / n_tokens, 2), "shards": listing}
        (out / "meta.json.tmp").write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(out / "meta.json.tmp", out / "meta.json")  # never seen half-written
    if world > 1:
        torch.distributed.barrier()  # no rank returns before meta.json is there
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
    length when given) and for intact shards (size and sha256, once; split over the ranks under
    torchrun). `get` memory-maps only the rows it is asked for."""

    OUT_DTYPES = {"input_ids": torch.int64, "topk_ids": torch.int64, "topk_logprobs": torch.float32,
                  "sample_ids": torch.int64, "entropy": torch.float32, "loss_mask": torch.bool}

    def __init__(self, path, tokenizer, seq_len=None, topk=None):
        self.path = Path(path)
        if not (self.path / "meta.json").exists():
            raise E3Error(f"'{path}' holds no complete teacher cache (no meta.json); build or "
                          f"finish it with python cache_teacher.py --out {path}")
        self.meta = json.loads((self.path / "meta.json").read_text())
        self.seq_len, self.topk, self.vocab_size = (self.meta["seq_len"], self.meta["topk"],
                                                    self.meta["vocab_size"])
        # the kind of targets (kd.TARGETS): "topk", "sampled" or "hybrid" (N = self.samples draws)
        self.targets, self.samples = self.meta.get("targets", "topk"), self.meta.get("samples")
        made = f"teacher cache '{path}' was made"
        if vocab_size(tokenizer) != self.vocab_size:
            raise E3Error(f"{made} with a vocabulary of {self.vocab_size} tokens, the student's "
                          f"tokenizer has {vocab_size(tokenizer)}; rebuild it with "
                          f"cache_teacher.py --model <the student's model>")
        if tokenizer_fingerprint(tokenizer) != self.meta["tokenizer"]:
            raise E3Error(f"{made} with another tokenizer ({self.meta['model']['model']}); "
                          f"rebuild it with cache_teacher.py --model <the student's model>")
        for name, want, have in (("topk", topk if self.targets != "sampled" else None, self.topk),
                                 ("seq-len", seq_len, self.seq_len)):
            if want is not None and want != have:
                raise E3Error(f"{made} with --{name} {have}, not {want}; pass --{name} {have} or "
                              f"rebuild the cache with --{name} {want}")
        # rank r hashes shards r, r + N, ...; every rank raises the first problem any found
        rank, world = rank_and_world()
        listed = [s for split_name in SPLITS for s in self.meta["shards"][split_name]]
        mine = [p for s in listed[rank::world] if (p := self._shard_problem(s))]
        if problems := [p for found in all_gather(mine) for p in found]:
            raise E3Error(problems[0])

    def _shard_problem(self, s):
        f, fix = self.path / s["file"], ("delete it and rerun the command that built the cache; "
                                         "it recomputes only the missing shards")
        size = f.stat().st_size if f.exists() else 0
        if size != s["bytes"]:  # the cheap check first
            return (f"teacher cache shard '{f}' is missing or truncated ({size} of {s['bytes']} "
                    f"bytes); {fix}")
        if _sha256(f) != s["sha256"]:
            return f"teacher cache shard '{f}' is corrupt (sha256 differs); {fix}"

    def len_split(self, split_name):
        return self.meta["sequences"][split_name]

    def get(self, indices, split_name="train", keys=None):
        """Rows `indices` of a split, any order: input_ids (n,T) int64, topk_ids (n,T,K) int64 and
        topk_logprobs (n,T,K) fp32 (sampled, hybrid: sample_ids (n,T,N)), entropy (n,T) fp32,
        loss_mask (n,T) bool if the cache has one (--assistant-only) and "targets" (kd.TARGETS);
        keys: only those tensors are read."""
        indices = torch.as_tensor(indices, dtype=torch.long).reshape(-1).tolist()
        n, T, S = len(indices), self.seq_len, self.meta["shard_seqs"]
        last = {"topk_ids": self.topk, "topk_logprobs": self.topk, "sample_ids": self.samples}
        if any(not 0 <= i < self.len_split(split_name) for i in indices):
            raise IndexError(f"sequence index out of range for the {self.len_split(split_name)} "
                             f"'{split_name}' sequences")
        stored = storage_dtypes(self.vocab_size, self.targets, self.meta.get("assistant_only"))
        batch = {k: torch.empty((n, T, last[k]) if k in last else (n, T), dtype=self.OUT_DTYPES[k])
                 for k in stored if keys is None or k in keys}
        rows_of = {}  # grouped by shard: each file opened once a call
        for pos, i in enumerate(indices):
            rows_of.setdefault(i // S, []).append((pos, i % S))
        for j, rows in rows_of.items():
            with safe_open(self.path / self.meta["shards"][split_name][j]["file"], "pt") as f:
                for k in batch:
                    stored = f.get_slice(k)  # lazy: only the sliced rows are read
                    for pos, r in rows:
                        batch[k][pos] = stored[r:r + 1][0]  # widens uint16/fp16 to int64/fp32
        return {**batch, "targets": self.targets}


# -----------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default="default", help="teacher: HF folder or hub id (default: the demo's)")
    p.add_argument("--data", help=".txt/.md, .jsonl, .parquet, or a folder (default: the plays)")
    p.add_argument("--text-field", default="text", help="the .jsonl field / .parquet column ('messages': chat)")
    p.add_argument("--targets", choices=["topk", "sampled", "hybrid"], default="topk", help="the "
                   "top-K (the paper), --samples draws, or the top-K + draws from the rest (kd.py)")
    p.add_argument("--topk", type=int, default=10, help="K teacher tokens kept per position")
    p.add_argument("--samples", type=int, default=12, help="draws per position (sampled, hybrid)")
    p.add_argument("--sample-seed", type=int, default=0, help="the draws' seed (sampled, hybrid)")
    p.add_argument("--assistant-only", action="store_true", help="chats: loss on the reply only")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence")
    p.add_argument("--max-tokens", type=int, help=f"cap on training tokens (default all; demo {DEMO_TOKENS})")
    p.add_argument("--val-frac", type=float, default=DEFAULT_VAL_FRAC, help="end share held out")
    p.add_argument("--max-val-tokens", type=int, help=f"validation tokens (default {VAL_SEQS} seqs)")
    p.add_argument("--out", default="out/teacher_cache", help="cache folder (a rerun resumes it)")
    p.add_argument("--batch-size", type=int, help="sequences a forward, per rank (CPU 8; GPU ~16K tokens)")
    p.add_argument("--shard-seqs", type=int, default=64, help="sequences a shard: the resume unit")
    p.add_argument("--logit-chunk", type=int, default=0, help="> 0: logits this many tokens at a time")
    p.add_argument("--shard-teacher", action="store_true", help="torchrun: FSDP2-shard the teacher")
    args = p.parse_args()
    if args.model == "default" and args.max_tokens is None:
        args.max_tokens = DEMO_TOKENS  # a few minutes on a CPU, the budget of `python prune.py`
    for name in ("topk", "samples", "seq_len", "batch_size", "shard_seqs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise E3Error(f"--{name.replace('_', '-')} must be at least 1")
    _, _, device = init_distributed()
    build_cache(model_name=args.model, device=device,
                **{k: v for k, v in vars(args).items() if k != "model"})


if __name__ == "__main__":
    run_main(main)
