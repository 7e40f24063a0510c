"""`tokq init`: write a commented starter tokq.toml (base model, variants, data, bench workload, gate rules)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

console = Console(stderr=True)


def init_cmd(
    path: Path = typer.Option(Path("tokq.toml"), "--path", help="Where to write it."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file."),
) -> None:
    """Write a commented starter tokq.toml to edit (it refuses to replace one unless --force)."""
    from tokq.config import load_project
    from tokq.config_starter import STARTER
    from tokq.errors import ConfigError
    from tokq.paths import atomic_write_text, data_dir

    if path.is_dir():  # --force replaces a file, never a folder
        raise ConfigError(f"--path {path} is a folder: name the file to write, e.g. --path {path / 'tokq.toml'}")
    if path.exists() and not force:
        raise ConfigError(f"{path} already exists: edit it, or pass --force to replace it with the starter")
    # The default document set lives under $TOKQ_HOME: point the starter at this machine's copy.
    default_docs = data_dir() / "default"
    home = Path.home()
    shown = "~/" + default_docs.relative_to(home).as_posix() if default_docs.is_relative_to(home) else str(default_docs)
    atomic_write_text(path, STARTER.replace('"~/.cache/tokq/data/default"', f'"{shown}"'))
    project = load_project(path)  # the starter must always parse
    console.print(f"wrote {path}: base {project.base}, {len(project.variants)} variant(s), "
                  f"{len(project.quality) + len(project.speed)} gate rule(s); edit it, then run `tokq gate`")
