"""Hostile data folders: a FIFO or a link to /dev/zero named like a document, a gzip bomb, a huge single-line
document scored with a small --max-tokens, a lone surrogate or a bad byte in a .jsonl line, and symlink loops.
tokq reads only regular files, caps what it reads and decompresses (--max-doc-mb, --max-file-mb), encodes long
documents in bounded chunks, and skips what it cannot use with a warning (an error with --strict).

The cases that hung or ate memory before the fix load the folder in a child process with a memory limit and a
timeout, so a regression fails the test instead of hanging CI or the machine."""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.test_quantize_cli import WORDS
from tokq.cli import main
from tokq.errors import DataError
from tokq.longctx.documents import load_documents

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
CHILD_MEMORY = 1 << 30  # address space of the child that loads a hostile folder: far below a bomb's size
CHILD_TIMEOUT = 60

# Loads argv[1] with load_documents(**json argv[2]) in a fresh interpreter under CHILD_MEMORY, and prints what came
# back (or the exception) as JSON on the last line of stdout.
_CHILD = textwrap.dedent("""
    import json, logging, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
    warnings = []
    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    logging.getLogger("tokq").addHandler(Keep())
    from tokq.longctx.documents import load_documents
    kwargs = json.loads(sys.argv[2])
    if "limits" in kwargs:
        from tokq.longctx.read_limits import ReadLimits
        kwargs["limits"] = ReadLimits(**kwargs["limits"])
    start = time.perf_counter()
    try:
        docs = load_documents(sys.argv[1], **kwargs)
        out = {{"documents": [d.doc_id for d in docs], "skipped": [[s.name, s.reason] for s in docs.skipped]}}
    except BaseException as e:
        out = {{"error": type(e).__name__, "message": str(e)[:500]}}
    out["seconds"] = time.perf_counter() - start
    # peak RSS of this process image: VmHWM starts afresh at exec, ru_maxrss would include the parent's
    try:
        status = open("/proc/self/status").read()
        out["maxrss_mib"] = int(status.split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError):  # no /proc: an upper bound
        out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["warnings"] = warnings
    print(json.dumps(out))
""")


