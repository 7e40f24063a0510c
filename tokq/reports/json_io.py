"""JSON results: the source of truth every other report is rendered from."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from tokq.errors import ConfigError
from tokq.paths import atomic_write_text


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader can parse the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def check_json_target(path: str | Path | None, option: str = "--json") -> None:
    """Refuse, before any work, a JSON path that cannot be written: an existing folder or special file, a
    path under a file, or a folder the user cannot write (probed with a temporary file, so a read-only mount
    is caught too). Creates nothing: folders that do not exist yet are made when the JSON is written."""
    if path is None:
        return
    path = Path(path)
    try:
        _check_writable(path, option)
    except OSError as exc:  # a folder on the way that cannot be searched
        raise ConfigError(f"{option} {path} cannot be written ({exc.strerror}); give another path") from None


def _check_writable(path: Path, option: str) -> None:
    if path.is_dir():
        raise ConfigError(f"{option} {path} is a folder: give a file path, e.g. {path / 'result.json'}")
    if path.exists() and not path.is_file():  # a device or pipe: the atomic rename would replace it
        raise ConfigError(f"{option} {path} is not a regular file: give a file path")
    folder = path.parent
    while not folder.exists():  # the nearest existing folder is where the missing ones will be created
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{option} {path}: {folder} is a file, so no folder can be created there; give another "
                          "path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tokq-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: {folder} cannot be written ({exc.strerror}); give another path") from None


def write_json(path: str | Path, payload: dict, option: str = "--json") -> Path:
    """Write `payload` atomically (temp file + rename) as indented JSON. The target is checked again: it may
    have changed since the command's early check_json_target."""
    path = Path(path)
    check_json_target(path, option)
    from tokq.remote.urls import redact

    # no server address with its user:password in a results file (remote/urls.py)
    atomic_write_text(path, redact(json.dumps(_clean(payload), indent=2, sort_keys=False)) + "\n")
    return path
