"""Per-token A/B metrics from engine scores: a baseline A (its top-k kept, cacheable) against a candidate B.

For each scored token (the prediction of token i of a window from tokens[:i]):
- ΔNLL = NLL_B − NLL_A of the actual token (exact);
- Δp = p_B(actual) − p_A(actual) (exact);
- top-1 agreement: A's argmax is an argmax of B too (ties count as agreement: 16-bit logits tie often,
  and which of two equal tokens a top-k returns first is arbitrary);
- `kl_topk`: KL(A‖B) over A's top-k tokens plus one bucket for all remaining tokens:
  Σ_top-k p log(p/q) + (1 − P) log((1 − P) / (1 − Q)), P and Q the two models' mass on A's top-k. This
  is the KL of the two distributions coarsened to k + 1 outcomes, a lower bound of the full-vocabulary
  KL (data-processing inequality) that becomes exact as k reaches the vocabulary; A's mean covered mass
  P is reported with it so the bound's tightness can be judged;
- `kl`: the full-vocabulary KL(A‖B): `kl_topk` plus, on the positions where the baseline kept A's whole
  distribution (a sample with inclusion probability π), the exact tail gap / π (evalsuite.full_kl: exact
  at π = 1, unbiased below it, `kl_topk` itself when no whole distribution was kept);
- expected acceptance rate Σ min(p, q) (the chance a speculative draft B's token is accepted by A):
  over A's top-k plus min(1 − P, 1 − Q) for the rest, an upper bound, exact at full vocabulary.

The baseline's scores come from one engine pass over the windows (`score_baseline`); the candidate is
scored at the baseline's top-k ids and over the whole vocabulary at the baseline's sampled positions
(`score_candidate`), so A and B never need to be in memory together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokq.engine.llm_engine import LLMEngine
from tokq.evalsuite.full_kl import ATail, FullSample, a_tail, bucket_kl, tail_gap
from tokq.longctx.windows import TokenWindow


@dataclass
class BaselineWindow:
    """A's scores of one window's scored predictions (rows = window.scored_positions, in order)."""

    logprob: torch.Tensor  # fp32 [n]: log p_A(actual token)
    topk_ids: torch.Tensor  # int64 [n, k]
    topk_logprobs: torch.Tensor  # fp32 [n, k]
    full_rows: torch.Tensor | None = None  # int64 [m]: rows (ascending) where A's whole distribution was scored
    tail: ATail | None = None  # what the full KL needs of A's rows there (evalsuite.full_kl)
    full_prob: float = 0.0  # π: every row's probability of being among full_rows (1.0: all of them)

    def rows_from(self, skip: int) -> BaselineWindow:
        """The same scores from row `skip` on (a sample's rows keep their inclusion probability)."""
        full_rows = tail = None
        if self.full_rows is not None:
            keep = self.full_rows >= skip
            full_rows = self.full_rows[keep] - skip
            tail = ATail(self.tail.probs[keep], self.tail.plogp[keep], self.tail.lognorm[keep])
        return BaselineWindow(self.logprob[skip:], self.topk_ids[skip:], self.topk_logprobs[skip:], full_rows, tail,
                              self.full_prob)


@dataclass
class TokenMetrics:
    """Per scored token, concatenated over windows."""

    kl: torch.Tensor  # the full-vocabulary estimate (see the module docstring)
    kl_topk: torch.Tensor  # its top-k + bucket lower bound
    kl_gap: torch.Tensor  # the exact tail gap on sampled tokens, 0 elsewhere
    sampled: torch.Tensor  # bool: the token's whole distributions were scored
    top1: torch.Tensor  # float 0/1
    delta_nll: torch.Tensor
    delta_p: torch.Tensor
    accept: torch.Tensor
    coverage: torch.Tensor  # A's probability mass on its top-k
    position: torch.Tensor  # int64: index of the predicted token in its window
    doc_index: torch.Tensor  # int64
    non_finite: torch.Tensor  # bool: B's log-probabilities of the token hold NaN or inf (a broken model)
    # a URL side (evalsuite.remote_compare): the KL's point estimate beside `kl`, its rigorous lower bound there
    kl_estimate: torch.Tensor | None = None

    def as_dict(self) -> dict[str, torch.Tensor]:
        out = {"kl": self.kl, "kl_topk": self.kl_topk, "top1": self.top1, "delta_nll": self.delta_nll,
               "delta_p": self.delta_p, "accept": self.accept}
        if self.kl_estimate is not None:
            out["kl_estimate"] = self.kl_estimate
        return out

    @property
    def tokens(self) -> int:
        return int(self.kl.shape[0])


def scored_rows(window: TokenWindow) -> slice:
    """Rows of a window's WindowScores (row p predicts token p + 1) that belong to its scored positions."""
    first = max(window.score_from, 1)
    return slice(first - 1, len(window.tokens) - 1)


def _full_masks(windows: Sequence[TokenWindow], rows: Sequence[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """Engine masks over each window's positions from indices into its scored rows (None: no window has any)."""
    if all(r is None for r in rows):
        return None
    masks = []
    for window, picked in zip(windows, rows, strict=True):
        mask = torch.zeros(len(window.tokens) - 1, dtype=torch.bool)
        if picked is not None:
            mask[scored_rows(window).start + picked] = True
        masks.append(mask)
    return masks


def score_baseline(engine: LLMEngine, windows: Sequence[TokenWindow], topk: int, decode_from: int | None = None,
                   progress: Callable[[int], None] | None = None,
                   sample: FullSample | None = None) -> list[BaselineWindow]:
    """A's scores; with `sample`, also what the full KL needs of A's whole distribution at the sample's rows."""
    wanted = sample is not None and sample.size > 0
    masks = _full_masks(windows, sample.rows) if wanted else None
    scores = engine.score([w.tokens for w in windows], topk=topk, decode_from=decode_from, progress=progress,
                          full_rows=masks)
    out = []
    for i, (window, score) in enumerate(zip(windows, scores, strict=True)):
        rows = scored_rows(window)
        base = BaselineWindow(score.logprobs[rows].clone(), score.topk_ids[rows].clone(),
                              score.topk_logprobs[rows].clone())
        if wanted:
            picked = sample.rows[i].clone()
            base.full_rows, base.full_prob = picked, sample.prob
            base.tail = a_tail(score.full_logprobs, base.topk_ids[picked])
        out.append(base)
    return out


def score_candidate(engine: LLMEngine, windows: Sequence[TokenWindow], baseline: Sequence[BaselineWindow],
                    doc_index: Sequence[int], decode_from: int | None = None,
                    progress: Callable[[int], None] | None = None) -> TokenMetrics:
    """B's per-token metrics against the baseline, on the same windows (and the same path)."""
    gathers = []
    for window, base in zip(windows, baseline, strict=True):
        ids = torch.zeros(len(window.tokens) - 1, base.topk_ids.shape[1], dtype=torch.long)
        ids[scored_rows(window)] = base.topk_ids
        gathers.append(ids)
    masks = _full_masks(windows, [base.full_rows for base in baseline])
    scores = engine.score([w.tokens for w in windows], topk=1, decode_from=decode_from, progress=progress,
                          gather_ids=gathers, full_rows=masks)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "kl", "kl_topk", "kl_gap", "sampled", "top1", "delta_nll", "delta_p", "accept", "coverage", "position",
        "doc_index", "non_finite")}
    for window, base, score, doc in zip(windows, baseline, scores, doc_index, strict=True):
        rows = scored_rows(window)
        metrics = token_metrics(base, score.logprobs[rows], score.topk_logprobs[rows, 0], score.gathered[rows],
                                engine.model.config.vocab_size)
        metrics.update(_tail_estimate(base, metrics["kl_topk"], score.gathered[rows], score.full_logprobs))
        metrics["non_finite"] = non_finite_rows(score.logprobs[rows], score.gathered[rows])
        for key, value in metrics.items():
            parts[key].append(value)
        positions = torch.arange(rows.start + 1, rows.stop + 1)
        parts["position"].append(positions)
        parts["doc_index"].append(torch.full_like(positions, doc))
    return TokenMetrics(**{k: torch.cat(v) if v else torch.empty(0) for k, v in parts.items()})


def non_finite_rows(logprob: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Per row, whether a model's scores are broken: the actual token's log-probability is NaN or infinite
    (finite logits never give either), or a kept log-probability [rows, k] is NaN. Such a row makes every
    metric NaN, and NaN fails no comparison: it must be counted and fail the run, never read as a pass."""
    return ~torch.isfinite(logprob) | torch.isnan(kept).any(-1)


def token_metrics(base: BaselineWindow, logprob_b: torch.Tensor, max_logprob_b: torch.Tensor,
                  gathered_b: torch.Tensor, vocab: int | None = None) -> dict[str, torch.Tensor]:
    """The module docstring's metrics for one window's rows (float64 where mass sums need it).

    `max_logprob_b`: B's largest log-probability per row; `gathered_b`: B's at A's top-k ids (A's argmax first);
    `vocab`: the vocabulary size, when known (k = vocab: the rows are whole distributions, no bucket)."""
    la, lb = base.logprob.double(), logprob_b.double()
    lp, lq = base.topk_logprobs.double(), gathered_b.double()
    p, q = lp.exp(), lq.exp()
    mass_p = p.sum(-1).clamp(max=1.0)
    mass_q = q.sum(-1).clamp(max=1.0)
    kl = bucket_kl(lp, lq, whole=vocab is not None and lp.shape[-1] >= vocab).clamp_min(0.0)  # negatives: rounding
    accept = torch.minimum(p, q).sum(-1) + torch.minimum((1 - mass_p).clamp_min(0), 1 - mass_q)
    return {"kl_topk": kl.float(), "top1": (gathered_b[:, 0] >= max_logprob_b).float(),
            "delta_nll": (la - lb).float(), "delta_p": (lb.exp() - la.exp()).float(),
            "accept": accept.clamp(0, 1).float(), "coverage": mass_p.float()}


def _tail_estimate(base: BaselineWindow, kl_topk: torch.Tensor, gathered_b: torch.Tensor,
                   full_b: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """kl = kl_topk + gap / π on the sampled rows (the full KL's Horvitz–Thompson estimate; exact at π = 1)."""
    gap = torch.zeros_like(kl_topk, dtype=torch.float64)
    sampled = torch.zeros_like(kl_topk, dtype=torch.bool)
    kl = kl_topk.double()
    if base.full_rows is not None and base.full_rows.numel():
        picked = base.full_rows
        gap[picked] = tail_gap(base.tail, base.topk_ids[picked], base.topk_logprobs[picked], gathered_b[picked], full_b)
        sampled[base.full_rows] = True
        kl = kl + gap / base.full_prob
    return {"kl": kl.float(), "kl_gap": gap.float(), "sampled": sampled}
