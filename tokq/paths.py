"""Where tokq keeps things, and how it writes them without leaving half-finished output."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokq.outputs import GENERIC, FolderKind, check_replaceable, output_lock, write_marker


def tokq_home() -> Path:
    """`$TOKQ_HOME`, default `~/.cache/tokq`: pulled models, default documents, baseline caches."""
    return Path(os.environ.get("TOKQ_HOME", "~/.cache/tokq")).expanduser()


def models_dir() -> Path:
    return tokq_home() / "models"


def data_dir() -> Path:
    return tokq_home() / "data"


def umask() -> int:
    """The process umask. Read from /proc where it can be (os.umask can only read it by setting it, which
    races with other threads creating files); else set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_mode(path: Path, mask: int | None = None) -> None:
    """Give `path` the mode a plain open() or mkdir gives it: mkdtemp, mkstemp and safetensors' writer make
    0700/0600, which a shared cache's other users, or a container running as another user, cannot read."""
    if not os.path.islink(path):
        os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~(umask() if mask is None else mask))


@contextlib.contextmanager
def atomic_directory(final: Path, kind: FolderKind = GENERIC, written_by: str = "tokq",
                     option: str = "--out") -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to `final` only if the block succeeds.

    An interrupted or failed write leaves no directory at `final` that looks complete. A previous `final` is
    replaced only after the new one is fully written, and only if tokq wrote it as a `kind` folder with nothing
    added since (outputs.check_replaceable, checked before and again after the write). The new folder gets an
    ownership marker listing its entries, and it and its files get the modes a plain mkdir and open() give
    (`plain_mode`); the folder's lock is held throughout, so no other tokq process writes it at the same time.
    """
    final = Path(final)
    with output_lock(final, option):
        check_replaceable(final, kind, option)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            yield tmp
            write_marker(tmp, kind, written_by)
            mask = umask()
            for path in (tmp, *tmp.rglob("*")):
                plain_mode(path, mask)
            check_replaceable(final, kind, option)  # a user may have put files there while we wrote
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
    """Write a file through a temp file + rename, so readers never see a partial file.

    The file gets the mode open() would give: an existing file's own mode, else 0666 less the umask (mkstemp
    makes it 0600, unreadable to a shared cache's other users)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
