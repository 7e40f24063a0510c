"""A source's eligible files and their text: which files of a `SourceSpec` are long enough to join the default
set, their plain text (gunzipped, HTML converted, tidied, cut at a paragraph break below `max_chars`), the
name each gets in the set and the licence each is under."""

from __future__ import annotations

import fnmatch
import gzip
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from .default_sources import SourceSpec
from .html_text import html_to_text, without_tags
from .readers import UnusableText, decode_text


@dataclass(frozen=True)
class Candidate:
    """A source file that passed the filters, with its converted text."""

    spec: SourceSpec
    rel: str  # relative posix path under spec.root
    text: str
    original_chars: int  # before truncation to max_chars
    licence: str

    @property
    def out_rel(self) -> str:
        return f"{self.spec.name}/{output_name(self.rel)}"


def eligible_files(spec: SourceSpec, min_chars: int, max_chars: int) -> list[Candidate]:
    """The source's usable files with at least `min_chars` chars, sorted by (length, path)."""
    seen_out: set[str] = set()
    found: list[Candidate] = []
    for rel in _matching_files(spec):
        path = spec.root / rel
        try:
            # Text is never longer than its (uncompressed) bytes: skip short files unread.
            if _uncompressed_size(path) < min_chars:
                continue
            text = _source_text(path, min_chars)
        except (UnusableText, OSError):
            continue  # a source package file we cannot read is simply not chosen
        text = _tidy(text)
        if len(text) < min_chars or output_name(rel) in seen_out:
            continue
        seen_out.add(output_name(rel))
        found.append(
            Candidate(spec, rel, _truncate(text, max_chars, min_chars), len(text), _licence(spec, rel, text))
        )
    found.sort(key=lambda c: (len(c.text), c.rel))
    return found


def _matching_files(spec: SourceSpec) -> list[str]:
    rels = set()
    for pattern in spec.patterns:
        for path in spec.root.glob(pattern):
            rel = path.relative_to(spec.root).as_posix()
            if path.is_file() and not any(fnmatch.fnmatchcase(rel, ex) for ex in spec.exclude):
                rels.add(rel)
    return sorted(rels)


def _licence(spec: SourceSpec, rel: str, text: str) -> str:
    if spec.spdx_licence:
        head = "\n".join(text.split("\n", 5)[:5])
        m = re.search(r"SPDX-License-Identifier:\s*(.+?)\s*(?:\*/|-->)?\s*$", head, re.M)
        if m:
            return m.group(1)
    for pattern, licence in spec.licence_rules:
        if fnmatch.fnmatchcase(rel, pattern):
            return licence
    return spec.licence


def output_name(rel: str) -> str:
    """`a/b.rst.gz` -> `a/b.rst.txt`, `a/b.html` -> `a/b.txt`, `a/b.py` -> `a/b.py.txt`."""
    if rel.endswith(".gz"):
        rel = rel[: -len(".gz")]
    if rel.endswith((".html", ".htm")):
        rel = rel.rsplit(".", 1)[0]
    return rel if rel.endswith(".txt") else rel + ".txt"


def _uncompressed_size(path: Path) -> int:
    """File size in bytes; for gzip, the size stored in its trailer (mod 2**32, fine here)."""
    size = path.stat().st_size
    if path.suffix == ".gz" and size >= 4:
        with path.open("rb") as f:
            f.seek(-4, os.SEEK_END)
            return struct.unpack("<I", f.read(4))[0]
    return size


def _source_text(path: Path, min_chars: int = 0) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise UnusableText(f"corrupt gzip ({e})") from e
    text = decode_text(data)
    inner = path.name[: -len(".gz")] if path.suffix == ".gz" else path.name
    if not inner.endswith((".html", ".htm")):
        return text
    # Parsing HTML is the slow step; a page whose text without tags is already short is
    # returned empty, to be dropped by the min_chars filter (tags only ever add length).
    if len(without_tags(text)) < min_chars:
        return ""
    return html_to_text(text)


def _tidy(text: str) -> str:
    """Trailing spaces off, at most two blank lines in a row, one final newline."""
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n") + "\n"


def _truncate(text: str, max_chars: int, min_chars: int) -> str:
    """Cut at the last paragraph break (else line break) at or before `max_chars`, keeping at
    least `min_chars` and half of `max_chars`; a hard cut only if there is no such break."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    floor = max(min_chars, max_chars // 2)
    for sep in ("\n\n", "\n"):
        cut = head.rfind(sep)
        if cut >= floor:
            return head[:cut].rstrip("\n") + "\n"
    return head
