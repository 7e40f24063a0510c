"""`tokq quantize --method M --model X --out DIR`: quantize a model and write a compressed-tensors checkpoint.

The work is `tokq.api.quantize.run_quantize` (also `tokq.quantize(...)` from Python); this module parses the
options into QuantizeSettings and prints the summary table.

Each QuantizeSettings field is the option of the same name here and a tokq.toml recipe key
(tests/test_recipe.py keeps them in step). The hidden `--recipe-sha256` records a recipe's hash in
tokq_quantization.json (the gate passes it to the API directly).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tokq.longctx.read_limits import (
    DEFAULT_MAX_DOC_MB,
    DEFAULT_MAX_FILE_MB,
    MAX_DOC_MB_HELP,
    MAX_FILE_MB_HELP,
)

console = Console(stderr=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def quantize_cmd(
    method: str = typer.Option(..., "--method", help="rtn, awq, gptq, smoothquant or fp8; none (with --kv-cache): "
                               "keep the weights, quantize only the KV cache."),
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
    gptq_scales: str = typer.Option(
        "mse", "--gptq-scales",
        help="GPTQ: each group's grid range: 'mse' (the clip ratio with the least rounding error, default) or "
        "'minmax' (the group's full range).",
    ),
    alpha: str = typer.Option(
        None, "--alpha",
        help="SmoothQuant migration strength in [0, 1] (default 0.5) or 'search'; with --method fp8, smooth "
        "activations into the weights before FP8 W8A8 (calibrated).",
    ),
    calib: Path = typer.Option(None, "--calib", help="Folder of calibration documents, or a built-in set: default (the default) or code."),
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
    mix: str = typer.Option(
        None, "--mix",
        help="Choose a format per Linear from these (e.g. w4a16,w8a16,bf16) by measured sensitivity, verified on "
        "held-out documents of --calib; needs --target-kl or --max-size-ratio.",
    ),
    target_kl: float = typer.Option(
        None, "--target-kl",
        help="--mix: the smallest build whose held-out mean KL (its 95% upper bound) is at most this (nats).",
    ),
    max_size_ratio: float = typer.Option(
        None, "--max-size-ratio",
        help="--mix: the lowest-KL build whose tensors take at most this fraction of the model's 16-bit size.",
    ),
    kv_cache: str = typer.Option(
        None, "--kv-cache",
        help="Also quantize the KV cache: fp8 or int8, with K/V scales per layer and KV head calibrated on the "
        "calibration windows and written as compressed-tensors' kv_cache_scheme (vLLM loads fp8).",
    ),
    kv_cache_strategy: str = typer.Option(
        "attn_head", "--kv-cache-strategy",
        help="--kv-cache scales: attn_head (one per KV head) or tensor (one per layer, for readers without "
        "per-head KV scales).",
    ),
    lm_head: str = typer.Option(
        "16bit", "--lm-head",
        help="The output layer: 16bit (as the source has it) or int8 (one scale per vocabulary row, untied from the "
        "embedding): faster decoding; HF transformers loads it, vLLM keeps output layers 16-bit.",
    ),
    in_memory: bool = typer.Option(
        False, "--in-memory",
        help="Load the whole model in fp32 first instead of streaming one decoder block at a time (the same "
        "checkpoint, more memory; --mix searches and --kv-cache always do).",
    ),
    recipe_sha256: str = typer.Option(None, "--recipe-sha256", hidden=True,
                                      help="tokq gate: the hash of the recipe this build follows (recorded)."),
) -> None:
    """Quantize MODEL with METHOD and write a checkpoint that tokq, vLLM and HF transformers load."""
    from tokq.api.quantize import run_quantize
    from tokq.reports.json_io import check_json_target, write_json
    from tokq.settings import QuantizeSettings

    check_json_target(json_path)  # refused before the quantization, not after
    settings = QuantizeSettings(method=method, scheme=scheme, bits=bits, group_size=group_size, sym=sym,
                                act_order=act_order, damp=damp, gptq_scales=gptq_scales, alpha=alpha, calib=calib, num_samples=num_samples,
                                seq_len=seq_len, max_doc_mb=max_doc_mb, max_file_mb=max_file_mb,
                                save_dtype=save_dtype, seed=seed, mix=mix, target_kl=target_kl,
                                max_size_ratio=max_size_ratio, kv_cache=kv_cache,
                                kv_cache_strategy=kv_cache_strategy, lm_head=lm_head)
    result = run_quantize(model, out, settings, force=force, name=name, recipe_sha256=recipe_sha256,
                          threads=threads, device=device, in_memory=in_memory)
    _print_summary(result)
    if result.variant is not None:
        console.print(f"recorded variant [bold]{name}[/] in {result.recorded_in}: `tokq score {name}` now uses {out}")
    if json_path:
        write_json(json_path, result.to_json())


def _print_summary(result) -> None:
    blocks = max(len(result.run.blocks), 1)
    table = Table(title=f"{result.model} -> {result.checkpoint} ({result.provenance['method']}, {result.scheme})")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("quantize time", f"{result.seconds:.1f} s ({result.seconds / blocks:.1f} s/block)")
    table.add_row("write time", f"{result.write_seconds:.1f} s")
    seconds = [b["seconds"] for b in result.run.blocks if "seconds" in b]
    if seconds:
        table.add_row("time per block", f"{min(seconds):.1f} to {max(seconds):.1f} s")
    table.add_row("peak RSS", f"{result.peak_rss_mib:,.0f} MiB ({result.walk})")
    if result.peak_gpu_bytes is not None:
        table.add_row("peak GPU memory", _mib(result.peak_gpu_bytes))
    disk, dense = result.size_bytes, result.dense_16bit_bytes
    table.add_row("size on disk", f"{_mib(disk)} ({disk / dense:.2f}x the 16-bit model's {_mib(dense)})")
    Console().print(table)

