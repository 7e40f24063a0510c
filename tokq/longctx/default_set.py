"""Assemble the default long-document set from licence-clean text already on this machine: the sources
are in `default_sources`, each source's eligible files and their text in `source_files`.

Selection is by characters, never tokens, so one set serves every model and its content hash
can key caches across models. Defaults and why:

- `min_chars=12_000` (about 3K tokens): shorter files add little long-range context.
- `max_chars=160_000` (about 40K tokens): enough to fill a 32K-token window from one document;
  a longer document is cut at a paragraph break below it (the manifest says so), so a few huge
  files cannot dominate the set.
- `max_documents=100`, handed out round-robin over the sources up to each source's own cap:
  with every package installed that is 30 each from the three big sources plus the eligible
  policy/GNU texts (about 5.3 MB, 1.4M Gemma-3 tokens); with CPython alone, its cap of 60 modules.
- Within a source the eligible files are sorted by length and picked at evenly spaced ranks,
  so the set spans short to long documents instead of only the longest; but first every file of
  `LONG_CHARS` (120K, about 30K tokens) or more is taken, up to a third of the source's slots, so the
  set holds as many documents as the machine has that fill a 32K-token window on their own (with
  every package installed: 15 such files from all five sources, each 33K-54K Gemma-3 tokens, where an
  even spread alone took 6; CPython alone: 3).

Output: `<out_dir>/<source>/<relative path>.txt` (plain UTF-8), `MANIFEST.json` (the record:
source, version, licence, original path, chars, tokens, sha256 per document) and
`MANIFEST.tsv` (the same, for people), written atomically. Two builds on the same machine with
the same arguments produce byte-identical manifests: no timestamps, sorted everything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tokq
from tokq.errors import DataError
from tokq.outputs import DOCUMENT_SET, check_replaceable
from tokq.paths import atomic_directory

from .default_sources import SourceSpec, default_sources
from .documents import Document, load_documents
from .source_files import Candidate, eligible_files
from .text_encoding import TextEncoder

MANIFEST_FORMAT = "tokq-default-set/1"
DEFAULT_MAX_DOCUMENTS = 100
DEFAULT_MIN_CHARS = 12_000
DEFAULT_MAX_CHARS = 160_000
LONG_DOCUMENT_TOKENS = 8192  # reported separately: documents that outgrow an 8K context
# Files this long are taken before the evenly spaced picks (up to LONG_SHARE of a source's slots): each
# fills a 32K-token window alone, which long-context checks need and an even spread would mostly skip.
LONG_CHARS = 120_000
LONG_SHARE = 1 / 3


@dataclass
class SourceSummary:
    name: str
    package: str
    version: str | None
    root: str
    n_documents: int = 0
    chars: int = 0
    tokens: int | None = None
    licences: list[str] = field(default_factory=list)


@dataclass
class DefaultSetSummary:
    """What `build_default_set` wrote (or what an existing set's manifest says)."""

    out_dir: Path
    n_documents: int
    total_chars: int
    total_tokens: int | None
    n_long_documents: int | None  # documents over LONG_DOCUMENT_TOKENS tokens; None if not counted
    content_hash: str
    tokenizer: str | None
    sources: list[SourceSummary]
    unavailable: list[tuple[str, str]] = field(default_factory=list)  # (source, why)

    def summary(self) -> str:
        tokens = f", {self.total_tokens:,} tokens" if self.total_tokens is not None else ""
        lines = [f"{self.out_dir}: {self.n_documents} documents, {self.total_chars:,} chars{tokens}"]
        for s in self.sources:
            tok = f", {s.tokens:,} tokens" if s.tokens is not None else ""
            version = f" {s.version}" if s.version else ""
            lines.append(
                f"  {s.name} ({s.package}{version}; {', '.join(s.licences)}): "
                f"{s.n_documents} documents, {s.chars:,} chars{tok}"
            )
        if self.n_long_documents is not None:
            lines.append(
                f"  {self.n_long_documents} documents over {LONG_DOCUMENT_TOKENS:,} tokens ({self.tokenizer})"
            )
        for name, why in self.unavailable:
            lines.append(f"  {name}: not used ({why})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["out_dir"] = str(self.out_dir)
        data["unavailable"] = [{"source": n, "reason": r} for n, r in self.unavailable]
        return data


def build_default_set(
    out_dir: str | os.PathLike[str],
    encoder: TextEncoder | None = None,
    max_documents: int = DEFAULT_MAX_DOCUMENTS,
    min_chars: int = DEFAULT_MIN_CHARS,
    max_chars: int = DEFAULT_MAX_CHARS,
    sources: Sequence[SourceSpec] | None = None,
    tokenizer_name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> DefaultSetSummary:
    """Select documents from `sources` (default: `default_sources()`), write them and the
    manifest into `out_dir` atomically, and return what was written. `encoder`, when given,
    counts tokens per document (recorded, never used to select)."""
    if max_documents < 1 or min_chars < 1 or max_chars < min_chars:
        raise ValueError("need max_documents >= 1 and 1 <= min_chars <= max_chars")
    out_dir = Path(out_dir)
    check_replaceable(out_dir, DOCUMENT_SET)  # --force replaces only a set tokq built: refused before the scan
    specs = default_sources() if sources is None else list(sources)
    say = progress or (lambda _msg: None)

    eligible: dict[str, list[Candidate]] = {}
    unavailable: list[tuple[str, str]] = []
    for spec in specs:
        if not spec.root.is_dir():
            unavailable.append((spec.name, f"{spec.root} not found; install {spec.package} to add it"))
            continue
        say(f"scanning {spec.name} ({spec.root})")
        found = eligible_files(spec, min_chars, max_chars)
        if found:
            eligible[spec.name] = found
        else:
            unavailable.append((spec.name, f"no file in {spec.root} has {min_chars:,}+ chars"))

    slots = _allocate(
        {s.name: min(s.max_documents, len(eligible.get(s.name, []))) for s in specs}, max_documents
    )
    chosen = [c for s in specs if s.name in eligible for c in _spread(eligible[s.name], slots[s.name])]
    if not chosen:
        raise DataError(
            f"{out_dir}: found no source documents ({'; '.join(why for _, why in unavailable)}); "
            "check that the Python standard library sources are installed"
        )

    tokens: dict[str, int] = {}
    if encoder is not None:
        tokenizer_name = tokenizer_name or getattr(encoder, "name", None) or type(encoder).__name__
        say(f"counting tokens in {len(chosen)} documents")
        tokens = {c.out_rel: len(encoder.encode(c.text)) for c in chosen}

    say(f"writing {len(chosen)} documents to {out_dir}")
    with atomic_directory(out_dir, DOCUMENT_SET, "tokq data build-default") as tmp:
        for c in chosen:
            path = tmp / c.out_rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(c.text, encoding="utf-8", newline="\n")
        # Reading the set back proves it loads cleanly and gives the hash that compare will see.
        loaded = load_documents(tmp, strict=True)
        if len(loaded) != len(chosen):
            raise RuntimeError(f"default set wrote {len(chosen)} documents but reads back {len(loaded)}")
        by_id = {d.doc_id: d for d in loaded}
        manifest = _manifest(
            chosen,
            by_id,
            tokens=tokens,
            tokenizer=tokenizer_name,
            unavailable=unavailable,
            content_hash=loaded.content_hash(),
            selection={"max_documents": max_documents, "min_chars": min_chars, "max_chars": max_chars},
        )
        (tmp / "MANIFEST.json").write_text(
            json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        (tmp / "MANIFEST.tsv").write_text(_manifest_tsv(manifest), encoding="utf-8")
    return summary_from_manifest(out_dir, manifest)


def read_default_set(out_dir: str | os.PathLike[str]) -> DefaultSetSummary:
    """The summary of a set built earlier, from its MANIFEST.json."""
    path = Path(out_dir) / "MANIFEST.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read the default-set manifest ({e}); rebuild it with --force") from e
    if manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path}: not a {MANIFEST_FORMAT} manifest; rebuild it with --force")
    return summary_from_manifest(Path(out_dir), manifest)


def summary_from_manifest(out_dir: Path, manifest: dict[str, Any]) -> DefaultSetSummary:
    docs = manifest["documents"]
    counted = manifest["tokenizer"] is not None and all(d["tokens"] is not None for d in docs)
    sources = []
    for src in manifest["sources"]:
        mine = [d for d in docs if d["source"] == src["name"]]
        sources.append(
            SourceSummary(
                name=src["name"],
                package=src["package"],
                version=src["version"],
                root=src["root"],
                n_documents=len(mine),
                chars=sum(d["chars"] for d in mine),
                tokens=sum(d["tokens"] for d in mine) if counted else None,
                licences=sorted({d["licence"] for d in mine}),
            )
        )
    return DefaultSetSummary(
        out_dir=out_dir,
        n_documents=len(docs),
        total_chars=sum(d["chars"] for d in docs),
        total_tokens=sum(d["tokens"] for d in docs) if counted else None,
        n_long_documents=sum(d["tokens"] > LONG_DOCUMENT_TOKENS for d in docs) if counted else None,
        content_hash=manifest["content_hash"],
        tokenizer=manifest["tokenizer"],
        sources=sources,
        unavailable=[(u["source"], u["reason"]) for u in manifest["unavailable"]],
    )


def _manifest(
    chosen: list[Candidate],
    loaded: dict[str, Document],
    *,
    tokens: dict[str, int],
    tokenizer: str | None,
    unavailable: list[tuple[str, str]],
    content_hash: str,
    selection: dict[str, int],
) -> dict[str, Any]:
    specs = {c.spec.name: c.spec for c in chosen}
    return {
        "format": MANIFEST_FORMAT,
        "tokq_version": tokq.__version__,
        "content_hash": content_hash,
        "tokenizer": tokenizer if tokens else None,
        "selection": selection,
        "sources": [
            {
                "name": s.name,
                "package": s.package,
                "version": s.version,
                "root": str(s.root),
                "licence": s.licence,
            }
            for s in specs.values()
        ],
        "unavailable": [{"source": n, "reason": r} for n, r in unavailable],
        "documents": [
            {
                "path": c.out_rel,
                "source": c.spec.name,
                "package": c.spec.package,
                "version": c.spec.version,
                "licence": c.licence,
                "original_path": str(c.spec.root / c.rel),
                "chars": len(c.text),
                "truncated_from_chars": c.original_chars if c.original_chars != len(c.text) else None,
                "tokens": tokens.get(c.out_rel),
                "sha256": loaded[c.out_rel].sha256,
            }
            for c in chosen
        ],
    }


_TSV_COLUMNS = (
    "path",
    "source",
    "package",
    "version",
    "licence",
    "chars",
    "tokens",
    "sha256",
    "original_path",
)


def _manifest_tsv(manifest: dict[str, Any]) -> str:
    def cell(value: Any) -> str:
        return "" if value is None else str(value).replace("\t", " ")

    rows = ["\t".join(_TSV_COLUMNS)]
    rows += ["\t".join(cell(d[c]) for c in _TSV_COLUMNS) for d in manifest["documents"]]
    return "\n".join(rows) + "\n"


def _allocate(caps: dict[str, int], total: int) -> dict[str, int]:
    """Hand out `total` slots one at a time, round-robin in source order, up to each cap."""
    slots = dict.fromkeys(caps, 0)
    remaining = total
    while remaining > 0:
        progressed = False
        for name, cap in caps.items():
            if remaining and slots[name] < cap:
                slots[name] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            break
    return slots


def _spread(items: list[Candidate], k: int, long_chars: int = LONG_CHARS) -> list[Candidate]:
    """`k` items of the length-sorted list, in path order: its longest items of `long_chars` or more (up to a
    third of `k`), then the rest at evenly spaced ranks of what remains, both ends included."""
    n = len(items)
    if k >= n:
        return sorted(items, key=lambda c: c.rel)
    n_long = min(int(k * LONG_SHARE), sum(1 for c in items if len(c.text) >= long_chars))
    picked = items[n - n_long:]
    rest, k = items[: n - n_long], k - n_long
    if k == 1:
        picked.append(rest[-1])
    elif k > 1:
        picked += [rest[round(i * (len(rest) - 1) / (k - 1))] for i in range(k)]
    return sorted(picked, key=lambda c: c.rel)
