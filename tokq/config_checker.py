"""Checks on tokq.toml values whose errors name the file and the line: `Checker` (what tokq.config's
`load_project` checks every table with) and `table_error` (a ConfigError at [table] key, for a check made
outside it).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from tokq.errors import ConfigError


class Checker:
    """Type checks that name the line of the offending key in the file."""

    def __init__(self, path: Path, text: str):
        self.path, self.lines = path, text.splitlines()

    def line_of(self, table: str, key: str | None = None) -> int | None:
        header = re.compile(r"^\s*\[\s*" + re.escape(table) + r"\s*\]\s*(#.*)?$") if table else None
        inside = table == ""
        for number, raw in enumerate(self.lines, 1):
            stripped = raw.strip()
            if stripped.startswith("["):
                inside = bool(header and header.match(raw))
                if inside and key is None:
                    return number
                continue
            if inside and key is not None and re.match(r'^\s*"?' + re.escape(key) + r'"?\s*=', raw):
                return number
        return None

    def fail(self, table: str, key: str | None, message: str) -> ConfigError:
        line = self.line_of(table, key) or (self.line_of(table) if key else None)
        where = f"{self.path}:{line}" if line else str(self.path)
        name = f"[{table}] {key}" if key and table else (key or f"[{table}]")
        return ConfigError(f"{where}: {name} {message}")

    def table(self, parent: dict, table: str, allowed: set[str] | None = None) -> dict:
        value = parent.get(table.rpartition(".")[2], {})
        if not isinstance(value, dict):
            raise self.fail(table.rpartition(".")[0], table.rpartition(".")[2], "must be a table")
        if allowed is not None:
            for key in value:
                if key not in allowed:
                    raise self.fail(table, key, f"is not a known key; known: {', '.join(sorted(allowed))}")
        return value

    def number(self, table: str, key: str, value: Any, *, integer: bool = False, minimum: float | None = None,
               below: float | None = None, finite: bool = False) -> float:
        kind = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise self.fail(table, key, f"= {value!r} must be {kind}")
        if finite and not math.isfinite(value):  # nan passes and fails nothing: a rule that checks nothing
            raise self.fail(table, key, f"= {value!r} must be a finite number")
        if minimum is not None and value < minimum:
            raise self.fail(table, key, f"= {value!r} must be >= {minimum}")
        if below is not None and value >= below:
            raise self.fail(table, key, f"= {value!r} must be < {below}")
        return value

    def string(self, table: str, key: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(table, key, f"= {value!r} must be a non-empty string")
        return value


def table_error(path: Path, table: str, key: str | None, message: str) -> ConfigError:
    """A ConfigError naming path:line of [table] key (table "": a top-level key), for the code that reads one
    table of tokq.toml itself instead of loading the whole project."""
    return Checker(Path(path), Path(path).read_text(encoding="utf-8")).fail(table, key, message)


def check_url_variant(check: Checker, name: str, entry: dict) -> tuple[str, str | None]:
    """A [variants] NAME = { url = "http://...", model = "served-name" }: a served model, compared over HTTP
    (prompt log-probabilities) and never quantized or rebuilt, so path and recipe make no sense beside it."""
    for key in entry:
        if key not in ("url", "model"):
            raise check.fail("variants", name, f"has url and {key!r}: a url variant (a served model) takes only url "
                                               "and model; it cannot be quantized or rebuilt, so give path/recipe "
                                               "to another variant")
    from tokq.errors import ConfigError
    from tokq.remote.urls import check_http_url, redact

    url = check.string("variants", name, entry["url"])
    if not url.startswith(("http://", "https://")) or "#" in url:
        raise check.fail("variants", name, f"url = {redact(url)!r} must be an http(s) address without '#', e.g. "
                                           "\"http://127.0.0.1:8000/v1\"")
    try:
        check_http_url(url, "url =")
    except ConfigError as exc:
        raise check.fail("variants", name, exc.message) from None
    model = entry.get("model")
    if model is not None:
        model = check.string("variants", name, model)
    return url.rstrip("/"), model


def url_side(url: str, model: str | None) -> str:
    """`url=URL#model=NAME`: how a url variant is named as a compare side (tokq.remote.endpoint_scoring)."""
    return f"url={url}" + (f"#model={model}" if model else "")
