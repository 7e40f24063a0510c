"""`tokq sensitivity MODEL --data DIR`: what quantizing each decoder Linear (and block) costs, alone and against
everything else quantized; prints the most sensitive units.

The work is `tokq.api.sensitivity` (also `tokq.sensitivity(...)` from Python); this module parses the options and
prints the table.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tokq.api.sensitivity import DEFAULT_WINDOW, DEFAULT_WINDOWS
from tokq.longctx.read_limits import (
    DEFAULT_MAX_DOC_MB,
    DEFAULT_MAX_FILE_MB,
    MAX_DOC_MB_HELP,
    MAX_FILE_MB_HELP,
)

console = Console(stderr=True)


def sensitivity_cmd(
    model: str = typer.Argument(..., help="The 16-bit model: zoo name, checkpoint directory or tokq.toml variant."),
    data: str = typer.Option(None, "--data", help="Folder of documents, or a tokq.toml \\[data.NAME] set name "
                                                  "(default: the default long-document set)."),
    scheme: list[str] = typer.Option(None, "--scheme", help="A format to measure (repeatable; default: w4a16 and "
                                                            "w8a16), resolved for the model as tokq quantize does."),
    method: str = typer.Option("rtn", "--method", help="Method whose presets --scheme names (the units are rounded "
                                                       "with RTN)."),
    window: int = typer.Option(DEFAULT_WINDOW, "--window", help="Tokens per window."),
    windows: int = typer.Option(DEFAULT_WINDOWS, "--windows", help="Windows scored, spread evenly over the "
                                "documents (time grows with windows x window; the default fits SmolLM2-135M in "
                                "~7 minutes on 2 quiet CPU cores)."),
    wide_gain: bool = typer.Option(True, "--wide-gain/--no-wide-gain", help="Also measure what keeping each unit "
                                   "wide buys when everything else is quantized (doubles the time)."),
    blocks: bool = typer.Option(True, "--blocks/--no-blocks", help="Also measure whole blocks."),
    top: int = typer.Option(15, "--top", help="Rows of the printed table (the most sensitive units)."),
    topk: int = typer.Option(256, "--topk", help="The base's top-k kept per position."),
    full_kl_rows: int = typer.Option(256, "--full-kl-rows", help="Positions scored over the whole vocabulary "
                                     "(the KL beyond the top-k is measured there; 0: the top-k lower bound only)."),
    resamples: int = typer.Option(1000, "--resamples", help="Bootstrap resamples for the 95% CIs."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Score the base again instead of reading its cached "
                                                            "scores."),
    strict: bool = typer.Option(False, "--strict", help="Fail on unreadable or binary files instead of skipping them."),
    max_doc_mb: float = typer.Option(DEFAULT_MAX_DOC_MB, "--max-doc-mb", help=MAX_DOC_MB_HELP),
    max_file_mb: float = typer.Option(DEFAULT_MAX_FILE_MB, "--max-file-mb", help=MAX_FILE_MB_HELP),
    json_path: Path = typer.Option(None, "--json", help="Write every number as JSON to this path."),
    report_dir: Path = typer.Option(None, "--report-dir", help="Write report.json and report.html (per-layer "
                                                               "plots) to this folder."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap and the full-KL sample."),
) -> None:
    """Per decoder Linear and block: KL, top-1 and ΔNLL (95% CIs over documents) of quantizing it alone, and the
    gain of keeping it wide when everything else is quantized; bytes per format."""
    from tokq.api.compare import resolve_data
    from tokq.api.sensitivity import SensitivitySettings, run_sensitivity
    from tokq.reports.json_io import check_json_target
    from tokq.runtime import setup_runtime

    check_json_target(json_path)  # refused before minutes of measuring, not after
    if report_dir:
        from tokq.reports.folder import check_report_folder

        check_report_folder(report_dir, "--report-dir")
    runtime = setup_runtime(threads, device, seed)
    folder, _ = resolve_data(data)
    s = SensitivitySettings(schemes=tuple(scheme or ("w4a16", "w8a16")), method=method, window=window,
                            windows=windows, wide_gain=wide_gain, blocks=blocks, topk=topk, full_kl_rows=full_kl_rows,
                            resamples=resamples, use_cache=not no_cache, strict=strict, max_doc_mb=max_doc_mb,
                            max_file_mb=max_file_mb, seed=seed)
    result = run_sensitivity(model, folder, s, runtime)
    Console().print(sensitivity_table(result, top))
    w = result.windows
    console.print(f"{w['count']} windows of up to {w['window']} tokens from {w['documents']} documents "
                  f"({w['scored_tokens']} scored tokens), {len(result.units)} measurements in {result.seconds:.0f} s",
                  highlight=False)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if json_path:
        result.write_json(json_path)
        console.print(f"json: {json_path}", highlight=False)
    if report_dir:
        console.print(f"report: {result.write_report(report_dir)}", highlight=False)


def _num(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3g}"


def _ci(est) -> str:
    """value over its interval: two short lines keep the table in an 80-column terminal."""
    return f"{_num(est.value)}\n[{_num(est.low)}, {_num(est.high)}]"


def sensitivity_table(result, top: int = 15) -> Table:
    """The `top` units with the largest alone KL at the first format, with every format's numbers beside."""
    first = result.formats[0]
    ranked = sorted((u for u in result.units if u.fmt == first), key=lambda u: -_key(u.alone["kl"].value))
    table = Table(title=f"most sensitive units (ranked by KL alone at {first}; 95% CIs over documents)")
    table.add_column("layer.unit", no_wrap=True)
    for fmt in result.formats:
        table.add_column(f"KL alone {fmt}", justify="right")
        if ranked and ranked[0].wide_gain is not None:
            table.add_column(f"keep-wide gain {fmt}", justify="right")
    table.add_column(f"top-1 alone {first}", justify="right")
    for u in ranked[:top]:
        row = [u.unit.removeprefix("model.layers.") + (" (block)" if u.kind == "block" else "")]
        for fmt in result.formats:
            cost = result.unit(u.unit, fmt)
            row.append(_ci(cost.alone["kl"]))
            if cost.wide_gain is not None:
                row.append(_ci(cost.wide_gain["kl"]))
        row.append(f"{u.alone['top1'].value:.2%}")
        table.add_row(*row)
    return table


def _key(x: float) -> float:
    return x if math.isfinite(x) else -math.inf
