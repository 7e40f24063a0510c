"""Write a compare result as a report folder: report.json (source of truth), report.md, report.html, junit.xml.

Written through a temporary sibling folder renamed into place, so an interrupted run never leaves a report
that looks complete. `render(folder)` re-renders the other files from report.json (`tokq report DIR`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokq.paths import atomic_directory
from tokq.reports.html import compare_html
from tokq.reports.junit import junit_xml
from tokq.reports.markdown import compare_markdown


def _files(result: dict) -> dict[str, str]:
    return {"report.json": json.dumps(result, indent=2, default=str) + "\n", "report.md": compare_markdown(result),
            "report.html": compare_html(result),
            "junit.xml": junit_xml(f"tokq compare {result['a']['name']} -> {result['b']['name']}",
                                   result["thresholds"])}


def write_report(folder: Path, result: dict) -> Path:
    with atomic_directory(folder) as tmp:
        for name, text in _files(result).items():
            (tmp / name).write_text(text, encoding="utf-8")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:  # GitHub Actions shows it on the run's page
        with open(summary, "a", encoding="utf-8") as f:
            f.write(compare_markdown(result))
    return folder / "report.html"


def render(folder: Path) -> Path:
    """Re-render report.md / report.html / junit.xml from the folder's report.json (a compare's or a gate's)."""
    from tokq.errors import DataError

    source = Path(folder) / "report.json"
    try:
        result = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{source} cannot be read ({exc}): pass a folder written by tokq compare --report-dir") from exc
    if result.get("command") == "gate":
        from tokq.reports.gate_report import write_gate_report

        return write_gate_report(folder, result)
    return write_report(folder, result)
