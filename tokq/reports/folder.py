"""One report folder (report.json, report.md, report.html, junit.xml), for compare and gate alike.

Each file is rendered and written inside a temporary sibling folder that is renamed into place only when
every file is written: an interrupted run leaves no report that looks complete. On a fresh run the
Markdown is appended to $GITHUB_STEP_SUMMARY (GitHub Actions shows it on the run's page); a re-render
(`tokq report DIR`) does not append it again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tokq.outputs import REPORT, check_replaceable
from tokq.paths import atomic_directory
from tokq.remote.urls import redact


def check_report_folder(folder: Path, option: str = "--out") -> None:
    """Refuse to replace anything but a report folder tokq wrote (or an empty one), before any work: `--out .`
    must not delete the user's working directory, nor a folder where the user keeps files next to a report."""
    check_replaceable(Path(folder), REPORT, option)


def write_report_folder(folder: Path, renderers: dict[str, Callable[[], str]], step_summary: bool = True,
                        written_by: str = "tokq report") -> Path:
    folder = Path(folder)
    with atomic_directory(folder, REPORT, written_by) as tmp:
        for name, render in renderers.items():
            # a server address written with user:password must not reach a report (nor the step summary below)
            (tmp / name).write_text(redact(render()), encoding="utf-8")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary and summary and (folder / "report.md").is_file():
        with open(summary, "a", encoding="utf-8") as f:
            f.write((folder / "report.md").read_text(encoding="utf-8"))
    return folder / "report.html"