def load_in_child(folder: Path, **kwargs) -> dict:
    """load_documents(folder, **kwargs) in a child process bounded by CHILD_MEMORY and CHILD_TIMEOUT (a hang
    raises subprocess.TimeoutExpired, and the child is killed)."""
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(memory=CHILD_MEMORY), str(folder), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in this (main) thread after `seconds`: it interrupts a blocking open() of a FIFO."""
    def expire(_signum, _frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


PROSE = "The quick brown fox jumps over the lazy dog. It keeps running through the night.\n"


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_gzip_bomb(path: Path, mib: int, unit: bytes = b"a ") -> Path:
    """A gzip file of `mib` members, each 1 MiB of text: decompresses to `mib` MiB from ~1 KiB per MiB."""
    member = gzip.compress(unit * (MIB // len(unit)), compresslevel=9)
    with path.open("wb") as f:
        for _ in range(mib):
            f.write(member)
    return path


def reasons(result: dict) -> dict[str, str]:
    return {Path(name).name: reason for name, reason in result["skipped"]}


# ------------------------------------------------------------------------------------------------------------
# Only regular files are read


def test_fifo_named_txt_is_skipped_without_opening_it(tmp_path: Path) -> None:
    """Hostile case: a FIFO named x.txt in the data folder (open() waits forever for a writer)."""
    (tmp_path / "ok.txt").write_text(PROSE)
    os.mkfifo(tmp_path / "x.txt")
    result = load_in_child(tmp_path)
    assert result["documents"] == ["ok.txt"]
    assert reasons(result)["x.txt"].startswith("not a regular file (a FIFO")
    assert any("x.txt" in w and "FIFO" in w for w in result["warnings"])


def test_symlink_to_dev_zero_is_skipped(tmp_path: Path) -> None:
    """Hostile case: x.txt -> /dev/zero (a read never ends; before the fix it grew until MemoryError)."""
    (tmp_path / "ok.txt").write_text(PROSE)
    (tmp_path / "x.txt").symlink_to("/dev/zero")
    result = load_in_child(tmp_path)
    assert result["documents"] == ["ok.txt"]
    assert reasons(result)["x.txt"].startswith("not a regular file (a character device, through a symlink")
    assert result["seconds"] < 10


def test_single_fifo_path_is_refused_not_opened(tmp_path: Path) -> None:
    """Hostile case: --data names a FIFO itself (not a folder holding one)."""
    os.mkfifo(tmp_path / "x.txt")
    result = load_in_child(tmp_path / "x.txt")
    assert result["error"] == "DataError" and "not a regular file" in result["message"]


def test_file_symlink_loop_is_skipped_as_a_loop(tmp_path: Path) -> None:
    """Hostile case: a.txt -> b.txt -> a.txt."""
    (tmp_path / "ok.txt").write_text(PROSE)
    (tmp_path / "a.txt").symlink_to(tmp_path / "b.txt")
    (tmp_path / "b.txt").symlink_to(tmp_path / "a.txt")
    docs = load_documents(tmp_path)
    assert [d.doc_id for d in docs] == ["ok.txt"]
    assert {s.path.name: s.reason.split(" (")[0] for s in docs.skipped} == {"a.txt": "symlink loop",
                                                                             "b.txt": "symlink loop"}


def test_folder_symlink_loop_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Hostile case: sub -> . (a folder loop: a walk that followed links would never end); it is reported, not
    silently dropped, and the walk ends."""
    (tmp_path / "ok.txt").write_text(PROSE)
    (tmp_path / "sub").symlink_to(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tokq"), deadline(30):
        docs = load_documents(tmp_path)
    assert [d.doc_id for d in docs] == ["ok.txt"]
    assert [(s.path.name, s.reason.split(" (")[0]) for s in docs.skipped] == [("sub", "symlink to a folder")]
    assert any("sub" in r.getMessage() and "not followed" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataError, match="sub: symlink to a folder"):
        load_documents(tmp_path, strict=True)


# ------------------------------------------------------------------------------------------------------------
# Size caps


def test_gzip_bomb_is_skipped_naming_the_flag(tmp_path: Path) -> None:
    """Hostile case: bomb.txt.gz, 1 MiB on disk that decompresses to 1 GiB of text (before the fix: the whole GiB
    was decompressed into memory, a MemoryError under this 1 GiB limit)."""
    (tmp_path / "ok.txt").write_text(PROSE)
    write_gzip_bomb(tmp_path / "bomb.txt.gz", 1024)
    result = load_in_child(tmp_path)
    assert result["documents"] == ["ok.txt"], result
    reason = reasons(result)["bomb.txt.gz"]
    assert "decompresses to more than 64 MiB" in reason and "--max-doc-mb" in reason
    assert any("bomb.txt.gz" in w and "--max-doc-mb" in w for w in result["warnings"])
    assert result["maxrss_mib"] < 400


def test_jsonl_gzip_bomb_is_skipped(tmp_path: Path) -> None:
    """Hostile case: rows.jsonl.gz whose first line decompresses to 8 MiB (past the per-line cap --max-doc-mb: that
    line is skipped, the next one read), and lines.jsonl.gz of 64 MiB of short lines (past the per-file cap
    --max-file-mb: the file is skipped). Caps set low here to keep the test fast."""
    (tmp_path / "ok.txt").write_text(PROSE)
    good = (json.dumps({"text": PROSE}) + "\n").encode()
    rows = write_gzip_bomb(tmp_path / "rows.jsonl.gz", 8, unit=b"aaaa")
    with rows.open("ab") as f:
        f.write(gzip.compress(b"\n" + good))
    write_gzip_bomb(tmp_path / "lines.jsonl.gz", 64, unit=good)
    result = load_in_child(tmp_path, limits={"max_doc_bytes": 4 * MIB, "max_file_bytes": 16 * MIB})
    assert result["documents"] == ["ok.txt", "rows.jsonl.gz#L2"], result
    got = reasons(result)
    assert got["rows.jsonl.gz#L1"].startswith("longer than 4 MiB (--max-doc-mb 4)")
    assert got["lines.jsonl.gz"].startswith("decompresses to more than 16 MiB (--max-file-mb 16)")
    assert result["maxrss_mib"] < 400


def test_oversized_plain_file_is_skipped_before_reading(tmp_path: Path) -> None:
    """Hostile case: a plain .txt larger than the per-document cap (sparse, so the test writes nothing)."""
    (tmp_path / "ok.txt").write_text(PROSE)
    with (tmp_path / "huge.txt").open("wb") as f:
        f.truncate(3 * MIB)
    from tokq.longctx.read_limits import ReadLimits

    docs = load_documents(tmp_path, limits=ReadLimits(max_doc_bytes=MIB))
    assert [d.doc_id for d in docs] == ["ok.txt"]
    assert docs.skipped[0].reason.startswith("larger than 1 MiB (--max-doc-mb 1)")
    with pytest.raises(DataError, match="huge.txt: larger than 1 MiB"):
        load_documents(tmp_path, strict=True, limits=ReadLimits(max_doc_bytes=MIB))


def test_bad_size_flag_is_a_config_error(capsys, tmp_path: Path) -> None:
    """Hostile case: --max-doc-mb 0 / nan (a cap that would skip every file, or none)."""
    (tmp_path / "ok.txt").write_text(PROSE)
    for flag in ("--max-doc-mb", "--max-file-mb"):
        for value in ("0", "nan", "-1"):
            assert main(["data", "inspect", str(tmp_path), "--model", "none", flag, value]) == 2
            assert f"{flag} " in (err := capsys.readouterr().err) and "positive number of MiB" in err
        assert main(["data", "inspect", str(tmp_path), "--model", "none", flag, "0.5"]) == 0


# ------------------------------------------------------------------------------------------------------------
# Long documents are encoded in bounded chunks


class CountingEncoder:
    """A whitespace word encoder (WORDS -> ids) that counts how many characters it was asked to encode."""

    bos_token_id = 0
    add_bos = False

    def __init__(self) -> None:
        self.vocab = {w: i + 1 for i, w in enumerate(WORDS)}
        self.chars = 0

    def encode(self, text: str) -> list[int]:
        self.chars += len(text)
        return [self.vocab.get(w, 0) for w in text.split()]


def test_long_single_line_with_max_tokens_encodes_a_bounded_prefix(tmp_path: Path) -> None:
    """Hostile case: an 8 MB single-line document scored with --max-tokens 512 (before the fix the whole line was
    encoded: 50 MB took 59 s and 6 GB RSS with the word tokenizer)."""
    from tokq.longctx.windows import build_windows

    text = words(2_000_000)  # ~8 MB, one line
    (tmp_path / "big.txt").write_text(text)
    (tmp_path / "small.txt").write_text(words(300, seed=1))
    docs = load_documents(tmp_path)
    encoder = CountingEncoder()
    windows = build_windows(docs.documents, encoder, 128, max_tokens=512)
    assert encoder.chars < 64_000, encoder.chars  # a few KB of the 8 MB
    full = CountingEncoder()
    expected = build_windows(docs.documents, full, 128, max_tokens=512,
                             encoded={d.doc_id: full.encode(d.text) for d in docs.documents})
    assert [w.tokens for w in windows.windows] == [w.tokens for w in expected.windows]
    assert windows.stopped_by == expected.stopped_by == "max_tokens"
    assert windows.doc_tokens["big.txt"] > 127  # longer than a window, though not all of it was encoded


@pytest.mark.parametrize("stride, max_tokens, min_window_tokens", [
    (None, 512, 16), (40, 1500, 16), (100, 1000, 90), (7, 5000, 2), (None, 50_000, 16), (64, 2000, 16)])
def test_windows_from_a_prefix_equal_windows_from_the_whole_text(stride, max_tokens, min_window_tokens) -> None:
    """Hostile case: a budget that ends inside a long document, at a tail window, or after crossing documents: the
    document it ends in is encoded only in part (less than half of it), and the windows are exactly those built from
    the full encodings."""
    from tokq.longctx.documents import Document
    from tokq.longctx.windows import build_windows

    docs = [Document(f"d{i}.txt", Path(f"d{i}.txt"), words(n, seed=i))
            for i, n in enumerate((150, 20, 129, 30_000, 100_000, 5_000))]
    for add_bos in (False, True):
        encoder = CountingEncoder()
        got = build_windows(docs, encoder, 128, stride, add_bos, max_tokens, min_window_tokens)
        encoded = {d.doc_id: CountingEncoder().encode(d.text) for d in docs}
        want = build_windows(docs, encoder, 128, stride, add_bos, max_tokens, min_window_tokens, encoded=encoded)
        assert [(w.doc_id, w.start, w.tokens, w.score_from) for w in got.windows] == \
               [(w.doc_id, w.start, w.tokens, w.score_from) for w in want.windows]
        assert (got.stopped_by, got.dropped_tails, got.dropped_documents, got.n_documents) == \
               (want.stopped_by, want.dropped_tails, want.dropped_documents, want.n_documents)
        # the document the budget ended in: the first one with a window past the budget
        uncapped = build_windows(docs, encoder, 128, stride, add_bos, None, min_window_tokens, encoded=encoded)
        last = [d.doc_id for d in docs].index(uncapped.windows[len(want.windows)].doc_id)
        on_last = encoder.chars - sum(len(d.text) for d in docs[:last])  # the ones before: encoded whole
        assert on_last < len(docs[last].text) / 2, (on_last, last)


def _tokenizers() -> dict[str, object]:
    """Three tokenizer families, trained here on a small corpus: word-level, GPT-2 style byte-level BPE, and
    SentencePiece style (Metaspace, which adds a ▁ at the start of the text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [_sample_text(seed) for seed in range(4)]
    out = {}
    word = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="<unk>"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    out["word"] = word
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel
                                                        .alphabet(), show_progress=False))
    out["byte-bpe"] = bpe
    sp = Tokenizer(models.Unigram())
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=400, unk_token="<unk>",
                                                           special_tokens=["<unk>"], show_progress=False))
    out["metaspace-unigram"] = sp
    return {name: PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<unk>")
            for name, t in out.items()}


def _sample_text(seed: int) -> str:
    rng = random.Random(seed)
    pieces = []
    for _ in range(3000):
        pieces.append(rng.choice(WORDS + ["the", "fox.", "naïve", "1234567", "(x)", "—", "don't", "ü"]))
        pieces.append(rng.choice([" ", " ", " ", "  ", "\n", ".\n\n", ", ", "\t", " \n "]))
    return "".join(pieces)


def test_chunked_encoding_equals_the_whole_encoding(monkeypatch) -> None:
    """Hostile case: a document far longer than a chunk (chunks made tiny here, so there are hundreds of seams):
    for word-level, byte-level BPE and Metaspace tokenizers the chunked ids equal the whole text's, and a prefix
    holds the whole text's first ids."""
    from tokq.longctx import text_encoding as encoding_mod
    from tokq.longctx.text_encoding import as_text_encoder, encode_text

    monkeypatch.setattr(encoding_mod, "CHUNK_CHARS", 600)
    monkeypatch.setattr(encoding_mod, "SEAM_CHARS", 80)
    text = _sample_text(9)
    for name, tokenizer in _tokenizers().items():
        encoder = as_text_encoder(tokenizer, add_bos=False)
        whole = encoder.encode(text)
        longest = []
        monkeypatch.setattr(encoder, "encode", lambda t, e=encoder.encode, seen=longest: seen.append(len(t)) or e(t))
        assert encode_text(encoder, text) == whole, name
        assert max(longest) < 2_000 < len(text), name  # chunks, not the whole text after a failed check
        for n in (1, 50, 333, 2000):
            prefix = encode_text(encoder, text, max_ids=n)
            assert len(prefix) >= n and prefix == whole[:len(prefix)], (name, n)
        assert max(longest) < 2_000, name


def test_encoding_falls_back_to_the_whole_text_when_a_seam_disagrees(monkeypatch) -> None:
    """Hostile case: a tokenizer whose ids at a cut depend on text after it (here: one id for the number of
    words): chunking would change its ids, so the whole text is encoded instead."""
    from tokq.longctx import text_encoding as encoding_mod
    from tokq.longctx.text_encoding import encode_text

    class NonLocal:
        bos_token_id = None

        def encode(self, text: str) -> list[int]:
            return [len(text.split())] + [1] * len(text.split())

    monkeypatch.setattr(encoding_mod, "CHUNK_CHARS", 600)
    monkeypatch.setattr(encoding_mod, "SEAM_CHARS", 80)
    text = words(2000)
    assert encode_text(NonLocal(), text) == NonLocal().encode(text)
    assert encode_text(NonLocal(), text, max_ids=10) == NonLocal().encode(text)


# ------------------------------------------------------------------------------------------------------------
# Text decoding


def test_lone_surrogate_in_jsonl_is_skipped_with_a_warning(tmp_path: Path, caplog) -> None:
    """Hostile case: a .jsonl line whose text holds the JSON escape \\ud800 (a lone surrogate: before the fix the
    run died with UnicodeEncodeError even without --strict)."""
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": PROSE}) + "\n" + '{"text": "bad \\ud800 here"}\n')
    with caplog.at_level(logging.WARNING, logger="tokq"):
        docs = load_documents(tmp_path)
    assert [d.doc_id for d in docs] == ["rows.jsonl#L1"]
    assert docs.skipped[0].line == 2 and "lone surrogate U+D800" in docs.skipped[0].reason
    assert any("rows.jsonl#L2" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataError, match=r"rows.jsonl#L2: lone surrogate"):
        load_documents(tmp_path, strict=True)


def test_lone_surrogate_cli_warns_and_strict_exits_2(capsys, tmp_path: Path, caplog) -> None:
    """Hostile case: the same .jsonl through `tokq data inspect`: a warning and exit 0; --strict: exit 2."""
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": PROSE}) + "\n" + '{"text": "\\udfff"}\n')
    with caplog.at_level(logging.WARNING, logger="tokq"):
        assert main(["data", "inspect", str(tmp_path), "--model", "none"]) == 0
    assert any("lone surrogate" in r.getMessage() for r in caplog.records)
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path), "--model", "none", "--strict"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "rows.jsonl#L2" in err and "lone surrogate" in err


