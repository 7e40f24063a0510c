"""The project file tokq.toml: which variants (name -> checkpoint) a project knows.

Only the `[variants]` table is read here; the gate issue adds data sets, workloads and rules.
    [variants]
    int4 = "out/smollm2-awq-int4"          # a path, relative to tokq.toml
    base = { path = "~/models/llama" }
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tokq.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_NAME = "tokq.toml"


def find_config(start: Path | None = None) -> Path | None:
    """$TOKQ_CONFIG, else tokq.toml in the working directory or one of its parents."""
    if os.environ.get("TOKQ_CONFIG"):
        return Path(os.environ["TOKQ_CONFIG"])
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / CONFIG_NAME).is_file():
            return folder / CONFIG_NAME
    return None


def load_config(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}; fix the file or run `tokq init` for a starter") from exc
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror})") from exc


def find_variant(name: str) -> Path | None:
    """The checkpoint path of variant `name` in tokq.toml, or None if there is no such variant."""
    path = find_config()
    if path is None:
        return None
    variants = load_config(path).get("variants", {})
    if name not in variants:
        return None
    entry = variants[name]
    target = entry.get("path") if isinstance(entry, dict) else entry
    if not isinstance(target, str):
        raise ConfigError(f"{path}: variant {name!r} needs a checkpoint path (a string or {{ path = \"...\" }})")
    resolved = Path(target).expanduser()
    return resolved if resolved.is_absolute() else path.parent / resolved
