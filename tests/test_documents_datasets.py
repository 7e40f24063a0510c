"""longctx.documents: .parquet and .arrow tables, one document per row, read through `datasets` with the same
rules as the other files (regular files only, --max-doc-mb per row, --max-file-mb per file, skip with a warning or
fail under strict), and nothing written to the HF cache or the data folder."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import pytest
from typer.testing import CliRunner

from tokq.cli import main
from tokq.commands import data as data_cmd
from tokq.errors import DataError
from tokq.longctx.documents import load_documents
from tokq.longctx.read_limits import ReadLimits

REPO = Path(__file__).resolve().parents[1]
PROSE = "The quick brown fox jumps over the lazy dog.\nIt keeps running through the night.\n"
TEXTS = ["alpha " + PROSE, "bravo " + PROSE, "charlie\r\n" + PROSE]


def parquet(path: Path, columns: dict[str, list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(columns).to_parquet(str(path))
    return path


@pytest.fixture
def tables(tmp_path: Path) -> Path:
    """A folder with a parquet file and a `save_to_disk` folder (an .arrow file and two JSON files)."""
    root = tmp_path / "docs"
    parquet(root / "rows.parquet", {"text": TEXTS, "id": [1, 2, 3]})
    datasets.Dataset.from_dict({"text": TEXTS[:2]}).save_to_disk(str(root / "saved"))
    return root


def test_parquet_and_arrow_rows_are_documents(tables: Path) -> None:
    docs = load_documents(tables)
    assert [d.doc_id for d in docs] == [
        "rows.parquet#R0",
        "rows.parquet#R1",
        "rows.parquet#R2",
        "saved/data-00000-of-00001.arrow#R0",
        "saved/data-00000-of-00001.arrow#R1",
    ]
    by_id = {d.doc_id: d for d in docs}
    assert by_id["rows.parquet#R2"].text == "charlie\n" + PROSE  # CRLF -> LF, as for every document
    assert by_id["saved/data-00000-of-00001.arrow#R1"].text == TEXTS[1]
    assert by_id["rows.parquet#R0"].path == tables / "rows.parquet"
    assert docs.n_files == 2 and not docs.skipped
    assert sorted(p.name for p in docs.ignored) == ["dataset_info.json", "state.json"]
    single = load_documents(tables / "rows.parquet")
    assert [d.doc_id for d in single] == ["rows.parquet#R0", "rows.parquet#R1", "rows.parquet#R2"]


def test_arrow_ipc_file_format_and_custom_field(tmp_path: Path) -> None:
    import pyarrow as pa

    table = pa.table({"body": ["one " + PROSE, "two " + PROSE]})
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    docs = load_documents(tmp_path, jsonl_field="body")
    assert [(d.doc_id, d.text) for d in docs] == [("t.arrow#R0", "one " + PROSE), ("t.arrow#R1", "two " + PROSE)]


def test_glob_characters_in_a_name_read_that_file(tmp_path: Path) -> None:
    # datasets takes a glob pattern: unescaped, `a[1].parquet` would read `a1.parquet`
    parquet(tmp_path / "a[1].parquet", {"text": ["bracket " + PROSE]})
    parquet(tmp_path / "a1.parquet", {"text": ["plain " + PROSE]})
    docs = {d.doc_id: d.text for d in load_documents(tmp_path)}
    assert docs == {"a1.parquet#R0": "plain " + PROSE, "a[1].parquet#R0": "bracket " + PROSE}


def test_missing_or_non_string_column_skips_the_file_naming_it(tmp_path: Path, caplog) -> None:
    parquet(tmp_path / "good.parquet", {"text": [PROSE]})
    parquet(tmp_path / "nocol.parquet", {"body": [PROSE], "id": [1]})
    parquet(tmp_path / "ints.parquet", {"text": [1, 2]})
    parquet(tmp_path / "nulls.parquet", {"text": [None, PROSE]})
    with caplog.at_level(logging.WARNING, logger="tokq"):
        docs = load_documents(tmp_path)
    assert [d.doc_id for d in docs] == ["good.parquet#R0", "nulls.parquet#R1"]
    reasons = {s.name: s.reason for s in docs.skipped}
    assert reasons == {
        str(tmp_path / "ints.parquet"): "column 'text' holds int64 values, not strings",
        str(tmp_path / "nocol.parquet"): "no column 'text' (has: body, id)",
        str(tmp_path / "nulls.parquet") + "#R0": "no text ('text' is null)",
    }
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "tokq")
    assert f"skipping {tmp_path / 'nocol.parquet'}: no column 'text'" in logged
    assert not [r for r in caplog.records if r.name.startswith("datasets")]  # tokq's warning, not datasets' log
    with pytest.raises(DataError, match=r"ints\.parquet: column 'text' holds int64 values"):
        load_documents(tmp_path, strict=True)


def test_corrupt_tables_are_skipped_or_refused_under_strict(tmp_path: Path) -> None:
    parquet(tmp_path / "good.parquet", {"text": [PROSE]})
    (tmp_path / "x.parquet").write_bytes(os.urandom(4096))
    (tmp_path / "y.arrow").write_bytes(os.urandom(4096))
    (tmp_path / "z.parquet").write_bytes((tmp_path / "good.parquet").read_bytes()[:-20])  # truncated footer
    docs = load_documents(tmp_path)
    assert [d.doc_id for d in docs] == ["good.parquet#R0"]
    reasons = {Path(s.name).name: s.reason for s in docs.skipped}
    assert reasons["x.parquet"].startswith("corrupt, or not a parquet file (ArrowInvalid")
    assert reasons["y.arrow"].startswith("corrupt, or not an Arrow IPC file")
    assert reasons["z.parquet"].startswith("corrupt, or not a parquet file")
    with pytest.raises(DataError, match=r"x\.parquet: corrupt, or not a parquet file") as err:
        load_documents(tmp_path, strict=True)
    assert "\n" not in err.value.message


def test_caps_skip_a_long_row_a_file_with_too_much_text_and_a_large_file(tmp_path: Path) -> None:
    parquet(tmp_path / "a.parquet", {"text": ["short " + PROSE, "x " * 3000, "after " + PROSE]})
    # 40 KiB of text that parquet compresses to far less: only counting the text catches it
    parquet(tmp_path / "b.parquet", {"text": ["y " * 2000] * 10})
    docs = load_documents(tmp_path, limits=ReadLimits(max_doc_bytes=4096, max_file_bytes=20480))
    assert [d.doc_id for d in docs] == ["a.parquet#R0", "a.parquet#R2"]
    reasons = {Path(s.name).name: s.reason for s in docs.skipped}
    assert reasons["a.parquet#R1"].startswith("longer than 0.00390625 MiB (--max-doc-mb 0.00390625)")
    # dictionary-encoded (one value ten times): its footer declares little, the streamed count catches it
    assert reasons["b.parquet"].startswith("holds more than 0.0195312 MiB of text (--max-file-mb 0.0195312)")
    assert (tmp_path / "b.parquet").stat().st_size < 20480


def test_a_parquet_bomb_is_refused_from_its_footer(tmp_path: Path) -> None:
    """A parquet bomb: a few KB on disk, 48 MiB of text once decompressed. Refused from the footer's declared
    size (the message says so), before datasets streams a row; the streamed count would say "holds more than"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["z" * (12 << 20)] * 4}), tmp_path / "bomb.parquet", compression="zstd",
                   use_dictionary=False)
    assert (tmp_path / "bomb.parquet").stat().st_size < (1 << 20)
    (tmp_path / "ok.txt").write_text(PROSE)
    docs = load_documents(tmp_path, limits=ReadLimits(max_doc_bytes=64 << 20, max_file_bytes=16 << 20))
    assert [d.doc_id for d in docs] == ["ok.txt"]
    assert docs.skipped[0].reason.startswith("its column 'text' expands to 48 MiB (--max-file-mb 16)")


