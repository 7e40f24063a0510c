"""`tokq data ...`: build the default long-document set, and show what tokq reads from a folder.

`inspect` is the dry run of what `quantize --calib` and `compare --data` will do with a folder:
which files become documents, which are skipped and why, how many tokens they hold, and the
windows that would be scored. Errors the user can fix surface as TokqError, which the main CLI
prints as one `error: ...` line with exit code 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from tokq.errors import DataError
from tokq.longctx.builtin_sets import builtin_problem, builtin_sources
from tokq.longctx.default_set import DefaultSetSummary, build_default_set, read_default_set
from tokq.longctx.documents import Document, load_documents
from tokq.longctx.read_limits import (
    DEFAULT_MAX_DOC_MB,
    DEFAULT_MAX_FILE_MB,
    MAX_DOC_MB_HELP,
    MAX_FILE_MB_HELP,
    read_limits,
)
from tokq.longctx.text_encoding import TextEncoder, as_text_encoder, tokenize_documents
from tokq.longctx.windows import build_windows
from tokq.paths import atomic_write_text, data_dir
from tokq.reports.json_io import check_json_target

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_WINDOW = 2048
MAX_ROWS = 40  # longer listings end in "... and N more"; --json has everything

data_app = typer.Typer(
    name="data",
    help="Build the default long-document set, and inspect what tokq reads from a folder.",
    no_args_is_help=True,
)

_MODEL_HELP = "Model whose tokenizer counts tokens (zoo name or checkpoint path); 'none' skips counting."


@data_app.command("build-default")
def build_default(
    out: Path | None = typer.Option(
        None, "--out", help="Where to write the set [default: <TOKQ_HOME>/data/<set>]."
    ),
    set_name: str = typer.Option(
        "default", "--set", help="Which built-in set: 'default' (manuals, prose and the Python stdlib) or 'code' "
        "(C++ and Python source of PyTorch and transformers)."
    ),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help=_MODEL_HELP),
    force: bool = typer.Option(
        False, "--force", help="Rebuild even if the set already exists (replaces --out)."
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the summary as JSON here."),
) -> None:
    """Assemble a built-in document set: `default` from the Python stdlib and Debian doc packages here, `code` from
    the source files of packages tokq installs.

    Licence-clean: MANIFEST.json records each document's source, version and licence.
    """
    check_json_target(json_path)  # refused before the build, not after
    problem = builtin_problem(set_name)
    if problem:
        raise DataError(f"--set {problem}")
    console = Console()
    out = out if out is not None else data_dir() / set_name
    if out.exists() and not force:
        if not (out / "MANIFEST.json").is_file():
            raise DataError(
                f"{out}: exists and is not a tokq default set; choose another --out or pass --force to replace it"
            )
        summary = read_default_set(out)
        console.print(f"{set_name} set already built at {out} (pass --force to rebuild it)")
    else:
        encoder = _load_encoder(model)
        with console.status(f"building the {set_name} set") as status:
            summary = build_default_set(
                out,
                sources=builtin_sources(set_name),
                encoder=encoder,
                tokenizer_name=model if encoder is not None else None,
                progress=lambda message: status.update(message),
            )
    console.print(_default_set_table(summary))
    for name, why in summary.unavailable:
        console.print(f"[yellow]not used[/yellow] {name}: {why}")
    console.print(
        f"{summary.n_documents} documents written to {summary.out_dir} (content hash {summary.content_hash[:12]})"
    )
    if json_path is not None:
        _write_json(json_path, summary.to_dict())


@data_app.command("inspect")
def inspect(
    directory: Path = typer.Argument(
        ..., help="Folder (or single file) of .txt/.md/.rst/.jsonl documents (optionally .gz) and "
                  ".parquet/.arrow tables (a document per row, its text in the column 'text')."
    ),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help=_MODEL_HELP),
    window: int = typer.Option(DEFAULT_WINDOW, "--window", help="Tokens per scored window (BOS included)."),
    stride: int | None = typer.Option(
        None, "--stride", help="Document tokens between window starts [default: no overlap]."
    ),
    strict: bool = typer.Option(
        False, "--strict", help="Fail on the first unusable file instead of skipping it."
    ),
    max_doc_mb: float = typer.Option(DEFAULT_MAX_DOC_MB, "--max-doc-mb", help=MAX_DOC_MB_HELP),
    max_file_mb: float = typer.Option(DEFAULT_MAX_FILE_MB, "--max-file-mb", help=MAX_FILE_MB_HELP),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the report as JSON here."),
) -> None:
    """Show what tokq reads from DIRECTORY: documents, skipped files and why, tokens, windows."""
    check_json_target(json_path)  # refused before tokenizing, not after
    console = Console()
    docs = load_documents(directory, strict=strict, limits=read_limits(max_doc_mb, max_file_mb))
    encoder = _load_encoder(model)

    tokens: dict[str, int] | None = None
    windows = None
    if encoder is not None:
        with console.status(f"tokenizing {len(docs)} documents"):
            encoded = tokenize_documents(docs, encoder)
        tokens = {doc_id: len(ids) for doc_id, ids in encoded.items()}
        windows = build_windows(docs, encoder, window=window, stride=stride, encoded=encoded)

    console.print(_documents_table(docs.documents, tokens))
    if docs.skipped:
        table = Table("skipped", "reason", title=f"{len(docs.skipped)} skipped", title_justify="left")
        for s in docs.skipped[:MAX_ROWS]:
            table.add_row(s.name, s.reason)
        _add_more_row(table, len(docs.skipped))
        console.print(table)
    console.print(docs.summary(max_listed=0))
    if tokens is not None:
        console.print(f"{sum(tokens.values()):,} tokens ({model})")
    if windows is not None:
        console.print(windows.summary())

    if json_path is not None:
        report: dict[str, Any] = docs.to_dict()
        report["model"] = model if encoder is not None else None
        if tokens is not None:
            for entry in report["documents"]:
                entry["tokens"] = tokens[entry["doc_id"]]
            report["total_tokens"] = sum(tokens.values())
        report["windows"] = windows.to_dict() if windows is not None else None
        _write_json(json_path, report)


def _load_encoder(model: str) -> TextEncoder | None:
    """The model's tokenizer as a TextEncoder, or None for `--model none`."""
    if model.strip().lower() == "none":
        return None
    # Imported here: the engine and zoo are heavy, and `--model none` must not need them.
    from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
    from tokq.zoo import resolve_model

    tokenizer = load_tokenizer(resolve_model(model))
    return as_text_encoder(tokenizer, add_bos=model_adds_bos(tokenizer))


