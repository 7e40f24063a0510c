"""Reading one text or .jsonl file of an untrusted data folder (each optionally gzip-compressed) into text.

Only regular files are opened (a FIFO, socket, device, or a link to one such as `x.txt -> /dev/zero`,
is refused: a FIFO would block forever, a device never ends). A document larger than `max_doc_bytes`
(`--max-doc-mb`, default 64 MiB: a text file after decompression, or one .jsonl line) and a file larger
than `max_file_bytes` (`--max-file-mb`, default 1024 MiB after decompression: bounds a .jsonl file and a
gzip bomb) are refused after reading at most one byte past the cap. A .jsonl file is read line by line,
so a bad line (invalid UTF-8, invalid JSON, a lone surrogate escape such as `"\ud800"`) is refused alone.
Text is decoded as UTF-8 (a BOM is dropped) and CRLF line ends become LF, so a document hashes the same
on every platform.

What cannot be used comes back as `UnusableText`; `documents.load_documents` skips it (or, strict, stops).
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import re
import stat
import zlib
from pathlib import Path
from typing import IO

from .read_limits import MIB, ReadLimits, format_mib

TEXT_EXTENSIONS = (".txt", ".md", ".rst")
JSONL_EXTENSION = ".jsonl"

# More than this fraction of control characters (other than tab, newlines, form feed) means
# the file is not text, even if it happens to decode as UTF-8.
MAX_CONTROL_CHAR_RATIO = 0.01
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")
# json.loads turns an unpaired "\ud800" escape into a lone surrogate, which no UTF-8 encoder accepts.
_SURROGATE = re.compile("[\ud800-\udfff]")
# Decompressed bytes read at a time while skipping the rest of an over-long .jsonl line.
_SKIP_CHUNK = 1 << 20


class UnusableText(Exception):
    """Raised by `decode_text` and the readers for input that is not usable text; `load_documents`
    turns it into a skipped file (or line, or row), or a DataError when strict."""

    def __init__(self, reason: str, line: int | None = None, row: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.line = line
        self.row = row


def extension(path: Path) -> str:
    """The lower-case extension, with an inner one kept for gzip: `a.rst.gz` -> `.rst.gz`."""
    suffixes = [s.lower() for s in path.suffixes]
    if len(suffixes) >= 2 and suffixes[-1] == ".gz":
        return "".join(suffixes[-2:])
    return suffixes[-1] if suffixes else ""


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))


def _not_regular(path: Path, mode: int) -> UnusableText:
    kind = next((name for test, name in _KINDS if test(mode)), "an unknown kind")
    via = ", through a symlink" if path.is_symlink() else ""
    return UnusableText(f"not a regular file ({kind}{via}); only regular files are read")


def open_regular(path: Path) -> IO[bytes]:
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


def too_large(cap: int, flag: str, decompressed: bool, what: str = "document") -> UnusableText:
    """Why a document (or file: `what`) past `cap` bytes is refused, and the flag (`flag`) that raises the cap."""
    size = f"{format_mib(cap)} MiB ({flag} {format_mib(cap)})"
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
    with open_regular(path) as raw:
        if os.fstat(raw.fileno()).st_size > cap:  # (compressed, it would decompress to more still)
            raise too_large(cap, flag, decompressed=False)
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
        raise too_large(cap, flag, decompressed=gz)
    return data


def read_text(path: Path, limits: ReadLimits) -> str:
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


def checked_text(text: str, min_chars: int) -> str:
    """`text` as it is, or UnusableText when it is blank or shorter than `min_chars`."""
    if not text.strip():
        raise UnusableText("empty")
    if len(text) < min_chars:
        raise UnusableText(f"too short ({len(text)} chars; min_chars is {min_chars})")
    return text


def read_jsonl(
    path: Path, jsonl_field: str, min_chars: int, limits: ReadLimits
) -> tuple[list[tuple[int, str]], list[UnusableText]]:
    """(line number, text) of each non-blank line, read as a stream so no line or file past its cap is
    ever held whole; bad lines come back as UnusableText with their line number. UnusableText for
    the whole file when it cannot be read or is larger than `limits.max_file_bytes`."""
    with open_regular(path) as raw:
        if os.fstat(raw.fileno()).st_size > limits.max_file_bytes:
            raise too_large(limits.max_file_bytes, "--max-file-mb", decompressed=False, what="file")
        try:
            if path.suffix.lower() != ".gz":
                return _jsonl_texts(path, raw, jsonl_field, min_chars, limits)
            with gzip.GzipFile(fileobj=raw) as unzipped:
                return _jsonl_texts(path, unzipped, jsonl_field, min_chars, limits)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise UnusableText(f"corrupt gzip ({e}); re-compress it or store it uncompressed") from e
        except OSError as e:
            raise UnusableText(f"unreadable ({e.strerror or e})") from e


def _jsonl_texts(
    path: Path, stream: IO[bytes], jsonl_field: str, min_chars: int, limits: ReadLimits
) -> tuple[list[tuple[int, str]], list[UnusableText]]:
    texts: list[tuple[int, str]] = []
    bad: list[UnusableText] = []
    total = 0  # bytes read (decompressed) so far, against limits.max_file_bytes

    def count(n_bytes: int) -> None:
        nonlocal total
        total += n_bytes
        if total > limits.max_file_bytes:
            raise too_large(limits.max_file_bytes, "--max-file-mb", path.suffix.lower() == ".gz", "file")

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
            cap = format_mib(limits.max_doc_bytes)
            bad.append(UnusableText(f"longer than {cap} MiB (--max-doc-mb {cap}); raise --max-doc-mb to read it", n))
            continue
        try:
            text = _jsonl_text(line, jsonl_field, min_chars)
        except UnusableText as e:
            bad.append(UnusableText(e.reason, n))
            continue
        if text is not None:
            texts.append((n, text))
    return texts, bad


def _jsonl_text(line: bytes, jsonl_field: str, min_chars: int) -> str | None:
    """The document text of one .jsonl line (None for a blank line); UnusableText when it has none."""
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
    return checked_text(value.replace("\r\n", "\n"), min_chars)
