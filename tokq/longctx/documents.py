"""Load a folder of the user's documents into memory, skipping (or rejecting) files it cannot use.

Accepted files: `.txt`, `.md`, `.rst` (one document each) and `.jsonl` (one document per line, a
JSON object whose text lives under `jsonl_field`), each also gzip-compressed as `<name>.<ext>.gz`;
and `.parquet` and `.arrow` tables (Arrow IPC stream or file, as `Dataset.save_to_disk` and
`to_parquet` write them), one document per row with its text in the string column `jsonl_field`,
read through `datasets` (streamed a record batch at a time; its lock files go to a temporary
folder, never to ~/.cache/huggingface or the data folder). Other extensions are ignored (and
counted); hidden files and folders (`.git`, `.DS_Store`) are not looked at. Order is the sorted
relative path, so the same folder always gives the same set.

A file that looks like it should be a document but cannot be used (unreadable, binary, not
UTF-8, corrupt gzip, bad JSON line, a corrupt table or one without a string column
`jsonl_field`, empty, too short) is skipped with a warning on the `tokq` logger and listed in
`DocumentSet.skipped`; `strict=True` turns the first one into a `DataError` instead. Text is
decoded as UTF-8 (a BOM is dropped) and CRLF line ends become LF, so a document hashes the same
on every platform.

A data folder is untrusted input, so reading is bounded (`ReadLimits`): only regular files are
opened (a FIFO, socket, device, or a link to one such as `x.txt -> /dev/zero`, is skipped: a
FIFO would block forever, a device never ends); links to folders are not followed (a loop would
never end); a document larger than `max_doc_bytes` (`--max-doc-mb`, default 64 MiB: a text file
after decompression, or one .jsonl line) and a file larger than `max_file_bytes` (`--max-file-mb`,
default 1024 MiB after decompression: bounds a .jsonl file and a gzip bomb) are skipped after
reading at most one byte past the cap. A .jsonl file is read line by line, so a bad line (invalid
UTF-8, invalid JSON, a lone surrogate escape such as `"\ud800"`) skips only that line. A .parquet
or .arrow file larger than `max_file_bytes` on disk is skipped unread; otherwise its rows are
streamed and a row over `max_doc_bytes` (or null) skips only that row, and a file whose text adds
up to more than `max_file_bytes` (a compressed table expands) is skipped. A parquet file whose
footer declares more than `max_file_bytes` of uncompressed text is skipped before a page is read (a
parquet bomb). Only the text column of a parquet file is decoded, and a row is measured in its Arrow
buffer before any copy is made, but pyarrow decompresses what it reads (a parquet page, which holds
at least one whole value; an arrow file's record batch) before tokq can measure it: a dictionary-
encoded table (whose footer declares only the distinct values) or a compressed arrow file can still
cost a few times one batch in memory while it is read, and is then skipped.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import gzip
import hashlib
import json
import logging
import math
import os
import re
import stat
import tempfile
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tokq.errors import ConfigError, DataError

logger = logging.getLogger("tokq")

TEXT_EXTENSIONS = (".txt", ".md", ".rst")
JSONL_EXTENSION = ".jsonl"
# Tables read through `datasets`: extension -> its packaged builder. Not also .gz: parquet compresses
# itself, and `datasets` reads neither format through gzip.
TABLE_EXTENSIONS = {".parquet": "parquet", ".arrow": "arrow"}
ACCEPTED_EXTENSIONS = (*TEXT_EXTENSIONS, JSONL_EXTENSION, *TABLE_EXTENSIONS)
ACCEPTED_HINT = ".txt, .md, .rst or .jsonl files (each optionally .gz), or .parquet / .arrow tables"

# More than this fraction of control characters (other than tab, newlines, form feed) means
# the file is not text, even if it happens to decode as UTF-8.
MAX_CONTROL_CHAR_RATIO = 0.01
# Warnings beyond this many are summarised in one line, so a broken .jsonl does not flood the log.
MAX_LOGGED_SKIPS = 20
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")
# json.loads turns an unpaired "\ud800" escape into a lone surrogate, which no UTF-8 encoder accepts.
_SURROGATE = re.compile("[\ud800-\udfff]")

MIB = 1 << 20
DEFAULT_MAX_DOC_MB = 64
DEFAULT_MAX_FILE_MB = 1024
MAX_DOC_MB_HELP = ("Skip a document larger than this many MiB: a text file (after decompression: where a gzip "
                   "bomb stops), one .jsonl line or one .parquet/.arrow row.")
MAX_FILE_MB_HELP = ("Skip a file holding more than this many MiB after decompression (a whole .jsonl file; a "
                    ".parquet/.arrow file on disk, and the text of its rows).")
# Decompressed bytes read at a time while skipping the rest of an over-long .jsonl line.
_SKIP_CHUNK = 1 << 20
# Rows per record batch `datasets` hands over (for parquet, the default is a whole row group): a small
# one keeps each batch small. pyarrow still decompresses a whole page, which holds at least one value.
_TABLE_BATCH_ROWS = 64


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


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / MIB:g}"


@dataclass(frozen=True)
class Document:
    """One document's text. `doc_id` is its path relative to the loaded folder (`file.jsonl#L<n>`
    for line n of a .jsonl file, counted from 1 as editors do; `file.parquet#R<n>` for row n of a
    table, counted from 0 as `datasets` indexes it: `Dataset[n]`); `sha256` is of the UTF-8 text,
    so it identifies the content."""

    doc_id: str
    path: Path
    text: str = field(repr=False)
    n_chars: int = field(init=False)
    sha256: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_chars", len(self.text))
        object.__setattr__(self, "sha256", hashlib.sha256(self.text.encode("utf-8")).hexdigest())


@dataclass(frozen=True)
class SkippedFile:
    """A file (or one line of a .jsonl file, when `line` is set, or one row of a table, when `row` is)
    that was not used, and why."""

    path: Path
    reason: str
    line: int | None = None
    row: int | None = None

    @property
    def name(self) -> str:
        if self.row is not None:
            return f"{self.path}#R{self.row}"
        return f"{self.path}#L{self.line}" if self.line is not None else str(self.path)


@dataclass
class DocumentSet:
    """The documents read from `root`, what was skipped, and which files were ignored."""

    root: Path
    documents: list[Document]
    skipped: list[SkippedFile] = field(default_factory=list)
    ignored: list[Path] = field(default_factory=list)
    n_files: int = 0  # files that produced at least one document

    def __iter__(self) -> Iterator[Document]:
        return iter(self.documents)

    def __len__(self) -> int:
        return len(self.documents)

    @property
    def total_chars(self) -> int:
        return sum(d.n_chars for d in self.documents)

    def content_hash(self) -> str:
        """sha256 over the sorted (doc_id, text hash) pairs: equal sets give equal hashes, and any
        renamed, added, removed or edited document changes it. Used as a cache key."""
        h = hashlib.sha256()
        for doc in sorted(self.documents, key=lambda d: d.doc_id):
            h.update(doc.doc_id.encode("utf-8") + b"\0" + doc.sha256.encode("ascii") + b"\n")
        return h.hexdigest()

    def summary(self, max_listed: int = 20) -> str:
        lines = [
            f"{self.root}: {len(self.documents):,} documents from {self.n_files:,} files, "
            f"{self.total_chars:,} chars"
        ]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped):,}:")
            lines += [f"  {s.name}: {s.reason}" for s in self.skipped[:max_listed]]
            if len(self.skipped) > max_listed:
                lines.append(f"  ... and {len(self.skipped) - max_listed:,} more")
        if self.ignored:
            counts = Counter(_extension(p) or "(none)" for p in self.ignored)
            kinds = ", ".join(f"{ext} x{n}" for ext, n in sorted(counts.items()))
            lines.append(f"ignored {len(self.ignored):,} files with other extensions ({kinds})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (no text): what was read, skipped and ignored."""
        return {
            "root": str(self.root),
            "content_hash": self.content_hash(),
            "n_documents": len(self.documents),
            "n_files": self.n_files,
            "total_chars": self.total_chars,
            "documents": [
                {"doc_id": d.doc_id, "path": str(d.path), "chars": d.n_chars, "sha256": d.sha256}
                for d in self.documents
            ],
            "skipped": [{"path": str(s.path), "line": s.line, "row": s.row, "reason": s.reason}
                        for s in self.skipped],
            "ignored": [str(p) for p in self.ignored],
        }


