"""longctx.default_set: deterministic, licence-recorded selection; atomic output; the CLI command."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokq.commands import data as data_cmd
from tokq.errors import DataError
from tokq.longctx import default_set
from tokq.longctx.default_set import build_default_set, read_default_set
from tokq.longctx.default_sources import SourceSpec, default_sources
from tokq.longctx.documents import load_documents
from tokq.longctx.html_text import html_to_text

MIN = 200  # min_chars used on the small trees below
MAX = 2_000


class WordEncoder:
    """One token per whitespace-separated word, ids from a stable hash: real and deterministic."""

    bos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [int(hashlib.md5(w.encode()).hexdigest()[:6], 16) for w in text.split()]


def prose(tag: str, n_chars: int) -> str:
    """Paragraphs of distinct words, about n_chars long."""
    out, i = [], 0
    while sum(map(len, out)) < n_chars:
        out.append(f"{tag} paragraph {i} says something about topic {i * 7 % 13}.\n\n")
        i += 1
    return "".join(out)


def write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


@pytest.fixture
def tree(tmp_path: Path) -> list[SourceSpec]:
    """Two small sources: 'code' (.py, with a test/ folder to exclude) and 'docs' (.rst.gz and
    .html, with SPDX headers and a file-specific licence rule)."""
    code = tmp_path / "src" / "code"
    for i, size in enumerate([100, 300, 500, 700, 900, 1100, 1300]):
        write(code / f"mod{i}.py", f'"""Module {i}."""\n' + prose(f"code{i}", size))
    write(code / "test" / "test_big.py", prose("test", 1500))  # excluded folder
    write(code / "pkg" / "huge.py", prose("huge", 5000))  # longer than MAX: truncated
    write(code / "broken.py", b"\xff\xfe binary \x00" * 50)  # unusable: never chosen

    docs = tmp_path / "src" / "docs"
    write(
        docs / "guide.rst.gz",
        gzip.compress(b".. SPDX-License-Identifier: (GPL-2.0 OR MIT)\n\n" + prose("guide", 600).encode()),
    )
    write(docs / "notes.rst", prose("notes", 400))
    write(docs / "special" / "policy.rst", prose("policy", 800))
    body = "".join(f"<p>Para {i} of the page &amp; more text here.</p>\n" for i in range(20))
    write(
        docs / "page.html",
        f"<html><body><div class='nav'>NAVIGATION</div><div role='main'>{body}</div></body></html>",
    )
    write(docs / "tiny.rst", "too short")
    return [
        SourceSpec(
            name="code",
            package="code-pkg",
            version="1.0",
            root=code,
            patterns=("**/*.py",),
            licence="PSF-2.0",
            exclude=("test/*", "*/test/*"),
            max_documents=4,
        ),
        SourceSpec(
            name="docs",
            package="docs-pkg",
            version=None,
            root=docs,
            patterns=("**/*.rst", "**/*.rst.gz", "**/*.html"),
            licence="GPL-2.0-only",
            licence_rules=(("special/*", "CC-BY-4.0"),),
            spdx_licence=True,
            max_documents=10,
        ),
        SourceSpec(
            name="absent",
            package="absent-doc",
            root=tmp_path / "src" / "nowhere",
            patterns=("*",),
            licence="MIT",
        ),
    ]


def build(out: Path, specs: list[SourceSpec], **kwargs):
    kwargs = {"min_chars": MIN, "max_chars": MAX, "max_documents": 50, **kwargs}
    return build_default_set(out, sources=specs, **kwargs)


def test_two_builds_give_identical_output(tree: list[SourceSpec], tmp_path: Path) -> None:
    a = build(tmp_path / "a", tree, encoder=WordEncoder(), tokenizer_name="words")
    b = build(tmp_path / "b", tree, encoder=WordEncoder(), tokenizer_name="words")
    assert (tmp_path / "a" / "MANIFEST.json").read_bytes() == (tmp_path / "b" / "MANIFEST.json").read_bytes()
    assert (tmp_path / "a" / "MANIFEST.tsv").read_bytes() == (tmp_path / "b" / "MANIFEST.tsv").read_bytes()
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files_a)
    assert a.content_hash == b.content_hash


def test_selection_and_manifest_records(tree: list[SourceSpec], tmp_path: Path) -> None:
    out = tmp_path / "set"
    summary = build(out, tree, encoder=WordEncoder(), tokenizer_name="words")
    manifest = json.loads((out / "MANIFEST.json").read_text())
    docs = {d["path"]: d for d in manifest["documents"]}

    # code: mod0 (too short), test/ (excluded) and broken.py (binary) never qualify; 6 eligible
    # files (mod1..mod6, pkg/huge) are spread by length down to the cap of 4, both ends kept.
    code = sorted(p for p in docs if p.startswith("code/"))
    assert code == ["code/mod1.py.txt", "code/mod3.py.txt", "code/mod5.py.txt", "code/pkg/huge.py.txt"]
    assert sorted(p for p in docs if p.startswith("docs/")) == [
        "docs/guide.rst.txt",
        "docs/notes.rst.txt",
        "docs/page.txt",
        "docs/special/policy.rst.txt",
    ]
    assert docs["docs/guide.rst.txt"]["licence"] == "(GPL-2.0 OR MIT)"  # from the SPDX line
    assert docs["docs/special/policy.rst.txt"]["licence"] == "CC-BY-4.0"  # from the rule
    assert docs["docs/notes.rst.txt"]["licence"] == "GPL-2.0-only"  # the source's default
    assert docs["code/mod1.py.txt"]["version"] == "1.0" and docs["code/mod1.py.txt"]["package"] == "code-pkg"
    assert docs["docs/guide.rst.txt"]["original_path"] == str(tree[1].root / "guide.rst.gz")

    huge = docs["code/pkg/huge.py.txt"]
    assert huge["chars"] <= MAX and huge["truncated_from_chars"] > MAX
    assert (out / "code/pkg/huge.py.txt").read_text().endswith(".\n")  # cut at a paragraph break
    assert docs["code/mod1.py.txt"]["truncated_from_chars"] is None

    for path, entry in docs.items():
        text = (out / path).read_text(encoding="utf-8")
        assert entry["chars"] == len(text)
        assert entry["sha256"] == hashlib.sha256(text.encode()).hexdigest()
        assert entry["tokens"] == len(WordEncoder().encode(text))
    assert manifest["tokenizer"] == "words"
    assert manifest["content_hash"] == load_documents(out).content_hash() == summary.content_hash

    page = (out / "docs/page.txt").read_text()
    assert "NAVIGATION" not in page and "Para 3 of the page & more text here." in page

    tsv = (out / "MANIFEST.tsv").read_text().splitlines()
    assert tsv[0].split("\t")[:5] == ["path", "source", "package", "version", "licence"]
    assert len(tsv) == 1 + len(docs)

    assert summary.n_documents == 8
    assert summary.total_tokens == sum(d["tokens"] for d in docs.values())
    assert [(s.name, s.n_documents) for s in summary.sources] == [("code", 4), ("docs", 4)]
    assert summary.unavailable[0][0] == "absent" and "install absent-doc" in summary.unavailable[0][1]
    text = summary.summary()
    assert "8 documents" in text and "code (code-pkg 1.0; PSF-2.0): 4 documents" in text
    assert "absent: not used" in text


def test_max_documents_is_shared_round_robin(tree: list[SourceSpec], tmp_path: Path) -> None:
    summary = build(tmp_path / "set", tree, max_documents=5)
    assert [(s.name, s.n_documents) for s in summary.sources] == [("code", 3), ("docs", 2)]
    one = build(tmp_path / "one", tree, max_documents=1)
    # With a single slot the longest eligible document of the first source is taken.
    assert [d["path"] for d in json.loads((tmp_path / "one" / "MANIFEST.json").read_text())["documents"]] == [
        "code/pkg/huge.py.txt"
    ]
    assert one.n_documents == 1


def test_without_encoder_tokens_are_null(tree: list[SourceSpec], tmp_path: Path) -> None:
    summary = build(tmp_path / "set", tree)
    manifest = json.loads((tmp_path / "set" / "MANIFEST.json").read_text())
    assert manifest["tokenizer"] is None
    assert all(d["tokens"] is None for d in manifest["documents"])
    assert summary.total_tokens is None and summary.n_long_documents is None
    assert read_default_set(tmp_path / "set") == summary


def test_no_source_documents_is_a_data_error(tree: list[SourceSpec], tmp_path: Path) -> None:
    with pytest.raises(DataError, match="found no source documents") as err:
        build(tmp_path / "set", [tree[2]])
    assert "absent-doc" in err.value.message
    assert not (tmp_path / "set").exists()


def test_failed_build_leaves_nothing_and_keeps_the_old_set(
    tree: list[SourceSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "set"
    build(out, tree)
    before = (out / "MANIFEST.json").read_bytes()

    def explode(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(default_set, "load_documents", explode)
    with pytest.raises(RuntimeError, match="disk on fire"):
        build(out, tree, max_documents=2)
    assert (out / "MANIFEST.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set", "src"]  # no temp dirs left


def test_html_to_text_keeps_main_body_and_code_layout() -> None:
    html = """<html><head><title>T</title><style>p {color: red}</style></head><body>
    <div class="related" role="navigation">Previous | Next</div>
    <div class="body" role="main">
      <h1>Title<a class="headerlink" href="#t">¶</a></h1>
      <p>Some   text
         across lines &lt;b&gt; &amp; more.</p>
      <div class="highlight"><pre>def f():
    return 1
