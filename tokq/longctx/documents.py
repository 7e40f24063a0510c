"""Load a folder of the user's documents into memory, skipping (or rejecting) files it cannot use.

Accepted files: `.txt`, `.md`, `.rst` (one document each) and `.jsonl` (one document per line, a
JSON object whose text lives under `jsonl_field`), each also gzip-compressed as `<name>.<ext>.gz`.
Other extensions are ignored (and counted); hidden files and folders (`.git`, `.DS_Store`) are
not looked at. Order is the sorted relative path, so the same folder always gives the same set.

A file that looks like it should be a document but cannot be used (unreadable, binary, not
UTF-8, corrupt gzip, bad JSON line, empty, too short) is skipped with a warning on the
`tokq` logger and listed in `DocumentSet.skipped`; `strict=True` turns the first one into a
`DataError` instead. Text is decoded as UTF-8 (a BOM is dropped) and CRLF line ends become LF,
so a document hashes the same on every platform.

A data folder is untrusted input, so reading is bounded (`ReadLimits`): only regular files are
opened (a FIFO, socket, device, or a link to one such as `x.txt -> /dev/zero`, is skipped: a
FIFO would block forever, a device never ends); links to folders are not followed (a loop would
never end); a document larger than `max_doc_bytes` (`--max-doc-mb`, default 64 MiB: a text file
after decompression, or one .jsonl line) and a file larger than `max_file_bytes` (`--max-file-mb`,
default 1024 MiB after decompression: bounds a .jsonl file and a gzip bomb) are skipped after
reading at most one byte past the cap. A .jsonl file is read line by line, so a bad line (invalid
UTF-8, invalid JSON, a lone surrogate escape such as `"\ud800"`) skips only that line.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import logging
import math
import os
import re
import stat
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
ACCEPTED_EXTENSIONS = (*TEXT_EXTENSIONS, JSONL_EXTENSION)
ACCEPTED_HINT = ".txt, .md, .rst or .jsonl files (each optionally .gz)"

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
                   "bomb stops) or one .jsonl line.")
MAX_FILE_MB_HELP = "Skip a file holding more than this many MiB after decompression (a whole .jsonl file)."
# Decompressed bytes read at a time while skipping the rest of an over-long .jsonl line.
_SKIP_CHUNK = 1 << 20


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
    for a line of a .jsonl file); `sha256` is of the UTF-8 text, so it identifies the content."""

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
    """A file (or one line of a .jsonl file, when `line` is set) that was not used, and why."""

    path: Path
    reason: str
    line: int | None = None

    @property
    def name(self) -> str:
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
            "skipped": [{"path": str(s.path), "line": s.line, "reason": s.reason} for s in self.skipped],
            "ignored": [str(p) for p in self.ignored],
        }


class UnusableText(Exception):
    """Raised by `decode_text` (and internally) for input that is not usable text; `load_documents`
    turns it into a skipped file, or a DataError when strict."""

    def __init__(self, reason: str, line: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.line = line


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

    def skip(path: Path, reason: str, line: int | None = None) -> None:
        entry = SkippedFile(path, reason, line)
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
            else:
                docs, bad_lines = [Document(rel, path, _checked_text(_read_text(path, limits), min_chars))], []
        except UnusableText as e:
            skip(path, e.reason)
            continue
        for bad in bad_lines:
            skip(path, bad.reason, bad.line)
        if not docs and not bad_lines and _extension(path).startswith(JSONL_EXTENSION):
            skip(path, "empty (no JSON lines)")
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


_ACCEPTED_WITH_GZ = frozenset((*ACCEPTED_EXTENSIONS, *(e + ".gz" for e in ACCEPTED_EXTENSIONS)))


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
