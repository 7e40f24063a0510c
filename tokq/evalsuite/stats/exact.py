"""Exact binomial statistics over probes: Clopper-Pearson intervals of a proportion and McNemar's test of
paired flips. They hold for any number of probes (no normal approximation)."""

from __future__ import annotations

import math

from .estimate import DEFAULT_CONFIDENCE, Estimate

METHOD_EXACT = "exact binomial (Clopper-Pearson)"


def mcnemar_exact(a_right_b_wrong: int, a_wrong_b_right: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of the discordant pairs against p = 0.5.

    For retrieval flips only the items where A and B disagree carry information about which is
    better; under "no difference" each flip goes either way with probability 1/2. With p = 0.5 the
    distribution is symmetric, so the two-sided p-value is min(1, 2 * P(X <= min(b, c))), the same
    as scipy.stats.binomtest. 1.0 when there are no discordant pairs (no evidence either way).
    """
    b, c = int(a_right_b_wrong), int(a_wrong_b_right)
    if b < 0 or c < 0:
        raise ValueError(f"counts must be non-negative, got ({b}, {c})")
    n = b + c
    if n == 0:
        return 1.0
    from scipy.stats import binom  # lazy: scipy is slow to import and only needed here

    return float(min(1.0, 2.0 * binom.cdf(min(b, c), n, 0.5)))


def clopper_pearson(successes: int, trials: int, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """Two-sided exact (Clopper-Pearson) interval of a binomial proportion: [B(a/2; x, n-x+1), B(1-a/2; x+1, n-x)].

    It holds for any n (no normal approximation): with 0 of 5 the upper 95% bound is 1 - 0.025^(1/5) = 0.52,
    so five clean probes cannot show a flip rate below 0.25. NaN bounds for n = 0.
    """
    x, n = int(successes), int(trials)
    if n < 0 or not 0 <= x <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= trials, got {x} of {n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n == 0:
        return math.nan, math.nan
    from scipy.stats import beta  # lazy: scipy is slow to import

    alpha = 1.0 - confidence
    low = 0.0 if x == 0 else float(beta.ppf(alpha / 2, x, n - x + 1))
    high = 1.0 if x == n else float(beta.ppf(1 - alpha / 2, x + 1, n - x))
    return low, high


def proportion(successes: int, trials: int, confidence: float = DEFAULT_CONFIDENCE) -> Estimate:
    """successes / trials with its Clopper-Pearson interval, as an Estimate over `trials` items (probes)."""
    low, high = clopper_pearson(successes, trials, confidence)
    value = successes / trials if trials else math.nan
    return Estimate(value, low, high, int(trials), int(trials), confidence, METHOD_EXACT)
