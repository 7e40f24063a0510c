"""tokq's own document sets by name: what `builtin = "default"` in a [data.NAME] table and `--data default` mean.

A tokq.toml that names a set rather than a path is the same file on every machine (a committed config, a CI
runner, a colleague's laptop): each machine keeps its copy under `$TOKQ_HOME/data/<name>` and builds it from its
own licence-clean sources the first time it is used (`tokq data build-default` builds the same thing ahead of
time). Light at import: no torch, no tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tokq.errors import ConfigError
from tokq.paths import data_dir

# Names `builtin = ...` and `--data` accept: `default` (long prose and manuals, with the CPython standard library's
# code), `code` (C++ and Python source of packages tokq installs; see longctx.code_sources).
BUILTIN_SETS = ("default", "code")


def builtin_problem(name: object) -> str | None:
    """Why `name` is not a built-in set's name (None when it is)."""
    if isinstance(name, str) and name in BUILTIN_SETS:
        return None
    return f"= {name!r} is not a built-in document set; known: {', '.join(BUILTIN_SETS)}"


def builtin_set_path(name: str) -> Path:
    """Where this machine keeps built-in set `name` (built or not)."""
    problem = builtin_problem(name)
    if problem:
        raise ConfigError(f"builtin {problem}")
    return data_dir() / name


def is_built(name: str) -> bool:
    return (builtin_set_path(name) / "MANIFEST.json").is_file()


def ensure_builtin_set(name: str, say: Callable[[str], None] | None = None) -> Path:
    """Built-in set `name`'s folder on this machine, built first when it is not there yet."""
    folder = builtin_set_path(name)
    if is_built(name):
        return folder
    from tokq.longctx.default_set import build_default_set

    (say or print)(f"building tokq's built-in document set {name!r} in {folder} (first use on this machine)")
    build_default_set(folder, sources=builtin_sources(name))
    return folder


def calibration_folder(calib: Path | None, say: Callable[[str], None] | None = None) -> Path:
    """The folder `--calib` means: the default set when not given, a built-in set when it names one (`--calib code`)
    and no folder of that name exists here, else the folder as given (checked where it is read)."""
    if calib is None:
        return ensure_builtin_set("default", say)
    if not calib.exists() and builtin_problem(str(calib)) is None:
        return ensure_builtin_set(str(calib), say)
    return calib


def builtin_sources(name: str):
    """The source specs built-in set `name` is assembled from; None for `default` (the builder's own default)."""
    if name == "code":
        from tokq.longctx.code_sources import code_sources

        return code_sources()
    return None
