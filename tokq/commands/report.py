"""`tokq report DIR`: re-render a report folder's Markdown, HTML and JUnit files from its report.json."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console


def report_cmd(folder: Path = typer.Argument(..., help="A folder written by --report-dir.")) -> None:
    """Re-render report.md, report.html and junit.xml from FOLDER/report.json."""
    from tokq.reports.compare_report import render

    Console(stderr=True).print(f"report: {render(folder)}")
