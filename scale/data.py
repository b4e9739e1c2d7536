"""
Corpus formats beyond plain text, read lazily: cache_teacher.documents imports this only when a
file other than .txt or .md is in --data (documents: which reader, or a refusal).

  .jsonl     one document a line: its --text-field, or a chat `messages` list rendered by the
             tokenizer's chat template (special tokens included; cache_teacher adds no EOS after it);
             with --assistant-only the loss counts only the assistant's tokens (assistant_spans)
  .parquet   its --text-field column (FineWeb-Edu's layout), a file or a folder of shards, a row
             group at a time; needs pyarrow (pip install pyarrow)
"""
import json
from pathlib import Path

import numpy as np
import torch

import kd
from runtime import FORMATS, UNREAD, E3Error


def documents(path, text_field, tok, assistant_only=False):
    """A --data file that is neither .txt nor .md: JSON lines, parquet, other text (any suffix but
    the formats of data it cannot read, runtime.UNREAD: read as text, they would train on
    markup or compressed bytes)."""
    if path.suffix in UNREAD + (".json",):  # (a folder's .json files, its metadata, are not read)
        raise E3Error(f"'{path}' is not in a format --data reads: {', '.join(FORMATS)}")
    if path.suffix in (".jsonl", ".parquet"):
        return (jsonl_documents(path, text_field, tok, assistant_only) if path.suffix == ".jsonl"
                else parquet_documents(path, text_field))
    return [(path.read_text(encoding="utf-8", errors="replace"), True, None)]