def test_a_table_larger_than_max_file_mb_on_disk_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_text(PROSE)
    with (tmp_path / "huge.parquet").open("wb") as f:
        f.truncate(3 << 20)  # sparse: nothing written; never opened by datasets
    docs = load_documents(tmp_path, limits=ReadLimits(max_file_bytes=1 << 20))
    assert [d.doc_id for d in docs] == ["ok.txt"]
    assert docs.skipped[0].reason.startswith("larger than 1 MiB (--max-file-mb 1)")


def test_fifo_and_device_link_named_like_tables_are_not_opened(tmp_path: Path) -> None:
    parquet(tmp_path / "good.parquet", {"text": [PROSE]})
    os.mkfifo(tmp_path / "pipe.parquet")
    (tmp_path / "zero.arrow").symlink_to("/dev/zero")
    docs = load_documents(tmp_path)  # a FIFO opened would block forever
    assert [d.doc_id for d in docs] == ["good.parquet#R0"]
    reasons = {Path(s.name).name: s.reason for s in docs.skipped}
    assert reasons["pipe.parquet"].startswith("not a regular file (a FIFO")
    assert reasons["zero.arrow"].startswith("not a regular file (a character device, through a symlink")


def test_reading_writes_nothing_to_the_hf_cache_or_the_data_folder(tables: Path, tmp_path: Path) -> None:
    """In a fresh interpreter whose HF_HOME, HF_DATASETS_CACHE, XDG_CACHE_HOME, HOME and TMPDIR are empty
    folders: they stay empty (the temporary lock folder is removed), and the data folder is unchanged."""
    homes = {name: tmp_path / name.lower() for name in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME", "HOME",
                                                         "TMPDIR")}
    for folder in homes.values():
        folder.mkdir()
    before = sorted((p.relative_to(tables), p.stat().st_mtime_ns) for p in tables.rglob("*"))
    child = textwrap.dedent("""
        import sys
        from tokq.longctx.documents import load_documents
        print(len(load_documents(sys.argv[1])))
    """)
    env = {**os.environ, **{name: str(folder) for name, folder in homes.items()}}
    proc = subprocess.run([sys.executable, "-c", child, str(tables)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["5"]
    assert {name: sorted(os.listdir(folder)) for name, folder in homes.items()} == {name: [] for name in homes}
    assert sorted((p.relative_to(tables), p.stat().st_mtime_ns) for p in tables.rglob("*")) == before


def test_data_inspect_reads_a_parquet_folder(tables: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = CliRunner().invoke(data_cmd.data_app, ["inspect", str(tables), "--model", "none", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "5 documents from 2 files" in " ".join(result.output.split())  # rich wraps lines
    report = json.loads(out.read_text())
    assert [d["doc_id"] for d in report["documents"]][:3] == ["rows.parquet#R0", "rows.parquet#R1", "rows.parquet#R2"]


def test_data_inspect_strict_on_a_corrupt_parquet_exits_2(tmp_path: Path, capsys) -> None:
    parquet(tmp_path / "good.parquet", {"text": [PROSE]})
    (tmp_path / "x.parquet").write_bytes(os.urandom(512))
    assert main(["data", "inspect", str(tmp_path), "--model", "none"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path), "--model", "none", "--strict"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "x.parquet" in err and "Traceback" not in err
