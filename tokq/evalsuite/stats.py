"""Paired statistics for A/B comparisons: per-document, per-position-bucket and overall estimates with CIs.

`tokq compare A B` scores the same token windows with a baseline A and a candidate B, so every
per-token value (KL(A||B), top-1 agreement, NLL_B - NLL_A, p_B - p_A, expected acceptance) is
already a *paired* quantity: a difference or pair statistic measured on one token. Tokens are not
independent, though: tokens of one document share topic, style and length, so their errors are
correlated. A per-token standard error would be far too narrow. We therefore resample whole
documents (a cluster bootstrap): each resample draws documents with replacement and keeps all of
a drawn document's tokens, so the within-document correlation travels with the document and the
interval reflects document-to-document variation, which is what a user's next corpus will differ by.
Because A and B were scored on the same tokens, the same draw serves both models (and all metrics),
which is what makes the bootstrap paired.

The statistic is the token-weighted mean (sum of values / number of tokens over the drawn
documents): the same estimator as the point value, so the interval describes the number reported.
Intervals are percentile intervals (outer order statistics); the draws come from a seeded torch.Generator so identical
inputs always give identical intervals (a gate must not flip on rerun).

Gate thresholds are checked against the unfavourable end of the interval (see `check_threshold`):
a candidate passes only when the data show it is within the limit, not merely when its point
estimate happens to be.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor

# Position buckets are powers of two from 512: quality loss from quantization or KV compression
# typically grows with distance into the context, and doubling widths keep every bucket populated
# with comparable numbers of tokens per octave of context length.
POSITION_BUCKETS: list[tuple[int, int, str]] = [
    (0, 512, "0-511"),
    (512, 1024, "512-1K"),
    (1024, 2048, "1K-2K"),
    (2048, 4096, "2K-4K"),
    (4096, 8192, "4K-8K"),
    (8192, 16384, "8K-16K"),
    (16384, 32768, "16K-32K"),
    (32768, 65536, "32K-64K"),
    (65536, 131072, "64K-128K"),
]

DEFAULT_CONFIDENCE = 0.95

# Bound on the number of elements of one [rows, D] resample-count block, so memory stays small
# (~32 MB of float64) even for many documents; blocks are drawn in a fixed order, so the result
# does not depend on the block size chosen for a given D.
_BLOCK_ELEMENTS = 1 << 22


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


def buckets_up_to(window: int) -> list[tuple[int, int, str]]:
    """The buckets a window of `window` tokens can reach (positions 0..window-1), in order.

    A report lists exactly these rows, so a 2K window shows three buckets rather than six empty ones.
    """
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    return [b for b in POSITION_BUCKETS if b[0] < window]


@dataclass
class Estimate:
    """One statistic with its bootstrap confidence interval.

    `n_tokens`/`n_docs` count the tokens and documents that contributed (after any mask), so a
    reader can tell a tight interval from a bucket that only two documents reach. Values are NaN
    when no token contributed.
    """

    value: float
    low: float
    high: float
    n_tokens: int
    n_docs: int
    confidence: float = DEFAULT_CONFIDENCE

    def to_json(self) -> dict:
        """Plain dict; NaN becomes None so the result is strict JSON."""
        return {
            "value": _json_float(self.value),
            "low": _json_float(self.low),
            "high": _json_float(self.high),
            "n_tokens": int(self.n_tokens),
            "n_docs": int(self.n_docs),
            "confidence": float(self.confidence),
        }


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
    method: str = field(default="paired document bootstrap, percentile interval, token-weighted mean")

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
        }


def _json_float(x: float) -> float | None:
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


def _check_doc_index(doc_index: Tensor, n: int, num_docs: int) -> Tensor:
    doc_index = torch.as_tensor(doc_index)
    if doc_index.dim() != 1 or doc_index.shape[0] != n:
        raise ValueError(f"doc_index must be 1-D with {n} entries, got shape {tuple(doc_index.shape)}")
    if doc_index.dtype.is_floating_point or doc_index.dtype == torch.bool:
        raise ValueError(f"doc_index must be an integer tensor, got {doc_index.dtype}")
    doc_index = doc_index.to(torch.int64)
    if n and (int(doc_index.min()) < 0 or int(doc_index.max()) >= num_docs):
        raise ValueError(
            f"doc_index values must lie in [0, {num_docs}); got [{int(doc_index.min())}, {int(doc_index.max())}]"
        )
    return doc_index


def per_document_means(values: Tensor, doc_index: Tensor, num_docs: int) -> tuple[Tensor, Tensor]:
    """Per-document sums (float64 [D]) and token counts (int64 [D]) of `values`.

    Sums and counts rather than means: the bootstrap and the token-weighted overall mean both need
    them, and a mean of per-doc means would weight a 100-token note like a 100K-token book.
    Divide where counts > 0 for the per-document means.
    """
    values = torch.as_tensor(values)
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D, got shape {tuple(values.shape)}")
    doc_index = _check_doc_index(doc_index, values.shape[0], num_docs)
    sums = torch.zeros(num_docs, dtype=torch.float64).index_add_(0, doc_index, values.to(torch.float64))
    counts = torch.bincount(doc_index, minlength=num_docs)[:num_docs].to(torch.int64)
    return sums, counts


def ppl_ratio_from(delta_nll: Tensor | float) -> Tensor | float:
    """Perplexity ratio PPL_B / PPL_A = exp(mean(NLL_B - NLL_A)), from a mean delta NLL.

    Used as a bootstrap transform: applied to the point mean and to each resample's mean, so the
    ratio's interval is exactly exp of the delta-NLL interval (exp is monotone).
    """
    if isinstance(delta_nll, Tensor):
        return torch.exp(delta_nll)
    return math.exp(delta_nll)


def _resample_counts(generator: torch.Generator, resamples: int, num: int) -> Iterator[Tensor]:
    """Yield [rows, num] float64 blocks: how often each document is drawn in each resample."""
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(num, 1))
    done = 0
    while done < resamples:
        rows = min(rows_per_block, resamples - done)
        idx = torch.randint(0, num, (rows, num), generator=generator)
        counts = torch.zeros(rows, num, dtype=torch.float64)
        counts.scatter_add_(1, idx, torch.ones(rows, num, dtype=torch.float64))
        yield counts
        done += rows


def paired_bootstrap(
    metrics: dict[str, Tensor],
    doc_index: Tensor,
    num_docs: int,
    mask: Tensor | None = None,
    resamples: int = 1000,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    transforms: dict[str, Callable[[Tensor], Tensor]] | None = None,
) -> dict[str, Estimate]:
    """Token-weighted mean of each metric with a percentile CI from a paired bootstrap over documents.

    Paired: A and B were measured on the same tokens, so each per-token value is already a paired
    difference (delta NLL, delta p) or a pair statistic (KL(A||B), top-1 agreement, acceptance);
    resampling *documents* (all of a document's tokens together) keeps the within-document
    correlation that a per-token bootstrap would ignore, and one draw serves every metric.

    metrics: name -> per-token values [N] (bool is fine). doc_index: int [N] in [0, num_docs).
    mask: optional bool [N]; only masked tokens count (e.g. one position bucket). Documents with no
    token under the mask contribute nothing: resampling is over the K documents that do (drawn K
    at a time with replacement), so an empty document neither dilutes nor randomises the interval.
    transforms: name -> function applied to the mean (as a 0-d float64 tensor) and elementwise to
    the [R] resample means before taking percentiles, e.g. {"ppl_ratio": ppl_ratio_from} with
    metrics["ppl_ratio"] = delta_nll.

    Vectorised: per-doc sums and counts are computed once; a [R, K] matrix of draw counts times
    the [K, M] sums gives all R statistics for all M metrics in one matmul. Deterministic given
    `seed` (a fresh torch.Generator per call).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    transforms = dict(transforms or {})
    unknown = set(transforms) - set(metrics)
    if unknown:
        raise ValueError(f"transforms name metrics that are not given: {sorted(unknown)}")
    names = list(metrics)
    if not names:
        return {}
    n = int(torch.as_tensor(metrics[names[0]]).shape[0])
    doc_index = _check_doc_index(doc_index, n, num_docs)
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.dtype != torch.bool or mask.shape != (n,):
            raise ValueError(f"mask must be a bool tensor of shape ({n},), got {mask.dtype} {tuple(mask.shape)}")

    columns = []
    for name in names:
        values = torch.as_tensor(metrics[name])
        if values.shape != (n,):
            raise ValueError(f"metric {name!r} has shape {tuple(values.shape)}, expected ({n},)")
        values = values.to(torch.float64)
        if mask is not None:
            values = torch.where(mask, values, torch.zeros((), dtype=torch.float64))
        columns.append(values)
    values_nm = torch.stack(columns, dim=1)  # [N, M]
    weights = torch.ones(n, dtype=torch.float64) if mask is None else mask.to(torch.float64)

    sums = torch.zeros(num_docs, len(names), dtype=torch.float64).index_add_(0, doc_index, values_nm)
    counts = torch.zeros(num_docs, dtype=torch.float64).index_add_(0, doc_index, weights)
    keep = counts > 0
    sums, counts = sums[keep], counts[keep]  # [K, M], [K]
    k = int(sums.shape[0])
    n_tokens = int(counts.sum().item())

    if k == 0:
        nan = float("nan")
        return {name: Estimate(nan, nan, nan, 0, 0, confidence) for name in names}

    point = sums.sum(dim=0) / counts.sum()  # [M]

    generator = torch.Generator().manual_seed(int(seed))
    stats_blocks = []
    for draw in _resample_counts(generator, resamples, k):
        total = draw @ counts  # [rows]
        stat = (draw @ sums) / total.unsqueeze(1)  # [rows, M]
        stats_blocks.append(stat[total > 0])  # cannot be 0 with K >= 1 drawn docs, kept as a guard
    stats = torch.cat(stats_blocks, dim=0)  # [R', M]

    alpha = (1.0 - confidence) / 2.0
    out: dict[str, Estimate] = {}
    for j, name in enumerate(names):
        value_t, col = point[j], stats[:, j]
        fn = transforms.get(name)
        if fn is not None:
            value_t, col = torch.as_tensor(fn(value_t), dtype=torch.float64), torch.as_tensor(fn(col))
            col = col.to(torch.float64)
        # Outer order statistics (no interpolation): never narrower than the interpolated
        # percentile, and exactly equivariant under increasing transforms, so the ppl_ratio bounds
        # are exactly exp of the delta_nll bounds.
        low = float(torch.quantile(col, alpha, interpolation="lower"))
        high = float(torch.quantile(col, 1.0 - alpha, interpolation="higher"))
        out[name] = Estimate(float(value_t), float(low), float(high), n_tokens, k, confidence)
    return out


def aggregate_table(
    per_token: dict[str, Tensor],
    doc_index: Tensor,
    position: Tensor,
    doc_ids: list[str],
    window: int,
    resamples: int = 1000,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
) -> MetricTable:
    """Overall, per-position-bucket and per-document aggregates of every per-token metric.

    If `per_token` has "delta_nll", a "ppl_ratio" metric (exp of the mean delta NLL, with its CI
    from the same resamples) is added. Buckets are those `window` can reach, plus any further
    bucket that actually holds tokens (so no token is dropped from the table). Every bootstrap uses
    the same seed, so the whole table is reproducible.
    """
    num_docs = len(doc_ids)
    metrics = {name: torch.as_tensor(v) for name, v in per_token.items()}
    transforms: dict[str, Callable[[Tensor], Tensor]] = {}
    if "delta_nll" in metrics and "ppl_ratio" not in metrics:
        metrics["ppl_ratio"] = metrics["delta_nll"]
        transforms["ppl_ratio"] = ppl_ratio_from
    position = torch.as_tensor(position)
    n = int(position.shape[0])
    doc_index = _check_doc_index(doc_index, n, num_docs)

    overall = paired_bootstrap(metrics, doc_index, num_docs, None, resamples, seed, confidence, transforms)

    bucket_idx = bucket_of(position)
    present = set(torch.unique(bucket_idx).tolist()) if n else set()
    reachable = {i for i, b in enumerate(POSITION_BUCKETS) if b[0] < window}
    buckets: dict[str, dict[str, Estimate]] = {}
    for i in sorted(reachable | present):
        label = POSITION_BUCKETS[i][2]
        mask = bucket_idx == i
        buckets[label] = paired_bootstrap(metrics, doc_index, num_docs, mask, resamples, seed, confidence,
                                          transforms)

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
    )


