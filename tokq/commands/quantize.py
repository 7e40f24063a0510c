"""`tokq quantize --method M --model X --out DIR`: quantize a model and write a compressed-tensors checkpoint.

Order of work: every cheap check first (method/scheme fit, group size against the model's layer
sizes, output directory, calibration folder), then load the model, draw calibration windows,
quantize block by block with progress, write the checkpoint atomically (an interrupted run
leaves no directory that looks complete) and optionally record it as a tokq.toml variant.

`tokq gate` builds a variant from its tokq.toml recipe by calling this command: `recipe_options` maps recipe
keys to these options (read from the signature, so the two cannot drift apart), and the hidden
`--recipe-sha256` records the recipe's hash in tokq_quantization.json, written with the checkpoint.
"""

from __future__ import annotations

import inspect
import re
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, get_type_hints

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from tokq import __version__
from tokq.longctx.documents import DEFAULT_MAX_DOC_MB, DEFAULT_MAX_FILE_MB, MAX_DOC_MB_HELP, MAX_FILE_MB_HELP

console = Console(stderr=True)


def _parse_alpha(alpha: str | None, method: str) -> tuple[bool, float | None]:
    """(given, value): --alpha is a number in [0, 1] or 'search' (value None); SmoothQuant's, or fp8's
    optional migration before FP8 W8A8."""
    from tokq.errors import ConfigError

    if alpha is None:
        return False, None
    if method not in ("smoothquant", "fp8"):
        raise ConfigError(f"--alpha is SmoothQuant's migration strength; it does not apply to --method {method}")
    if alpha == "search":
        return True, None
    try:
        value = float(alpha)
    except ValueError:
        raise ConfigError(f"--alpha {alpha!r}: give a number in [0, 1] (e.g. 0.5) or 'search'") from None
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"--alpha {value} is outside [0, 1]: 0 keeps activations as they are, 1 moves all scale to weights")
    return True, value


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def quantize_cmd(
    method: str = typer.Option(..., "--method", help="rtn, awq, gptq, smoothquant or fp8."),
    model: str = typer.Option(..., "--model", help="Checkpoint directory, zoo name (pulled on demand) or tokq.toml variant."),
    out: Path = typer.Option(..., "--out", help="Directory to write the quantized checkpoint to (must not exist)."),
    scheme: str = typer.Option(
        None, "--scheme", help="w4a16, w4a16-asym, w8a16, w8a8-int8, w8a8-fp8 or fp8-weight-only (default: the method's)."
    ),
    bits: int = typer.Option(None, "--bits", help="Integer weight bits (2, 3, 4, 8) overriding the scheme's."),
    group_size: int = typer.Option(None, "--group-size", help="Weight group size (32, 64, 128...; -1: per-channel)."),
    sym: bool = typer.Option(None, "--sym/--asym", help="Symmetric (no zero point) or asymmetric integer weights."),
    act_order: bool = typer.Option(
        None, "--act-order/--no-act-order",
        help="GPTQ: quantize columns by decreasing activation energy, with static groups (default: on).",
    ),
    damp: float = typer.Option(0.01, "--damp", help="GPTQ: Hessian dampening as a fraction of its mean diagonal."),
    alpha: str = typer.Option(
        None, "--alpha",
        help="SmoothQuant migration strength in [0, 1] (default 0.5) or 'search'; with --method fp8, smooth "
        "activations into the weights before FP8 W8A8 (calibrated).",
    ),
    calib: Path = typer.Option(None, "--calib", help="Folder of calibration documents (default: the default long-document set)."),
    num_samples: int = typer.Option(32, "--num-samples", help="Calibration windows to draw."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per calibration window."),
    max_doc_mb: float = typer.Option(DEFAULT_MAX_DOC_MB, "--max-doc-mb", help="Calibration: " + MAX_DOC_MB_HELP),
    max_file_mb: float = typer.Option(DEFAULT_MAX_FILE_MB, "--max-file-mb", help="Calibration: " + MAX_FILE_MB_HELP),
    name: str = typer.Option(None, "--name", help="Record the result as this variant in tokq.toml (e.g. int4)."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it is a checkpoint tokq wrote."),
    save_dtype: str = typer.Option("auto", "--save-dtype", help="dtype of scales and 16-bit tensors: auto (the source's), bf16, fp16, fp32."),
    json_path: Path = typer.Option(None, "--json", help="Write the run record (scheme, calibration, per-block stats) as JSON."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]: where blocks are quantized."),
    seed: int = typer.Option(0, "--seed", help="Seed for drawing calibration windows (recorded)."),
    recipe_sha256: str = typer.Option(None, "--recipe-sha256", hidden=True,
                                      help="tokq gate: the hash of the recipe this build follows (recorded)."),
) -> None:
    """Quantize MODEL with METHOD and write a checkpoint that tokq, vLLM and HF transformers load."""
    from tokq.engine.checkpoint import load_model, parse_dtype
    from tokq.engine.config import read_config
    from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
    from tokq.errors import ConfigError, DataError
    from tokq.longctx.documents import read_limits
    from tokq.outputs import CHECKPOINT, check_replaceable, output_lock
    from tokq.paths import data_dir
    from tokq.project import check_recordable, check_variant_name, record_variant, variants_file
    from tokq.quantize.calibration import calibration_samples
    from tokq.quantize.formats.compressed_tensors import save_quantized
    from tokq.quantize.methods.options import MethodOptions
    from tokq.quantize.pipeline import METHODS, NEEDS_CALIBRATION, quantize_model, resolve_scheme
    from tokq.reports.json_io import check_json_target, write_json
    from tokq.runtime import setup_runtime
    from tokq.zoo import resolve_model

    if method not in METHODS:
        raise ConfigError(f"unknown --method {method!r}: choose one of {', '.join(METHODS)}")
    if act_order is not None and method != "gptq":
        raise ConfigError(f"--act-order is a GPTQ option; it does not apply to --method {method}")
    alpha_given, alpha_value = _parse_alpha(alpha, method)
    limits = read_limits(max_doc_mb, max_file_mb)
    if recipe_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", recipe_sha256):
        raise ConfigError(f"--recipe-sha256 {recipe_sha256!r} is not a sha256 (64 lowercase hex digits)")
    check_json_target(json_path)  # refused before the quantization, not after
    if name is not None:  # the tokq.toml edit is checked now, not once the quantization is done
        check_variant_name(name)
        check_recordable(variants_file())
    # The lock is held from before the checks on --out until the checkpoint is written and recorded: a second
    # `tokq quantize --out` on the same folder fails here, before any work.
    with output_lock(out):
        if out.exists() and not force:
            raise ConfigError(f"{out} already exists; choose another --out or pass --force to replace it")
        check_replaceable(out, CHECKPOINT)  # --force replaces only a checkpoint tokq wrote, nothing added since
        runtime = setup_runtime(threads, device, seed)
        checkpoint = resolve_model(model)
        config = read_config(checkpoint)
        resolved, notes = resolve_scheme(method, config, scheme, bits, group_size, sym)
        for note in notes:
            console.print(f"[yellow]note:[/] {note}")
        dtype = None if save_dtype == "auto" else parse_dtype(save_dtype)
        calibration = None
        # fp8 with --alpha: SmoothQuant's migration first, then the same FP8 quantization of weights and activations.
        run_method = "smoothquant" if method == "fp8" and alpha_given else method
        if run_method != method and resolved.activations is None:
            raise ConfigError(f"--alpha smooths activation outliers before FP8 W8A8; scheme {resolved.name} keeps "
                              "activations in 16-bit, so there is nothing to smooth")
        if run_method in NEEDS_CALIBRATION:
            if calib is None:
                calib = data_dir() / "default"
                if not calib.is_dir():
                    raise DataError(f"the default document set {calib} is not built yet: run `tokq data build-default` "
                                    "or pass --calib DIR")
            tokenizer = load_tokenizer(checkpoint)
            if seq_len > config.max_position_embeddings:
                raise DataError(f"--seq-len {seq_len} exceeds the context of {model} ({config.max_position_embeddings} tokens)")
            calibration = calibration_samples(calib, tokenizer, model_adds_bos(tokenizer), num_samples, seq_len, seed,
                                              limits)
        elif calib is not None:
            console.print(f"[yellow]note:[/] --method {method} needs no calibration data; --calib is ignored")

        options = MethodOptions(damp=damp)
        if act_order is not None:
            options.act_order = act_order
        if alpha_given:
            options.alpha = alpha_value
        # Methods search and quantize in fp32 on CPU (bf16 matmuls there are slow and less exact).
        lm = load_model(checkpoint, dtype="fp32", device=runtime.device)
        dense_bytes = 2 * sum(p.numel() for p in {id(p): p for p in lm.parameters()}.values())
        blocks = len(lm.model.layers)
        calib_desc = (f"{calibration.num_samples} x {calibration.seq_len} tokens from {calibration.source}"
                      if calibration else "none")
        console.print(f"quantizing {model} with {method} ({resolved.name}); calibration: {calib_desc}; "
                      f"{runtime.device}, {runtime.threads} threads")
        columns = (TextColumn(f"{method} block"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("blocks", total=blocks)
            result = quantize_model(lm, run_method, resolved, calibration, options, on_block=lambda _i: progress.advance(task))
        started_save = time.perf_counter()
        provenance = {"method": method, "source_model": model, "source_checkpoint": str(checkpoint),
                      "result": result.to_json(), "runtime": runtime.to_json()}
        if recipe_sha256 is not None:
            provenance["recipe_sha256"] = recipe_sha256  # in tokq_quantization.json, inside the atomic write
        save_quantized(lm, resolved, out, source_dir=checkpoint, dtype=dtype, force=force, provenance=provenance)
        save_seconds = time.perf_counter() - started_save
        disk = _dir_bytes(out)
        peak_gpu = None
        if str(runtime.device).startswith("cuda"):
            import torch

            peak_gpu = torch.cuda.max_memory_allocated(runtime.device)

        table = Table(title=f"{model} -> {out} ({method}, {resolved.name})")
        table.add_column("what")
        table.add_column("value", justify="right")
        table.add_row("quantize time", f"{result.seconds:.1f} s ({result.seconds / blocks:.1f} s/block)")
        table.add_row("write time", f"{save_seconds:.1f} s")
        table.add_row("peak RSS", f"{result.peak_rss_mib:,.0f} MiB")
        if peak_gpu is not None:
            table.add_row("peak GPU memory", _mib(peak_gpu))
        table.add_row("size on disk", f"{_mib(disk)} ({disk / dense_bytes:.2f}x the 16-bit model's {_mib(dense_bytes)})")
        Console().print(table)
        if name is not None:
            # path only: a variant takes path and recipe; method, scheme and source are in tokq_quantization.json
            toml = record_variant(name, out, {})
            console.print(f"recorded variant [bold]{name}[/] in {toml}: `tokq score {name}` now uses {out}")
        if json_path:
            write_json(json_path, {
                "tokq_version": __version__, "command": "quantize", "model": model, "checkpoint": str(checkpoint),
                "out": str(out), "variant": name, "size_bytes": disk, "dense_16bit_bytes": dense_bytes,
                "write_seconds": save_seconds, "peak_gpu_bytes": peak_gpu, **provenance,
            })


# Options a recipe cannot set: the gate sets them (model, out, force, threads, the recipe hash), or they would
# write somewhere else (name edits tokq.toml, json writes a run record).
_GATE_SETS = {"model", "out", "force", "threads", "recipe_sha256", "name", "json_path"}


@dataclass(frozen=True)
class RecipeOption:
    """One `tokq quantize` option as a tokq.toml recipe key: group_size = 64 -> --group-size 64."""

    key: str
    flag: str
    off_flag: str | None  # booleans: the flag that turns it off (--asym, --no-act-order)
    kind: type  # bool, int, float or str

    def accepts(self, value: Any) -> bool:
        if self.kind is bool or isinstance(value, bool):
            return self.kind is bool and isinstance(value, bool)
        if self.kind is int:
            return isinstance(value, int)
        if self.kind is float:
            return isinstance(value, (int, float))
        return isinstance(value, (str, int, float)) and str(value) != ""

    def describe(self) -> str:
        return {bool: "true or false", int: "an integer", float: "a number"}.get(self.kind, "a string")

    def args(self, value: Any) -> list[str]:
        if self.off_flag is not None:
            return [self.flag if value else self.off_flag]
        return [self.flag, str(value)]


@cache
def recipe_options() -> dict[str, RecipeOption]:
    """Recipe key -> option, read from `quantize_cmd`'s own signature (key: the flag without dashes)."""
    hints = get_type_hints(quantize_cmd)
    options = {}
    for param, spec in inspect.signature(quantize_cmd).parameters.items():
        if param in _GATE_SETS:
            continue
        flag, _, off_flag = spec.default.param_decls[0].partition("/")
        key = flag.removeprefix("--").replace("-", "_")
        kind = hints[param] if hints[param] in (bool, int, float) else str
        options[key] = RecipeOption(key, flag, off_flag or None, kind)
    return options