def test_invalid_utf8_in_one_jsonl_line_skips_only_that_line(tmp_path: Path) -> None:
    """Hostile case: one .jsonl line with a Latin-1 byte among good lines (before the fix the whole file was
    dropped)."""
    good = (json.dumps({"text": PROSE}) + "\n").encode()
    (tmp_path / "rows.jsonl").write_bytes(good + b'{"text": "caf\xe9"}\n' + good)
    docs = load_documents(tmp_path)
    assert [d.doc_id for d in docs] == ["rows.jsonl#L1", "rows.jsonl#L3"]
    assert docs.skipped[0].line == 2 and "not UTF-8" in docs.skipped[0].reason
    with pytest.raises(DataError, match=r"rows.jsonl#L2: not UTF-8"):
        load_documents(tmp_path, strict=True)


# ------------------------------------------------------------------------------------------------------------
# Whole runs




def test_score_on_a_hostile_folder_completes(capsys, caplog, checkpoint: Path, tmp_path: Path) -> None:
    """Hostile case, end to end: `tokq score` on a folder holding a FIFO, a lone surrogate line, a file link loop,
    a folder link loop, a gzip bomb and one real document: exit 0, each named in a warning (bounded by a deadline:
    before the fix the FIFO hung the run)."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "doc.txt").write_text(words(700) + "\n")
    os.mkfifo(folder / "fifo.txt")
    (folder / "rows.jsonl").write_text('{"text": "\\ud800"}\n')
    (folder / "a.txt").symlink_to(folder / "b.txt")
    (folder / "b.txt").symlink_to(folder / "a.txt")
    (folder / "loop").symlink_to(folder)
    write_gzip_bomb(folder / "bomb.md.gz", 8)
    with caplog.at_level(logging.WARNING, logger="tokq"), deadline(120):
        code = main(["score", str(checkpoint), "--data", str(folder), "--window", "128", "--threads", "1",
                     "--max-doc-mb", "1"])
    out = capsys.readouterr()
    assert code == 0, out.err
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for name in ("fifo.txt", "rows.jsonl#L1", "a.txt", "b.txt", "loop", "bomb.md.gz"):
        assert name in logged, name
    assert "overall" in out.out


def test_score_of_a_long_single_line_with_max_tokens_is_bounded(capsys, checkpoint: Path, tmp_path: Path,
                                                                monkeypatch) -> None:
    """Hostile case, end to end: `tokq score --max-tokens 512` on an 8 MB single-line document: the tokenizer sees
    a few KB of it (before the fix: all 8 MB, and 50 MB took 59 s and 6 GB RSS)."""
    from tokq.longctx.text_encoding import HFTextEncoder

    (tmp_path / "big.txt").write_text(words(2_000_000))
    seen = []
    original = HFTextEncoder.encode
    monkeypatch.setattr(HFTextEncoder, "encode", lambda self, text: seen.append(len(text)) or original(self, text))
    with deadline(120):
        code = main(["score", str(checkpoint), "--data", str(tmp_path), "--window", "128", "--threads", "1",
                     "--max-tokens", "512"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert sum(seen) < 64_000, sum(seen)
