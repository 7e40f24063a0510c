"""Output folders tokq writes: an ownership marker in each, checked replacement and removal, a lock per folder.

tokq replaces or removes a folder only when it wrote it itself: the folder holds `.tokq-owner.json` (written
by `paths.atomic_directory`) naming the kind of folder and every entry tokq put there, and nothing else has
been added since. A user file dropped in later protects the folder; an empty folder may be used. Folders an
earlier tokq wrote, before markers existed, are recognised by the files only tokq writes there (a report's
report.json/.md/.html/junit.xml, a checkpoint's tokq_quantization.json beside weights, config and tokenizer
files, a default set's MANIFEST.json and the documents it lists, a zoo model's provenance.json).

`output_lock` holds an flock on the sibling `.NAME.lock` while a folder is written, so two tokq processes
never write one folder at once: the second fails fast, naming the first's pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokq.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking
    fcntl = None  # type: ignore[assignment]

MARKER = ".tokq-owner.json"


@dataclass(frozen=True)
class FolderKind:
    """What a folder is (the marker's "kind"), and how to recognise one an earlier tokq wrote without a marker."""

    name: str
    label: str  # in messages: "is not a tokq <label> folder"
    legacy: Callable[[Path, set[str]], bool] = field(default=lambda folder, entries: False)


def _legacy_report(folder: Path, entries: set[str]) -> bool:
    names = {"report.json", "report.md", "report.html", "junit.xml"}
    return "report.json" in entries and all(e in names or e.endswith(".png") for e in entries)


_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
# The tokenizer files a checkpoint carries beside its weights (quantization.formats.compressed_tensors copies them).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


def _checkpoint_files(entries: set[str], extra: set[str]) -> bool:
    known = {"config.json", *TOKENIZER_FILES, *extra}
    return all(e in known or _WEIGHTS.fullmatch(e) for e in entries)


def _legacy_checkpoint(folder: Path, entries: set[str]) -> bool:
    return "tokq_quantization.json" in entries and _checkpoint_files(entries, {"tokq_quantization.json"})


def _legacy_model(folder: Path, entries: set[str]) -> bool:
    return "provenance.json" in entries and _checkpoint_files(entries, {"provenance.json"})


def _legacy_document_set(folder: Path, entries: set[str]) -> bool:
    try:
        manifest = json.loads((folder / "MANIFEST.json").read_text(encoding="utf-8"))
        listed = {str(d["path"]).split("/", 1)[0] for d in manifest["documents"]}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return entries <= {"MANIFEST.json", "MANIFEST.tsv", *listed}


GENERIC = FolderKind("folder", "output")
REPORT = FolderKind("report", "report", _legacy_report)
CHECKPOINT = FolderKind("checkpoint", "checkpoint", _legacy_checkpoint)
MODEL = FolderKind("model", "zoo model", _legacy_model)
DOCUMENT_SET = FolderKind("document-set", "document set", _legacy_document_set)


def read_marker(folder: Path) -> dict | None:
    try:
        owner = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(owner, dict) and isinstance(owner.get("kind"), str) and isinstance(owner.get("entries"), list)
    return owner if ok else None


def write_marker(folder: Path, kind: FolderKind, written_by: str) -> None:
    """List every entry of `folder` (written by tokq) in its marker: anything added later is the user's."""
    from tokq import __version__

    entries = sorted(p.name for p in Path(folder).iterdir() if p.name != MARKER)
    owner = {"written_by": written_by, "kind": kind.name, "tokq_version": __version__, "entries": entries}
    (Path(folder) / MARKER).write_text(json.dumps(owner, indent=2) + "\n", encoding="utf-8")


def _refuse(folder: Path, why: str, option: str, yourself: bool = True) -> ConfigError:
    fix = ", or remove it yourself if nothing in it is needed" if yourself else ""
    return ConfigError(f"{folder} {why}: choose another {option}{fix}")


def check_replaceable(folder: Path, kind: FolderKind, option: str = "--out") -> None:
    """Raise ConfigError unless `folder` is absent, empty, or a `kind` folder tokq wrote with nothing added."""
    folder = Path(folder)
    if folder.is_symlink():
        raise _refuse(folder, "is a symbolic link, not a folder tokq wrote", option)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise _refuse(folder, f"is a file, not a tokq {kind.label} folder", option)
    here = Path.cwd().resolve()
    if here == folder.resolve() or folder.resolve() in here.parents:
        raise _refuse(folder, f"is the working directory {here} or one above it, never replaced", option, False)
    entries = {p.name for p in folder.iterdir()}
    if not entries:
        return
    owner = read_marker(folder)
    if owner is None:
        if MARKER not in entries and kind.legacy(folder, entries):
            return
        raise _refuse(folder, f"exists and is not a tokq {kind.label} folder (no readable {MARKER} says tokq "
                              "wrote it)", option)
    if owner["kind"] != kind.name:
        raise _refuse(folder, f"holds a tokq {owner['kind']}, not a {kind.label} ({owner.get('written_by')} "
                              "wrote it)", option)
    added = sorted(entries - set(owner["entries"]) - {MARKER})
    if added:
        shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
        raise _refuse(folder, f"is a tokq {kind.label} folder that now also holds files tokq did not write "
                              f"({shown})", option)


def remove_owned(folder: Path, kind: FolderKind, option: str = "--out") -> None:
    """Remove `folder` after `check_replaceable`; moved aside first, so it is gone at once even if the
    deletion of its files is interrupted."""
    folder = Path(folder)
    check_replaceable(folder, kind, option)
    if not folder.exists():
        return
    aside = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    folder.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


# lock file -> (fd, depth): a process that holds a folder's lock may take it again (gate -> write report)
_held: dict[str, list[int]] = {}


def lock_path(folder: Path) -> Path:
    folder = Path(os.path.abspath(folder))
    return folder.parent / f".{folder.name}.lock"


@contextlib.contextmanager
def output_lock(folder: Path, option: str = "--out", wait: bool = False) -> Iterator[None]:
    """Hold the flock on `folder`'s sibling `.NAME.lock` for the block; another process holding it is an
    error naming its pid (or, with `wait`, waited for). The lock file is removed when the block ends."""
    path = lock_path(folder)
    key = str(path)
    if key in _held:  # this process holds it already (the gate writing its report)
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    if fcntl is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire(path, folder, option, wait)
    except OSError as exc:  # a parent that is a file, a read-only folder: before any work, not after
        raise ConfigError(f"{folder} cannot be written ({exc.strerror or exc}): choose another {option}") from None
    _held[key] = [fd, 1]
    try:
        yield
    finally:
        del _held[key]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # unlinked while still locked: a process waiting on this inode sees it and retries
        os.close(fd)


def _acquire(path: Path, folder: Path, option: str, wait: bool) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"another tokq process (pid {holder}) is writing {folder}: wait for it, or choose "
                              f"another {option}") from None
        except BaseException:
            os.close(fd)
            raise
        # The holder before us may have removed the file after we opened it: only the file at `path` counts.
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_ino, current.st_dev) == (mine.st_ino, mine.st_dev):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)
