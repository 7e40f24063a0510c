"""Caps on what one data folder may make tokq read (`--max-doc-mb`, `--max-file-mb`): a folder is
untrusted input, and a gzip bomb, a huge .jsonl line or a parquet bomb must be skipped, not read."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokq.errors import ConfigError

MIB = 1 << 20
DEFAULT_MAX_DOC_MB = 64
DEFAULT_MAX_FILE_MB = 1024
MAX_DOC_MB_HELP = ("Skip a document larger than this many MiB: a text file (after decompression: where a gzip "
                   "bomb stops), one .jsonl line or one .parquet/.arrow row.")
MAX_FILE_MB_HELP = ("Skip a file holding more than this many MiB after decompression (a whole .jsonl file; a "
                    ".parquet/.arrow file on disk, and the text of its rows).")


@dataclass(frozen=True)
class ReadLimits:
    """Caps on what one folder may make tokq read. `max_doc_bytes`: one document (a text file,
    after decompression, or one .jsonl line); `max_file_bytes`: one file after decompression (a
    whole .jsonl file; with .gz, what a gzip bomb could expand to). Larger ones are skipped."""

    max_doc_bytes: int = DEFAULT_MAX_DOC_MB * MIB
    max_file_bytes: int = DEFAULT_MAX_FILE_MB * MIB


def read_limits(max_doc_mb: float = DEFAULT_MAX_DOC_MB, max_file_mb: float = DEFAULT_MAX_FILE_MB) -> ReadLimits:
    """ReadLimits from the --max-doc-mb / --max-file-mb flags (MiB), refusing values that cannot work."""
    for flag, value in (("--max-doc-mb", max_doc_mb), ("--max-file-mb", max_file_mb)):
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{flag} {value}: give a positive number of MiB")
    return ReadLimits(max_doc_bytes=max(1, int(max_doc_mb * MIB)), max_file_bytes=max(1, int(max_file_mb * MIB)))


def format_mib(n_bytes: int) -> str:
    """`n_bytes` in MiB as messages and flags write it (`64`, `0.5`)."""
    return f"{n_bytes / MIB:g}"
