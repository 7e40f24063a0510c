"""Progress in a log: where the output is not a terminal (a CI job), long work prints plain lines, not nothing."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokq.progress import PlainProgress, progress_display

COLUMNS = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("windows"),
           TimeElapsedColumn())


def log_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_a_terminal_gets_rich_bars_and_a_log_gets_plain_lines(monkeypatch):
    monkeypatch.setenv("TOKQ_PROGRESS_SECONDS", "0")
    assert isinstance(progress_display(*COLUMNS, console=Console(file=io.StringIO(), force_terminal=True)), Progress)
    console, out = log_console()
    with progress_display(*COLUMNS, console=console) as progress:
        assert isinstance(progress, PlainProgress)
        task = progress.add_task("compare base", total=4)
        for _ in range(4):
            progress.advance(task)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("compare base: 1/4 windows, 0:00:00 elapsed, ETA 0:00:0"), lines
    assert lines[-1] == "compare base: 4/4 windows, 0:00:00 elapsed, done"
    assert len(lines) == 4  # one per update at interval 0, the last one "done" and not repeated at exit


def test_lines_are_spaced_by_the_interval_and_the_end_is_always_printed(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("tokq.progress.time.monotonic", lambda: now[0])
    console, out = log_console()
    columns = (TextColumn("awq block"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with PlainProgress(console, label="awq block", seconds=10) as progress:
        task = progress.add_task("blocks", total=30)
        for _ in range(30):
            now[0] += 1.5  # a block every 1.5 s: a line about every 10 s, then the last
            progress.advance(task)
    lines = out.getvalue().splitlines()
    assert lines[0] == "awq block: 7/30, 0:00:10 elapsed, ETA 0:00:34"
    assert lines[-1] == "awq block: 30/30, 0:00:45 elapsed, done" and len(lines) == 5
    assert progress_display(*columns, console=console).label == "awq block"  # fixed words from the columns


def test_unknown_totals_and_renamed_tasks(monkeypatch):
    monkeypatch.setenv("TOKQ_PROGRESS_SECONDS", "0")
    console, out = log_console()
    with progress_display(TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("paired bench: pass 0", total=None)
        progress.update(task, description="paired bench: pass 3, 12 s left")
    assert out.getvalue().splitlines() == ["paired bench: pass 3, 12 s left, 0:00:00 elapsed"]