</pre></div>
      <ul><li>one</li><li>two</li></ul>
      <script>var x = 1;</script>
    </div>
    <div class="footer">Copyright</div>
    </body></html>"""
    assert (
        html_to_text(html)
        == "Title\n\nSome text across lines <b> & more.\n\ndef f():\n    return 1\n\none\ntwo\n"
    )


def test_html_without_main_role_keeps_the_body() -> None:
    assert (
        html_to_text("<html><body><nav>menu</nav><p>Hello <b>world</b></p></body></html>") == "Hello world\n"
    )


def test_real_cpython_stdlib_source(tmp_path: Path) -> None:
    specs = {s.name: s for s in default_sources()}
    assert list(specs) == ["cpython-stdlib", "python-doc", "linux-doc", "debian-policy", "gnu-standards"]
    stdlib = specs["cpython-stdlib"]
    assert stdlib.root.is_dir()
    small = SourceSpec(**{**stdlib.__dict__, "max_documents": 3})
    summary = build_default_set(tmp_path / "set", sources=[small], min_chars=40_000, max_chars=60_000)
    manifest = json.loads((tmp_path / "set" / "MANIFEST.json").read_text())
    paths = [d["original_path"] for d in manifest["documents"]]
    assert len(paths) == 3 and summary.n_documents == 3
    assert all(p.endswith(".py") and "/test/" not in p and "site-packages" not in p for p in paths)
    assert all(d["licence"] == "PSF-2.0" and 40_000 <= d["chars"] <= 60_000 for d in manifest["documents"])
    assert manifest["sources"][0]["version"] == stdlib.version
    assert len(load_documents(tmp_path / "set", strict=True)) == 3


# --- tokq data build-default ---------------------------------------------------------------------


def test_cli_build_default(tree: list[SourceSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = [SourceSpec(**{**s.__dict__, "max_documents": 2}) for s in tree]
    monkeypatch.setattr(default_set, "default_sources", lambda: small)
    monkeypatch.setattr(
        data_cmd,
        "build_default_set",
        lambda out, **kw: build_default_set(out, min_chars=MIN, max_chars=MAX, **kw),
    )
    monkeypatch.setenv("TOKQ_HOME", str(tmp_path / "home"))
    runner = CliRunner()

    result = runner.invoke(
        data_cmd.data_app, ["build-default", "--model", "none", "--json", str(tmp_path / "s.json")]
    )
    assert result.exit_code == 0, result.output
    out = tmp_path / "home" / "data" / "default"
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["n_documents"] == 4 and report["out_dir"] == str(out)
    assert (out / "MANIFEST.json").is_file()

    # A second run does not rebuild; --force does.
    stamp = (out / "MANIFEST.json").stat().st_mtime_ns
    result = runner.invoke(data_cmd.data_app, ["build-default", "--model", "none"])
    assert result.exit_code == 0 and "already built" in result.output
    assert (out / "MANIFEST.json").stat().st_mtime_ns == stamp
    result = runner.invoke(data_cmd.data_app, ["build-default", "--model", "none", "--force"])
    assert result.exit_code == 0 and "already built" not in result.output

    # An unrelated folder is never replaced without --force.
    other = tmp_path / "mine"
    write(other / "keep.txt", "mine")
    result = runner.invoke(data_cmd.data_app, ["build-default", "--model", "none", "--out", str(other)])
    assert isinstance(result.exception, DataError) and str(other) in result.exception.message
    assert (other / "keep.txt").read_text() == "mine"


def _candidates(lengths: list[int]) -> list:
    from tokq.longctx.source_files import Candidate

    spec = SourceSpec(name="s", package="p", root=Path("/nowhere"), patterns=("*",), licence="MIT")
    items = [Candidate(spec, f"f{i:02d}.txt", "x" * n, n, "MIT") for i, n in enumerate(lengths)]
    return sorted(items, key=lambda c: (len(c.text), c.rel))


def test_spread_takes_the_long_files_first_up_to_a_third_then_spreads_the_rest() -> None:
    # 12 files, 3 of them long: 6 slots take the 2 longest (a third of 6), then 4 evenly spaced over the
    # 10 left, both ends included (ranks 0, 3, 6, 9)
    items = _candidates([100, 200, 300, 400, 500, 600, 700, 800, 900, 5000, 6000, 7000])
    picked = default_set._spread(items, 6, long_chars=5000)
    assert sorted(len(c.text) for c in picked) == [100, 400, 700, 5000, 6000, 7000]
    assert [c.rel for c in picked] == sorted(c.rel for c in picked)  # path order
    # 9 slots: all 3 long files, then 6 spread over the 9 short ones
    long_all = sorted(len(c.text) for c in default_set._spread(items, 9, long_chars=5000))
    assert long_all[-3:] == [5000, 6000, 7000] and long_all[0] == 100 and long_all[5] == 900
    # no file that long: the plain even spread (both ends)
    plain = sorted(len(c.text) for c in default_set._spread(items, 4, long_chars=10_000))
    assert plain == [100, 500, 800, 7000]  # ranks 0, 4 (3.67 rounded), 7, 11
