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
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokq.errors import DataError

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
) -> DocumentSet:
    """Read every accepted file under `folder` (recursively, sorted), or the single file `folder`.

    Raises DataError when the path is missing, holds no files, or yields no usable document,
    and (with `strict`) at the first file or line that would otherwise be skipped.
    """
    root = Path(folder)
    if not root.exists():
        raise DataError(f"{root}: no such file or folder; pass a folder of {ACCEPTED_HINT}")

    if root.is_file():
        if _extension(root) not in _ACCEPTED_WITH_GZ:
            raise DataError(f"{root}: not a document file; accepted are {ACCEPTED_HINT}")
        files, ignored, walk_errors = [(root.name, root)], [], []
    else:
        files, ignored, walk_errors = _list_files(root)
        if not files and not ignored and not walk_errors:
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

    for error in walk_errors:
        skip(Path(error.filename or root), f"unreadable folder ({error.strerror or error})")
    for rel, path in files:
        try:
            text = _read_text(path)
        except UnusableText as e:
            skip(path, e.reason)
            continue
        if _extension(path).startswith(JSONL_EXTENSION):
            docs, bad_lines = _jsonl_documents(rel, path, text, jsonl_field, min_chars)
            for bad in bad_lines:
                skip(path, bad.reason, bad.line)
            if not docs and not bad_lines:
                skip(path, "empty (no JSON lines)")
        else:
            try:
                docs = [Document(rel, path, _checked_text(text, min_chars))]
            except UnusableText as e:
                skip(path, e.reason)
                continue
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


def _list_files(root: Path) -> tuple[list[tuple[str, Path]], list[Path], list[OSError]]:
    """(relative posix path, path) of accepted files, the ignored ones (both sorted), and the
    errors from folders that could not be listed."""
    accepted: list[tuple[str, Path]] = []
    ignored: list[Path] = []
    errors: list[OSError] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=errors.append):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
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
    return accepted, ignored, errors


def _read_text(path: Path) -> str:
    """The file's text (gunzipped when `.gz`), or UnusableText saying why it is not usable text."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UnusableText(f"unreadable ({e.strerror or e})") from e
    if path.suffix.lower() == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise UnusableText(f"corrupt gzip ({e}); re-compress it or store it uncompressed") from e
    return decode_text(data)


def decode_text(data: bytes) -> str:
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


def _jsonl_documents(
    rel: str, path: Path, text: str, jsonl_field: str, min_chars: int
) -> tuple[list[Document], list[UnusableText]]:
    """One document per non-blank line; bad lines come back as UnusableText with their line number."""
    docs: list[Document] = []
    bad: list[UnusableText] = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            bad.append(UnusableText(f"invalid JSON ({e.msg} at column {e.colno})", n))
            continue
        value = record.get(jsonl_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            keys = ", ".join(sorted(record)[:5]) if isinstance(record, dict) else type(record).__name__
            bad.append(UnusableText(f"no string field {jsonl_field!r} (has: {keys or 'nothing'})", n))
            continue
        try:
            docs.append(Document(f"{rel}#L{n}", path, _checked_text(value.replace("\r\n", "\n"), min_chars)))
        except UnusableText as e:
            bad.append(UnusableText(e.reason, n))
    return docs, bad
