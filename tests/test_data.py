"""The corpus (cache_teacher.py): today's demo blocks kept bit for bit, every format against the
tokenizer itself, the split rule, reading that stops at --max-tokens, token-file reuse and width,
one-line errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cache_teacher as data
import demo
import runtime
from cache_teacher import checked_blocks

WORDS = "thou art more lovely and more temperate rough winds do shake the buds of may".split()


@pytest.fixture(autouse=True)
def token_dir(tmp_path, monkeypatch):
    """Every test tokenises afresh into its own folder: a stale token file cannot make it pass."""
    monkeypatch.setattr(data, "TOKEN_DIR", tmp_path / "tokens")
    return tmp_path / "tokens"


def sentences(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (5 + k % 40,), generator=g)) + "."
            for k in range(n)]


def reference_stream(tok, docs):
    """The stream written out with the tokenizer itself: each text encoded, then EOS; each chat as
    its template renders it, which ends every turn with its own marker (no EOS after it)."""
    ids = []
    for doc in docs:
        if isinstance(doc, list):  # a chat
            ids += tok.apply_chat_template(doc, tokenize=True)["input_ids"]
        else:
            ids += tok(doc)["input_ids"] + [tok.eos_token_id]
    return torch.tensor(ids)


def reference_split(ids, seq_len, val_frac=0.05):
    """The split written out: the last max(floor(5% of N), 4 (T + 1)) tokens are held out."""
    n_val = max(int(len(ids) * val_frac), 4 * (seq_len + 1))
    return ids[:len(ids) - n_val], ids[len(ids) - n_val:]


def whole_stream(tok, path, text_field="text"):
    tokens = data.token_file(tok, str(path), text_field)
    return tokens.read(0, tokens.n_tokens)


# checksums (sha256, first 16 hex digits) of the packaged demo's blocks as the code before data.py
# made them (common.read_documents -> token_stream -> split_stream -> pack, recorded at commit
# 6571888): the README's numbers were measured on these blocks
TODAY = {(128, 40960, 4096): (320, "1a18d3811a4da605", 32, "a2c76ac728728651"),
         (512, None, None): (3158, "5040d78d1f94f962", 32, "38a598d11d4657d6"),
         (128, None, 10 ** 9): (12635, "9c929901687f9602", 665, "48fe2ebacf00886a")}


def test_the_demo_blocks_are_todays(tokenizer):
    for (seq_len, max_tokens, max_val), (n_train, train_sha, n_val, val_sha) in TODAY.items():
        max_val = max_val or 32 * seq_len
        blocks = checked_blocks(tokenizer, None, "text", seq_len, max_tokens, 0.05, max_val)
        assert (len(blocks["train"]), len(blocks["val"])) == (n_train, n_val)
        assert blocks["train"].sha256()[:16] == train_sha and blocks["val"].sha256()[:16] == val_sha


def test_every_format_gives_the_tokenizers_own_stream(tokenizer, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    docs = sentences(30)
    chats = [[{"role": "user", "content": a}, {"role": "assistant", "content": b}]
             for a, b in zip(docs[::2], docs[1::2])]
    folder = tmp_path / "folder"
    for i, d in enumerate(docs[:3]):  # read in sorted path order: a.md, b.txt, c.md
        (folder / "sub").mkdir(parents=True, exist_ok=True)
        (folder / "sub" / f"{'abc'[i]}.{'md' if i != 1 else 'txt'}").write_text(d)
    (folder / "sub" / "ignored.py").write_text("not text")
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps({"body": d}) + "\n\n" for d in docs))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    for i in range(2):  # two shards of a FineWeb-Edu-like folder, 'text' among other columns
        (tmp_path / "shards").mkdir(exist_ok=True)
        part = docs[i * 15:(i + 1) * 15]
        pq.write_table(pa.table({"id": list(range(len(part))), "text": part}),
                       tmp_path / "shards" / f"{i:03d}.parquet", row_group_size=4)
    cases = [(folder, "text", docs[:3]), (tmp_path / "plain.jsonl", "body", docs),
             (tmp_path / "chat.jsonl", "text", chats), (tmp_path / "shards", "text", docs),
             (tmp_path / "shards" / "001.parquet", "text", docs[15:])]
    for path, field, expect in cases:
        got = whole_stream(tokenizer, path, field)
        assert torch.equal(got, reference_stream(tokenizer, expect)), path


def test_a_chat_ends_once(tokenizer, tmp_path):
    """A conversation's tokens are its template's, and the next one follows at once: the template
    ends every turn with its own marker, so an EOS appended after it doubled the end of every
    conversation (<|im_end|> twice for SmolLM2's, whose EOS it is)."""
    chats = [[{"role": "user", "content": "to be"}, {"role": "assistant", "content": "or not"}],
             [{"role": "user", "content": "that is"}, {"role": "assistant", "content": "the question"}]]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    got = whole_stream(tokenizer, path)
    rendered = [tokenizer.apply_chat_template(c, tokenize=True)["input_ids"] for c in chats]
    assert got.tolist() == rendered[0] + rendered[1]
    ends = sum(r.count(tokenizer.eos_token_id) for r in rendered)  # one end marker a turn
    assert (got == tokenizer.eos_token_id).sum() == ends


def test_a_corpus_read_whole_splits_at_its_end(tokenizer, tmp_path):
    docs = sentences(400)
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train, val = reference_split(reference_stream(tokenizer, docs), 16)
    for max_tokens in (None, 1000):
        blocks = data.corpus_blocks(tokenizer, str(path), 16, max_tokens, max_val_tokens=None)
        n = len(train) // 16 if max_tokens is None else 1000 // 16
        assert torch.equal(blocks["train"][:n].flatten(), train[:n * 16])
        assert torch.equal(blocks["val"][:len(blocks["val"])].flatten(), val[:len(val) // 16 * 16])


def test_max_tokens_stops_reading(tokenizer, tmp_path, monkeypatch):
    """A corpus 'too big to read whole' (the read-whole threshold lowered to 0): reading stops at
    the rule's N tokens. The lines after the first ~N tokens are not JSON, so a reader that went on
    would fail, and the documents handed to the tokenizer are counted. Train is the stream's start,
    val the end of its first N tokens, disjoint; a smaller budget later reuses the file."""
    monkeypatch.setattr(data, "READ_WHOLE_TOKENS", 0)
    monkeypatch.setattr(data, "BATCH_CHARS", 4096)  # the read-ahead: one batch of documents
    docs = sentences(3000)
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) + "not json\n" * 1000)
    read = []
    real = data.documents
    monkeypatch.setattr(data, "documents", lambda *a: (read.append(d) or d for d in real(*a)))
    seq_len, budget = 16, 2000
    N = -(-(budget + 4 * 17) // 0.95)  # the rule: ceil((M + 4 (T + 1)) / (1 - val_frac))
    blocks = data.corpus_blocks(tokenizer, str(path), seq_len, budget, max_val_tokens=None)
    ids = reference_stream(tokenizer, docs)[: int(N)]
    train, val = reference_split(ids, seq_len)
    assert len(train) >= budget and len(blocks["train"]) == budget // seq_len
    assert torch.equal(blocks["train"][:125].flatten(), train[:budget])
    assert torch.equal(blocks["val"][:len(blocks["val"])].flatten(), val[:len(val) // 16 * 16])
    # one batch of documents (BATCH_CHARS) past the ~N tokens at most, a small part of the corpus
    read_chars = sum(len(doc[0]) for doc in read)
    assert read_chars <= data.BATCH_CHARS + 2 * 4 * N, read_chars
    assert len(read) < len(docs) / 2, len(read)
    meta = json.loads(next(data.TOKEN_DIR.glob("*/tokens.json")).read_text())
    assert (meta["tokens"], meta["complete"]) == (N, False)
    monkeypatch.setattr(data, "write_token_file", lambda *a: pytest.fail("rewritten for less"))
    again = data.corpus_blocks(tokenizer, str(path), seq_len, 10 * seq_len)["train"]
    assert torch.equal(again[:10], blocks["train"][:10])


def test_the_token_file_is_reused_and_follows_the_corpus(tokenizer, tmp_path, token_dir):
    path = tmp_path / "c.txt"
    path.write_text(" ".join(sentences(200)))
    first = whole_stream(tokenizer, path)
    (binary,) = token_dir.glob("*/tokens.bin")
    stamp = binary.stat().st_mtime_ns
    assert torch.equal(whole_stream(tokenizer, path), first) and binary.stat().st_mtime_ns == stamp
    assert binary.stat().st_size == 2 * len(first)  # uint16: the vocabulary has 49152 ids
    assert not list(token_dir.glob("*/*.tmp*"))
    path.write_text(path.read_text() + " the end.")  # an edited corpus is another corpus
    expect = reference_stream(tokenizer, [path.read_text()])
    assert torch.equal(whole_stream(tokenizer, path), expect)


def test_ids_beyond_uint16_are_stored_as_uint32(tokenizer, tmp_path, token_dir):
    tok = type(tokenizer).from_pretrained(demo.default_model())
    tok.add_tokens([f"<w{i}>" for i in range(65536 - len(tok) + 8)])  # ids up to 65543
    text = "a <w16390> b <w16385> c"
    path = tmp_path / "c.txt"
    path.write_text(text)
    got = whole_stream(tok, path)
    assert got.max() >= 65536 and torch.equal(got, reference_stream(tok, [text]))
    assert next(token_dir.glob("*/tokens.bin")).stat().st_size == 4 * len(got)


@pytest.mark.parametrize("case", ["missing", "empty", "bad line", "no column", "no pyarrow",
                                  "no template", "json", "gzipped shards"])
def test_bad_corpora_are_one_line_errors(case, tokenizer, tmp_path, monkeypatch, token_dir):
    path, tok, field = tmp_path / "c.jsonl", tokenizer, "text"
    expect = {"missing": "does not exist", "empty": "no text found",
              "bad line": "c.jsonl:2 is not a JSON", "no column": "no column 'text'",
              "no pyarrow": "needs pyarrow", "no template": "no chat template",
              "json": "c.json' is not in a format", "gzipped shards": "c.jsonl.gz' is not in a format"}
    if case == "json":  # read as text, it would train on its markup
        path = tmp_path / "c.json"
        path.write_text(json.dumps([{"text": "fine"}]))
    elif case == "gzipped shards":  # a dataset folder: read, it would train on its card alone
        path = tmp_path / "ds"
        (path / "data").mkdir(parents=True)
        (path / "README.md").write_text("# a dataset card")
        (path / "data" / "c.jsonl.gz").write_bytes(b"\x1f\x8b\x08")
    elif case == "empty":
        path.write_text("\n" + json.dumps({"text": "  "}) + "\n")
    elif case == "bad line":
        path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    elif case in ("no column", "no pyarrow"):
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa
        path = tmp_path / "c.parquet"
        pq.write_table(pa.table({"content": ["some text"]}), path)
        if case == "no pyarrow":
            monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import then fails
    elif case == "no template":
        tok = type(tokenizer).from_pretrained(demo.default_model())
        tok.chat_template = None
        path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(runtime.E3Error, match=expect[case]):
        whole_stream(tok, path, field)
    assert not list(token_dir.glob("*/*"))  # no token file, not even a temporary one


def test_two_ranks_stop_together_when_rank_0_finds_no_text(tmp_path):
    """Rank 0 alone tokenises while rank 1 waits: its error must reach rank 1 (one line, no hang)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "cache_teacher.py", "--model", demo.default_model(), "--data", str(empty),
           "--out", str(tmp_path / "cache")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "E3_TOKEN_CACHE": str(tmp_path / "t")}
    r = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                       text=True, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "no text found" in errors[0], r.stderr[-3000:]
    assert "[rank1]: Traceback" not in r.stderr, r.stderr[-3000:]  # it too ended with the E3Error


@pytest.mark.parametrize("change", ["chat template", "bos"])
def test_a_tokenizer_that_encodes_otherwise_gets_its_own_token_file(change, tokenizer, tmp_path,
                                                                    token_dir):
    """One vocabulary, another encoding (a chat template, a BOS before every document): its own
    token file, never the first tokenizer's stream."""
    tok = type(tokenizer).from_pretrained(demo.default_model())
    if change == "chat template":
        tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        path = tmp_path / "c.jsonl"
        path.write_text(json.dumps({"messages": [{"role": "user", "content": "Who is there?"},
                                                 {"role": "assistant", "content": "Nay, answer me."}]}))
        text = tok.apply_chat_template(json.loads(path.read_text())["messages"], tokenize=False)
        expect = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    else:
        tok._tokenizer.post_processor = __import__("tokenizers").processors.TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
        path = tmp_path / "c.txt"
        path.write_text("Who is there?")
        expect = torch.tensor(tok("Who is there?")["input_ids"] + [tok.eos_token_id])
        assert expect[0] == 1 != tokenizer("Who is there?")["input_ids"][0]
    whole_stream(tokenizer, path)  # the demo tokenizer's token file first
    assert torch.equal(whole_stream(tok, path), expect)
    assert len(list(token_dir.glob("*/tokens.bin"))) == 2
