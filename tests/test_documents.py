"""longctx.documents: what a folder of user documents turns into, and what `tokq data inspect` says."""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokq.commands import data as data_cmd
from tokq.errors import DataError
from tokq.longctx.documents import Document, load_documents

PROSE = "The quick brown fox jumps over the lazy dog.\nIt keeps running through the night.\n"


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """A folder with every kind of file the loader must handle."""
    root = tmp_path / "docs"
    write(root / "a.txt", "alpha " + PROSE)
    write(root / "b.md", "# Bravo\n\n" + PROSE)
    write(root / "sub" / "c.rst", "Charlie\n=======\n\n" + PROSE)
    write(root / "sub" / "deeper" / "d.txt.gz", gzip.compress(("delta " + PROSE).encode()))
    write(
        root / "e.jsonl",
        "\n".join(
            [
                json.dumps({"text": "echo one " + PROSE, "id": 1}),
                "",  # blank lines are not documents and not errors
                json.dumps({"text": "echo two " + PROSE}),
                "{not json",
                json.dumps({"body": "wrong field"}),
            ]
        )
        + "\n",
    )
    write(root / "f.jsonl.gz", gzip.compress((json.dumps({"text": "foxtrot " + PROSE}) + "\n").encode()))
    write(root / "bin.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    write(root / "latin1.txt", "caf\xe9 cr\xe8me".encode("latin-1"))
    write(root / "corrupt.txt.gz", b"\x1f\x8b\x08\x00 this is not deflate data")
    write(root / "empty.md", "")
    write(root / "notes.json", "{}")
    write(root / "image.png", b"\x89PNG")
    write(root / ".hidden" / "secret.txt", "never read")
    write(root / ".DS_Store", b"\x00\x01")
    return root


def test_mixed_folder_reads_documents_in_sorted_order(mixed: Path) -> None:
    docs = load_documents(mixed)
    assert [d.doc_id for d in docs] == [
        "a.txt",
        "b.md",
        "e.jsonl#L1",
        "e.jsonl#L3",
        "f.jsonl.gz#L1",
        "sub/c.rst",
        "sub/deeper/d.txt.gz",
    ]
    by_id = {d.doc_id: d for d in docs}
    assert by_id["sub/deeper/d.txt.gz"].text == "delta " + PROSE
    assert by_id["e.jsonl#L3"].text == "echo two " + PROSE
    assert by_id["e.jsonl#L1"].path == mixed / "e.jsonl"
    assert by_id["a.txt"].n_chars == len("alpha " + PROSE)
    assert docs.n_files == 6
    assert docs.total_chars == sum(len(d.text) for d in docs)


def test_mixed_folder_skips_unusable_files_with_reasons(mixed: Path) -> None:
    docs = load_documents(mixed)
    reasons = {s.name: s.reason for s in docs.skipped}
    assert set(reasons) == {
        str(mixed / "bin.txt"),
        str(mixed / "corrupt.txt.gz"),
        str(mixed / "e.jsonl") + "#L4",
        str(mixed / "e.jsonl") + "#L5",
        str(mixed / "empty.md"),
        str(mixed / "latin1.txt"),
    }
    assert reasons[str(mixed / "bin.txt")].startswith("binary")
    assert reasons[str(mixed / "corrupt.txt.gz")].startswith("corrupt gzip")
    assert "not UTF-8" in reasons[str(mixed / "latin1.txt")] and "0xe9" in reasons[str(mixed / "latin1.txt")]
    assert reasons[str(mixed / "empty.md")] == "empty"
    assert "invalid JSON" in reasons[str(mixed / "e.jsonl") + "#L4"]
    assert "no string field 'text'" in reasons[str(mixed / "e.jsonl") + "#L5"]
    assert "body" in reasons[str(mixed / "e.jsonl") + "#L5"]
    assert sorted(p.name for p in docs.ignored) == ["image.png", "notes.json"]


def test_summary_lists_counts_skips_and_ignored(mixed: Path) -> None:
    docs = load_documents(mixed)
    text = docs.summary()
    assert text.splitlines()[0] == f"{mixed}: 7 documents from 6 files, {docs.total_chars:,} chars"
    assert "skipped 6:" in text
    assert f"{mixed / 'latin1.txt'}: not UTF-8" in text
    assert f"{mixed / 'e.jsonl'}#L4: invalid JSON" in text
    assert "ignored 2 files with other extensions (.json x1, .png x1)" in text
    assert "secret" not in text
    short = docs.summary(max_listed=2)
    assert "... and 4 more" in short


def test_skips_are_logged_as_warnings(mixed: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tokq"):
        load_documents(mixed)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "tokq")
    assert f"skipping {mixed / 'bin.txt'}: binary" in logged
    assert f"skipping {mixed / 'e.jsonl'}#L4" in logged


def test_strict_raises_on_first_unusable_file_naming_it(mixed: Path) -> None:
    with pytest.raises(DataError) as err:
        load_documents(mixed, strict=True)
    # bin.txt is the first unusable file in sorted order.
    assert str(mixed / "bin.txt") in err.value.message
    assert "binary" in err.value.message
    assert "\n" not in err.value.message


def test_strict_accepts_a_clean_folder(tmp_path: Path) -> None:
    write(tmp_path / "one.txt", PROSE)
    write(tmp_path / "two.md.gz", gzip.compress(PROSE.encode()))
    assert len(load_documents(tmp_path, strict=True)) == 2


def test_strict_names_the_bad_jsonl_line(tmp_path: Path) -> None:
    write(tmp_path / "rows.jsonl", json.dumps({"text": PROSE}) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=r"rows\.jsonl#L2: no string field 'text' \(has: list\)"):
        load_documents(tmp_path, strict=True)


def test_missing_folder_is_a_data_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError) as err:
        load_documents(missing)
    assert str(missing) in err.value.message
    assert ".txt, .md, .rst or .jsonl" in err.value.message


