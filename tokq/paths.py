"""Where tokq keeps things, and how it writes them without leaving half-finished output."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def tokq_home() -> Path:
    """`$TOKQ_HOME`, default `~/.cache/tokq`: pulled models, default documents, baseline caches."""
    return Path(os.environ.get("TOKQ_HOME", "~/.cache/tokq")).expanduser()


def models_dir() -> Path:
    return tokq_home() / "models"


def data_dir() -> Path:
    return tokq_home() / "data"


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to `final` only if the block succeeds.

    An interrupted or failed write leaves no directory at `final` that looks complete.
    A previous `final` is replaced only after the new one is fully written.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file through a temp file + rename, so readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
