"""The closed loop of `tokq quantize --mix`: choose a format per Linear, build it, verify it on held-out windows,
and choose again when it misses.

Prediction. `costs[linear][fmt]` is the KL of quantizing that Linear alone (SensitivityResult.linear_costs(); 0 for
DENSE); their sum is an additive model of the whole mix's KL. Quantization errors compound, so the sum of alone
costs underestimates: one calibration factor k = (measured KL with every Linear at the lowest format) / (sum of
alone costs at that format) scales it, so the prediction is exact at the all-lowest end and 0 at all-dense.

Goals (exactly one):
  * `target_kl`: the fewest bytes whose verified KL meets the target. A build meets it when the upper bound of
    its KL interval on held-out windows is <= target_kl (the bound, not the point: the gate's conservative
    reading). Round 1 gives the knapsack the target itself as its KL budget. A round that misses rescales the
    budget by target / measured upper bound (and always below the missed build's predicted KL, so the next
    build differs and no later budget is bigger than a missed one). A round that passes with room to spare
    (upper bound < PASS_MARGIN x target) rescales it up the same way, still below every missed build's
    prediction, to look for a smaller build that passes. The smallest passing build wins; a target that
    every build in `max_rounds` misses is refused (MixSearchFailed, with the record).
  * `max_bytes`: the least predicted KL whose candidate Linears fit in `max_bytes` (built once and verified:
    the byte budget is a hard constraint, the measured KL is what the user gets). `size_budget` turns
    --max-size-ratio into `max_bytes`.

`build(assignment, round)` makes a build and returns a handle (run_quantize: a checkpoint folder);
`verify(handle)` returns its KL vs the base on held-out windows as (point, low, high). Both are the caller's,
so this module is pure and tested with plain callables.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokq.errors import ConfigError

from .knapsack import InfeasibleBudget, frontier, solve

PASS_MARGIN = 0.9  # a pass with upper bound below this fraction of the target tries a smaller build
FRONTIER_POINTS = 16  # predicted (bytes, KL) points recorded for the report


class MixSearchFailed(ConfigError):
    """No build met the target; `search` holds every round."""

    def __init__(self, message: str, search: MixSearch):
        super().__init__(message)
        self.search = search


@dataclass
class MixRound:
    """One build: the budget the knapsack was given, what it predicted, what the held-out windows measured."""

    round: int
    kl_budget: float | None  # target_kl goal: the (scaled) KL budget given to the knapsack
    max_bytes: int | None  # max_bytes goal: the byte budget of the candidate Linears
    predicted_kl: float
    measured_kl: float
    kl_low: float
    kl_high: float
    bytes: int  # the candidate Linears' bytes (sum of their sizes at the chosen formats)
    counts: dict[str, int]  # Linears per format
    passed: bool | None  # kl_high <= target_kl (None for a byte budget)
    assignment: dict[str, str]
    exact: bool  # the knapsack's answer is exact (see knapsack.py)
    seconds: float

    def to_json(self) -> dict:
        return {"round": self.round, "kl_budget": self.kl_budget, "max_bytes": self.max_bytes,
                "predicted_kl": self.predicted_kl, "measured_kl": _num(self.measured_kl),
                "kl_low": _num(self.kl_low), "kl_high": _num(self.kl_high), "bytes": self.bytes,
                "counts": dict(self.counts), "passed": self.passed, "knapsack_exact": self.exact,
                "seconds": round(self.seconds, 3), "assignment": dict(self.assignment)}


@dataclass
class MixSearch:
    """The search record (`to_json()` is tokq_quantization.json's "mix")."""

    formats: list[str]
    lowest_format: str
    target_kl: float | None
    max_bytes: int | None
    calibration: dict  # how the additive model was scaled
    rounds: list[MixRound] = field(default_factory=list)
    chosen: int | None = None  # index into rounds
    frontier: list[tuple[int, float]] = field(default_factory=list)  # predicted (bytes, KL), smallest first
    size: dict = field(default_factory=dict)  # the caller's description of the byte budget (size_budget)
    notes: list[str] = field(default_factory=list)

    @property
    def chosen_round(self) -> MixRound | None:
        return None if self.chosen is None else self.rounds[self.chosen]

    def to_json(self) -> dict:
        goal = {"target_kl": self.target_kl} if self.target_kl is not None else {"max_bytes": self.max_bytes}
        return {"goal": goal, "formats": list(self.formats), "lowest_format": self.lowest_format,
                "met_when": ("the upper bound of the held-out KL interval <= target_kl"
                             if self.target_kl is not None else "the candidate Linears' bytes <= max_bytes"),
                "calibration": dict(self.calibration), "size": dict(self.size),
                "chosen_round": None if self.chosen is None else self.rounds[self.chosen].round,
                "rounds": [r.to_json() for r in self.rounds],
                "predicted_frontier": [{"bytes": b, "predicted_kl": c} for b, c in self.frontier],
                "notes": list(self.notes)}


def _num(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else float(x)


def size_budget(ratio: float, dense_16bit_bytes: int, fixed_bytes: int,
                sizes: Mapping[str, Mapping[str, int]]) -> tuple[int, dict]:
    """(byte budget of the candidate Linears, a description) for --max-size-ratio `ratio`.

    `ratio` is relative to the whole model at 16 bits (2 bytes per parameter, tied weights once:
    `dense_16bit_bytes`), the size users know: the mixed checkpoint's tensors must take at most
    ratio x dense_16bit_bytes. The parts that are never candidates (embeddings, lm_head, norms, biases) take
    `fixed_bytes` as written (2 per parameter in a 16-bit checkpoint), so the candidate Linears get what is
    left: ratio x dense_16bit_bytes - fixed_bytes. File overhead (safetensors headers, JSON, tokenizer) is not
    counted. A ratio no mix can meet is refused naming the smallest one that can.
    """
    if not 0.0 < ratio:
        raise ConfigError(f"--max-size-ratio {ratio}: give the size as a fraction of the 16-bit model, e.g. 0.35")
    budget = int(math.floor(ratio * dense_16bit_bytes)) - fixed_bytes
    smallest = fixed_bytes + sum(min(int(b) for b in s.values()) for s in sizes.values())
    if budget + fixed_bytes < smallest:
        need = math.ceil(smallest / dense_16bit_bytes * 1e4) / 1e4
        raise ConfigError(f"--max-size-ratio {ratio:g} is below what any mix reaches: the smallest is {need:g} "
                          f"({smallest:,} of {dense_16bit_bytes:,} bytes: every Linear at its smallest format, the "
                          "rest as written); raise it or add a smaller format to --mix")
    return budget, {"max_size_ratio": ratio, "relative_to": "the model's tensors at 16 bits",
                    "dense_16bit_bytes": int(dense_16bit_bytes), "non_candidate_bytes": int(fixed_bytes),
                    "candidate_budget_bytes": int(budget), "smallest_ratio": smallest / dense_16bit_bytes}


def lowest_format(sizes: Mapping[str, Mapping[str, int]]) -> str:
    """The format with the fewest bytes over all Linears (the all-quantized end the model is calibrated at)."""
    totals: dict[str, int] = {}
    for per in sizes.values():
        for fmt, b in per.items():
            totals[fmt] = totals.get(fmt, 0) + int(b)
    return min(totals, key=lambda f: (totals[f], f))


def calibrate(costs: Mapping[str, Mapping[str, float]], sizes: Mapping[str, Mapping[str, int]],
              all_quantized_kl: Mapping[str, float] | None) -> tuple[dict[str, dict[str, float]], str, dict]:
    """(costs scaled by the calibration factor, the lowest format, a description)."""
    low = lowest_format(sizes)
    alone = sum(float(per[low]) for per in costs.values())
    measured = None if all_quantized_kl is None else all_quantized_kl.get(low)
    if measured is not None and math.isfinite(measured) and measured > 0 and alone > 0:
        factor, how = measured / alone, f"measured KL with every Linear at {low} / sum of alone KLs at {low}"
    else:
        factor, how = 1.0, f"1 (no positive all-{low} KL and alone sum to calibrate with)"
    scaled = {u: {f: factor * float(c) for f, c in per.items()} for u, per in costs.items()}
    return scaled, low, {"factor": factor, "how": how, "sum_alone_lowest": alone, "all_quantized_kl": measured}


def _counts(assignment: Mapping[str, str], formats: list[str]) -> dict[str, int]:
    out = dict.fromkeys(formats, 0)
    for fmt in assignment.values():
        out[fmt] = out.get(fmt, 0) + 1
    return out


def search_mix(costs: Mapping[str, Mapping[str, float]], sizes: Mapping[str, Mapping[str, int]], *,
               build: Callable[[dict[str, str], int], Any], verify: Callable[[Any], tuple[float, float, float]],
               target_kl: float | None = None, max_bytes: int | None = None,
               all_quantized_kl: Mapping[str, float] | None = None, max_rounds: int = 3,
               discard: Callable[[Any], None] | None = None,
               on_round: Callable[[MixRound], None] | None = None) -> tuple[MixSearch, Any]:
    """(the search record, the chosen build's handle). See the module docstring; `discard(handle)` is called on
    every build that is not (or no longer) the chosen one, `on_round` after each round."""
    if (target_kl is None) == (max_bytes is None):
        raise ConfigError("--mix needs exactly one goal: --target-kl X (the smallest build that meets it) or "
                          "--max-size-ratio R (the best build within that size)")
    if target_kl is not None and not (math.isfinite(target_kl) and target_kl > 0):
        raise ConfigError(f"--target-kl {target_kl}: give a positive mean KL in nats, e.g. 0.02")
    if max_rounds < 1:
        raise ConfigError(f"max_rounds {max_rounds}: at least 1")
    scaled, low, calibration = calibrate(costs, sizes, all_quantized_kl)
    formats = sorted({f for per in sizes.values() for f in per})
    record = MixSearch(formats, low, target_kl, max_bytes, calibration,
                       frontier=[(b, c) for b, c, _ in frontier(scaled, sizes, FRONTIER_POINTS)])
    discard = discard or (lambda _handle: None)

    def run_round(index: int, solution, kl_budget: float | None) -> tuple[MixRound, Any]:
        started = time.perf_counter()
        handle = build(dict(solution.assignment), index)
        point, lo, hi = (float(x) for x in verify(handle))
        passed = None if target_kl is None else bool(hi <= target_kl)
        r = MixRound(index, kl_budget, max_bytes, solution.cost, point, lo, hi, solution.bytes,
                     _counts(solution.assignment, formats), passed, dict(solution.assignment), solution.exact,
                     time.perf_counter() - started)
        record.rounds.append(r)
        if on_round:
            on_round(r)
        return r, handle

    if max_bytes is not None:
        solution = solve(scaled, sizes, max_bytes=max_bytes)
        _r, handle = run_round(1, solution, None)
        record.chosen = 0
        return record, handle

    budget = float(target_kl)
    below_missed = math.inf  # every later budget stays strictly below the predicted KL of every missed build
    best: tuple[int, Any] | None = None  # (round index, handle) of the smallest passing build so far
    tried: set[tuple] = set()
    for index in range(1, max_rounds + 1):
        try:
            solution = solve(scaled, sizes, target_cost=budget)
        except InfeasibleBudget as exc:
            # no format is dense, so even the widest mix is predicted over the budget: try the widest once
            solution = solve(scaled, sizes, target_cost=exc.smallest)
            record.notes.append(f"round {index}: KL budget {budget:.4g} is below the least predicted KL "
                                f"{exc.smallest:.4g} (every Linear at its widest format); built that")
        key = tuple(sorted(solution.assignment.items()))
        if key in tried:
            record.notes.append(f"round {index}: the budget {budget:.4g} gives a build already tried; stopped")
            break
        tried.add(key)
        r, handle = run_round(index, solution, budget)
        if r.passed:
            if best is None or r.bytes < record.rounds[best[0]].bytes:
                if best is not None:
                    discard(best[1])
                best = (len(record.rounds) - 1, handle)
            else:
                discard(handle)
            if r.kl_high >= PASS_MARGIN * target_kl:
                break  # close to the target: a smaller build would likely miss
            step = budget * target_kl / r.kl_high if r.kl_high > 0 else math.inf
            new_budget = min(step, math.nextafter(below_missed, -math.inf))
            if not new_budget > budget:
                break  # no room between this budget and a missed build's prediction
        else:
            discard(handle)
            below_missed = min(below_missed, solution.cost)
            step = budget * target_kl / r.kl_high if r.kl_high > 0 and math.isfinite(r.kl_high) else budget / 2
            new_budget = min(step, math.nextafter(below_missed, -math.inf))
        budget = max(new_budget, 0.0)
    if best is None:
        closest = min(record.rounds, key=lambda r: r.kl_high)
        raise MixSearchFailed(
            f"--target-kl {target_kl:g}: no build in {len(record.rounds)} round(s) met it on the held-out windows "
            f"(closest: round {closest.round}, KL {closest.measured_kl:.4g}, upper bound {closest.kl_high:.4g}, "
            f"{closest.bytes:,} bytes); raise --target-kl, add a wider format (bf16) to --mix or use more "
            "held-out documents for a tighter interval", record)
    record.chosen = best[0]
    return record, best[1]