def _documents_table(documents: list[Document], tokens: dict[str, int] | None) -> Table:
    table = Table("document", "chars", title=f"{len(documents)} documents", title_justify="left")
    if tokens is not None:
        table.add_column("tokens", justify="right")
    table.columns[1].justify = "right"
    for doc in documents[:MAX_ROWS]:
        row = [doc.doc_id, f"{doc.n_chars:,}"]
        if tokens is not None:
            row.append(f"{tokens[doc.doc_id]:,}")
        table.add_row(*row)
    _add_more_row(table, len(documents))
    return table


def _default_set_table(summary: DefaultSetSummary) -> Table:
    table = Table(
        "source",
        "package",
        "licences",
        "documents",
        "chars",
        "tokens",
        title=str(summary.out_dir),
        title_justify="left",
    )
    for col in table.columns[3:]:
        col.justify = "right"
    for s in summary.sources:
        package = f"{s.package} {s.version}" if s.version else s.package
        tokens = f"{s.tokens:,}" if s.tokens is not None else "-"
        table.add_row(s.name, package, ", ".join(s.licences), str(s.n_documents), f"{s.chars:,}", tokens)
    total_tokens = f"{summary.total_tokens:,}" if summary.total_tokens is not None else "-"
    table.add_row(
        "total", "", "", str(summary.n_documents), f"{summary.total_chars:,}", total_tokens, style="bold"
    )
    return table


def _add_more_row(table: Table, total: int) -> None:
    if total > MAX_ROWS:
        table.add_row(f"... and {total - MAX_ROWS:,} more", *([""] * (len(table.columns) - 1)))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    check_json_target(path)  # again: the target may have changed while the command ran
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