class UnusableText(Exception):
    """Raised by `decode_text` (and internally) for input that is not usable text; `load_documents`
    turns it into a skipped file, or a DataError when strict."""

    def __init__(self, reason: str, line: int | None = None, row: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.line = line
        self.row = row


def load_documents(
    folder: str | os.PathLike[str],
    strict: bool = False,
    jsonl_field: str = "text",
    min_chars: int = 1,
    limits: ReadLimits | None = None,
) -> DocumentSet:
    """Read every accepted file under `folder` (recursively, sorted), or the single file `folder`.

    Raises DataError when the path is missing, holds no files, or yields no usable document,
    and (with `strict`) at the first file or line that would otherwise be skipped.
    """
    root = Path(folder)
    limits = limits or ReadLimits()
    if not root.exists():
        if root.is_symlink():
            raise DataError(f"{root}: a broken symlink or a symlink loop; pass a folder of {ACCEPTED_HINT}")
        raise DataError(f"{root}: no such file or folder; pass a folder of {ACCEPTED_HINT}")

    if not root.is_dir():  # a single file; not is_file(): a FIFO or device is refused by the reader, not walked
        if _extension(root) not in _ACCEPTED_WITH_GZ:
            raise DataError(f"{root}: not a document file; accepted are {ACCEPTED_HINT}")
        files, ignored, walk_skips = [(root.name, root)], [], []
    else:
        files, ignored, walk_skips = _list_files(root)
        if not files and not ignored and not walk_skips:
            raise DataError(f"{root}: folder has no files; put {ACCEPTED_HINT} in it")

    documents: list[Document] = []
    skipped: list[SkippedFile] = []
    n_files = 0

    def skip(path: Path, reason: str, line: int | None = None, row: int | None = None) -> None:
        entry = SkippedFile(path, reason, line, row)
        if strict:
            raise DataError(f"{entry.name}: {reason}; fix or remove it, or load without strict to skip it")
        if len(skipped) < MAX_LOGGED_SKIPS:
            logger.warning("skipping %s: %s", entry.name, reason)
        skipped.append(entry)

    for entry in walk_skips:
        skip(entry.path, entry.reason)
    for rel, path in files:
        try:
            if _extension(path).startswith(JSONL_EXTENSION):
                docs, bad_lines = _read_jsonl(rel, path, jsonl_field, min_chars, limits)
            elif _extension(path) in TABLE_EXTENSIONS:
                docs, bad_lines = _read_table(rel, path, jsonl_field, min_chars, limits)
            else:
                docs, bad_lines = [Document(rel, path, _checked_text(_read_text(path, limits), min_chars))], []
        except UnusableText as e:
            skip(path, e.reason)
            continue
        for bad in bad_lines:
            skip(path, bad.reason, bad.line, bad.row)
        if not docs and not bad_lines and _extension(path).startswith(JSONL_EXTENSION):
            skip(path, "empty (no JSON lines)")
        if not docs and not bad_lines and _extension(path) in TABLE_EXTENSIONS:
            skip(path, "empty (no rows)")
        if docs:
            n_files += 1
            documents.extend(docs)

    if len(skipped) > MAX_LOGGED_SKIPS:
        logger.warning("skipped %d more files or lines in %s", len(skipped) - MAX_LOGGED_SKIPS, root)
    if not documents:
        detail = (
            f"{len(skipped)} skipped (first: {skipped[0].name}: {skipped[0].reason})"
            if skipped
            else "none accepted"
        )
        raise DataError(
            f"{root}: no usable documents ({detail}; {len(ignored)} with other extensions); "
            f"accepted are {ACCEPTED_HINT}"
        )
    return DocumentSet(root=root, documents=documents, skipped=skipped, ignored=ignored, n_files=n_files)


_GZIPPABLE = (*TEXT_EXTENSIONS, JSONL_EXTENSION)
_ACCEPTED_WITH_GZ = frozenset((*ACCEPTED_EXTENSIONS, *(e + ".gz" for e in _GZIPPABLE)))


def _extension(path: Path) -> str:
    """The lower-case extension, with an inner one kept for gzip: `a.rst.gz` -> `.rst.gz`."""
    suffixes = [s.lower() for s in path.suffixes]
    if len(suffixes) >= 2 and suffixes[-1] == ".gz":
        return "".join(suffixes[-2:])
    return suffixes[-1] if suffixes else ""


def _list_files(root: Path) -> tuple[list[tuple[str, Path]], list[Path], list[SkippedFile]]:
    """(relative posix path, path) of accepted files, the ignored ones (both sorted), and the
    folders not walked: unlistable ones, and links to folders (never followed, so a link loop
    such as `sub -> ..` cannot make the walk endless)."""
    accepted: list[tuple[str, Path]] = []
    ignored: list[Path] = []
    errors: list[OSError] = []
    links: list[SkippedFile] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=errors.append):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            dirnames.remove(name)
            links.append(SkippedFile(Path(dirpath) / name, "symlink to a folder (not followed, so a link loop "
                                     "cannot recurse; pass the target folder, or copy its files in)"))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            if _extension(path) in _ACCEPTED_WITH_GZ:
                accepted.append((path.relative_to(root).as_posix(), path))
            else:
                ignored.append(path)
    accepted.sort(key=lambda item: item[0])
    ignored.sort()
    unreadable = [SkippedFile(Path(e.filename or root), f"unreadable folder ({e.strerror or e})") for e in errors]
    return accepted, ignored, unreadable + sorted(links, key=lambda s: s.path)


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))