def test_empty_folder_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="folder has no files") as err:
        load_documents(tmp_path / "empty")
    assert str(tmp_path / "empty") in err.value.message


def test_folder_without_usable_documents_is_a_data_error(tmp_path: Path) -> None:
    write(tmp_path / "bin.txt", b"\x00\x01\x02")
    write(tmp_path / "data.csv", "a,b\n1,2\n")
    with pytest.raises(DataError) as err:
        load_documents(tmp_path)
    message = err.value.message
    assert message.startswith(f"{tmp_path}: no usable documents")
    assert "1 skipped" in message and "bin.txt" in message and "1 with other extensions" in message
    assert ".txt, .md, .rst or .jsonl" in message


def test_single_file_is_a_one_document_set(tmp_path: Path) -> None:
    path = write(tmp_path / "notes" / "only.md", PROSE)
    docs = load_documents(path)
    assert [d.doc_id for d in docs] == ["only.md"]
    assert docs.documents[0].path == path
    assert docs.n_files == 1


def test_single_file_with_other_extension_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path / "table.csv", "a,b\n")
    with pytest.raises(DataError, match="not a document file") as err:
        load_documents(path)
    assert str(path) in err.value.message


def test_single_jsonl_file_gives_one_document_per_line(tmp_path: Path) -> None:
    rows = [{"content": f"row {i} " + PROSE} for i in range(3)]
    path = write(tmp_path / "rows.jsonl", "\n".join(json.dumps(r) for r in rows))
    docs = load_documents(path, jsonl_field="content")
    assert [d.doc_id for d in docs] == ["rows.jsonl#L1", "rows.jsonl#L2", "rows.jsonl#L3"]
    assert docs.documents[2].text == rows[2]["content"]


def test_bom_and_crlf_are_normalised(tmp_path: Path) -> None:
    write(tmp_path / "unix.txt", "line one\nline two\n")
    write(tmp_path / "windows.txt", b"\xef\xbb\xbfline one\r\nline two\r\n")
    a, b = load_documents(tmp_path).documents
    assert a.text == b.text == "line one\nline two\n"
    assert a.sha256 == b.sha256


def test_text_with_many_control_characters_is_binary(tmp_path: Path) -> None:
    write(tmp_path / "ok.txt", PROSE + "\f" + PROSE)  # a form feed is text
    write(tmp_path / "weird.txt", "ab\x01\x02" * 50)
    docs = load_documents(tmp_path)
    assert [d.doc_id for d in docs] == ["ok.txt"]
    assert docs.skipped[0].reason.startswith("binary (50.0% control characters")


def test_min_chars_skips_short_documents(tmp_path: Path) -> None:
    write(tmp_path / "long.txt", "x" * 100)
    write(tmp_path / "short.txt", "x" * 10)
    docs = load_documents(tmp_path, min_chars=50)
    assert [d.doc_id for d in docs] == ["long.txt"]
    assert docs.skipped[0].reason == "too short (10 chars; min_chars is 50)"


