"""tokq.mixed.knapsack: exact against brute force on small random instances, budgets refused with the smallest
reachable one named, a frontier that is monotone from the smallest build to the least-cost one."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokq.errors import ConfigError
from tokq.mixed.knapsack import InfeasibleBudget, choose, frontier, solve

FORMATS = ("a", "b", "c")


@st.composite
def instances(draw):
    """2-5 units, each with 1-3 formats, integer sizes (some repeated, as Linears of one shape are) and costs."""
    n = draw(st.integers(2, 5))
    costs, sizes = {}, {}
    for u in range(n):
        fmts = draw(st.lists(st.sampled_from(FORMATS), min_size=1, max_size=3, unique=True))
        sizes[f"u{u}"] = {f: draw(st.integers(0, 60)) for f in fmts}
        # costs on a grid of 1/8 (exact in binary) so that sums compare exactly, plus some arbitrary floats
        costs[f"u{u}"] = {f: draw(st.one_of(st.integers(0, 40).map(lambda k: k / 8),
                                            st.floats(0, 5, allow_nan=False))) for f in fmts}
    return costs, sizes


def _all(costs, sizes):
    units = sorted(costs)
    for combo in itertools.product(*(sorted(costs[u]) for u in units)):
        a = dict(zip(units, combo, strict=True))
        yield a, sum(sizes[u][a[u]] for u in units), sum(costs[u][a[u]] for u in units)


def _totals(a, costs, sizes):
    return sum(sizes[u][f] for u, f in a.items()), sum(costs[u][f] for u, f in a.items())


@settings(max_examples=300, deadline=None)
@given(instances(), st.floats(0, 1))
def test_least_cost_within_bytes_matches_brute_force(inst, frac):
    costs, sizes = inst
    everything = list(_all(costs, sizes))
    lo, hi = min(b for _, b, _ in everything), max(b for _, b, _ in everything)
    budget = int(lo + frac * (hi - lo))
    best = min(c for _, b, c in everything if b <= budget)
    a = choose(costs, sizes, max_bytes=budget)
    assert set(a) == set(costs) and all(a[u] in costs[u] for u in a)  # exactly one format per unit
    b, c = _totals(a, costs, sizes)
    assert b <= budget  # feasible on the real sizes
    assert c == pytest.approx(best, rel=1e-9, abs=1e-12)  # and optimal


@settings(max_examples=300, deadline=None)
@given(instances(), st.floats(0, 1))
def test_fewest_bytes_within_cost_matches_brute_force(inst, frac):
    costs, sizes = inst
    everything = list(_all(costs, sizes))
    lo, hi = min(c for *_, c in everything), max(c for *_, c in everything)
    target = lo + frac * (hi - lo)
    reachable = [b for _, b, c in everything if c <= target]
    if not reachable:  # float sums: the least cost may sit a hair above lo + 0 * (hi - lo) in another order
        return
    a = choose(costs, sizes, target_cost=target)
    b, c = _totals(a, costs, sizes)
    assert c <= target + 1e-9
    assert b == min(reachable)


def test_prefers_cheap_widening_where_it_matters():
    # two units; only one can be wide: the one whose narrow format costs more gets it
    costs = {"x": {"w4": 5.0, "w8": 0.0}, "y": {"w4": 1.0, "w8": 0.0}}
    sizes = {"x": {"w4": 10, "w8": 20}, "y": {"w4": 10, "w8": 20}}
    assert choose(costs, sizes, max_bytes=30) == {"x": "w8", "y": "w4"}
    assert choose(costs, sizes, max_bytes=29) == {"x": "w4", "y": "w4"}
    assert choose(costs, sizes, target_cost=1.0) == {"x": "w8", "y": "w4"}
    assert choose(costs, sizes, target_cost=0.0) == {"x": "w8", "y": "w8"}
    # a generous target still gives the smallest build, not the widest
    assert choose(costs, sizes, target_cost=100.0) == {"x": "w4", "y": "w4"}


def test_infeasible_budgets_name_the_smallest_reachable_one():
    costs = {"x": {"w4": 2.0, "w8": 1.0}, "y": {"w4": 3.0, "w8": 0.5}}
    sizes = {"x": {"w4": 10, "w8": 20}, "y": {"w4": 12, "w8": 24}}
    with pytest.raises(InfeasibleBudget, match="smallest possible size 22") as e:
        choose(costs, sizes, max_bytes=21)
    assert e.value.smallest == 22 and isinstance(e.value, ConfigError)
    assert "\n" not in str(e.value)
    with pytest.raises(InfeasibleBudget, match="least possible cost 1.5") as e:
        choose(costs, sizes, target_cost=1.4)
    assert e.value.smallest == 1.5
    assert choose(costs, sizes, max_bytes=22) == {"x": "w4", "y": "w4"}
    assert choose(costs, sizes, target_cost=1.5) == {"x": "w8", "y": "w8"}


def test_bad_tables_and_arguments_are_refused():
    costs = {"x": {"w4": 1.0}}
    with pytest.raises(ConfigError, match="exactly one"):
        choose(costs, {"x": {"w4": 1}})
    with pytest.raises(ConfigError, match="exactly one"):
        choose(costs, {"x": {"w4": 1}}, max_bytes=1, target_cost=1.0)
    with pytest.raises(ConfigError, match="different units"):
        choose(costs, {"y": {"w4": 1}}, max_bytes=5)
    with pytest.raises(ConfigError, match="sizes for"):
        choose(costs, {"x": {"w8": 1}}, max_bytes=5)
    with pytest.raises(ConfigError, match="finite"):
        choose({"x": {"w4": float("nan")}}, {"x": {"w4": 1}}, max_bytes=5)


def test_thinned_search_still_meets_the_byte_budget():
    # many distinct sizes, a tiny state cap: the answer is approximate but never over the real budget
    costs = {f"u{i}": {"a": (i * 7 % 11) / 3, "b": (i * 5 % 13) / 7, "c": 0.0} for i in range(24)}
    sizes = {f"u{i}": {"a": 100 + i, "b": 300 + 3 * i, "c": 700 + 11 * i} for i in range(24)}
    budget = 24 * 400
    approx = solve(costs, sizes, max_bytes=budget, max_states=20)
    exact = solve(costs, sizes, max_bytes=budget)
    assert not approx.exact and approx.resolution > 1 and exact.exact
    assert approx.bytes <= budget and _totals(approx.assignment, costs, sizes) == (approx.bytes, approx.cost)
    assert approx.cost >= exact.cost - 1e-12


@settings(max_examples=100, deadline=None)
@given(instances(), st.integers(2, 8))
def test_frontier_is_pareto_and_monotone(inst, points):
    costs, sizes = inst
    front = frontier(costs, sizes, points)
    everything = list(_all(costs, sizes))
    assert 1 <= len(front) <= points
    for (b1, c1, _), (b2, c2, _) in zip(front, front[1:], strict=False):
        assert b1 < b2 and c1 > c2  # strictly more bytes buy strictly less cost
    for b, c, a in front:
        assert _totals(a, costs, sizes) == (b, pytest.approx(c))
        # nothing beats a frontier point on both axes
        assert not any(bb <= b and cc < c - 1e-9 for _, bb, cc in everything)
    smallest = min(b for _, b, _ in everything)
    assert front[0][0] == smallest
    assert front[-1][1] == pytest.approx(min(c for *_, c in everything))


def test_frontier_runs_from_all_smallest_to_all_dense():
    costs = {f"u{i}": {"w4": 1.0 + i, "w8": 0.1 * (i + 1), "bf16": 0.0} for i in range(4)}
    sizes = {f"u{i}": {"w4": 10, "w8": 20, "bf16": 40} for i in range(4)}
    front = frontier(costs, sizes, 5)
    assert front[0][2] == {u: "w4" for u in costs} and front[0][0] == 40
    assert front[-1][2] == {u: "bf16" for u in costs} and front[-1][1] == 0.0
    with pytest.raises(ConfigError, match="at least 2"):
        frontier(costs, sizes, 1)
