""".parquet and .arrow tables (Arrow IPC stream or file, as `Dataset.save_to_disk` and `to_parquet` write
them), one document per row with its text in a string column, read through `datasets` (streamed a record
batch at a time; its lock files go to a temporary folder, never to ~/.cache/huggingface or the data folder).

A table larger than `max_file_bytes` on disk is refused unread; otherwise its rows are streamed and a row
over `max_doc_bytes` (or null) is refused alone, and a table whose text adds up to more than
`max_file_bytes` (a compressed table expands) is refused. A parquet file whose footer declares more than
`max_file_bytes` of uncompressed text is refused before a page is read (a parquet bomb). Only the text
column of a parquet file is decoded, and a row is measured in its Arrow buffer before any copy is made,
but pyarrow decompresses what it reads (a parquet page, which holds at least one whole value; an arrow
file's record batch) before tokq can measure it: a dictionary-encoded table (whose footer declares only
the distinct values) or a compressed arrow file can still cost a few times one batch in memory while it
is read, and is then refused.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .read_limits import ReadLimits, format_mib
from .readers import UnusableText, checked_text, decode_text, extension, open_regular, too_large

# Tables read through `datasets`: extension -> its packaged builder. Not also .gz: parquet compresses
# itself, and `datasets` reads neither format through gzip.
TABLE_EXTENSIONS = {".parquet": "parquet", ".arrow": "arrow"}
# Rows per record batch `datasets` hands over (for parquet, the default is a whole row group): a small
# one keeps each batch small. pyarrow still decompresses a whole page, which holds at least one value.
_TABLE_BATCH_ROWS = 64


def read_table(
    path: Path, field: str, min_chars: int, limits: ReadLimits
) -> tuple[list[tuple[int, str]], list[UnusableText]]:
    """(row, text) of each row of a .parquet / .arrow file, its text in the string column `field`, streamed
    through `datasets`; bad rows (null, longer than `limits.max_doc_bytes`, not text) come back as
    UnusableText with their row. UnusableText for the whole file when it is not a regular file, is
    larger than `limits.max_file_bytes` on disk or holds more text than that, is corrupt, or has no
    string column `field`."""
    with open_regular(path) as raw:  # a FIFO or a device is refused here, before `datasets` opens the path
        if os.fstat(raw.fileno()).st_size > limits.max_file_bytes:
            raise too_large(limits.max_file_bytes, "--max-file-mb", decompressed=False, what="file")
    if "::" in str(path):  # fsspec, under `datasets`, splits "a::b" as a chained URL and finds no file
        raise UnusableText("its path holds '::', which datasets reads as a chained URL; rename it")
    import datasets  # here, not at the top: it takes about a second to import, and only tables need it

    texts: list[tuple[int, str]] = []
    bad: list[UnusableText] = []
    total = 0  # bytes of text so far, against limits.max_file_bytes: a compressed table expands
    with tempfile.TemporaryDirectory(prefix="tokq-datasets-") as cache, _quiet_datasets(datasets), \
            contextlib.closing(_table_rows(datasets, path, field, cache, limits.max_file_bytes)) as rows:
        for row, (n_bytes, value) in enumerate(rows):
            if n_bytes is None:
                bad.append(UnusableText(f"no text ({field!r} is null)", row=row))
                continue
            total += n_bytes
            if total > limits.max_file_bytes:
                cap = format_mib(limits.max_file_bytes)
                raise UnusableText(f"holds more than {cap} MiB of text (--max-file-mb {cap}); "
                                   "raise --max-file-mb to read it")
            if n_bytes > limits.max_doc_bytes:
                cap = format_mib(limits.max_doc_bytes)
                reason = f"longer than {cap} MiB (--max-doc-mb {cap}); raise --max-doc-mb to read it"
                bad.append(UnusableText(reason, row=row))
                continue
            try:  # the row's UTF-8 bytes, checked as any document's (not UTF-8, binary, CRLF)
                text = decode_text(value.as_buffer().to_pybytes())
                texts.append((row, checked_text(text, min_chars)))
            except UnusableText as e:
                bad.append(UnusableText(e.reason, row=row))
    return texts, bad


def _table_rows(datasets: Any, path: Path, field: str, cache: str,
                limits_bytes: int) -> Iterator[tuple[int | None, Any]]:
    """(UTF-8 bytes or None for a null, Arrow scalar) of each row's `field` in a .parquet / .arrow file,
    a record batch at a time. A row is measured from its Arrow buffer, never copied into a Python
    string first, so an over-long one costs no more memory than its batch already holds. UnusableText
    when `datasets` cannot read the file or it has no string column `field`: anything `datasets` (or
    pyarrow under it) raises means the file is unusable, not that tokq is broken, so each call into it
    is guarded, and nothing else is."""
    builder = TABLE_EXTENSIONS[extension(path)]
    # data_files is a glob pattern: escaped, `a[1].parquet` names itself and not `a1.parquet`
    pattern = glob.escape(os.path.abspath(path))

    def load(**options: Any) -> Any:
        # streaming: no arrow copy of the table is written; cache_dir: its lock files go to `cache`
        return datasets.load_dataset(builder, data_files=pattern, split="train", streaming=True,
                                     cache_dir=cache, **options)

    try:
        features = load().features or {}
    except Exception as e:
        raise _unreadable_table(builder, e) from e
    if field not in features:
        raise UnusableText(f"no column {field!r} (has: {', '.join(sorted(features)[:5]) or 'nothing'})")
    if builder == "parquet":
        _check_parquet_expansion(path, field, limits_bytes)
    feature = features[field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        kind = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__
        raise UnusableText(f"column {field!r} holds {kind} values, not strings")
    try:
        if builder == "parquet":  # only the text column is decoded, a few rows at a time
            table = load(columns=[field], batch_size=_TABLE_BATCH_ROWS)
        else:
            table = load().select_columns([field])
        batches = iter(table.with_format("arrow").iter(batch_size=_TABLE_BATCH_ROWS))
    except Exception as e:
        raise _unreadable_table(builder, e) from e
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:
            raise _unreadable_table(builder, e) from e
        for chunk in batch.column(field).chunks:
            for i in range(len(chunk)):
                value = chunk[i]
                yield (value.as_buffer().size if value.is_valid else None), value


def _check_parquet_expansion(path: Path, field: str, max_bytes: int) -> None:
    """A parquet bomb (a few KB holding GBs of highly compressible text) is refused from its footer,
    before pyarrow decompresses a page: the text column's declared uncompressed size, summed over row
    groups, must fit `max_bytes` (--max-file-mb, the same cap a gzip file's decompressed size meets)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
        columns = [meta.schema.column(i).path for i in range(meta.num_columns)]
        index = columns.index(field)
        declared = sum(meta.row_group(g).column(index).total_uncompressed_size for g in range(meta.num_row_groups))
    except ValueError:
        return  # not a flat column of that name: the reader reports what the file holds
    except Exception as e:
        raise _unreadable_table("parquet", e) from e
    if declared > max_bytes:
        cap = format_mib(max_bytes)
        raise UnusableText(f"its column {field!r} expands to {declared / 2**20:,.0f} MiB (--max-file-mb {cap}); "
                           "raise --max-file-mb to read it")


def _unreadable_table(builder: str, error: Exception) -> UnusableText:
    detail = (str(error).strip().splitlines() or [""])[0][:200]
    what = type(error).__name__ + (f": {detail}" if detail else "")
    kind = {"parquet": "a parquet", "arrow": "an Arrow IPC"}[builder]
    return UnusableText(f"corrupt, or not {kind} file ({what}); write it again, e.g. with datasets' "
                        "to_parquet or save_to_disk")


@contextlib.contextmanager
def _quiet_datasets(datasets: Any) -> Iterator[None]:
    """`datasets` logs a file it cannot read at ERROR (tokq's own warning names it, once) and may draw
    progress bars: both off while tokq reads a table, and as they were afterwards."""
    library_logger = logging.getLogger("datasets")
    level, bars = library_logger.level, datasets.is_progress_bar_enabled()
    library_logger.setLevel(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        library_logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()
