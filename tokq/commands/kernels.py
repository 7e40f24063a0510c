"""`tokq kernels list MODEL`: which kernel runs each kind of layer of a model, and why."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from tokq import __version__

if TYPE_CHECKING:
    import torch

kernels_app = typer.Typer(name="kernels", help="The kernel registry: which kernel runs each quantized layer.",
                          no_args_is_help=True)
console = Console(stderr=True)


def kernel_rows(model) -> list[dict]:
    """One row per distinct (layer kind, shape, format): the kernel chosen and why higher-priority ones were not."""
    from tokq.dtypes import DTYPE_NAMES
    from tokq.engine.layers import Linear
    from tokq.engine.quant_linear import QuantizedLinearMethod
    from tokq.kernels.problem import LinearProblem
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


def attention_rows(model, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int = 16) -> list[dict]:
    """One row per distinct attention layer kind (global, sliding window): the paged-attention kernel chosen."""
    from tokq.dtypes import dtype_name
    from tokq.kernels.attention import AttentionProblem
    from tokq.kernels.registry import choose, explain

    config = model.config
    device = next(model.parameters()).device.type
    rows: dict[int | None, dict] = {}
    for layer in range(config.num_layers):
        window = config.layer_window(layer)
        if window in rows:
            rows[window]["count"] += 1
            continue
        problem = AttentionProblem(device, dtype, kv_dtype, config.num_heads, config.num_kv_heads, config.head_dim,
                                   block_size, window)
        candidate, reason = choose(problem)
        verdicts = explain(problem)
        names = [v.name for v in verdicts]
        rows[window] = {
            "layer": "attention" if window is None else f"attention (window {window})",
            "heads": config.num_heads, "kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "format": f"paged, {dtype_name(kv_dtype)} KV, block {block_size}", "dtype": dtype_name(dtype),
            "kernel": candidate.name, "reason": reason, "count": 1,
            "skipped": [{"kernel": v.name, "reason": v.reason} for v in verdicts[: names.index(candidate.name)]],
        }
    return list(rows.values())


@kernels_app.command("list")
def list_cmd(
    model: str = typer.Argument(..., help="Checkpoint directory, zoo name or tokq.toml variant."),
    dtype: str = typer.Option("bf16", "--dtype", help="Compute dtype the model is loaded in: bf16, fp32, fp16."),
    json_path: Path = typer.Option(None, "--json", help="Also write the table as JSON to this path."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    seed: int = typer.Option(0, "--seed", help="Random seed (recorded in the JSON)."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype",
                                 help="KV cache dtype for the attention rows: auto (the compute dtype), fp32, bf16, "
                                      "fp16, int8, fp8."),
) -> None:
    """Load MODEL and print, per kind of layer, the kernel the registry chose and why (TOKQ_KERNELS applies)."""
    from tokq.engine.checkpoint import load_model
    from tokq.errors import ConfigError
    from tokq.kernels.registry import ENV, KernelError, Selection
    from tokq.reports.json_io import check_json_target, write_json
    from tokq.runtime import setup_runtime
    from tokq.zoo import resolve_model

    check_json_target(json_path)  # refused before the model is loaded, not after
    runtime = setup_runtime(threads, device, seed)
    try:
        Selection.from_env()
    except KernelError as exc:
        raise ConfigError(str(exc)) from exc
    from tokq.dtypes import kv_dtype_of

    try:
        kv = kv_dtype_of(dtype if kv_dtype == "auto" else kv_dtype)
    except ValueError as exc:
        raise ConfigError(f"--kv-dtype {kv_dtype}: {exc}") from exc
    checkpoint = resolve_model(model)
    with console.status(f"loading {model} ({dtype}, {runtime.device})...", spinner="dots"):
        lm = load_model(checkpoint, dtype=dtype, device=runtime.device)
    rows = kernel_rows(lm)
    attention = attention_rows(lm, next(lm.parameters()).dtype, kv)
    selection = os.environ.get(ENV) or None
    table = Table(title=f"{model}: kernels ({dtype} on {runtime.device}"
                        f"{f', {ENV}={selection}' if selection else ''})")
    for col in ("layer", "shape", "format", "layers", "kernel", "why not the ones before it"):
        # names never wrap or truncate (people grep for them); the reasons fold instead
        table.add_column(col, justify="right" if col == "layers" else "left",
                         no_wrap=col in ("layer", "layers", "kernel"), overflow="fold")
    for r in rows + attention:
        why = "\n".join(f"{s['kernel']}: {s['reason']}" for s in r["skipped"]) or "-"
        shape = f"{r['n']} x {r['k']}" if "n" in r else f"{r['heads']}/{r['kv_heads']} heads x {r['head_dim']}"
        table.add_row(r["layer"], shape, r["format"], str(r["count"]), f"[bold]{r['kernel']}[/]", why)
    Console().print(table)
    if json_path:
        write_json(json_path, {
            "tokq_version": __version__, "command": "kernels list", "model": model, "checkpoint": str(checkpoint),
            "dtype": dtype, ENV: selection, "runtime": runtime.to_json(), "layers": rows,
            "attention": attention,
        })
