"""`tokq init`: write a commented starter tokq.toml (base model, variants, data, bench workload, gate rules)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

console = Console(stderr=True)


def init_cmd(
    path: Path = typer.Option(Path("tokq.toml"), "--path", help="Where to write it."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file."),
    model: str = typer.Option("smollm2-135m", "--model", help="The base model: a zoo name (its int4 group size comes "
                              "from the zoo's table) or a checkpoint folder."),
    data: str = typer.Option("default", "--data", help="What the gate judges on: a built-in set (default, code) or "
                             "a folder of your documents, relative to the file."),
) -> None:
    """Write a commented starter tokq.toml to edit (it refuses to replace one unless --force)."""
    from tokq.config import load_project
    from tokq.config_starter import starter
    from tokq.errors import ConfigError
    from tokq.paths import atomic_write_text

    if path.is_dir():  # --force replaces a file, never a folder
        raise ConfigError(f"--path {path} is a folder: name the file to write, e.g. --path {path / 'tokq.toml'}")
    if path.exists() and not force:
        raise ConfigError(f"{path} already exists: edit it, or pass --force to replace it with the starter")
    # Nothing of this machine goes into the file (it is committed and read on other machines, CI included): the
    # documents are tokq's built-in set by name, and every path in it is relative to the file.
    atomic_write_text(path, starter(model, data))
    project = load_project(path)  # the starter must always parse
    console.print(f"wrote {path}: base {project.base}, {len(project.variants)} variant(s), "
                  f"{len(project.quality) + len(project.speed)} gate rule(s); edit it, then run `tokq gate`")
