"""Assemble the default long-document set from licence-clean text already on this machine.

Sources, in order (each used only where present):

- `cpython-stdlib`: the running interpreter's standard library sources (PSF-2.0); tests,
  site-packages and generated data tables are left out. Present on every machine, so the set
  is never empty.
- `python-doc`: the `python3.X-doc` Debian package's HTML manual for the running version
  (PSF-2.0; code examples also 0BSD), converted to plain text (Sphinx main body only).
- `linux-doc`: the `linux-doc-<version>` Debian package's kernel `Documentation/` (GPL-2.0;
  a file's own `SPDX-License-Identifier` line overrides that). Translations (duplicates of
  English pages) and the media uAPI tree (mostly tables) are left out.
- `debian-policy`: the Debian Policy Manual and companion texts (GPL-2.0-or-later; the FHS,
  the debconf spec (BSD-3-Clause) and copyright-format under their own notices, as the
  package's copyright file says).
- `gnu-standards`: the GNU Coding Standards and Information for Maintainers
  (GFDL-1.3-no-invariants-or-later).

Licences are SPDX identifiers where one exists, else `LicenseRef-<name>`.

Selection is by characters, never tokens, so one set serves every model and its content hash
can key caches across models. Defaults and why:

- `min_chars=12_000` (about 3K tokens): shorter files add little long-range context.
- `max_chars=160_000` (about 40K tokens): enough to fill a 32K-token window from one document;
  a longer document is cut at a paragraph break below it (the manifest says so), so a few huge
  files cannot dominate the set.
- `max_documents=100`, handed out round-robin over the sources up to each source's own cap:
  with every package installed that is 30 each from the three big sources plus the eligible
  policy/GNU texts (about 4 MB, 1M tokens); with CPython alone, its cap of 60 modules.
- Within a source the eligible files are sorted by length and picked at evenly spaced ranks,
  so the set spans short to long documents instead of only the longest.

Output: `<out_dir>/<source>/<relative path>.txt` (plain UTF-8), `MANIFEST.json` (the record:
source, version, licence, original path, chars, tokens, sha256 per document) and
`MANIFEST.tsv` (the same, for people), written atomically. Two builds on the same machine with
the same arguments produce byte-identical manifests: no timestamps, sorted everything.
"""

from __future__ import annotations

import fnmatch
import gzip
import json
import os
import platform
import re
import struct
import sys
import sysconfig
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import tokq
from tokq.errors import DataError
from tokq.outputs import DOCUMENT_SET, check_replaceable
from tokq.paths import atomic_directory

from .documents import Document, UnusableText, decode_text, load_documents
from .windows import TextEncoder

MANIFEST_FORMAT = "tokq-default-set/1"
DEFAULT_MAX_DOCUMENTS = 100
DEFAULT_MIN_CHARS = 12_000
DEFAULT_MAX_CHARS = 160_000
LONG_DOCUMENT_TOKENS = 8192  # reported separately: documents that outgrow an 8K context

DPKG_STATUS = Path("/var/lib/dpkg/status")
DEBIAN_DOC = Path("/usr/share/doc")


@dataclass(frozen=True)
class SourceSpec:
    """Where one source's files are, which of them to consider, and under what licence.

    `patterns` are `Path.glob` patterns under `root`; `exclude` are fnmatch patterns on the
    relative posix path. `licence_rules` are (fnmatch pattern, licence) pairs, first match
    wins, else `licence`; with `spdx_licence` a `SPDX-License-Identifier:` line in a file's
    first lines overrides both. `max_documents` caps what this source contributes.
    """

    name: str
    package: str
    root: Path
    patterns: tuple[str, ...]
    licence: str
    version: str | None = None
    exclude: tuple[str, ...] = ()
    licence_rules: tuple[tuple[str, str], ...] = ()
    spdx_licence: bool = False
    max_documents: int = 40


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
        return f"{self.spec.name}/{_output_name(self.rel)}"


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


# ---------------------------------------------------------------------------------------------
# The sources this machine has