def aggregate(
    per_token: dict[str, Tensor],
    doc_index: Tensor,
    position: Tensor,
    doc_ids: list[str],
    window: int,
    resamples: int = 1000,
    seed: int = 0,
) -> dict:
    """JSON-ready aggregates: {"overall", "buckets", "documents", "n_tokens", "n_docs", "resamples",
    "seed", "confidence", ...}; see `aggregate_table` (this is its `to_json()`)."""
    return aggregate_table(per_token, doc_index, position, doc_ids, window, resamples, seed).to_json()


def mcnemar_exact(a_right_b_wrong: int, a_wrong_b_right: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of the discordant pairs against p = 0.5.

    For retrieval flips only the items where A and B disagree carry information about which is
    better; under "no difference" each flip goes either way with probability 1/2. With p = 0.5 the
    distribution is symmetric, so the two-sided p-value is min(1, 2 * P(X <= min(b, c))), the same
    as scipy.stats.binomtest. 1.0 when there are no discordant pairs (no evidence either way).
    """
    b, c = int(a_right_b_wrong), int(a_wrong_b_right)
    if b < 0 or c < 0:
        raise ValueError(f"counts must be non-negative, got ({b}, {c})")
    n = b + c
    if n == 0:
        return 1.0
    from scipy.stats import binom  # lazy: scipy is slow to import and only needed here

    return float(min(1.0, 2.0 * binom.cdf(min(b, c), n, 0.5)))


@dataclass
class ThresholdResult:
    """The outcome of one gate threshold, with the bound that decided it and a one-line reason."""

    metric: str
    bucket: str | None  # None = overall
    threshold: float
    direction: str  # "max" or "min"
    estimate: Estimate
    passed: bool
    bound_used: float
    rule: str

    def to_json(self) -> dict:
        return {
            "metric": self.metric,
            "bucket": self.bucket,
            "threshold": float(self.threshold),
            "direction": self.direction,
            "estimate": self.estimate.to_json(),
            "passed": bool(self.passed),
            "bound_used": _json_float(self.bound_used),
            "rule": self.rule,
        }


CI_RULES = ("bound", "point")


def check_threshold(
    estimate: Estimate, threshold: float, direction: str, metric: str, bucket: str | None = None,
    on: str = "bound",
) -> ThresholdResult:
    """Pass/fail a threshold on the interval's unfavourable bound (on="bound", the default), or on the
    point estimate (on="point": the CI is reported but does not decide).

    direction "max" (KL, ppl ratio, flip rate must stay below): fail if estimate.high > threshold.
    direction "min" (top-1 agreement, acceptance must stay above): fail if estimate.low < threshold.
    A point estimate just inside the limit with a wide interval fails: the data do not show the
    candidate is within it. An estimate with no tokens (NaN) fails, since nothing was shown.
    """
    if direction not in ("max", "min"):
        raise ValueError(f"direction must be 'max' or 'min', got {direction!r}")
    if on not in CI_RULES:
        raise ValueError(f"on must be one of {CI_RULES}, got {on!r}")
    pct = f"{estimate.confidence * 100:g}%"
    if on == "point":
        bound, side = estimate.value, "estimate"
    else:
        bound, side = (estimate.high, f"upper {pct} bound") if direction == "max" else (estimate.low,
                                                                                        f"lower {pct} bound")
    bad = bound > threshold if direction == "max" else bound < threshold
    op = (">" if bad else "<=") if direction == "max" else ("<" if bad else ">=")
    if math.isnan(bound):
        return ThresholdResult(metric, bucket, threshold, direction, estimate, False, bound,
                               f"no tokens to bound {metric}; {direction} {threshold:.4g} not shown")
    rule = f"{side} {bound:.4g} {op} {direction} {threshold:.4g}"
    if on == "point":
        rule += f" ({pct} CI [{estimate.low:.4g}, {estimate.high:.4g}])"
    return ThresholdResult(metric, bucket, threshold, direction, estimate, not bad, float(bound), rule)
