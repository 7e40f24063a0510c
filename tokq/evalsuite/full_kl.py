"""The full-vocabulary KL(A‖B) from a top-k baseline: exact, estimated with an interval, or a lower bound only.

A baseline keeps A's top-k log-probabilities at every scored position (what the baseline cache stores). KL
over those k tokens plus one bucket for the rest is the KL of the two distributions coarsened to k + 1
outcomes: a lower bound of the full-vocabulary KL (data-processing inequality), reported as `kl_topk`. The
part it misses at token t, the gap g_t = KL_full(t) − KL_topk(t) ≥ 0, is measured exactly wherever both
models' whole-vocabulary log-probabilities are kept: a systematic sample of `full_rows` of the path's N
scored positions (seeded random start, step N / full_rows, over the positions in window order), so every
scored token is in the sample with the same known probability π = full_rows / N. Per token

    kl_t = kl_topk(t) + g_t / π · 1[t sampled]

is unbiased for the mean full-vocabulary KL over any set of tokens (overall, a position bucket, a document):
the Horvitz–Thompson estimator of the tail's total. Its CI comes from the same paired document bootstrap as
every metric: the per-document sums carry the sampling noise of the tail term with them (a systematic draw
varies less than independent ones, so that interval errs wide, not narrow).

- exact: k is the vocabulary (g = 0), or π = 1 (every position sampled);
- estimated: 0 < π < 1;
- lower bound only: no whole distribution kept for either side (full_rows = 0, or an endpoint that returns
  only its top tokens): `kl` is `kl_topk`, and a max_kl rule can fail (the lower bound itself is above the
  limit) or be inconclusive (`lower_bound_verdict`), never pass.

What a baseline keeps of A at a sampled row (`a_tail`) is only what the gap needs: A's tail probabilities
p̃ (every token but its top-k) in bf16, rounded to nearest, and two float64 scalars: c = Σ_tail p̃ log p and
the fp32 row's normalisation error z = logsumexp(log p) (≈ 1e-7; A's top-k log-probabilities minus z are
exactly normalised). With B's whole row (fp32, renormalised in float64) the row's full KL is
Σ_topk p log(p/q) + c − Σ_tail p̃ log q, linear in p̃: bf16 rounding adds zero-mean noise of relative size
≤ 2^-9 per token, not a bias. (Rounding A's log-probabilities instead would bias every gap upward by KL(Ã‖A),
visible against an fp32 noise floor; fp16 probabilities flush the many tokens below 3e-8 to zero, a bias
of ~3e-4 of the KL on SmolLM2, whatever k: bf16 keeps fp32's exponent range.) With both rows exactly
normalised, kernel noise between A and B enters only at second order, as in `kl_topk`. g = that full KL
− `kl_topk`'s own value is therefore not clamped at 0 and can be a rounding error below it when A and B agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokq.evalsuite.stats.estimate import Estimate

A_TAIL_DTYPE = torch.bfloat16  # A's stored tail probabilities: half of fp32's bytes, its exponent range
KINDS = ("exact", "estimated", "lower_bound")
_ROWS_AT_ONCE = 32  # float64 rows in flight (32 x 262K x 8 B = 67 MB for Gemma 3's vocabulary)
_EMPTY = torch.zeros(0, dtype=torch.float64)


@dataclass
class FullSample:
    """Which scored rows of each window both models keep over the whole vocabulary, and with what
    inclusion probability (the same π for every scored token of the path)."""

    rows: list[torch.Tensor]  # per window: int64 indices into its scored rows, ascending
    prob: float  # π: 1.0 every row, 0.0 none

    @property
    def size(self) -> int:
        return sum(int(r.numel()) for r in self.rows)


def systematic_sample(counts: Sequence[int], budget: int, seed: int) -> FullSample:
    """`budget` of the sum(counts) rows, evenly spaced over the windows in order from a seeded random start:
    row i (global index) is drawn iff some u + j·s falls in [i, i + 1), s = N / budget, u ~ U[0, s), which
    happens with probability exactly 1 / s for every row. budget >= N takes every row (π = 1); 0 none."""
    total = sum(counts)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if total == 0 or budget == 0:
        return FullSample([torch.empty(0, dtype=torch.long) for _ in counts], 0.0 if total else 1.0)
    if budget >= total:
        return FullSample([torch.arange(n) for n in counts], 1.0)
    step = total / budget
    start = float(torch.rand((), generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)) * step
    picks = (start + torch.arange(budget, dtype=torch.float64) * step).floor().long().clamp(max=total - 1)
    rows, offset = [], 0
    for n in counts:
        inside = picks[(picks >= offset) & (picks < offset + n)]
        rows.append(inside - offset)
        offset += n
    return FullSample(rows, budget / total)


def _xlogy_rows(p: torch.Tensor, log_values: torch.Tensor) -> torch.Tensor:
    """Σ p · log_values per row, a term with p = 0 counting 0 (whatever the log)."""
    return torch.where(p > 0, p * log_values, torch.zeros_like(p)).sum(-1)


def _rest_kl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """(1 − P) log((1 − P)/(1 − Q)): the bucket of everything outside the k ids of lp/lq [n, k]."""
    rest_p = (1 - lp.exp().sum(-1).clamp(max=1.0)).clamp_min(0)
    rest_q = (1 - lq.exp().sum(-1).clamp(max=1.0)).clamp_min(1e-30)
    return torch.where(rest_p > 0, rest_p * (rest_p.clamp_min(1e-30).log() - rest_q.log()), torch.zeros_like(rest_p))


def bucket_kl(lp: torch.Tensor, lq: torch.Tensor, whole: bool = False) -> torch.Tensor:
    """Per row, KL over k ids plus one bucket for everything else, from float64 log-probabilities [n, k] of
    A (lp) and B (lq) at the same ids: Σ p log(p/q) + (1 − P) log((1 − P)/(1 − Q)). `whole`: the k ids are the
    whole vocabulary, so there is no bucket: both rows are renormalised instead (an fp32 row's normalisation
    error would enter at first order, and a bucket of rounding residue 1e-7 against an empty one adds ~5e-6)."""
    if whole:
        lp, lq = lp - lp.logsumexp(-1, keepdim=True), lq - lq.logsumexp(-1, keepdim=True)
        return _xlogy_rows(lp.exp(), lp - lq)
    return _xlogy_rows(lp.exp(), lp - lq) + _rest_kl(lp, lq)


def full_row_kl(full_a: torch.Tensor, full_b: torch.Tensor) -> torch.Tensor:
    """The exact KL(A‖B) per row from two rows of whole-vocabulary log-probabilities [m, vocab] (float64, both
    renormalised first: an fp32 row's normalisation error would otherwise enter at first order)."""
    out = [_EMPTY]
    for lo in range(0, full_a.shape[0], _ROWS_AT_ONCE):
        la = full_a[lo: lo + _ROWS_AT_ONCE].double().log_softmax(-1)
        lb = full_b[lo: lo + _ROWS_AT_ONCE].double().log_softmax(-1)
        out.append(_xlogy_rows(la.exp(), la - lb))
    return torch.cat(out)


@dataclass
class ATail:
    """What the full KL needs of A's whole rows at the sampled positions (see the module docstring)."""

    probs: torch.Tensor  # bf16 [m, vocab]: p̃, A's probabilities with its top-k ids zeroed
    plogp: torch.Tensor  # float64 [m]: c = Σ_tail p̃ log p
    lognorm: torch.Tensor  # float64 [m]: z, the fp32 row's logsumexp


def _renormalised(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-probability rows in float64, exactly normalised, and the normalisation error removed."""
    raw = rows.double()
    z = raw.logsumexp(-1)
    return raw - z[:, None], z


def a_tail(full_a: torch.Tensor, topk_ids: torch.Tensor) -> ATail:
    """A's whole rows [m, vocab] of fp32 log-probabilities, reduced to what the baseline keeps."""
    probs, plogp, lognorm = [torch.zeros(0, full_a.shape[1], dtype=A_TAIL_DTYPE)], [_EMPTY], [_EMPTY]
    for lo in range(0, full_a.shape[0], _ROWS_AT_ONCE):
        la, z = _renormalised(full_a[lo: lo + _ROWS_AT_ONCE])
        tail = la.exp().to(A_TAIL_DTYPE).scatter_(1, topk_ids[lo: lo + _ROWS_AT_ONCE], 0.0)
        probs.append(tail)
        plogp.append(_xlogy_rows(tail.double(), la))
        lognorm.append(z)
    return ATail(torch.cat(probs), torch.cat(plogp), torch.cat(lognorm))


def tail_gap(tail: ATail, topk_ids: torch.Tensor, topk_logprobs_a: torch.Tensor, gathered_b: torch.Tensor,
             full_b: torch.Tensor) -> torch.Tensor:
    """g = KL_full − KL_topk per sampled row (float64), from A's kept tail, A's top-k (ids, fp32 log-probs), B's
    values at those ids (what `kl_topk` was computed from) and B's whole rows (fp32 log-probabilities)."""
    out = [_EMPTY]
    for lo in range(0, tail.probs.shape[0], _ROWS_AT_ONCE):
        hi = lo + _ROWS_AT_ONCE
        lb, _ = _renormalised(full_b[lo:hi])  # as A's rows were: identical rows give a gap of exactly 0
        la_top = topk_logprobs_a[lo:hi].double() - tail.lognorm[lo:hi, None]
        full = (_xlogy_rows(la_top.exp(), la_top - lb.gather(1, topk_ids[lo:hi])) + tail.plogp[lo:hi]
                - _xlogy_rows(tail.probs[lo:hi].double(), lb))
        out.append(full - bucket_kl(topk_logprobs_a[lo:hi].double(), gathered_b[lo:hi].double()))
    return torch.cat(out)


def kind_of(topk: int, vocab: int, prob: float | None) -> str:
    """exact / estimated / lower_bound for a path scored at top-k with whole rows at inclusion probability
    `prob` (None: no whole distribution exists for either side)."""
    if topk >= vocab or prob == 1.0:
        return "exact"
    return "estimated" if prob else "lower_bound"


def lower_bound_verdict(estimate: Estimate, threshold: float, on: str = "bound") -> dict:
    """A max_kl rule on a KL that is only a lower bound of the full KL: never a pass. It fails when the lower
    bound's CI lies above the limit (on="point": its estimate), since the full KL is larger still; otherwise
    the data cannot decide: inconclusive."""
    pct = f"{estimate.confidence * 100:g}%"
    bound, side = (estimate.low, f"lower {pct} bound") if on == "bound" else (estimate.value, "estimate")
    if math.isnan(bound):
        return {"passed": False, "inconclusive": True,
                "rule": f"no tokens to bound the KL; max {threshold:.4g} not shown (inconclusive)"}
    if bound > threshold:
        return {"passed": False, "inconclusive": False,
                "rule": f"top-k lower bound of the KL: {side} {bound:.4g} > max {threshold:.4g}, and the full KL is "
                        "larger still"}
    return {"passed": False, "inconclusive": True,
            "rule": f"top-k lower bound of the KL only (no full distribution): {side} {bound:.4g} <= max "
                    f"{threshold:.4g} cannot show the full KL is within it (inconclusive)"}
