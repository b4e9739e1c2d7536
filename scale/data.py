"""
Corpus formats beyond plain text, read lazily: cache_teacher.documents imports this only when a
.jsonl or .parquet file is in --data.

  .jsonl     one document a line: its --text-field, or a chat `messages` list rendered by the
             tokenizer's chat template (special tokens included; cache_teacher adds no EOS after it)
  .parquet   its --text-field column (FineWeb-Edu's layout), a file or a folder of shards, a row
             group at a time; needs pyarrow (pip install pyarrow)
"""
import json

from cache_teacher import E3Error


def jsonl_documents(path, text_field, tok):
    """(text, True) for each line's `text_field`, or (the rendered chat, False) for a line with a
    'messages' list instead."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if text_field not in obj and isinstance(obj.get("messages"), list):
                    yield render_chat(tok, obj["messages"], f"{path}:{n}"), False
                else:
                    yield obj[text_field], True
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


def parquet_documents(path, text_field):
    """(text, True) for every row of the file's `text_field` column, one row group at a time."""
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
            yield text, True
