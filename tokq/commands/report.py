"""`tokq report DIR`: re-render a report folder's Markdown, HTML and JUnit files from its report.json."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console


def report_cmd(
    folder: Path = typer.Argument(..., help="A folder written by --report-dir or `tokq gate --out`."),
    screenshot: Path = typer.Option(None, "--screenshot", help="Also save a PNG of report.html (headless Chromium)."),
    height: int = typer.Option(3000, "--height", help="Screenshot height in CSS pixels (width 1200)."),
) -> None:
    """Re-render report.md, report.html and junit.xml from FOLDER/report.json."""
    from tokq.reports.compare_report import render

    console = Console(stderr=True)
    html_path = render(folder)
    console.print(f"report: {html_path}", highlight=False)
    if screenshot is not None:
        from tokq.reports.screenshot import screenshot as take

        console.print(f"screenshot: {take(html_path, screenshot, height=height)}", highlight=False)
