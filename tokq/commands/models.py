"""`tokq models list` and `tokq models pull NAME`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tokq import zoo
from tokq.reports.json_io import check_json_target, write_json

models_app = typer.Typer(name="models", help="The model zoo: real models shipped as GGUF in PyPI packages.", no_args_is_help=True)
console = Console(stderr=True)


@models_app.command("list")
def list_cmd(json_path: Path = typer.Option(None, "--json", help="Also write the list as JSON to this path.")) -> None:
    """List the zoo models, whether they are pulled, and where."""
    check_json_target(json_path)
    rows = zoo.list_models()
    table = Table(title=f"tokq model zoo (cache: {zoo.models_dir()})")
    for col in ("name", "architecture", "licence", "pulled", "description"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["architecture"], r["licence"], "yes" if r["pulled"] else "no", r["description"])
    Console().print(table)
    if json_path:
        write_json(json_path, {"models": rows})


@models_app.command("pull")
def pull_cmd(
    name: str = typer.Argument(..., help=f"Zoo model name: {', '.join(zoo.ZOO)}."),
    force: bool = typer.Option(False, "--force", help="Convert again even if already pulled."),
    json_path: Path = typer.Option(None, "--json", help="Write the provenance record as JSON to this path."),
) -> None:
    """Install the model's package if missing, dequantize its GGUF into a bf16 checkpoint under $TOKQ_HOME."""
    check_json_target(json_path)  # refused before the pull, not after
    already = zoo.is_pulled(name) and not force
    with console.status(f"pulling {name} (install package, dequantize GGUF, write safetensors)...", spinner="dots"):
        path = zoo.pull(name, force=force)
    console.print(f"{name}: {'already pulled' if already else 'pulled'} -> {path}")
    print(path)
    if json_path:
        import json

        write_json(json_path, json.loads((path / zoo.PROVENANCE).read_text()) | {"path": str(path)})