def default_sources() -> list[SourceSpec]:
    """The source specs for this machine, in a fixed order (missing roots are reported, not fatal)."""
    versions = _dpkg_versions()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    # The newest kernel's docs if several are installed (6.10 sorts after 6.9).
    linux_roots = sorted(
        DEBIAN_DOC.glob("linux-doc-*/Documentation"),
        key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.name)],
    )
    linux_root = linux_roots[-1] if linux_roots else DEBIAN_DOC / "linux-doc-6.1" / "Documentation"
    linux_pkg = linux_root.parent.name
    return [
        SourceSpec(
            name="cpython-stdlib",
            package="cpython",
            version=platform.python_version(),
            root=Path(sysconfig.get_paths()["stdlib"]),
            patterns=("**/*.py",),
            licence="PSF-2.0",
            # Tests are repetitive fixtures; encodings/, pydoc_data/ and the entity/stringprep
            # modules are generated tables, not prose or code a model is scored on.
            exclude=(
                "test/*",
                "*/test/*",
                "tests/*",
                "*/tests/*",
                "*/idle_test/*",
                "site-packages/*",
                "dist-packages/*",
                "*/__pycache__/*",
                "encodings/*",
                "pydoc_data/*",
                "html/entities.py",
                "stringprep.py",
                "config-*/*",
            ),
            max_documents=60,
        ),
        SourceSpec(
            name="python-doc",
            package=f"python{py}-doc",
            version=versions.get(f"python{py}-doc"),
            root=DEBIAN_DOC / f"python{py}" / "html",
            patterns=("**/*.html",),
            licence="PSF-2.0",  # code examples in it are also offered under 0BSD
            # Indexes, search, the changelog (a list of issue numbers) and licence texts.
            exclude=(
                "_sources/*",
                "_static/*",
                "_images/*",
                "_downloads/*",
                "genindex*",
                "py-modindex.html",
                "search.html",
                "contents.html",
                "whatsnew/changelog.html",
                "license.html",
                "copyright.html",
                "bugs.html",
                "about.html",
                "download.html",
            ),
        ),
        SourceSpec(
            name="linux-doc",
            package=linux_pkg,
            version=versions.get(linux_pkg),
            root=linux_root,
            patterns=("**/*.rst", "**/*.rst.gz", "**/*.txt", "**/*.txt.gz"),
            licence="GPL-2.0-only",
            exclude=("translations/*", "userspace-api/media/*", "ABI/*", "*/ABI/*"),
            spdx_licence=True,
        ),
        SourceSpec(
            name="debian-policy",
            package="debian-policy",
            version=versions.get("debian-policy"),
            root=DEBIAN_DOC / "debian-policy",
            patterns=("*.txt.gz", "fhs/*.txt.gz"),
            licence="GPL-2.0-or-later",
            licence_rules=(
                ("fhs/*", "LicenseRef-FHS"),  # copying and modified copies permitted with notice
                ("debconf_specification*", "BSD-3-Clause"),
                ("copyright-format*", "LicenseRef-preserve-notice"),
            ),
            exclude=("README*",),
            max_documents=10,
        ),
        SourceSpec(
            name="gnu-standards",
            package="gnu-standards",
            version=versions.get("gnu-standards"),
            root=DEBIAN_DOC / "gnu-standards",
            patterns=("*.text.gz",),
            licence="GFDL-1.3-no-invariants-or-later",
            max_documents=4,
        ),
    ]


def _dpkg_versions() -> dict[str, str]:
    """Installed Debian package versions, read from dpkg's status file ({} when not Debian)."""
    try:
        status = DPKG_STATUS.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    versions: dict[str, str] = {}
    for stanza in status.split("\n\n"):
        fields = dict(re.findall(r"^(Package|Version|Status): (.*)$", stanza, flags=re.M))
        if "Package" in fields and "Version" in fields and fields.get("Status", "").endswith(" installed"):
            versions[fields["Package"]] = fields["Version"]
    return versions


# ---------------------------------------------------------------------------------------------
# Building


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
        found = _eligible(spec, min_chars, max_chars)
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


# ---------------------------------------------------------------------------------------------
# Selection


def _eligible(spec: SourceSpec, min_chars: int, max_chars: int) -> list[Candidate]:
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
        if len(text) < min_chars or _output_name(rel) in seen_out:
            continue
        seen_out.add(_output_name(rel))
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


def _spread(items: list[Candidate], k: int) -> list[Candidate]:
    """`k` items at evenly spaced ranks of the length-sorted list, both ends included, in path order."""
    n = len(items)
    if k >= n:
        picked = list(items)
    elif k == 1:
        picked = [items[-1]]
    else:
        picked = [items[round(i * (n - 1) / (k - 1))] for i in range(k)]
    return sorted(picked, key=lambda c: c.rel)


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


