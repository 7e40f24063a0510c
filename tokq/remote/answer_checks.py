"""Sanity checks on the numbers a URL side sends back, before any of them reaches a statistic.

A server is not trusted to be right: one answering positive log-probabilities, or top-k probabilities summing
above 1, got a low KL and a PASS, a NaN became -inf silently, and one listing no alternatives read as 0% top-1
agreement. Every number is checked here, and the first one that fails is a DataError naming the server, the
position and the check: a verdict is never computed from numbers that cannot be log-probabilities.
"""

from __future__ import annotations

import math

from tokq.errors import DataError

# JSON rounding: a server writing 6 decimals may send log 1 as 1e-7, and k probabilities that sum to 1 as a
# little more. Anything past these slacks is no rounding.
LOGPROB_SLACK = 1e-4
MASS_SLACK = 1e-3


def logprob(label: str, where: str, value) -> float:
    """A log-probability as a float: a number, not NaN, at most 0 (within rounding; clamped to 0 there). -inf
    (probability 0) is allowed; vLLM writes it as -9999."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"{label}: {where} has log-probability {str(value)[:40]!r}, not a number: the server's "
                        "answer is malformed")
    value = float(value)
    if math.isnan(value):
        raise DataError(f"{label}: {where} has log-probability NaN: the server's scores are broken (a NaN model "
                        "or an overflow); nothing from it can be compared")
    if value > LOGPROB_SLACK:
        raise DataError(f"{label}: {where} has log-probability {value:.6g} > 0, which no probability has: the server "
                        "does not send log-probabilities (raw logits?); nothing from it can be compared")
    return min(value, 0.0)


def mass(label: str, where: str, logprobs: list[float]) -> None:
    """The listed alternatives of one position (distinct tokens) hold at most probability 1."""
    total = math.fsum(math.exp(lp) for lp in logprobs)
    if total > 1.0 + MASS_SLACK:
        raise DataError(f"{label}: {where} lists alternatives whose probabilities sum to {total:.6g} > 1: they are "
                        "not one distribution's log-probabilities; nothing from this server can be compared")


def alternatives(label: str, where: str, listed: int, wanted: int) -> None:
    """A position lists the number of alternatives asked for: with fewer, top-1 agreement and the KL bounds are
    not measurable, and reading the gaps as zeros would report them wrong."""
    if listed < wanted:
        raise DataError(f"{label}: {where} lists {listed} alternatives, {wanted} were asked for: top-1 agreement and "
                        f"the KL bounds are not measurable from it; ask for fewer with #topk={max(listed, 1)} in the "
                        "URL, or start the server so that it returns them (vLLM: --max-logprobs)")


def malformed(label: str, where: str, exc: Exception) -> DataError:
    """The error for an answer whose shape is not a completions answer (a list where an object goes, a missing key)."""
    return DataError(f"{label}: the answer for {where} is not an OpenAI completions answer with logprobs "
                     f"({type(exc).__name__}: {str(exc)[:120]}); is this an OpenAI-compatible server?")
