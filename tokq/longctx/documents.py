"""Load a folder of the user's documents into memory, skipping (or rejecting) files it cannot use.

Accepted files: `.txt`, `.md`, `.rst` (one document each) and `.jsonl` (one document per line, a
JSON object whose text lives under `jsonl_field`), each also gzip-compressed as `<name>.<ext>.gz`
(`readers`); and `.parquet` and `.arrow` tables, one document per row with its text in the string
column `jsonl_field` (`tables`). Other extensions are ignored (and counted); hidden files and folders
(`.git`, `.DS_Store`) are not looked at. Order is the sorted relative path, so the same folder always
gives the same set.

A file that looks like it should be a document but cannot be used (unreadable, binary, not
UTF-8, corrupt gzip, bad JSON line, a corrupt table or one without a string column
`jsonl_field`, empty, too short) is skipped with a warning on the `tokq` logger and listed in
`DocumentSet.skipped`; `strict=True` turns the first one into a `DataError` instead.

A data folder is untrusted input, so reading is bounded (`read_limits.ReadLimits`): links to folders
are not followed (a loop would never end), only regular files are read, and a document or file past its
cap is skipped after reading at most one byte past it (`readers`, `tables`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokq.errors import DataError

from .read_limits import ReadLimits
from .readers import (
    JSONL_EXTENSION,
    TEXT_EXTENSIONS,
    UnusableText,
    checked_text,
    extension,
    read_jsonl,
    read_text,
)
from .tables import TABLE_EXTENSIONS, read_table

logger = logging.getLogger("tokq")

ACCEPTED_EXTENSIONS = (*TEXT_EXTENSIONS, JSONL_EXTENSION, *TABLE_EXTENSIONS)
ACCEPTED_HINT = ".txt, .md, .rst or .jsonl files (each optionally .gz), or .parquet / .arrow tables"
_GZIPPABLE = (*TEXT_EXTENSIONS, JSONL_EXTENSION)
_ACCEPTED_WITH_GZ = frozenset((*ACCEPTED_EXTENSIONS, *(e + ".gz" for e in _GZIPPABLE)))
# Warnings beyond this many are summarised in one line, so a broken .jsonl does not flood the log.
MAX_LOGGED_SKIPS = 20


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
            counts = Counter(extension(p) or "(none)" for p in self.ignored)
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
        if extension(root) not in _ACCEPTED_WITH_GZ:
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
            if extension(path).startswith(JSONL_EXTENSION):
                texts, bad_lines = read_jsonl(path, jsonl_field, min_chars, limits)
                docs = [Document(f"{rel}#L{n}", path, text) for n, text in texts]
            elif extension(path) in TABLE_EXTENSIONS:
                texts, bad_lines = read_table(path, jsonl_field, min_chars, limits)
                docs = [Document(f"{rel}#R{row}", path, text) for row, text in texts]
            else:
                docs, bad_lines = [Document(rel, path, checked_text(read_text(path, limits), min_chars))], []
        except UnusableText as e:
            skip(path, e.reason)
            continue
        for bad in bad_lines:
            skip(path, bad.reason, bad.line, bad.row)
        if not docs and not bad_lines and extension(path).startswith(JSONL_EXTENSION):
            skip(path, "empty (no JSON lines)")
        if not docs and not bad_lines and extension(path) in TABLE_EXTENSIONS:
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


MAX_FOLDER_DEPTH = 64  # folders below the root walked; deeper ones are reported, not read


def _walk(root: Path, errors: list[OSError], too_deep: list[SkippedFile]):
    """os.walk's (dirpath, dirnames, filenames) top-down, with an explicit stack instead of recursion (1500 nested
    folders raised RecursionError) and folders deeper than MAX_FOLDER_DEPTH reported in `too_deep`."""
    stack = [(os.fspath(root), 0)]
    while stack:
        dirpath, depth = stack.pop()
        try:
            with os.scandir(dirpath) as entries:
                listed = list(entries)
        except OSError as exc:
            errors.append(exc)
            continue
        dirnames, filenames = [], []
        for entry in listed:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            (dirnames if is_dir else filenames).append(entry.name)
        yield dirpath, dirnames, filenames  # the caller may prune dirnames, as with os.walk
        for name in reversed(dirnames):
            if depth + 1 > MAX_FOLDER_DEPTH:
                too_deep.append(SkippedFile(Path(dirpath) / name, f"folder deeper than {MAX_FOLDER_DEPTH} levels "
                                            "below the data folder (not read): move its files up"))
                continue
            stack.append((os.path.join(dirpath, name), depth + 1))


def _list_files(root: Path) -> tuple[list[tuple[str, Path]], list[Path], list[SkippedFile]]:
    """(relative posix path, path) of accepted files, the ignored ones (both sorted), and the
    folders not walked: unlistable ones, too deep ones, and links to folders (never followed, so a link loop
    such as `sub -> ..` cannot make the walk endless)."""
    accepted: list[tuple[str, Path]] = []
    ignored: list[Path] = []
    errors: list[OSError] = []
    links: list[SkippedFile] = []
    too_deep: list[SkippedFile] = []
    for dirpath, dirnames, filenames in _walk(root, errors, too_deep):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            dirnames.remove(name)
            links.append(SkippedFile(Path(dirpath) / name, "symlink to a folder (not followed, so a link loop "
                                     "cannot recurse; pass the target folder, or copy its files in)"))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            if extension(path) in _ACCEPTED_WITH_GZ:
                accepted.append((path.relative_to(root).as_posix(), path))
            else:
                ignored.append(path)
    accepted.sort(key=lambda item: item[0])
    ignored.sort()
    unreadable = [SkippedFile(Path(e.filename or root), f"unreadable folder ({e.strerror or e})") for e in errors]
    return accepted, ignored, unreadable + sorted(links + too_deep, key=lambda s: s.path)

