"""Pick one format per unit (an engine Linear): the multiple-choice knapsack behind `tokq quantize --mix`.

Two questions, one solver:
  * `choose(costs, sizes, max_bytes=B)`: the assignment of least total cost whose total bytes are <= B;
  * `choose(costs, sizes, target_cost=T)`: the assignment of fewest total bytes whose total cost is <= T.
`costs[unit][fmt]` is what quantizing that unit to that format costs (an additive KL model), `sizes[unit][fmt]`
the exact bytes it then takes on disk; every unit gets exactly one of its formats.

How: a dynamic programme over units whose states are the Pareto set of (bytes, cost) over the units seen so far
(a state is kept only if no other state has both fewer-or-equal bytes and lower-or-equal cost). Bytes are the
real integers, never rounded, so the answer is exact: the same optimum as trying every assignment (the tests
check this against brute force). States that can no longer meet the constraint (bytes so far + the smallest
bytes the remaining units can take > B; or the same with cost) are dropped on the way.

The Pareto set is usually small (units of one shape share sizes, so byte totals collide), but nothing bounds
it in general; past MAX_STATES states it is thinned to the cheapest state per byte bucket of width
`resolution = (bytes range) / MAX_STATES`. The constraint still holds on the real sizes (each kept state carries
its real bytes and cost); only optimality becomes approximate, within what one bucket's width of bytes buys.
`solve` reports `exact` and the resolution used, which the search records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tokq.errors import ConfigError

MAX_STATES = 200_000  # Pareto states kept per step before thinning (back-pointers: 1.2 MB per unit at the cap)


class InfeasibleBudget(ConfigError):
    """No assignment meets the constraint; `smallest` is the least budget that some assignment meets."""

    def __init__(self, message: str, smallest: float):
        super().__init__(message)
        self.smallest = smallest


@dataclass
class Solution:
    """One assignment and its totals; `exact` is False when the Pareto set was thinned at `resolution` bytes."""

    assignment: dict[str, str]
    bytes: int
    cost: float
    exact: bool = True
    resolution: int = 1


@dataclass
class _Table:
    units: list[str]
    formats: list[list[str]]  # per unit, its formats in a fixed order
    costs: list[np.ndarray]  # per unit, float64 per format
    sizes: list[np.ndarray]  # per unit, int64 per format


def _table(costs: Mapping[str, Mapping[str, float]], sizes: Mapping[str, Mapping[str, int]]) -> _Table:
    if not costs:
        raise ConfigError("knapsack: no units to choose formats for")
    if set(costs) != set(sizes):
        missing = sorted(set(costs) ^ set(sizes))[:3]
        raise ConfigError(f"knapsack: costs and sizes name different units (e.g. {', '.join(missing)})")
    table = _Table([], [], [], [])
    for unit in sorted(costs):  # sorted: the same input in any dict order gives the same answer
        fmts = sorted(costs[unit])
        if not fmts:
            raise ConfigError(f"knapsack: unit {unit} has no formats")
        if set(fmts) != set(sizes[unit]):
            raise ConfigError(f"knapsack: unit {unit} has costs for {fmts} but sizes for {sorted(sizes[unit])}")
        c = np.array([float(costs[unit][f]) for f in fmts], dtype=np.float64)
        s = np.array([int(sizes[unit][f]) for f in fmts], dtype=np.int64)
        if not np.all(np.isfinite(c)):
            raise ConfigError(f"knapsack: unit {unit} has a cost that is not a finite number: {c.tolist()}")
        if np.any(s < 0):
            raise ConfigError(f"knapsack: unit {unit} has a negative size: {s.tolist()}")
        table.units.append(unit)
        table.formats.append(fmts)
        table.costs.append(c)
        table.sizes.append(s)
    return table


def _pareto(b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the states no other state dominates, by increasing bytes (and so strictly decreasing cost)."""
    order = np.lexsort((c, b))  # by bytes, then cost
    b, c = b[order], c[order]
    # keep a state when its cost is below every cost at fewer-or-equal bytes seen before it
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(c)[:-1]))
    return order[c < best_before]


