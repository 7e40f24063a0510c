#!/usr/bin/env python3
"""Numbers in README.md and docs/*.md that come from benchmarks/results/, kept equal to them.

A number quoted from a result is written between two markers naming the file, the path to the value (a JSON list
of keys) and its format:

    <!--r vs-llamacpp-smollm2-135m-epyc-avx512.json ["ratios", "...", "median"] .2f-->1.25<!--/r-->

`python scripts/render_numbers.py` rewrites every such number from its file; `--check` only reports the ones that
differ (exit 1), which tests/test_docs.py runs, so text and results cannot drift apart. A format is Python's
(`.2f`, `.0%`, `,d`); `x` after it appends a multiplication sign (`.2fx` -> 1.25×); `|text` after it is shown
where the result holds null (`s|overall`), else a dash.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"<!--r (\S+) (\[.*?\]) (\S+?)-->(.*?)<!--/r-->")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def value_of(file: str, path: list, fmt: str) -> str:
    data = json.loads((RESULTS / file).read_text(encoding="utf-8"))
    for key in path:
        data = data[key]
    fmt, _, missing = fmt.partition("|")
    if data is None:  # a value the result does not have (a deterministic ratio's interval): `fmt|text` or a dash
        return missing or "–"
    times = fmt.endswith("x")
    text = format(data, fmt[:-1] if times else fmt)
    return text + ("×" if times else "")


def render(text: str) -> tuple[str, list[str]]:
    """(the text with every marked number rendered, one line per number that changed)."""
    changed = []

    def one(match: re.Match) -> str:
        file, path, fmt, shown = match.groups()
        want = value_of(file, json.loads(path), fmt)
        if want != shown:
            changed.append(f"{file} {path}: the text says {shown}, the result {want}")
        return f"<!--r {file} {path} {fmt}-->{want}<!--/r-->"

    return MARKER.sub(one, text), changed


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        rendered, changed = render(text)
        stale += [f"{doc.relative_to(ROOT)}: {line}" for line in changed]
        if changed and not check:
            doc.write_text(rendered, encoding="utf-8")
    for line in stale:
        print(line)
    return 1 if stale and check else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