def _not_regular(path: Path, mode: int) -> UnusableText:
    kind = next((name for test, name in _KINDS if test(mode)), "an unknown kind")
    via = ", through a symlink" if path.is_symlink() else ""
    return UnusableText(f"not a regular file ({kind}{via}); only regular files are read")


def _open_regular(path: Path) -> IO[bytes]:
    """The file opened for binary reading, if it is a regular file (after links); UnusableText if
    not. A FIFO is never opened (open would wait for a writer), nor a device (/dev/zero never ends)."""
    try:
        size_stat = os.stat(path)  # follows links: what counts is what a read would reach
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnusableText(f"symlink loop ({e.strerror}); fix or remove the link") from e
        raise UnusableText(f"unreadable ({e.strerror or e})") from e
    if not stat.S_ISREG(size_stat.st_mode):
        raise _not_regular(path, size_stat.st_mode)
    try:
        # O_NONBLOCK: were the path swapped for a FIFO since the stat, open returns instead of waiting;
        # the fstat below then refuses it. It changes nothing for a regular file.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise UnusableText(f"unreadable ({e.strerror or e})") from e
    opened = os.fdopen(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        opened.close()
        raise _not_regular(path, mode)
    return opened


def _too_large(cap: int, flag: str, decompressed: bool, what: str = "document") -> UnusableText:
    size = f"{_mib(cap)} MiB ({flag} {_mib(cap)})"
    lead = (f"decompresses to more than {size}: a gzip bomb or a very large {what}" if decompressed
            else f"larger than {size}")
    return UnusableText(f"{lead}; raise {flag} to read it")


def _read_upto(stream: IO[bytes], limit: int) -> bytearray:
    """Up to `limit` bytes, read a MiB at a time: one read(limit) would allocate all of a raised cap at once."""
    data = bytearray()
    while len(data) < limit and (chunk := stream.read(min(MIB, limit - len(data)))):
        data += chunk
    return data


def _read_capped(path: Path, cap: int, flag: str) -> bytearray:
    """At most `cap` bytes of the file, gunzipped when `.gz`; UnusableText when there are more
    (only cap + 1 bytes are ever read or decompressed), or the file cannot be read."""
    gz = path.suffix.lower() == ".gz"
    with _open_regular(path) as raw:
        if os.fstat(raw.fileno()).st_size > cap:  # (compressed, it would decompress to more still)
            raise _too_large(cap, flag, decompressed=False)
        try:
            if gz:
                with gzip.GzipFile(fileobj=raw) as unzipped:
                    data = _read_upto(unzipped, cap + 1)
            else:
                data = _read_upto(raw, cap + 1)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise UnusableText(f"corrupt gzip ({e}); re-compress it or store it uncompressed") from e
        except OSError as e:
            raise UnusableText(f"unreadable ({e.strerror or e})") from e
    if len(data) > cap:
        raise _too_large(cap, flag, decompressed=gz)
    return data


def _read_text(path: Path, limits: ReadLimits) -> str:
    """The file's text (gunzipped when `.gz`), or UnusableText saying why it is not usable text."""
    if limits.max_file_bytes < limits.max_doc_bytes:
        return decode_text(_read_capped(path, limits.max_file_bytes, "--max-file-mb"))
    return decode_text(_read_capped(path, limits.max_doc_bytes, "--max-doc-mb"))


def decode_text(data: bytes | bytearray) -> str:
    """Decode bytes that should be UTF-8 text (BOM dropped, CRLF -> LF); raise UnusableText for
    binary data or another encoding."""
    if b"\0" in data:
        raise UnusableText("binary (contains NUL bytes; UTF-16 text must be re-encoded as UTF-8)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        bad = data[e.start : e.start + 1].hex()
        raise UnusableText(f"not UTF-8 (byte 0x{bad} at offset {e.start}); re-encode it as UTF-8") from e
    text = text.replace("\r\n", "\n")
    if text:
        n_control = len(_CONTROL_CHARS.findall(text))
        if n_control / len(text) > MAX_CONTROL_CHAR_RATIO:
            raise UnusableText(f"binary ({n_control / len(text):.1%} control characters)")
    return text


def _checked_text(text: str, min_chars: int) -> str:
    if not text.strip():
        raise UnusableText("empty")
    if len(text) < min_chars:
        raise UnusableText(f"too short ({len(text)} chars; min_chars is {min_chars})")
    return text


def _read_jsonl(
    rel: str, path: Path, jsonl_field: str, min_chars: int, limits: ReadLimits
) -> tuple[list[Document], list[UnusableText]]:
    """One document per non-blank line, read as a stream so no line or file past its cap is ever
    held whole; bad lines come back as UnusableText with their line number. UnusableText for
    the whole file when it cannot be read or is larger than `limits.max_file_bytes`."""
    with _open_regular(path) as raw:
        if os.fstat(raw.fileno()).st_size > limits.max_file_bytes:
            raise _too_large(limits.max_file_bytes, "--max-file-mb", decompressed=False, what="file")
        try:
            if path.suffix.lower() != ".gz":
                return _jsonl_documents(rel, path, raw, jsonl_field, min_chars, limits)
            with gzip.GzipFile(fileobj=raw) as unzipped:
                return _jsonl_documents(rel, path, unzipped, jsonl_field, min_chars, limits)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise UnusableText(f"corrupt gzip ({e}); re-compress it or store it uncompressed") from e
        except OSError as e:
            raise UnusableText(f"unreadable ({e.strerror or e})") from e


def _jsonl_documents(
    rel: str, path: Path, stream: IO[bytes], jsonl_field: str, min_chars: int, limits: ReadLimits
) -> tuple[list[Document], list[UnusableText]]:
    docs: list[Document] = []
    bad: list[UnusableText] = []
    total = 0  # bytes read (decompressed) so far, against limits.max_file_bytes

    def count(n_bytes: int) -> None:
        nonlocal total
        total += n_bytes
        if total > limits.max_file_bytes:
            raise _too_large(limits.max_file_bytes, "--max-file-mb", path.suffix.lower() == ".gz", "file")

    n = 0
    while True:
        # one past the cap tells a line at the cap from a longer one; never past the file's cap either
        line = stream.readline(min(limits.max_doc_bytes, limits.max_file_bytes - total) + 1)
        if not line:
            break
        n += 1
        count(len(line))
        if not line.endswith(b"\n") and len(line) > limits.max_doc_bytes:
            while (rest := stream.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
                count(len(rest))
            count(len(rest))
            cap = _mib(limits.max_doc_bytes)
            bad.append(UnusableText(f"longer than {cap} MiB (--max-doc-mb {cap}); raise --max-doc-mb to read it", n))
            continue
        try:
            doc = _jsonl_document(f"{rel}#L{n}", path, line, jsonl_field, min_chars)
        except UnusableText as e:
            bad.append(UnusableText(e.reason, n))
            continue
        if doc is not None:
            docs.append(doc)
    return docs, bad


def _jsonl_document(doc_id: str, path: Path, line: bytes, jsonl_field: str, min_chars: int) -> Document | None:
    """The document of one .jsonl line (None for a blank line); UnusableText when it has none."""
    text = decode_text(line)
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise UnusableText(f"invalid JSON ({e.msg} at column {e.colno})") from e
    value = record.get(jsonl_field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        keys = ", ".join(sorted(record)[:5]) if isinstance(record, dict) else type(record).__name__
        raise UnusableText(f"no string field {jsonl_field!r} (has: {keys or 'nothing'})")
    if surrogate := _SURROGATE.search(value):
        raise UnusableText(f"lone surrogate U+{ord(surrogate.group()):04X} at character {surrogate.start()} of "
                           f"{jsonl_field!r} (an unpaired \\u escape, not text); fix or remove the line")
    return Document(doc_id, path, _checked_text(value.replace("\r\n", "\n"), min_chars))


def _read_table(
    rel: str, path: Path, field: str, min_chars: int, limits: ReadLimits
) -> tuple[list[Document], list[UnusableText]]:
    """One document per row of a .parquet / .arrow file, its text in the string column `field`, streamed
    through `datasets`; bad rows (null, longer than `limits.max_doc_bytes`, not text) come back as
    UnusableText with their row. UnusableText for the whole file when it is not a regular file, is
    larger than `limits.max_file_bytes` on disk or holds more text than that, is corrupt, or has no
    string column `field`."""
    with _open_regular(path) as raw:  # a FIFO or a device is refused here, before `datasets` opens the path
        if os.fstat(raw.fileno()).st_size > limits.max_file_bytes:
            raise _too_large(limits.max_file_bytes, "--max-file-mb", decompressed=False, what="file")
    if "::" in str(path):  # fsspec, under `datasets`, splits "a::b" as a chained URL and finds no file
        raise UnusableText("its path holds '::', which datasets reads as a chained URL; rename it")
    import datasets  # here, not at the top: it takes about a second to import, and only tables need it

    docs: list[Document] = []
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
                cap = _mib(limits.max_file_bytes)
                raise UnusableText(f"holds more than {cap} MiB of text (--max-file-mb {cap}); "
                                   "raise --max-file-mb to read it")
            if n_bytes > limits.max_doc_bytes:
                cap = _mib(limits.max_doc_bytes)
                reason = f"longer than {cap} MiB (--max-doc-mb {cap}); raise --max-doc-mb to read it"
                bad.append(UnusableText(reason, row=row))
                continue
            try:  # the row's UTF-8 bytes, checked as any document's (not UTF-8, binary, CRLF)
                text = decode_text(value.as_buffer().to_pybytes())
                docs.append(Document(f"{rel}#R{row}", path, _checked_text(text, min_chars)))
            except UnusableText as e:
                bad.append(UnusableText(e.reason, row=row))
    return docs, bad


def _table_rows(datasets: Any, path: Path, field: str, cache: str,
                limits_bytes: int) -> Iterator[tuple[int | None, Any]]:
    """(UTF-8 bytes or None for a null, Arrow scalar) of each row's `field` in a .parquet / .arrow file,
    a record batch at a time. A row is measured from its Arrow buffer, never copied into a Python
    string first, so an over-long one costs no more memory than its batch already holds. UnusableText
    when `datasets` cannot read the file or it has no string column `field`: anything `datasets` (or
    pyarrow under it) raises means the file is unusable, not that tokq is broken, so each call into it
    is guarded, and nothing else is."""
    builder = TABLE_EXTENSIONS[_extension(path)]
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
        cap = _mib(max_bytes)
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
