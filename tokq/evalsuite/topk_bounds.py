"""KL(A‖B) when a side reports only part of its distribution: a rigorous lower bound and a point estimate.

A URL side (an OpenAI-compatible server) gives, at each position, its own top-k (k <= 20 on most servers)
and the actual next token's log-probability; a local side gives what it is asked for (its top-k and its values
at the other side's ids). Per row each side is a `PartialRows`: log-probabilities at some ids, and a cap: every
token it did not report has log-probability <= cap (its k-th value).

Lower bound (`kl_bound`, rigorous). Partition the vocabulary into: K, tokens both sides reported (singletons);
D, tokens only A reported (singletons; B's value unknown, <= B's cap c each); W, everything A did not report
(one cell: A's mass there is P_W = 1 − Σ_reported p, B's is Q_W = the B values it reported inside W plus an
unknown u >= 0). By the log-sum inequality, the KL of the coarsened distributions is <= the full KL, for every
completion of B. Over all completions of B consistent with its report (values on D in [0, c], u >= 0, B's
unreported mass R = 1 − Σ_reported q shared by D and u), the coarsened KL is convex and separable; its minimum is
water-filling: q(x) = min(c, λ p(x)) on D, Q_W = max(Q_W known, λ P_W), λ such that the masses add up to R. We
evaluate at a λ bisected from above (masses >= R): every q is then >= its optimum, the objective is decreasing in
q, so the figure is <= the minimum: a lower bound up to float rounding, whichever side is remote. The reported
values carry rounding (a server's fp32 log-probabilities summed over k tokens), so R is floored at 1e-6: a sum of
reported probabilities a hair above 1 never turns into an infinite bound. A remote A's own unknown tail is never
guessed: it sits in W as one cell (coarse-graining only lowers the KL).

Point estimate (`kl_estimate`, NOT a bound). The union of reported ids, each unknown value filled in as "the
side agrees with the other, up to its cap" (q(x) = min(c_B, p(x)), p(x) = min(c_A, q(x))), plus one bucket for
the rest mass of each side, as full_kl's top-k + rest estimator treats the tail. Exact when both sides report
everything; close when both distributions are peaked (little mass outside the top-k); raised to the lower bound
where it would fall below it (an estimate below a rigorous bound is certainly wrong).

Exact (no estimate involved): ΔNLL and Δp of the actual token (both sides always report it), top-1 agreement
(A's argmax is an argmax of B: B's value there is known when B reported it, and otherwise <= B's k-th value,
which agrees only on an exact tie we count as disagreement).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ROWS_AT_ONCE = 32
REST_FLOOR = 1e-6  # an unreported mass below this is taken as this (rounding of the reported values)
_BISECTIONS = 80


@dataclass
class PartialRows:
    """One side's scores at a window's scored rows, as far as it reported them."""

    logprob: torch.Tensor  # fp32 [n]: log-probability of the actual next token
    ids: torch.Tensor  # int64 [n, m]: ids whose log-probabilities are known (duplicates allowed; -1: padding)
    logprobs: torch.Tensor  # fp32 [n, m]
    cap: torch.Tensor  # fp32 [n]: every id not in `ids` has log-probability <= cap (0.0: no cap known)
    top1: torch.Tensor  # int64 [n]: the argmax id
    top1_logprob: torch.Tensor  # fp32 [n]: its log-probability


def _reported(side: PartialRows, targets: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows lo:hi: every id the side reported a value for, and the values (float64), as [r, m + 2]."""
    ids = torch.cat([side.ids[lo:hi], targets[lo:hi, None], side.top1[lo:hi, None]], 1)
    values = torch.cat([side.logprobs[lo:hi], side.logprob[lo:hi, None], side.top1_logprob[lo:hi, None]], 1).double()
    return ids, values