def test_broken_symlink_is_skipped_as_unreadable(tmp_path: Path) -> None:
    write(tmp_path / "real.txt", PROSE)
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    docs = load_documents(tmp_path)
    assert [d.doc_id for d in docs] == ["real.txt"]
    assert docs.skipped[0].path == tmp_path / "dangling.txt"
    assert docs.skipped[0].reason.startswith("unreadable")


def test_document_hash_is_of_the_text() -> None:
    import hashlib

    doc = Document("x.txt", Path("x.txt"), "héllo")
    assert doc.sha256 == hashlib.sha256("héllo".encode()).hexdigest()
    assert doc.n_chars == 5


def test_content_hash_depends_on_names_and_text_only(tmp_path: Path) -> None:
    def make(folder: str, files: dict[str, str]) -> str:
        for name, text in files.items():
            write(tmp_path / folder / name, text)
        return load_documents(tmp_path / folder).content_hash()

    base = make("a", {"x.txt": "one", "y/z.md": "two"})
    assert make("b", {"y/z.md": "two", "x.txt": "one"}) == base  # another folder, same content
    assert make("c", {"x.txt": "one", "y/z.md": "two!"}) != base  # edited
    assert make("d", {"x.txt": "one", "y/w.md": "two"}) != base  # renamed
    assert make("e", {"x.txt": "one"}) != base  # removed
    # gzip is a storage detail of the name, so it changes the id and the hash.
    write(tmp_path / "f" / "x.txt.gz", gzip.compress(b"one"))
    write(tmp_path / "f" / "y" / "z.md", "two")
    assert load_documents(tmp_path / "f").content_hash() != base


# --- tokq data inspect -------------------------------------------------------------------------


class ByteEncoder:
    """A real (if tiny) tokenizer: one token per UTF-8 byte, ids shifted past BOS."""

    bos_token_id = 1
    add_bos = True

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]


def test_inspect_without_model_reports_documents_and_skips(mixed: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        data_cmd.data_app, ["inspect", str(mixed), "--model", "none", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "7 documents" in result.output
    assert "6 skipped" in result.output
    report = json.loads(out.read_text())
    assert report["n_documents"] == 7
    assert report["model"] is None and report["windows"] is None
    assert {s["reason"].split(" ")[0] for s in report["skipped"]} >= {"binary", "corrupt", "empty", "not"}
    assert report["content_hash"] == load_documents(mixed).content_hash()


def test_inspect_with_encoder_reports_tokens_and_windows(
    mixed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data_cmd, "_load_encoder", lambda model: ByteEncoder())
    out = tmp_path / "report.json"
    args = ["inspect", str(mixed), "--window", "32", "--stride", "16", "--json", str(out)]
    result = CliRunner().invoke(data_cmd.data_app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    docs = load_documents(mixed)
    expected_tokens = sum(len(d.text.encode()) for d in docs)
    assert report["total_tokens"] == expected_tokens
    assert report["windows"]["window"] == 32 and report["windows"]["stride"] == 16
    assert report["windows"]["add_bos"] is True
    assert report["windows"]["n_new_tokens"] == expected_tokens  # all docs are longer than a tail
    assert f"{expected_tokens:,} tokens" in result.output


def test_inspect_strict_and_missing_folder_raise_data_errors(mixed: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(data_cmd.data_app, ["inspect", str(mixed), "--model", "none", "--strict"])
    assert isinstance(result.exception, DataError)
    assert "bin.txt" in result.exception.message
    result = runner.invoke(data_cmd.data_app, ["inspect", str(tmp_path / "missing"), "--model", "none"])
    assert isinstance(result.exception, DataError)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any folder")
def test_unreadable_folder_is_skipped(tmp_path: Path) -> None:
    write(tmp_path / "a.txt", PROSE)
    write(tmp_path / "locked" / "b.txt", PROSE)
    (tmp_path / "locked").chmod(0)
    try:
        docs = load_documents(tmp_path)
    finally:
        (tmp_path / "locked").chmod(0o755)
    assert [d.doc_id for d in docs] == ["a.txt"]
    assert docs.skipped[0].path == tmp_path / "locked"
    assert docs.skipped[0].reason.startswith("unreadable folder")
