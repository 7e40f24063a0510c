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

from tokq.paths import atomic_directory


def check_report_folder(folder: Path) -> None:
    """Refuse to replace anything but an earlier report folder (or an empty one): `--out .` must not
    delete the user's working directory."""
    from tokq.errors import ConfigError

    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ConfigError(f"{folder} is a file, not a report folder: choose another --out")
    entries = {p.name for p in folder.iterdir()}
    if entries and "report.json" not in entries:
        raise ConfigError(f"{folder} exists and is not a tokq report folder (no report.json): choose another "
                          "--out, or remove it yourself")


def write_report_folder(folder: Path, renderers: dict[str, Callable[[], str]], step_summary: bool = True) -> Path:
    folder = Path(folder)
    check_report_folder(folder)
    with atomic_directory(folder) as tmp:
        for name, render in renderers.items():
            (tmp / name).write_text(render(), encoding="utf-8")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary and summary and (folder / "report.md").is_file():
        with open(summary, "a", encoding="utf-8") as f:
            f.write((folder / "report.md").read_text(encoding="utf-8"))
    return folder / "report.html"