def _lookup(ids: torch.Tensor, values: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """Per row, the value reported at each `wanted` id (NaN where none was; of an id reported twice, the later)."""
    order = torch.sort(ids, dim=1, stable=True)
    at = torch.searchsorted(order.values, wanted.contiguous(), right=True) - 1
    found = (at >= 0) & (order.values.gather(1, at.clamp_min(0)) == wanted) & (wanted >= 0)
    return torch.where(found, values.gather(1, order.indices.gather(1, at.clamp_min(0))), float("nan"))


def _columns(a: PartialRows, b: PartialRows, targets: torch.Tensor, lo: int, hi: int):
    """Both sides' values over the union of the ids either reported, one column per distinct id (others NaN on
    both sides, like every id neither reported): what a [rows, vocab] layout holds, in the work of k, not of the
    vocabulary (a real model's 50K-260K ids, times the bound's bisections, made the client the bottleneck)."""
    ids_a, values_a = _reported(a, targets, lo, hi)
    ids_b, values_b = _reported(b, targets, lo, hi)
    union = torch.cat([ids_a, ids_b], 1).sort(1).values
    first = torch.ones_like(union, dtype=torch.bool)
    first[:, 1:] = union[:, 1:] != union[:, :-1]
    union = torch.where(first & (union >= 0), union, -1)  # repeats and padding: a column neither side reported
    b_at_top_a = _lookup(ids_b, values_b, a.top1[lo:hi, None])[:, 0]
    return _lookup(ids_a, values_a, union), _lookup(ids_b, values_b, union), b_at_top_a


def _xlogratio(p: torch.Tensor, lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    return torch.where(p > 0, p * (lp - lq), torch.zeros_like(p))


def pair_metrics(a: PartialRows, b: PartialRows, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row: kl_bound (rigorous lower bound), kl_estimate, top1, delta_nll, delta_p, accept (estimate) and
    coverage (A's reported mass). `targets`: int64 [n], the actual next tokens."""
    n = targets.shape[0]
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("kl_bound", "kl_estimate", "top1", "accept", "coverage")}
    for lo in range(0, n, _ROWS_AT_ONCE):
        hi = min(n, lo + _ROWS_AT_ONCE)
        for key, value in _chunk(a, b, targets, lo, hi).items():
            parts[key].append(value)
    out = {k: torch.cat(v) if v else torch.empty(0, dtype=torch.float64) for k, v in parts.items()}
    la, lb = a.logprob.double(), b.logprob.double()
    out["delta_nll"] = la - lb
    out["delta_p"] = lb.exp() - la.exp()
    return {k: v.float() for k, v in out.items()}


def _chunk(a: PartialRows, b: PartialRows, targets: torch.Tensor, lo: int, hi: int) -> dict:
    lp, lq, b_at_top_a = _columns(a, b, targets, lo, hi)
    kp, kq = ~lp.isnan(), ~lq.isnan()
    p, q = torch.where(kp, lp.exp(), 0.0), torch.where(kq, lq.exp(), 0.0)
    cap_p, cap_q = a.cap[lo:hi].double().exp()[:, None], b.cap[lo:hi].double().exp()[:, None]
    bound = _water_filled_bound(lp, lq, p, q, kp, kq, cap_q)
    # the estimate: unknown values filled as agreement up to the side's cap, one rest bucket per side
    both = kp | kq
    pe = torch.where(kp, p, torch.where(both, torch.minimum(cap_p, q), 0.0))
    qe = torch.where(kq, q, torch.where(both, torch.minimum(cap_q, p), 0.0))
    rest_p = (1 - pe.sum(-1)).clamp_min(0)
    rest_q = (1 - qe.sum(-1)).clamp_min(REST_FLOOR)
    lpe, lqe = pe.clamp_min(1e-300).log(), qe.clamp_min(1e-300).log()
    est = _xlogratio(pe, lpe, lqe).sum(-1) + torch.where(rest_p > 0, rest_p * (rest_p.clamp_min(1e-300).log()
                                                                                - rest_q.log()), 0.0)
    accept = torch.minimum(pe, qe).sum(-1) + torch.minimum(rest_p, rest_q)
    top1 = (a.top1[lo:hi] == b.top1[lo:hi]) | (b_at_top_a >= b.top1_logprob[lo:hi].double())  # NaN: False
    return {"kl_bound": bound.clamp_min(0.0), "kl_estimate": torch.maximum(est, bound).clamp_min(0.0),
            "top1": top1.double(), "accept": accept.clamp(0, 1), "coverage": p.sum(-1).clamp(max=1.0)}


def _water_filled_bound(lp, lq, p, q, kp, kq, cap_q) -> torch.Tensor:
    """min over B's completions of the coarsened KL (the module docstring), evaluated at λ from above."""
    known = kp & kq
    only_a = kp & ~kq
    term_k = _xlogratio(p, lp, lq).where(known, 0.0).sum(-1)
    p_w = (1 - p.sum(-1)).clamp_min(0)  # A's mass on everything it did not report
    q_w_known = q.where(kq & ~kp, 0.0).sum(-1)  # B's reported mass inside that cell
    rest_q = (1 - q.sum(-1)).clamp_min(REST_FLOOR)  # B's unreported mass, shared by D and the cell
    p_d = p.where(only_a, 0.0)

    def mass(lam: torch.Tensor) -> torch.Tensor:
        on_d = torch.minimum(cap_q, lam[:, None] * p_d).where(p_d > 0, 0.0).sum(-1)
        return on_d + (lam * p_w - q_w_known).clamp_min(0)

    # an upper end where the mass is >= R: the cell alone holds it, or every D token sits at its cap
    smallest = p_d.where(p_d > 0, float("inf")).min(-1).values
    hi = torch.maximum(torch.where(p_w > 0, (rest_q + q_w_known) / p_w.clamp_min(1e-300), 0.0),
                       torch.where(smallest.isfinite(), cap_q[:, 0] / smallest, 0.0)) * (1 + 1e-9)
    unbounded = (p_w <= 0) & (mass(hi) < rest_q)  # P_W = 0 and D's caps hold less than R: D at its caps, the rest costs nothing
    lo = torch.zeros_like(hi)
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        over = mass(mid) >= rest_q
        hi, lo = torch.where(over, mid, hi), torch.where(over, lo, mid)
    lam = torch.where(unbounded, float("inf"), hi)
    q_d = torch.minimum(cap_q, lam[:, None] * p_d)
    term_d = _xlogratio(p_d, p_d.clamp_min(1e-300).log(), q_d.clamp_min(1e-300).log()).sum(-1)
    q_w = torch.maximum(q_w_known, torch.where(unbounded, q_w_known, lam * p_w))
    term_w = torch.where(p_w > 0, p_w * (p_w.clamp_min(1e-300).log() - q_w.clamp_min(1e-300).log()), 0.0)
    return term_k + term_d + term_w
