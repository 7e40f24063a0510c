"""`tokq score MODEL --data DIR --window N`: per-document and overall perplexity."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from tokq import __version__
from tokq.longctx.read_limits import (
    DEFAULT_MAX_DOC_MB,
    DEFAULT_MAX_FILE_MB,
    MAX_DOC_MB_HELP,
    MAX_FILE_MB_HELP,
)
from tokq.progress import progress_display

console = Console(stderr=True)


def score_cmd(
    model: str = typer.Argument(..., help="Checkpoint directory, zoo name (pulled on demand) or tokq.toml variant."),
    data: Path = typer.Option(None, "--data", help="Folder of documents (default: the default long-document set)."),
    window: int = typer.Option(2048, "--window", help="Tokens per window (BOS included where the model uses one)."),
    stride: int = typer.Option(None, "--stride", help="Document tokens between window starts (default: no overlap)."),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Stop after this many window tokens in total."),
    sample_windows: int = typer.Option(
        None, "--sample-windows", help="Score only this many windows, spread evenly over all documents."
    ),
    dtype: str = typer.Option("fp32", "--dtype", help="Compute dtype: fp32, bf16 (CPU) or fp16/bf16 (CUDA)."),
    strict: bool = typer.Option(False, "--strict", help="Fail on unreadable or binary files instead of skipping them."),
    max_doc_mb: float = typer.Option(DEFAULT_MAX_DOC_MB, "--max-doc-mb", help=MAX_DOC_MB_HELP),
    max_file_mb: float = typer.Option(DEFAULT_MAX_FILE_MB, "--max-file-mb", help=MAX_FILE_MB_HELP),
    json_path: Path = typer.Option(None, "--json", help="Write the full result as JSON to this path."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    seed: int = typer.Option(0, "--seed", help="Random seed (recorded in the JSON)."),
) -> None:
    """Perplexity of MODEL on a folder of documents, per document and overall."""
    from tokq.engine.checkpoint import load_model
    from tokq.engine.config import read_config
    from tokq.engine.tokenizer import check_windows_fit, load_tokenizer, model_adds_bos
    from tokq.errors import DataError, ModelError
    from tokq.evalsuite.perplexity import score_windows
    from tokq.longctx.documents import load_documents
    from tokq.longctx.read_limits import read_limits
    from tokq.longctx.text_encoding import as_text_encoder
    from tokq.longctx.windows import build_windows
    from tokq.paths import data_dir
    from tokq.reports.json_io import check_json_target, write_json
    from tokq.runtime import setup_runtime
    from tokq.zoo import resolve_model

    check_json_target(json_path)  # refused before minutes of scoring, not after
    runtime = setup_runtime(threads, device, seed)
    # Cheap checks first: the model's config, then the documents, before any weights are read.
    checkpoint = resolve_model(model)
    context = read_config(checkpoint).max_position_embeddings
    if window > context:
        raise DataError(f"--window {window} exceeds the context of {model} ({context} tokens): use --window {context} or less")
    if data is None:
        data = data_dir() / "default"
        if not data.is_dir():
            raise DataError(f"the default document set {data} is not built yet: run `tokq data build-default` or pass --data DIR")
    docs = load_documents(data, strict=strict, limits=read_limits(max_doc_mb, max_file_mb))  # skips: warnings
    tokenizer = load_tokenizer(checkpoint)
    add_bos = model_adds_bos(tokenizer)
    windows = build_windows(docs.documents, as_text_encoder(tokenizer, add_bos), window, stride, add_bos, max_tokens)
    if sample_windows is not None:
        windows = windows.sample(sample_windows)
    if not windows.windows:
        raise DataError(f"{data}: no document yields a window of at least 16 tokens; add longer documents")
    check_windows_fit(windows.windows, read_config(checkpoint).vocab_size, model, tokenizer)
    lm = load_model(checkpoint, dtype=dtype, device=runtime.device)

    columns = (TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"), TimeRemainingColumn())
    with progress_display(*columns, console=console, transient=True) as progress:
        task = progress.add_task("score", total=windows.n_tokens)
        result = score_windows(lm, windows.windows, on_window=lambda n: progress.advance(task, n))

    table = Table(title=f"{model}: perplexity on {data} (window {window}, {dtype}, {runtime.device}, {runtime.threads} threads)")
    for col in ("document", "tokens", "windows", "NLL", "PPL"):
        table.add_column(col, justify="right" if col != "document" else "left")
    worst = sorted(result.documents, key=lambda d: -d.mean_nll)
    for d in worst[:20]:
        table.add_row(d.doc_id, str(d.tokens), str(d.windows), f"{d.mean_nll:.4f}", f"{d.perplexity:.3f}")
    if len(worst) > 20:
        table.add_row(f"... {len(worst) - 20} more (highest NLL shown)", "", "", "", "")
    table.add_row("[bold]overall[/]", str(result.tokens), str(len(windows.windows)), f"{result.mean_nll:.4f}",
                  f"[bold]{result.perplexity:.3f}[/]")
    Console().print(table)
    console.print(f"{result.window_tokens} tokens in {result.seconds:.1f}s ({result.tokens_per_second:.0f} tok/s)")
    if json_path:
        payload = {
            "tokq_version": __version__,
            "command": "score",
            "model": model,
            "checkpoint": str(checkpoint),
            "data": str(data),
            "data_hash": docs.content_hash(),
            "window": window,
            "stride": windows.stride,
            "windows": windows.to_dict(),
            "add_bos": add_bos,
            "dtype": dtype,
            "runtime": runtime.to_json(),
            **result.to_json(),
        }
        write_json(json_path, payload)
    if result.non_finite:  # after the table and the JSON, which show where: NaN must never exit 0
        broken = sum(1 for d in result.documents if d.non_finite)
        raise ModelError(f"{model} produced non-finite log-probabilities (NaN or inf) on {result.non_finite} of "
                         f"{result.tokens} scored tokens ({broken} of {len(result.documents)} documents): its weights "
                         f"or the {dtype} compute overflow; check the checkpoint, or score it with --dtype fp32")
