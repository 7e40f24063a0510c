"""Sub-command groups of the tokq CLI, one module each; `tokq/cli.py` mounts them with `add_typer`."""
