"""Gate thresholds checked against the unfavourable end of an interval: a candidate passes only when the data
show it is within the limit, not merely when its point estimate happens to be."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .estimate import Estimate, json_float


@dataclass
class ThresholdResult:
    """The outcome of one gate threshold, with the bound that decided it and a one-line reason."""

    metric: str
    bucket: str | None  # None = overall
    threshold: float
    direction: str  # "max" or "min"
    estimate: Estimate
    passed: bool
    bound_used: float
    rule: str

    def to_json(self) -> dict:
        return {
            "metric": self.metric,
            "bucket": self.bucket,
            "threshold": float(self.threshold),
            "direction": self.direction,
            "estimate": self.estimate.to_json(),
            "passed": bool(self.passed),
            "bound_used": json_float(self.bound_used),
            "rule": self.rule,
        }


CI_RULES = ("bound", "point")


def check_threshold(
    estimate: Estimate, threshold: float, direction: str, metric: str, bucket: str | None = None,
    on: str = "bound",
) -> ThresholdResult:
    """Pass/fail a threshold on the interval's unfavourable bound (on="bound", the default), or on the
    point estimate (on="point": the CI is reported but does not decide).

    direction "max" (KL, ppl ratio, flip rate must stay below): fail if estimate.high > threshold.
    direction "min" (top-1 agreement, acceptance must stay above): fail if estimate.low < threshold.
    A point estimate just inside the limit with a wide interval fails: the data do not show the
    candidate is within it. An estimate with no tokens (NaN) fails, since nothing was shown.
    """
    if direction not in ("max", "min"):
        raise ValueError(f"direction must be 'max' or 'min', got {direction!r}")
    if on not in CI_RULES:
        raise ValueError(f"on must be one of {CI_RULES}, got {on!r}")
    pct = f"{estimate.confidence * 100:g}%"
    if on == "point":
        bound, side = estimate.value, "estimate"
    else:
        bound, side = (estimate.high, f"upper {pct} bound") if direction == "max" else (estimate.low,
                                                                                        f"lower {pct} bound")
    bad = bound > threshold if direction == "max" else bound < threshold
    op = (">" if bad else "<=") if direction == "max" else ("<" if bad else ">=")
    if math.isnan(bound):
        return ThresholdResult(metric, bucket, threshold, direction, estimate, False, bound,
                               f"no tokens to bound {metric}; {direction} {threshold:.4g} not shown")
    rule = f"{side} {bound:.4g} {op} {direction} {threshold:.4g}"
    if on == "point":
        rule += f" ({pct} CI [{estimate.low:.4g}, {estimate.high:.4g}])"
    return ThresholdResult(metric, bucket, threshold, direction, estimate, not bad, float(bound), rule)


def straddles(estimate: Estimate, threshold: float, direction: str) -> bool:
    """Whether the interval holds the threshold (some of it meets the limit, some misses it): the data cannot
    tell on which side the model is, so the rule is inconclusive rather than failed or passed."""
    low, high = estimate.low, estimate.high
    if not (math.isfinite(low) and math.isfinite(high)):
        return False
    return (low <= threshold < high) if direction == "max" else (low < threshold <= high)


def more_data_note(estimate: Estimate, threshold: float, unit: str = "documents") -> tuple[str, float | None]:
    """How much more data would likely decide a straddling rule, as text and as a factor: an interval's half width
    shrinks as 1 / sqrt(n), so it clears the threshold at about (half width / distance)^2 times the sample, if the
    estimate stays where it is."""
    half = (estimate.high - estimate.low) / 2
    gap = abs(estimate.value - threshold)
    if not math.isfinite(half) or gap < 1e-12 * max(1.0, abs(threshold)):
        return "the estimate sits at the threshold: no sample size decides it", None
    factor = max((half / gap) ** 2, 1.0)
    return (f"about {math.ceil(estimate.n_docs * factor)} {unit} instead of {estimate.n_docs} would likely decide "
            f"it", factor)
