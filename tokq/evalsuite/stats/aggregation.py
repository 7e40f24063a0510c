"""The table `tokq compare` reports: overall, per-position-bucket and per-document aggregates of every
per-token metric, each mean with its paired-bootstrap interval and the KL tail with its quantile intervals."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokq.evalsuite.rule_defs import POSITION_BUCKETS

from .bootstrap import check_doc_index, paired_bootstrap, per_document_means, ppl_ratio_from, rms_from
from .estimate import DEFAULT_CONFIDENCE, FEW_DOCUMENTS, INF, Estimate, few_documents_warning
from .quantiles import cluster_quantiles

log = logging.getLogger("tokq")

Tensor = torch.Tensor

# Where each aggregated metric can lie: interval bounds are clipped to it (the true mean lies there too,
# so clipping never loses coverage), and with a single document the interval is the whole range.
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "kl": (0.0, INF), "kl_topk": (0.0, INF), "top1": (0.0, 1.0), "accept": (0.0, 1.0), "delta_p": (-1.0, 1.0),
    "rms_delta_p": (0.0, 1.0), "delta_nll": (-INF, INF), "ppl_ratio": (-INF, INF),
}

# KL tail statistics as llama.cpp's KLD report gives them: name -> quantile level of the per-token KL.
KL_QUANTILES = {"kl_p90": 0.90, "kl_p95": 0.95, "kl_p99": 0.99, "kl_p999": 0.999}


def bucket_of(position: Tensor) -> Tensor:
    """Index into POSITION_BUCKETS of each token's position (int64, same shape as `position`).

    Positions outside [0, 131072) raise: silently folding them into the last bucket would mislabel
    tokens of windows longer than tokq supports.
    """
    position = torch.as_tensor(position)
    if position.numel() == 0:
        return torch.zeros(position.shape, dtype=torch.int64)
    lo_all, hi_all = POSITION_BUCKETS[0][0], POSITION_BUCKETS[-1][1]
    pmin, pmax = int(position.min()), int(position.max())
    if pmin < lo_all or pmax >= hi_all:
        raise ValueError(f"positions must lie in [{lo_all}, {hi_all}); got range [{pmin}, {pmax}]")
    upper = torch.tensor([hi for _, hi, _ in POSITION_BUCKETS], dtype=torch.int64)
    # right=True: index i such that upper[i-1] <= position < upper[i].
    return torch.bucketize(position.to(torch.int64), upper, right=True)



@dataclass
class MetricTable:
    """Everything `aggregate` computes: overall and per-bucket estimates per metric, per-doc means.

    overall[metric] -> Estimate; buckets[label][metric] -> Estimate; doc_means[metric][d] -> mean of
    that metric over document d's tokens (None for a document with no scored tokens).
    """

    overall: dict[str, Estimate]
    buckets: dict[str, dict[str, Estimate]]
    doc_ids: list[str]
    doc_tokens: list[int]
    doc_means: dict[str, list[float | None]]
    n_tokens: int
    n_docs: int
    resamples: int
    seed: int
    confidence: float = DEFAULT_CONFIDENCE
    window: int | None = None
    method: str = field(default="paired document bootstrap: token-weighted means with a studentized (bootstrap-t) "
                                "interval, KL quantiles with a percentile interval, the maximum without one")
    warnings: list[str] = field(default_factory=list)
    kl_tails_from: str | None = None  # the per-token metric the KL tail statistics are taken from

    def to_json(self) -> dict:
        documents = []
        for d, doc_id in enumerate(self.doc_ids):
            row: dict = {"doc_id": doc_id, "tokens": int(self.doc_tokens[d])}
            for name, means in self.doc_means.items():
                row[name] = means[d]
            documents.append(row)
        return {
            "overall": {name: est.to_json() for name, est in self.overall.items()},
            "buckets": {
                label: {name: est.to_json() for name, est in ests.items()}
                for label, ests in self.buckets.items()
            },
            "documents": documents,
            "n_tokens": int(self.n_tokens),
            "n_docs": int(self.n_docs),
            "resamples": int(self.resamples),
            "seed": int(self.seed),
            "confidence": float(self.confidence),
            "window": self.window,
            "method": self.method,
            "warnings": list(self.warnings),
            "kl_tails_from": self.kl_tails_from,
        }


def aggregate_table(
    per_token: dict[str, Tensor],
    doc_index: Tensor,
    position: Tensor,
    doc_ids: list[str],
    window: int,
    resamples: int = 1000,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    kl_tails_from: str | None = "kl",
) -> MetricTable:
    """Overall, per-position-bucket and per-document aggregates of every per-token metric.

    If `per_token` has "delta_nll", a "ppl_ratio" metric (exp of the mean delta NLL, with its CI
    from the same resamples) is added; if it has "delta_p", "rms_delta_p" (sqrt of the mean Δp²).
    The KL tail statistics (KL_QUANTILES and "kl_max") come from per_token[kl_tails_from] when it is
    given (per-token values: a per-token estimator whose values are not each a token's KL would give
    meaningless quantiles, so the caller names the tensor). Buckets are those `window` can reach, plus
    any further bucket that actually holds tokens (so no token is dropped from the table). Every
    bootstrap uses the same seed, so the whole table is reproducible. Estimates backed by fewer than
    FEW_DOCUMENTS documents carry a warning; the table lists them in `warnings` and logs one line.
    """
    num_docs = len(doc_ids)
    metrics = {name: torch.as_tensor(v) for name, v in per_token.items()}
    transforms: dict[str, Callable[[Tensor], Tensor]] = {}
    if "delta_nll" in metrics and "ppl_ratio" not in metrics:
        metrics["ppl_ratio"] = metrics["delta_nll"]
        transforms["ppl_ratio"] = ppl_ratio_from
    if "delta_p" in metrics and "rms_delta_p" not in metrics:
        metrics["rms_delta_p"] = metrics["delta_p"].to(torch.float64) ** 2
        transforms["rms_delta_p"] = rms_from
    tails = per_token.get(kl_tails_from) if kl_tails_from else None
    position = torch.as_tensor(position)
    n = int(position.shape[0])
    doc_index = check_doc_index(doc_index, n, num_docs)

    def estimates(mask: Tensor | None) -> dict[str, Estimate]:
        out = paired_bootstrap(metrics, doc_index, num_docs, mask, resamples, seed, confidence, transforms,
                               METRIC_RANGES)
        if tails is not None:
            quantiles = cluster_quantiles(tails, doc_index, num_docs, KL_QUANTILES, mask, resamples, seed, confidence,
                                          lowest=0.0)
            out.update({("kl_max" if name == "max" else name): est for name, est in quantiles.items()})
        return out

    overall = estimates(None)

    bucket_idx = bucket_of(position)
    present = set(torch.unique(bucket_idx).tolist()) if n else set()
    reachable = {i for i, b in enumerate(POSITION_BUCKETS) if b[0] < window}
    buckets: dict[str, dict[str, Estimate]] = {}
    for i in sorted(reachable | present):
        label = POSITION_BUCKETS[i][2]
        buckets[label] = estimates(bucket_idx == i)

    doc_means: dict[str, list[float | None]] = {}
    counts = torch.bincount(doc_index, minlength=num_docs)[:num_docs]
    for name, values in metrics.items():
        sums, _ = per_document_means(values, doc_index, num_docs)
        means = sums / counts.clamp(min=1).to(torch.float64)
        if name in transforms:
            means = transforms[name](means)
        doc_means[name] = [float(m) if c > 0 else None for m, c in zip(means.tolist(), counts.tolist(), strict=True)]

    return MetricTable(
        overall=overall,
        buckets=buckets,
        doc_ids=list(doc_ids),
        doc_tokens=[int(c) for c in counts.tolist()],
        doc_means=doc_means,
        n_tokens=n,
        n_docs=int((counts > 0).sum()),
        resamples=resamples,
        seed=seed,
        confidence=confidence,
        window=window,
        warnings=_few_documents(overall, buckets),
        kl_tails_from=kl_tails_from if tails is not None else None,
    )


def _few_documents(overall: dict[str, Estimate], buckets: dict[str, dict[str, Estimate]]) -> list[str]:
    """One line per scope (overall, each bucket) whose intervals rest on fewer than FEW_DOCUMENTS documents."""
    few = []
    for scope, ests in [("overall", overall), *buckets.items()]:
        n_docs = max((e.n_docs for e in ests.values()), default=0)
        if few_documents_warning(n_docs):
            few.append((scope, n_docs))
    if few:
        log.warning("confidence intervals rest on fewer than %d documents (%s): they may not hold; score more "
                    "documents", FEW_DOCUMENTS, ", ".join(f"{scope} {n}" for scope, n in few))
    return [f"{scope}: the intervals rest on {n} documents (fewer than {FEW_DOCUMENTS}): they may not hold; score "
            "more documents" for scope, n in few]


def aggregate(
    per_token: dict[str, Tensor],
    doc_index: Tensor,
    position: Tensor,
    doc_ids: list[str],
    window: int,
    resamples: int = 1000,
    seed: int = 0,
    kl_tails_from: str | None = "kl",
) -> dict:
    """JSON-ready aggregates: {"overall", "buckets", "documents", "n_tokens", "n_docs", "resamples",
    "seed", "confidence", "warnings", ...}; see `aggregate_table` (this is its `to_json()`)."""
    return aggregate_table(per_token, doc_index, position, doc_ids, window, resamples, seed,
                           kl_tails_from=kl_tails_from).to_json()
