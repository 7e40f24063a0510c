"""One progress style for every long job: rich's live bar on a terminal, plain lines in a log.

A CI job's output is not a terminal: rich's live bars draw nothing there (and transient ones leave nothing), so a
20-minute step printed nothing until it ended. `progress_display(...)` takes the columns a command would give rich and
returns rich's `Progress` on a terminal, else `PlainProgress`, which has the same `add_task` / `update` /
`advance` and prints one line per task every `$TOKQ_PROGRESS_SECONDS` (10) and when the task completes:
what, n/total, elapsed, and an ETA from the rate so far.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import MofNCompleteColumn, Progress, TextColumn

ENV = "TOKQ_PROGRESS_SECONDS"
DEFAULT_SECONDS = 10.0


def interval_seconds() -> float:
    """Seconds between plain progress lines ($TOKQ_PROGRESS_SECONDS; default 10; <= 0: every update)."""
    try:
        return float(os.environ.get(ENV, DEFAULT_SECONDS))
    except ValueError:
        return DEFAULT_SECONDS


def progress_display(*columns: Any, console: Console, transient: bool = True) -> Progress | PlainProgress:
    """rich's Progress with these columns when `console` is a terminal; else plain lines in the same words."""
    if console.is_terminal:
        return Progress(*columns, console=console, transient=transient)
    return PlainProgress(console, _label(columns), _unit(columns))


def _label(columns: tuple) -> str | None:
    """The first text column's fixed words (None when it shows the task's description)."""
    for column in columns:
        if isinstance(column, TextColumn):
            text = str(column.text_format)
            return None if "{task.description}" in text else text
    return None


def _unit(columns: tuple) -> str:
    """The text column right after the n/total one ("windows", "requests", ...), if any."""
    for before, after in zip(columns, columns[1:], strict=False):
        if isinstance(before, MofNCompleteColumn) and isinstance(after, TextColumn):
            return str(after.text_format)
    return ""


@dataclass
class _Task:
    description: str
    total: float | None
    started: float
    completed: float = 0.0
    printed: float = 0.0
    done_printed: bool = False


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class PlainProgress:
    """rich Progress's task API, printing a plain line per task every few seconds (see the module docstring)."""

    def __init__(self, console: Console, label: str | None = None, unit: str = "",
                 seconds: float | None = None) -> None:
        self.console, self.label, self.unit = console, label, unit
        self.seconds = interval_seconds() if seconds is None else seconds
        self.tasks: dict[int, _Task] = {}

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        for task in self.tasks.values():  # a task that ended between lines still gets its last line
            if exc[0] is None and not task.done_printed and task.completed:
                self._print(task)

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        task_id = len(self.tasks)
        now = time.monotonic()
        self.tasks[task_id] = _Task(description, total, started=now, printed=now)
        return task_id

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(self, task_id: int, *, total: float | None = None, completed: float | None = None,
               advance: float | None = None, description: str | None = None, **_: Any) -> None:
        task = self.tasks[task_id]
        if total is not None:
            task.total = total
        if completed is not None:
            task.completed = completed
        if advance:
            task.completed += advance
        if description is not None:
            task.description = description
        now = time.monotonic()
        finished = task.total is not None and task.completed >= task.total
        if (finished and not task.done_printed) or now - task.printed >= self.seconds:
            self._print(task)

    def _print(self, task: _Task) -> None:
        now = time.monotonic()
        task.printed = now
        elapsed = now - task.started
        what = self.label or task.description
        if task.total is not None:
            head = f"{what}: {task.completed:g}/{task.total:g}{' ' + self.unit if self.unit else ''}"
        elif task.completed:
            head = f"{what}: {task.completed:g}{' ' + self.unit if self.unit else ''}"
        else:  # no count to show (a task described by its text alone, e.g. the paired bench's pass)
            head = what
        parts = [head, f"{_clock(elapsed)} elapsed"]
        if task.total is not None and task.completed >= task.total:
            task.done_printed = True
            parts.append("done")
        elif task.total and task.completed > 0:
            parts.append(f"ETA {_clock(elapsed / task.completed * (task.total - task.completed))}")
        self.console.print(", ".join(parts), highlight=False, markup=False)
