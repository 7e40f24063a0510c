"""The gate's closed loop: a recipe with `target = "gate"` asks for the smallest mix that passes [gate.quality].

    mixed = { path = "built/mixed", recipe = { method = "awq", mix = "w4a16,w8a16,bf16", target = "gate" } }

No tuning on the test set: the gate scores its windows on the documents of its [data.NAME] set that those windows
use; the search sees only the set's other documents (the gate's windows are a sample: `sample_windows`), split
by document into a choice part (calibration, per-Linear sensitivities, the knapsack frontier) and a held-out part
where each candidate build is judged by the gate's own quality rules (`run_compare_settings` with the gate's
settings). Along the frontier (fewer bytes, more predicted KL) the search bisects for the smallest point that
passes, starting from the point whose calibrated predicted KL meets the tightest overall `max_kl` rule; every
evaluated build is recorded (bytes, predicted KL, measured rules) so the report can draw what was explored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from tokq.errors import ConfigError

PASS = "pass"
MAX_EVALUATIONS = 4  # builds judged on the held-out documents (each is a quantization and a compare)
# A build must pass the held-out documents with room to spare: the gate's own windows are other documents, and
# a point that passes one sample at the edge fails the next about half the time (SmolLM2, max_kl 0.08: held-out
# upper bound 0.073, the gate's 0.083). Each rule is judged at MARGIN of its distance from the no-loss value.
MARGIN = 0.8
NO_LOSS = {"min_top1": 1.0, "max_ppl_ratio": 1.0}  # other rules (KL, its quantiles, flip rate, rms dp): 0


@dataclass
class FrontierPoint:
    """One point of the knapsack frontier: the assignment, its candidate-Linear bytes and its predicted KL."""

    bytes: int
    predicted_kl: float
    assignment: dict[str, str] = field(repr=False)
    label: str = ""

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for fmt in self.assignment.values():
            out[fmt] = out.get(fmt, 0) + 1
        return out


@dataclass
class Evaluation:
    """A frontier point built and judged on the held-out documents."""

    index: int  # into the frontier
    result: str  # "pass" | "fail" | "inconclusive"
    checkpoint_bytes: int
    rules: list[dict]  # the gate's quality rules as the held-out compare judged them
    kl: dict | None  # the held-out compare's overall mean KL estimate (value, low, high)


@dataclass
class GateSearch:
    """What the search did: its documents, the frontier, every evaluation, the chosen point."""

    documents: dict[str, int]  # gate_windows / choice / held_out document counts
    frontier: list[FrontierPoint]
    uniform: dict[str, FrontierPoint]  # format -> the all-one-format point, for the report
    evaluations: list[Evaluation] = field(default_factory=list)
    chosen: int | None = None  # frontier index built for the gate
    note: str = ""

    def to_json(self) -> dict:
        def point(p: FrontierPoint) -> dict:
            return {"bytes": p.bytes, "predicted_kl": p.predicted_kl, "label": p.label, "counts": p.counts()}

        return {"documents": self.documents, "frontier": [point(p) for p in self.frontier],
                "uniform": {fmt: point(p) for fmt, p in self.uniform.items()},
                "evaluations": [asdict(e) for e in self.evaluations], "chosen": self.chosen,
                "chosen_assignment": None if self.chosen is None else self.frontier[self.chosen].assignment,
                "note": self.note}


def search_documents(all_documents: Sequence, gate_doc_ids: set[str]) -> list:
    """The data set's documents the gate's own windows do not touch; refuses when too few are left to split."""
    rest = [d for d in all_documents if d.doc_id not in gate_doc_ids]
    if len(rest) < 2:
        raise ConfigError(f"the gate's windows use {len(gate_doc_ids)} of the data set's {len(all_documents)} "
                          "documents, leaving fewer than 2 for the search (it must not tune on the gate's own "
                          "windows): set sample_windows in the [data.NAME] table, or add documents")
    return rest


def tightest_max_kl(thresholds: dict[str, dict[str | None, float]]) -> float | None:
    """The overall max_kl rule's threshold, if the gate has one (the search's first guess aims under it)."""
    rule = thresholds.get("max_kl") or {}
    return rule.get(None)


def frontier_points(frontier: Sequence[tuple[int, float, dict[str, str]]]) -> list[FrontierPoint]:
    """Knapsack points (bytes, predicted KL, assignment) on calibrated costs (mixed.search.calibrate), smallest
    first, each labelled by how many Linears take each format."""
    points = [FrontierPoint(int(b), float(c), dict(a)) for b, c, a in frontier]
    points.sort(key=lambda p: (p.bytes, p.predicted_kl))
    for i, p in enumerate(points):
        p.label = ", ".join(f"{n} {fmt}" for fmt, n in sorted(p.counts().items())) or f"point {i}"
    return points


def thin_by_kl(points: Sequence[FrontierPoint], relative: float = 0.05, floor: float = 1e-3) -> list[FrontierPoint]:
    """Keep a point (smallest first) only when its predicted KL is below the last kept one's by more than `relative`
    of it and more than `floor` x the smallest build's: a byte-spaced frontier spends most of its points where the KL
    no longer moves (between all-int8 and all-16-bit), and each judged point costs a build and a compare."""
    kept: list[FrontierPoint] = []
    for p in points:
        if not kept or kept[-1].predicted_kl - p.predicted_kl > max(relative * kept[-1].predicted_kl,
                                                                    floor * kept[0].predicted_kl):
            kept.append(p)
    return kept


def tightened(thresholds: dict[str, dict[str | None, float]], margin: float = MARGIN) -> dict:
    """The rules the search judges a build by: each threshold moved toward the no-loss value, to `margin` of its
    distance from it (max_kl 0.08 -> 0.064, min_top1 0.8 -> 0.84, max_ppl_ratio 1.3 -> 1.24)."""
    out = {}
    for rule, by_bucket in thresholds.items():
        zero = NO_LOSS.get(rule, 0.0)
        out[rule] = {bucket: zero + (t - zero) * margin for bucket, t in by_bucket.items()}
    return out


def first_guess(points: Sequence[FrontierPoint], max_kl: float | None) -> int:
    """Where bisection starts: the smallest point predicted at or under 80% of max_kl (the search's own, tightened
    max_kl), else the middle."""
    if max_kl is not None:
        for i, p in enumerate(points):
            if p.predicted_kl <= 0.8 * max_kl:
                return i
    return len(points) // 2


def bisect_smallest_passing(points: Sequence[FrontierPoint], judge: Callable[[int], Evaluation], start: int,
                            max_evaluations: int = MAX_EVALUATIONS) -> tuple[int | None, list[Evaluation]]:
    """The smallest frontier index whose build passes, assuming quality improves with bytes along the frontier.

    Bisection over [0, len) from `start`; at most `max_evaluations` builds. Returns (index or None when no
    evaluated point passed, every evaluation in order)."""
    lo, hi = 0, len(points) - 1  # the answer lies in [lo, hi] if any point passes
    best: int | None = None
    evaluations: list[Evaluation] = []
    probe = min(max(start, lo), hi)
    while lo <= hi and len(evaluations) < max_evaluations:
        evaluation = judge(probe)
        evaluations.append(evaluation)
        if evaluation.result == PASS:
            best, hi = probe, probe - 1
        else:
            lo = probe + 1
        probe = (lo + hi) // 2
    return best, evaluations