def _thin(b: np.ndarray, c: np.ndarray, keep: np.ndarray, limit: int) -> tuple[np.ndarray, int]:
    """`keep` (Pareto, by bytes) cut to at most about `limit` states: the cheapest per bucket of bytes."""
    lo, hi = int(b[keep[0]]), int(b[keep[-1]])
    resolution = max(1, -(-(hi - lo) // limit))
    bucket = (b[keep] - lo) // resolution
    # Pareto order means cost falls as bytes rise, so the cheapest of a bucket is its last state
    last = np.concatenate((bucket[1:] != bucket[:-1], [True]))
    return keep[last], resolution


def _frontier_states(t: _Table, max_bytes: int | None = None, target_cost: float | None = None,
                     max_states: int = MAX_STATES):
    """Forward pass: the final Pareto states (bytes, cost) and back-pointers to rebuild their assignments."""
    n = len(t.units)
    min_size_after = np.concatenate((np.cumsum([s.min() for s in t.sizes][::-1])[::-1][1:], [0]))
    min_cost_after = np.concatenate((np.cumsum([c.min() for c in t.costs][::-1])[::-1][1:], [0.0]))
    b = np.zeros(1, dtype=np.int64)
    c = np.zeros(1, dtype=np.float64)
    parents: list[np.ndarray] = []
    choices: list[np.ndarray] = []
    exact, resolution = True, 1
    for i in range(n):
        k = len(t.formats[i])
        nb = (b[:, None] + t.sizes[i][None, :]).ravel()
        nc = (c[:, None] + t.costs[i][None, :]).ravel()
        parent = np.repeat(np.arange(len(b)), k)
        choice = np.tile(np.arange(k), len(b))
        alive = np.ones(len(nb), dtype=bool)
        if max_bytes is not None:
            alive &= nb + min_size_after[i] <= max_bytes
        if target_cost is not None:  # a hair of slack: the sums below add in another order; exact check at the end
            alive &= nc + min_cost_after[i] <= target_cost + 1e-12 * max(1.0, abs(target_cost))
            if i == n - 1:
                alive &= nc <= target_cost
        idx = np.flatnonzero(alive)
        keep = idx[_pareto(nb[idx], nc[idx])]
        if len(keep) > max_states:
            keep, step = _thin(nb, nc, keep, max_states)
            exact, resolution = False, max(resolution, step)
        b, c = nb[keep], nc[keep]
        parents.append(parent[keep].astype(np.int32))  # compact: back-pointers are kept for every step
        choices.append(choice[keep].astype(np.int16))
    return b, c, parents, choices, exact, resolution


def _assignment(t: _Table, parents, choices, state: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for i in range(len(t.units) - 1, -1, -1):
        out[t.units[i]] = t.formats[i][int(choices[i][state])]
        state = int(parents[i][state])
    return dict(sorted(out.items()))


def solve(costs: Mapping[str, Mapping[str, float]], sizes: Mapping[str, Mapping[str, int]], *,
          max_bytes: int | None = None, target_cost: float | None = None, max_states: int = MAX_STATES) -> Solution:
    """`choose` with the totals, and whether the answer is exact (see the module docstring)."""
    if (max_bytes is None) == (target_cost is None):
        raise ConfigError("knapsack: give exactly one of max_bytes (least cost within a size) or target_cost "
                          "(least size within a cost)")
    t = _table(costs, sizes)
    smallest_bytes = int(sum(int(s.min()) for s in t.sizes))
    smallest_cost = float(sum(float(c.min()) for c in t.costs))
    if max_bytes is not None and max_bytes < smallest_bytes:
        raise InfeasibleBudget(f"max_bytes {max_bytes:,} is below the smallest possible size {smallest_bytes:,} "
                               "(every unit at its smallest format): raise the size budget", smallest_bytes)
    if target_cost is not None and not target_cost >= smallest_cost:
        raise InfeasibleBudget(f"target cost {target_cost:g} is below the least possible cost {smallest_cost:g} "
                               "(every unit at its cheapest format): raise the target", smallest_cost)
    b, c, parents, choices, exact, resolution = _frontier_states(t, max_bytes, target_cost, max_states)
    if len(b) == 0:  # float sums in another order can put the least-cost assignment a hair over the target
        raise InfeasibleBudget(f"target cost {target_cost:g} is not reachable (least possible {smallest_cost:g}): "
                               "raise the target", smallest_cost)
    # Pareto states run from fewest bytes (dearest) to most bytes (cheapest), all within the constraint
    state = len(b) - 1 if max_bytes is not None else 0
    return Solution(_assignment(t, parents, choices, state), int(b[state]), float(c[state]), exact, resolution)


def choose(costs: Mapping[str, Mapping[str, float]], sizes: Mapping[str, Mapping[str, int]], *,
           max_bytes: int | None = None, target_cost: float | None = None) -> dict[str, str]:
    """unit -> format: least total cost with total bytes <= `max_bytes`, or fewest total bytes with total cost
    <= `target_cost` (exactly one of the two). Ties go to the smaller build (by cost) or the cheaper (by bytes).
    An unreachable budget raises InfeasibleBudget (a ConfigError) naming the smallest one that is reachable."""
    return solve(costs, sizes, max_bytes=max_bytes, target_cost=target_cost).assignment


def frontier(costs: Mapping[str, Mapping[str, float]], sizes: Mapping[str, Mapping[str, int]],
             points: int) -> list[tuple[int, float, dict[str, str]]]:
    """Up to `points` Pareto-optimal (bytes, cost, assignment), by increasing bytes and falling cost, from the
    smallest build (every unit at its smallest format, cheapest among those) to the least-cost one (with a
    dense format in the mix, every unit dense); between them, the least-cost build within evenly spaced sizes."""
    if points < 2:
        raise ConfigError(f"frontier: points {points}: ask for at least 2 (the two ends)")
    t = _table(costs, sizes)
    b, c, parents, choices, _exact, _res = _frontier_states(t)
    targets = np.linspace(int(b[0]), int(b[-1]), points)
    picked: list[int] = []
    for target in targets:
        state = int(np.searchsorted(b, int(np.floor(target)), side="right")) - 1
        if not picked or state != picked[-1]:
            picked.append(state)
    return [(int(b[s]), float(c[s]), _assignment(t, parents, choices, s)) for s in picked]