def jsonl_documents(path, text_field, tok, assistant_only=False):
    """(text, True, None) for each line's `text_field`, or (the rendered chat, False, spans) for a
    line with a 'messages' list instead; spans: the assistant's (assistant_only), else None."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if text_field not in obj and isinstance(obj.get("messages"), list):
                    text = render_chat(tok, obj["messages"], f"{path}:{n}")
                    yield text, False, (assistant_spans(tok, obj["messages"], text, f"{path}:{n}")
                                        if assistant_only else None)
                else:
                    yield obj[text_field], True, None
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise E3Error(f"{path}:{n} is not a JSON object with a '{text_field}' field or a "
                              f"'messages' list; fix the line or pass --text-field") from None


def render_chat(tok, messages, where):
    """A conversation as its chat template writes it, special tokens included (encoded with
    add_special_tokens=False, as apply_chat_template(tokenize=True) does)."""
    if getattr(tok, "chat_template", None) is None:
        raise E3Error(f"{where} is a chat ('messages') but the tokenizer has no chat template; "
                      f"pass a model whose tokenizer has one, or plain text with --text-field")
    return tok.apply_chat_template(messages, tokenize=False)


def assistant_spans(tok, messages, text, where):
    """The character spans of `text` (the rendered chat) that the assistant wrote, for a loss on
    them alone: each assistant turn from where the template's generation prompt ends (the turn's
    header is the prompt's) to where the turn's own rendering ends (its end-of-turn marker
    included: the student learns to stop). Found by rendering the conversation's prefixes, which a
    template must write as prefixes of the whole; one that rewrites earlier turns once later ones
    follow (Qwen3 drops their reasoning) is refused, with the way out."""
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        if i == 0:
            raise E3Error(f"{where}: the chat opens with the assistant's turn: no prompt tells it "
                          f"from the rest; drop that turn or pass no --assistant-only")
        prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        turn = tok.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (turn.startswith(prompt) and text.startswith(turn)):
            raise E3Error(f"{where}: the chat template renders this conversation's first {i + 1} "
                          f"turns other than as the start of the whole (it rewrites earlier turns), "
                          f"so the assistant's tokens cannot be told; put each assistant turn on a "
                          f"line of its own (with the turns before it), or pass no --assistant-only")
        spans.append((len(prompt), len(turn)))
    return spans


def loss_targets(tok, batch, encoded):
    """For the token file's mask.bin: 1 for each id of `encoded` (cache_teacher._encode of `batch`)
    that the loss predicts, else 0: every id of a plain text; a chat's ids whose first character
    lies in one of its assistant spans, told by the fast tokenizer's offsets (the same ids)."""
    out = []
    for (text, plain, spans), ids in zip(batch, encoded):
        if plain:
            out += [1] * len(ids)
            continue
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert enc["input_ids"] == ids, "the offsets' encoding differs from the token file's"
        out += [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return np.array(out, dtype=np.uint8)


def stored_mask(blocks, rows):
    """cache_teacher.Blocks rows -> {"loss_mask": (n, T) bool}, stored beside their ids: True at a
    position whose next token the loss predicts (position i's target is token i + 1 of the stream;
    the stream's last position has none); {} for a token file written without --assistant-only."""
    if not blocks.tokens.meta.get("assistant_only"):
        return {}
    a, b, _ = slice(rows.start, rows.stop).indices(blocks.n)
    T, n_tokens = blocks.seq_len, blocks.tokens.n_tokens
    start, stop = blocks.start + a * T, blocks.start + max(a, b) * T
    end = min(stop + 1, n_tokens)
    mask = np.fromfile(blocks.tokens.folder / "mask.bin", np.uint8, end - start - 1,
                       offset=start + 1)
    return {"loss_mask": torch.nn.functional.pad(torch.from_numpy(mask.astype(bool)),
                                                 (0, stop + 1 - end)).view(-1, T)}


def parquet_documents(path, text_field):
    """(text, True, None) for every row of the file's `text_field` column, a row group at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise E3Error(f"reading '{path}' needs pyarrow; install it with: pip install pyarrow") \
            from None
    f = pq.ParquetFile(path)
    if text_field not in f.schema_arrow.names:
        names = ", ".join(f.schema_arrow.names)
        raise E3Error(f"'{path}' has no column '{text_field}' (it has {names}); pass --text-field")
    for batch in f.iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            yield text, True, None


def micro_batch_weights(source, idx, n_micro, kind, world):
    """prune.py's weight of each micro-batch in a step's loss over an --assistant-only cache: its
    counted positions over the global batch's, times the ranks (FSDP averages them), so that the
    step's loss is the mean over all of them (1 / n_micro, as for packed text, would make it the
    mean of the micro-batches' means: an assistant token weighs more where there are few)."""
    mask = kd.counted(source.get(idx, keys=("loss_mask",))["loss_mask"], kind)  # the mask alone
    counts = mask.reshape(n_micro, -1).sum(-1).double()
    total = counts.sum()
    if world > 1:
        torch.distributed.all_reduce(total)
    return (counts * world / total.clamp(min=1)).tolist()


# -----------------------------------------------------------------------------
# A mixture of corpora in stated proportions: any of --data, --calib-data, --search-data given as
# SOURCE:WEIGHT,... ("python-docs.jsonl:0.5,torch-code.jsonl:0.3,plays/:0.2"); cache_teacher's
# corpus_blocks hands such a spec here. The proportions are of the blocks (seq-len tokens each),
# so of the tokens: N blocks split by the largest remainder of N w_i / sum(w), each source's from
# its own start (its held-out end from its own end), then interleaved so that every prefix holds
# the proportions too, within a block a source (the calibration reads the first --n-calib).

def is_mixture(text):
    """Whether a text flag's value is a SOURCE:WEIGHT,... mixture rather than a file or folder."""
    return bool(text) and ":" in str(text) and not Path(text).exists()


def mixture_sources(spec):
    """'a:0.5,b:0.3' -> [('a', 0.5), ('b', 0.3)]; one line naming the problem otherwise."""
    sources = []
    for part in str(spec).split(","):
        path, _, weight = part.rpartition(":")
        try:
            sources.append((path, float(weight)))
        except ValueError:
            sources.append((part, float("nan")))
        if not path or not sources[-1][1] > 0:
            raise E3Error(f"'{spec}' is neither a file nor a mixture SOURCE:WEIGHT,... with weights > 0 "
                          f"(e.g. a.txt:0.5,b.jsonl:0.5)")
    return sources


def allot(n, weights):
    """n split into integer shares proportional to weights: each floor(n w_i / sum w), then the
    blocks left over one each to the largest remainders (ties: the earlier source)."""
    exact = [n * w / sum(weights) for w in weights]
    shares = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: shares[i] - exact[i])[:n - sum(shares)]:
        shares[i] += 1
    return shares


