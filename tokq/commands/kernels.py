"""`tokq kernels list MODEL`: which kernel runs each kind of layer of a model, and why."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tokq import __version__

kernels_app = typer.Typer(name="kernels", help="The kernel registry: which kernel runs each quantized layer.",
                          no_args_is_help=True)
console = Console(stderr=True)


def kernel_rows(model) -> list[dict]:
    """One row per distinct (layer kind, shape, format): the kernel chosen and why higher-priority ones were not."""
    from tokq.engine.layers import Linear
    from tokq.engine.quant_linear import QuantizedLinearMethod
    from tokq.kernels.problem import DTYPE_NAMES, LinearProblem
    from tokq.kernels.registry import explain

    rows: dict[tuple, dict] = {}
    for module_name, layer in model.named_modules():
        if not isinstance(layer, Linear):
            continue
        kind = module_name.rpartition(".")[2]
        method = layer.method
        if isinstance(method, QuantizedLinearMethod):
            kernel = method.kernel_name
            fmt = method.name.replace(f":{kernel}", "")  # e.g. int4-g64, int4-g128+actorder
            problem = LinearProblem.of(method.weight, method.act, method.dtype)
            verdicts = explain(problem)
            names = [v.name for v in verdicts]
            skipped = [{"kernel": v.name, "reason": v.reason} for v in verdicts[: names.index(kernel)]] \
                if kernel in names else []
            reason = method.kernel.reason
            dtype = method.dtype
        else:
            dtype = layer.weight.dtype
            fmt, kernel, skipped, reason = "dense", "dense", [], "F.linear on the dense weight"
        key = (kind, layer.out_features, layer.in_features, fmt, kernel)
        row = rows.setdefault(key, {
            "layer": kind, "n": layer.out_features, "k": layer.in_features, "format": fmt,
            "dtype": DTYPE_NAMES.get(dtype, str(dtype)), "kernel": kernel, "reason": reason, "count": 0,
            "skipped": skipped,
        })
        row["count"] += 1
    return list(rows.values())


@kernels_app.command("list")
def list_cmd(
    model: str = typer.Argument(..., help="Checkpoint directory, zoo name or tokq.toml variant."),
    dtype: str = typer.Option("bf16", "--dtype", help="Compute dtype the model is loaded in: bf16, fp32, fp16."),
    json_path: Path = typer.Option(None, "--json", help="Also write the table as JSON to this path."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    seed: int = typer.Option(0, "--seed", help="Random seed (recorded in the JSON)."),
) -> None:
    """Load MODEL and print, per kind of layer, the kernel the registry chose and why (TOKQ_KERNELS applies)."""
    from tokq.engine.checkpoint import load_model
    from tokq.errors import ConfigError
    from tokq.kernels.registry import ENV, KernelError, Selection
    from tokq.reports.json_io import write_json
    from tokq.runtime import setup_runtime
    from tokq.zoo import resolve_model

    runtime = setup_runtime(threads, device, seed)
    try:
        Selection.from_env()
    except KernelError as exc:
        raise ConfigError(str(exc)) from exc
    checkpoint = resolve_model(model)
    with console.status(f"loading {model} ({dtype}, {runtime.device})...", spinner="dots"):
        lm = load_model(checkpoint, dtype=dtype, device=runtime.device)
    rows = kernel_rows(lm)
    selection = os.environ.get(ENV) or None
    table = Table(title=f"{model}: kernels ({dtype} on {runtime.device}"
                        f"{f', {ENV}={selection}' if selection else ''})")
    for col in ("layer", "N x K", "format", "layers", "kernel", "why not the ones before it"):
        table.add_column(col, justify="right" if col == "layers" else "left")
    for r in rows:
        why = "\n".join(f"{s['kernel']}: {s['reason']}" for s in r["skipped"]) or "-"
        table.add_row(r["layer"], f"{r['n']} x {r['k']}", r["format"], str(r["count"]), f"[bold]{r['kernel']}[/]", why)
    Console().print(table)
    if json_path:
        write_json(json_path, {
            "tokq_version": __version__, "command": "kernels list", "model": model, "checkpoint": str(checkpoint),
            "dtype": dtype, ENV: selection, "runtime": runtime.to_json(), "layers": rows,
        })
