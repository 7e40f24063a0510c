"""One statistic with its confidence interval (`Estimate`), as every part of evalsuite.stats reports it."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_CONFIDENCE = 0.95

# Below this many documents an interval rests on few clusters: the estimate says so (Estimate.warning).
FEW_DOCUMENTS = 20

INF = math.inf


@dataclass
class Estimate:
    """One statistic with its confidence interval.

    `n_tokens`/`n_docs` count the tokens and documents that contributed (after any mask), so a
    reader can tell a tight interval from a bucket that only two documents reach (for a proportion
    over probes, both count the probes). Values are NaN when no token contributed; a bound is NaN
    when the statistic has no interval (a maximum) and +-inf when the sample gives none (one
    document, no known range). `method` names how the interval was made; `warning` says why it may
    not hold (few documents).
    """

    value: float
    low: float
    high: float
    n_tokens: int
    n_docs: int
    confidence: float = DEFAULT_CONFIDENCE
    method: str | None = None
    warning: str | None = None

    def to_json(self) -> dict:
        """Plain dict; NaN and +-inf become None so the result is strict JSON."""
        out = {
            "value": json_float(self.value),
            "low": json_float(self.low),
            "high": json_float(self.high),
            "n_tokens": int(self.n_tokens),
            "n_docs": int(self.n_docs),
            "confidence": float(self.confidence),
        }
        if self.method is not None:
            out["method"] = self.method
        if self.warning is not None:
            out["warning"] = self.warning
        return out


def few_documents_warning(n_docs: int) -> str | None:
    """The warning an interval backed by fewer than FEW_DOCUMENTS documents carries (None otherwise)."""
    if 0 < n_docs < FEW_DOCUMENTS:
        return (f"only {n_docs} document{'s' if n_docs != 1 else ''} back this interval (fewer than "
                f"{FEW_DOCUMENTS}): its coverage rests on few clusters; score more documents")
    return None


def json_float(x: float) -> float | None:
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x
