"""JSON results: the source of truth every other report is rendered from."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tokq.paths import atomic_write_text


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader can parse the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str | Path, payload: dict) -> Path:
    """Write `payload` atomically (temp file + rename) as indented JSON."""
    path = Path(path)
    atomic_write_text(path, json.dumps(_clean(payload), indent=2, sort_keys=False) + "\n")
    return path
