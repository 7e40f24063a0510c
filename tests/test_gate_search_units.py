"""The gate's mixed-precision search, its pure parts: which documents it may use, where bisection starts, and that
bisection finds the smallest passing frontier point within its build budget."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tokq.errors import ConfigError
from tokq.mixed.gate_search import (
    Evaluation,
    bisect_smallest_passing,
    first_guess,
    frontier_points,
    search_documents,
    thin_by_kl,
    tightened,
    tightest_max_kl,
)


@dataclass
class Doc:
    doc_id: str


def test_search_documents_exclude_every_document_the_gate_scores():
    docs = [Doc(f"d{i}.txt") for i in range(6)]
    rest = search_documents(docs, {"d0.txt", "d3.txt"})
    assert [d.doc_id for d in rest] == ["d1.txt", "d2.txt", "d4.txt", "d5.txt"]
    with pytest.raises(ConfigError, match="sample_windows"):
        search_documents(docs, {f"d{i}.txt" for i in range(5)})


def points(n: int):
    # bytes grow, predicted KL falls: what the knapsack frontier gives
    return frontier_points([(1000 * (i + 1), 1.0 / (i + 1), {"a": "w4a16" if i < n // 2 else "w8a16"})
                            for i in reversed(range(n))])


def test_frontier_points_sorted_by_bytes_and_labelled():
    ps = points(6)
    assert [p.bytes for p in ps] == sorted(p.bytes for p in ps)
    assert ps[0].label == "1 w4a16" and ps[-1].label == "1 w8a16"


def test_first_guess_aims_under_the_max_kl_rule():
    ps = points(10)  # predicted KL 1, 1/2, ..., 1/10
    assert tightest_max_kl({"max_kl": {None: 0.25, "1K-2K": 0.3}}) == 0.25
    assert tightest_max_kl({"min_top1": {None: 0.9}}) is None
    i = first_guess(ps, 0.25)
    assert ps[i].predicted_kl <= 0.2 and ps[i - 1].predicted_kl > 0.2
    assert first_guess(ps, None) == 5
    assert first_guess(ps, 1e-9) == 5  # nothing predicted under it: the middle


@pytest.mark.parametrize("threshold", range(0, 13))
@pytest.mark.parametrize("start", [0, 3, 6, 11])
def test_bisection_finds_the_smallest_passing_point(threshold, start):
    ps = points(12)
    judged: list[int] = []

    def judge(i: int) -> Evaluation:
        judged.append(i)
        return Evaluation(i, "pass" if i >= threshold else "fail", 0, [], None)

    best, evaluations = bisect_smallest_passing(ps, judge, start, max_evaluations=12)
    assert best == (threshold if threshold < 12 else None)
    assert [e.index for e in evaluations] == judged and len(set(judged)) == len(judged)
    # a bounded budget never returns a failing point, and stops after that many builds
    best4, evaluations4 = bisect_smallest_passing(ps, judge, start, max_evaluations=2)
    assert len(evaluations4) <= 2 and (best4 is None or best4 >= threshold)


def test_inconclusive_counts_as_not_passing():
    ps = points(4)
    best, _ = bisect_smallest_passing(ps, lambda i: Evaluation(i, "inconclusive", 0, [], None), 1)
    assert best is None


def test_thinning_keeps_points_whose_predicted_kl_moves():
    ps = frontier_points([(100, 1.0, {}), (200, 0.99, {}), (300, 0.5, {}), (400, 1e-4, {}), (450, 1e-5, {}),
                          (500, 0.0, {})])
    assert [p.bytes for p in thin_by_kl(ps)] == [100, 300, 400]  # below 0.001 x the smallest's KL: not moving


def test_the_search_judges_by_rules_tightened_toward_no_loss():
    rules = {"max_kl": {None: 0.08, "1K-2K": 0.1}, "min_top1": {None: 0.8}, "max_ppl_ratio": {None: 1.3},
             "max_flip_rate": {None: 0.25}}
    t = tightened(rules, 0.8)
    assert t["max_kl"][None] == pytest.approx(0.064) and t["max_kl"]["1K-2K"] == pytest.approx(0.08)
    assert t["min_top1"][None] == pytest.approx(0.84) and t["max_ppl_ratio"][None] == pytest.approx(1.24)
    assert t["max_flip_rate"][None] == pytest.approx(0.2)
    assert tightened(rules, 1.0) == rules
