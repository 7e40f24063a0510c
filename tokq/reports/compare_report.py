"""Write a compare result as a report folder: report.json (source of truth), report.md, report.html, junit.xml.

Written by reports.folder (atomically). `render(folder)` re-renders the other files from report.json
(`tokq report DIR`).
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import UndefinedError

from tokq.reports.folder import write_report_folder
from tokq.reports.html import compare_html
from tokq.reports.junit import junit_xml
from tokq.reports.markdown import compare_markdown


def write_report(folder: Path, result: dict, step_summary: bool = True) -> Path:
    suite = f"tokq compare {result['a']['name']} -> {result['b']['name']}"
    return write_report_folder(folder, {
        "report.json": lambda: json.dumps(result, indent=2, default=str) + "\n",
        "report.md": lambda: compare_markdown(result), "report.html": lambda: compare_html(result),
        "junit.xml": lambda: junit_xml(suite, result["thresholds"])}, step_summary, "tokq compare")


# What a report.json that is not one of tokq's (hand-edited, truncated, another tool's) raises while it is
# rendered: a key it lacks, a value of the wrong type. Rendering happens inside the atomic folder write, so
# such a failure leaves the folder as it was.
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, UndefinedError)
FIX = "pass a folder written by tokq compare --report-dir or tokq gate --out (or run it again to rewrite the report)"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, KeyError):
        return f"no key {exc.args[0]!r}" if exc.args else "a key is missing"
    text = " ".join(str(exc).split())  # one line: the CLI prints the error as one
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def render(folder: Path) -> Path:
    """Re-render report.md / report.html / junit.xml from the folder's report.json (a compare's or a gate's; a
    sensitivity report's report.html).
    A report.json that cannot be read or is not a tokq report is a DataError naming it; nothing is written."""
    from tokq.errors import DataError

    source = Path(folder) / "report.json"
    try:
        result = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
        raise DataError(f"{source} cannot be read ({_reason(exc)}): {FIX}") from exc
    if not isinstance(result, dict):
        raise DataError(f"{source} holds a JSON {type(result).__name__}, not a tokq report (an object): {FIX}")
    try:
        if result.get("command") == "gate":
            from tokq.reports.gate_report import write_gate_report

            return write_gate_report(folder, result, step_summary=False)
        if result.get("command") == "sensitivity":
            from tokq.reports.sensitivity_report import write_sensitivity_report

            return write_sensitivity_report(folder, result, step_summary=False)
        return write_report(folder, result, step_summary=False)
    except MALFORMED as exc:
        raise DataError(f"{source} is not a complete tokq report ({_reason(exc)}): {FIX}") from exc
