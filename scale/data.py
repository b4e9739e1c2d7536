"""
Corpus formats beyond text and JSON lines, read a row group at a time: cache_teacher.documents
imports this only when a .parquet file is in --data.

  .parquet   its --text-field column (FineWeb-Edu's layout), a file or a folder of shards; needs
             pyarrow (pip install pyarrow)
"""
from cache_teacher import E3Error


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
