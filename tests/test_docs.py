"""What README.md and docs/ say is true: every number they quote from benchmarks/results/ equals the result file,
every `tokq` command in their code blocks parses with the CLI's own parser, and the front page's commands run
(on a tiny model standing in for the zoo's)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.cli_parse import parse_cli

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import render_numbers  # noqa: E402


def code_block_commands(path: Path) -> list[list[str]]:
    """Every `tokq ...` line of a shell code block (``` or ```sh/bash fences), as argv, comments dropped."""
    text = path.read_text(encoding="utf-8")
    commands = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang not in ("", "sh", "bash", "console"):
            continue
        for line in block.replace("\\\n", " ").splitlines():  # a command continued with \ is one line
            line = line.strip().removeprefix("$ ").removeprefix(".venv/bin/")
            if line.startswith("tokq "):
                commands.append(shlex.split(line, comments=True))
    return commands


def test_every_quoted_number_equals_its_result_file():
    stale = []
    for doc in render_numbers.documents():
        stale += render_numbers.render(doc.read_text(encoding="utf-8"))[1]
    assert not stale, "run `python scripts/render_numbers.py`:\n" + "\n".join(stale)
    front = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(render_numbers.MARKER.findall(front)) >= 8  # the front page's speed numbers are rendered


# A measured-looking number: a decimal with 2+ places, or a number with a speed or ratio unit.
MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:×|x\b|tok/s|GB/s|ms\b|µs|min \d+ s)|(?<![\w.\-/])\d+\.\d{2,}(?![\w.%])")
# What the docs may write by hand: versions, targets, limits, shapes and arithmetic, not measurements.
NOT_MEASURED = {"3.10", "1.7x", "4096 ×", "2 ×", "0.52", "4x", "0.25", "4 x"}


def unrendered_numbers(text: str) -> list[str]:
    """Measured-looking numbers outside rendered markers, code blocks and inline code."""
    text = render_numbers.MARKER.sub("", text)
    text = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)
    return [n for n in MEASURED.findall(text) if n not in NOT_MEASURED]


def test_no_measured_number_is_written_by_hand():
    """gate-report.md is the gate's own Markdown report of the recorded run (written by tokq, not by hand)."""
    found = {doc.name: unrendered_numbers(doc.read_text(encoding="utf-8"))
             for doc in render_numbers.documents() if doc.name != "gate-report.md"}
    assert not {k: v for k, v in found.items() if v}, "quote these through <!--r FILE [path] fmt--> markers"
    assert unrendered_numbers("int4 is 1.31× faster, `1.2x` in code, <!--r f [0] .2f-->0.38<!--/r-->") == ["1.31×"]


def test_a_number_that_drifts_from_its_result_is_caught(tmp_path, monkeypatch):
    (tmp_path / "r.json").write_text(json.dumps({"ratios": {"a / b": {"median": 1.2468}}}))
    monkeypatch.setattr(render_numbers, "RESULTS", tmp_path)
    text = 'int4 is <!--r r.json ["ratios", "a / b", "median"] .2fx-->1.31×<!--/r--> faster'
    rendered, changed = render_numbers.render(text)
    assert changed == ['r.json ["ratios", "a / b", "median"]: the text says 1.31×, the result 1.25×']
    assert rendered == 'int4 is <!--r r.json ["ratios", "a / b", "median"] .2fx-->1.25×<!--/r--> faster'
    assert render_numbers.render(rendered)[1] == []
    (tmp_path / "n.json").write_text(json.dumps({"bucket": None, "low": None}))
    nulls = '<!--r n.json ["bucket"] s|overall-->?<!--/r--> <!--r n.json ["low"] .2f-->?<!--/r-->'
    assert re.sub(r"<!--.*?-->", "", render_numbers.render(nulls)[0]) == "overall –"


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_every_tokq_command_shown_parses(doc):
    path = ROOT / doc if doc == "README.md" else ROOT / "docs" / doc
    for argv in code_block_commands(path):
        parse_cli(argv[1:])  # raises on an unknown command or option, or a value of the wrong type