class MixedBlocks:
    """Blocks (cache_teacher.Blocks) of several sources interleaved: source i's j-th block sits at
    the rank of (j + 1/2) / n_i among all, so any first m rows hold ~m w_i of source i's."""

    def __init__(self, parts, seq_len, names=None):
        self.names = names or [str(i) for i in range(len(parts))]  # the sources, as --data named them
        order = sorted(((j + 0.5) / len(b), i, j) for i, b in enumerate(parts) for j in range(len(b)))
        self.parts, self.rows, self.seq_len = parts, [(i, j) for _, i, j in order], seq_len
        self.n = len(self.rows)
        # the hash of cache_teacher.Blocks, over these rows (it reads only self.n and self[a:b])
        self.sha256 = type(parts[0]).sha256.__get__(self)

    def __len__(self):
        return self.n

    def __getitem__(self, rows):
        a, b, _ = slice(rows.start, rows.stop).indices(self.n)
        got = [self.parts[i][j:j + 1] for i, j in self.rows[a:b]]
        return torch.cat(got) if got else torch.empty(0, self.seq_len, dtype=torch.long)

    def by_source(self, n):
        """{source: [n_i, T] its rows among the first n}, in the sources' order (each source named
        once and given some of the n: experts/search.check_args refuses a mixture that is not)."""
        return {s: torch.cat([self.parts[k][j:j + 1] for k, j in self.rows[:n] if k == i])
                for i, s in enumerate(self.names)}

    def source_rows(self):
        """[(source, row in that source)] in order: which text each block is (tests, reports)."""
        return list(self.rows)


def mixture_blocks(corpus_blocks, tok, data, seq_len, max_tokens, val_frac, max_val_tokens,
                   text_field="text", assistant_only=False):
    """corpus_blocks (cache_teacher's, passed in: no wing imports a script) of a SOURCE:WEIGHT,...
    spec: {"train", "val"} MixedBlocks. A budget of training tokens that a source cannot supply
    its share of is refused; without one, the largest mixture all sources supply. The held-out
    blocks are mixed alike, as many as the sources' ends hold in proportion."""
    if assistant_only:
        raise E3Error("--assistant-only reads one corpus, not a mixture; mix the chats into one file")
    sources = mixture_sources(data)
    paths, weights = [p for p, _ in sources], [w for _, w in sources]
    whole = [corpus_blocks(tok, p, seq_len, max_tokens, val_frac, max_val_tokens, text_field)
             for p in paths]  # each source read with the whole budget: enough for any share
    out = {}
    for s in ("train", "val"):
        have = [len(b[s]) for b in whole]
        n = min(int(h / (w / sum(weights))) for h, w in zip(have, weights))  # what all supply
        want = (max_tokens if s == "train" else max_val_tokens or n * seq_len)
        if s == "train" and want and want // seq_len > n:
            share = allot(want // seq_len, weights)
            short = next(i for i in range(len(have)) if share[i] > have[i])
            raise E3Error(f"mixture source '{paths[short]}' holds {have[short]} training blocks of "
                          f"{seq_len} tokens, too few for its share, {share[short]} of "
                          f"{want // seq_len}; add text or lower the budget")
        shares = allot(min(n, want // seq_len) if want else n, weights)
        out[s] = MixedBlocks([type(b[s])(b[s].tokens, b[s].start, k, seq_len)
                              for b, k in zip(whole, shares)], seq_len, paths)
    return out