def _output_name(rel: str) -> str:
    """`a/b.rst.gz` -> `a/b.rst.txt`, `a/b.html` -> `a/b.txt`, `a/b.py` -> `a/b.py.txt`."""
    if rel.endswith(".gz"):
        rel = rel[: -len(".gz")]
    if rel.endswith((".html", ".htm")):
        rel = rel.rsplit(".", 1)[0]
    return rel if rel.endswith(".txt") else rel + ".txt"


# ---------------------------------------------------------------------------------------------
# Reading and converting


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
    # returned as is, to be dropped by the min_chars filter (tags only ever add length).
    if len(_TAG.sub("", text)) < min_chars:
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


# Tags that end a line of text, tags whose content is never text, and void tags (no end tag).
_BLOCK_TAGS = frozenset(
    "p div section article aside h1 h2 h3 h4 h5 h6 li ul ol dl dt dd pre table tr blockquote br hr "
    "figure figcaption caption".split()
)
_SKIP_TAGS = frozenset("script style nav header footer head noscript template svg".split())
_SKIP_CLASSES = frozenset("headerlink sphinxsidebar related footer navigation".split())
_VOID_TAGS = frozenset("area base br col embed hr img input link meta source track wbr".split())


class _HTMLText(HTMLParser):
    """Plain text of an HTML page; with `main_only`, only inside the element with role="main"
    (Sphinx's page body), which leaves out navigation, sidebars and footers."""

    def __init__(self, main_only: bool):
        super().__init__(convert_charrefs=True)
        self.main_only = main_only
        self.stack: list[tuple[str, bool, bool]] = []  # open elements: (tag, skipped, role=main)
        self.n_skipped = self.n_main = self.n_pre = 0  # how many open elements are each kind
        self.parts: list[tuple[str, str]] = []  # (kind, value): kind is "text", "pre" or "break"

    def _count(self, entry: tuple[str, bool, bool], sign: int) -> None:
        tag, skipped, main = entry
        self.n_skipped += sign * skipped
        self.n_main += sign * main
        self.n_pre += sign * (tag == "pre")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in _BLOCK_TAGS:
            self.parts.append(("break", "\n\n" if tag in _PARAGRAPH_TAGS else "\n"))
        if tag in _VOID_TAGS:
            return
        skipped = tag in _SKIP_TAGS or bool(set((a.get("class") or "").split()) & _SKIP_CLASSES)
        entry = (tag, skipped, a.get("role") == "main")
        self.stack.append(entry)
        self._count(entry, +1)

    def handle_endtag(self, tag: str) -> None:
        # Pop to the matching tag; unclosed <p>/<li> inside it are closed implicitly.
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                for entry in self.stack[i:]:
                    self._count(entry, -1)
                del self.stack[i:]
                break
        if tag in _BLOCK_TAGS:
            self.parts.append(("break", "\n\n" if tag in _PARAGRAPH_TAGS else "\n"))

    def handle_data(self, data: str) -> None:
        if self.n_skipped or (self.main_only and not self.n_main):
            return
        self.parts.append(("pre", data) if self.n_pre else ("text", re.sub(r"\s+", " ", data)))

    def text(self) -> str:
        # Adjacent breaks (an </li><li>, or </p> then <h2>) merge into the largest of them;
        # flowing text loses the spaces around a break, <pre> text keeps its layout.
        out: list[str] = []
        pending = ""
        for kind, value in self.parts:
            if kind == "break":
                pending = max(pending, value, key=len)
                continue
            if pending and kind == "text":
                value = value.lstrip(" ")
                if not value:
                    continue
            if pending:
                out.append(pending)
                pending = ""
            out.append(value)
        return "".join(out)


_TAG = re.compile(r"<[^>]*>")
_PARAGRAPH_TAGS = frozenset("p pre section h1 h2 h3 h4 h5 h6 table blockquote".split())


def html_to_text(html: str) -> str:
    """Readable plain text of an HTML page (Sphinx pages: the main body only)."""
    text = ""
    for main_only in (True, False):
        parser = _HTMLText(main_only)
        parser.feed(html)
        parser.close()
        text = parser.text()
        if text.strip():
            break
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"
