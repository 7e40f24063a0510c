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


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def record_variant(name: str, checkpoint: Path, fields: dict[str, str], config: Path | None = None) -> Path:
    """Add or replace `name = { path = ..., **fields }` in tokq.toml's [variants] table.

    The file is edited as text (comments and other tables survive) and written atomically; it is
    created in the working directory when no tokq.toml is found. Paths are stored relative to the file
    when they sit below it, so a project folder can move.
    """
    from tokq.paths import atomic_write_text

    if not name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"variant name {name!r} must be letters, digits, '-' or '_' (it is a TOML key)")
    path = config or find_config() or Path.cwd() / CONFIG_NAME
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if text:
        load_config(path)  # refuse to edit a file that does not parse
    checkpoint = checkpoint.resolve()
    try:
        stored = checkpoint.relative_to(path.parent.resolve()).as_posix()
    except ValueError:
        stored = str(checkpoint)
    entry = ", ".join(f"{k} = {_toml_string(v)}" for k, v in {"path": stored, **fields}.items())
    line = f"{name} = {{ {entry} }}"
    lines = text.splitlines()
    header = next((i for i, raw in enumerate(lines) if raw.strip() == "[variants]"), None)
    if header is None:
        lines += ([""] if lines else []) + ["[variants]", line]
    else:
        end = next((i for i in range(header + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
        key = [i for i in range(header + 1, end) if lines[i].split("=", 1)[0].strip().strip('"') == name]
        if key:
            lines[key[0]] = line
        else:
            insert = end
            while insert > header + 1 and not lines[insert - 1].strip():
                insert -= 1  # keep blank lines before the next table
            lines.insert(insert, line)
    atomic_write_text(path, "\n".join(lines) + "\n")
    load_config(path)
    return path
