"""Write a compare result as a report folder: report.json (source of truth), report.md, report.html, junit.xml.

Written by reports.folder (atomically). `render(folder)` re-renders the other files from report.json
(`tokq report DIR`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokq.reports.folder import write_report_folder
from tokq.reports.html import compare_html
from tokq.reports.junit import junit_xml
from tokq.reports.markdown import compare_markdown


def write_report(folder: Path, result: dict, step_summary: bool = True) -> Path:
    suite = f"tokq compare {result['a']['name']} -> {result['b']['name']}"
    return write_report_folder(folder, {
        "report.json": lambda: json.dumps(result, indent=2, default=str) + "\n",
        "report.md": lambda: compare_markdown(result), "report.html": lambda: compare_html(result),
        "junit.xml": lambda: junit_xml(suite, result["thresholds"])}, step_summary)


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

        return write_gate_report(folder, result, step_summary=False)
    return write_report(folder, result, step_summary=False)
