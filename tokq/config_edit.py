"""Adding a variant to tokq.toml (`tokq quantize --name`): the [variants] entry, edited in place with tomlkit.

Reading tokq.toml is tokq.config's; this module only writes it, through `record_variant`, after
`check_variant_name` and `check_recordable` refused before any work what it could not write.
"""

from __future__ import annotations

import re
from pathlib import Path

from tokq.config import CONFIG_NAME, find_config, tomllib, variants_table
from tokq.errors import ConfigError

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
