"""Per-token A/B metrics from engine scores: a baseline A (its top-k kept, cacheable) against a candidate B.

For each scored token (the prediction of token i of a window from tokens[:i]):
- ΔNLL = NLL_B − NLL_A of the actual token (exact);
- Δp = p_B(actual) − p_A(actual) (exact);
- top-1 agreement: A's argmax is an argmax of B too (ties count as agreement: 16-bit logits tie often,
  and which of two equal tokens a top-k returns first is arbitrary);
- KL(A‖B) over A's top-k tokens plus one bucket for all remaining tokens:
  Σ_top-k p log(p/q) + (1 − P) log((1 − P) / (1 − Q)), P and Q the two models' mass on A's top-k. This
  is the KL of the two distributions coarsened to k + 1 outcomes, a lower bound of the full-vocabulary
  KL (data-processing inequality) that becomes exact as k reaches the vocabulary; A's mean covered mass
  P is reported with it so the bound's tightness can be judged;
- expected acceptance rate Σ min(p, q) (the chance a speculative draft B's token is accepted by A):
  over A's top-k plus min(1 − P, 1 − Q) for the rest, an upper bound, exact at full vocabulary.

The baseline's scores come from one engine pass over the windows (`score_baseline`); the candidate is
scored at the baseline's top-k ids (`score_candidate`), so A and B never need to be in memory together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokq.engine.llm_engine import LLMEngine
from tokq.longctx.windows import TokenWindow


@dataclass
class BaselineWindow:
    """A's scores of one window's scored predictions (rows = window.scored_positions, in order)."""

    logprob: torch.Tensor  # fp32 [n]: log p_A(actual token)
    topk_ids: torch.Tensor  # int64 [n, k]
    topk_logprobs: torch.Tensor  # fp32 [n, k]


@dataclass
class TokenMetrics:
    """Per scored token, concatenated over windows."""

    kl: torch.Tensor
    top1: torch.Tensor  # float 0/1
    delta_nll: torch.Tensor
    delta_p: torch.Tensor
    accept: torch.Tensor
    coverage: torch.Tensor  # A's probability mass on its top-k
    position: torch.Tensor  # int64: index of the predicted token in its window
    doc_index: torch.Tensor  # int64

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"kl": self.kl, "top1": self.top1, "delta_nll": self.delta_nll, "delta_p": self.delta_p,
                "accept": self.accept}

    @property
    def tokens(self) -> int:
        return int(self.kl.shape[0])


def scored_rows(window: TokenWindow) -> slice:
    """Rows of a window's WindowScores (row p predicts token p + 1) that belong to its scored positions."""
    first = max(window.score_from, 1)
    return slice(first - 1, len(window.tokens) - 1)


def score_baseline(engine: LLMEngine, windows: Sequence[TokenWindow], topk: int, decode_from: int | None = None,
                   progress: Callable[[int], None] | None = None) -> list[BaselineWindow]:
    scores = engine.score([w.tokens for w in windows], topk=topk, decode_from=decode_from, progress=progress)
    out = []
    for window, score in zip(windows, scores, strict=True):
        rows = scored_rows(window)
        out.append(BaselineWindow(score.logprobs[rows].clone(), score.topk_ids[rows].clone(),
                                  score.topk_logprobs[rows].clone()))
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
    scores = engine.score([w.tokens for w in windows], topk=1, decode_from=decode_from, progress=progress,
                          gather_ids=gathers)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("kl", "top1", "delta_nll", "delta_p", "accept",
                                                            "coverage", "position", "doc_index")}
    for window, base, score, doc in zip(windows, baseline, scores, doc_index, strict=True):
        rows = scored_rows(window)
        metrics = token_metrics(base, score.logprobs[rows], score.topk_logprobs[rows, 0], score.gathered[rows])
        for key, value in metrics.items():
            parts[key].append(value)
        positions = torch.arange(rows.start + 1, rows.stop + 1)
        parts["position"].append(positions)
        parts["doc_index"].append(torch.full_like(positions, doc))
    return TokenMetrics(**{k: torch.cat(v) if v else torch.empty(0) for k, v in parts.items()})


def token_metrics(base: BaselineWindow, logprob_b: torch.Tensor, max_logprob_b: torch.Tensor,
                  gathered_b: torch.Tensor) -> dict[str, torch.Tensor]:
    """The module docstring's metrics for one window's rows (float64 where mass sums need it).

    `max_logprob_b`: B's largest log-probability per row; `gathered_b`: B's at A's top-k ids (A's argmax first)."""
    la, lb = base.logprob.double(), logprob_b.double()
    lp, lq = base.topk_logprobs.double(), gathered_b.double()
    p, q = lp.exp(), lq.exp()
    mass_p = p.sum(-1).clamp(max=1.0)
    mass_q = q.sum(-1).clamp(max=1.0)
    rest_p, rest_q = (1 - mass_p).clamp_min(0), (1 - mass_q).clamp_min(1e-30)
    kl_top = (p * (lp - lq)).sum(-1)
    kl_rest = torch.where(rest_p > 0, rest_p * (rest_p.clamp_min(1e-30).log() - rest_q.log()), torch.zeros_like(rest_p))
    kl = (kl_top + kl_rest).clamp_min(0.0)  # tiny negatives are rounding
    accept = torch.minimum(p, q).sum(-1) + torch.minimum(rest_p, 1 - mass_q)
    return {"kl": kl.float(), "top1": (gathered_b[:, 0] >= max_logprob_b).float(), "delta_nll": (la - lb).float(),
            "delta_p": (lb.exp() - la.exp()).float(), "accept": accept.clamp(0, 1).float(), "coverage": mass_p.float()}
