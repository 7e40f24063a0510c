"""The project file tokq.toml: which variants (name -> checkpoint) a project knows.

Only the `[variants]` table is read here; the gate issue adds data sets, workloads and rules.
    [variants]
    int4 = "out/smollm2-awq-int4"          # a path, relative to tokq.toml
    base = { path = "~/models/llama" }
"""

from __future__ import annotations

import os
import re
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


def variants_table(path: Path) -> dict:
    """tokq.toml's [variants] ({} when it has none); `variants = 5` or a list is an error naming file:line."""
    variants = load_config(path).get("variants", {})
    if not isinstance(variants, dict):
        from tokq.config import table_error  # tokq.config imports this module

        raise table_error(path, "", "variants", f"= {variants!r} must be a table: fix the file, e.g. [variants] "
                                                "with one `name = \"path\"` line per checkpoint")
    return variants


def find_variant(name: str) -> Path | None:
    """The checkpoint path of variant `name` in tokq.toml, or None if there is no such variant."""
    path = find_config()
    if path is None:
        return None
    variants = variants_table(path)
    if name not in variants:
        return None
    entry = variants[name]
    target = entry.get("path") if isinstance(entry, dict) else entry
    if not isinstance(target, str):
        raise ConfigError(f"{path}: variant {name!r} needs a checkpoint path (a string or {{ path = \"...\" }})")
    resolved = Path(target).expanduser()
    return resolved if resolved.is_absolute() else path.parent / resolved


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def check_variant_name(name: str) -> None:
    """A variant name is a TOML bare key (so `tokq score NAME` and the gate's messages name it as written)."""
    if not _BARE_KEY.fullmatch(name):
        raise ConfigError(f"--name {name!r}: a variant name is ASCII letters, digits, '-' and '_' (a TOML bare "
                          "key), e.g. int4 or awq-g64")


def variants_file() -> Path:
    """The tokq.toml that `record_variant` edits: the one found, else a new one in the working directory."""
    return find_config() or Path.cwd() / CONFIG_NAME


def check_recordable(path: Path) -> None:
    """Refuse, before any work, a tokq.toml that `record_variant` could not edit: one that does not parse, or
    whose `variants` is not a table."""
    import tomlkit

    if not path.exists():
        return
    variants_table(path)
    try:
        tomlkit.parse(path.read_text(encoding="utf-8"))
    except tomlkit.exceptions.TOMLKitError as exc:  # tomllib read it: a corner tomlkit cannot keep as it is
        raise ConfigError(f"{path}: cannot be edited without changing it ({exc}): add the variant yourself") from exc


def record_variant(name: str, checkpoint: Path, fields: dict[str, str], config: Path | None = None) -> Path:
    """Add or replace `name = { path = ..., **fields }` in tokq.toml's [variants] table.

    Edited with tomlkit, which keeps comments and layout and escapes what it writes (a newline or a quote in
    a path); an inline `variants = { ... }` gets the entry inline. The result is parsed again and must hold
    exactly the old content plus this entry before it atomically replaces the file; tokq.toml's lock is held
    while it is read, edited and written, so two runs recording variants at once both land. The file is
    created in the working directory when no tokq.toml is found. Paths are stored relative to the file when
    they sit below it, so a project folder can move.
    """
    import tomlkit

    from tokq.outputs import output_lock
    from tokq.paths import atomic_write_text

    check_variant_name(name)
    path = config or variants_file()
    checkpoint = checkpoint.resolve()
    try:
        stored = checkpoint.relative_to(path.parent.resolve()).as_posix()
    except ValueError:
        stored = str(checkpoint)
    entry = {"path": stored, **fields}
    with output_lock(path, wait=True):
        check_recordable(path)
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        doc = tomlkit.parse(text)
        table = tomlkit.inline_table()
        table.update(entry)
        if "variants" in doc:
            doc["variants"][name] = table
        else:
            variants = tomlkit.table()
            variants.add(name, table)
            doc.add("variants", variants)
        edited = tomlkit.dumps(doc)
        expected = tomllib.loads(text)
        expected.setdefault("variants", {})[name] = entry
        try:
            ok = tomllib.loads(edited) == expected
        except tomllib.TOMLDecodeError:
            ok = False
        if not ok:
            raise ConfigError(f"{path}: adding variant {name} would change more than that entry; add "
                              f"`{name} = {{ path = {tomlkit.string(stored).as_string()} }}` under [variants] "
                              "yourself")
        atomic_write_text(path, edited)
    return path
