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
Its interval is a studentized (bootstrap-t) interval: each resample's mean is centred on the point
value and divided by that resample's own cluster-robust standard error (the linearized ratio
estimator's, with the K/(K-1) small-sample factor), and the quantiles of that t statistic scale the
data's standard error; each side is at least the cluster-robust t interval's, with Satterthwaite's
degrees of freedom for documents of unequal sizes (`effective_df`). A percentile interval (the previous
method, `interval="percentile"`) inherits the narrowness and skew of a bootstrap distribution built from
few documents: on simulated clustered data shaped on a real comparison (skewed per-document KL,
documents of 200..2000 tokens, correlated tokens; tests/test_stats.py) it covers the true mean in ~85%
of runs at 8 documents and ~93% at 50; this interval in 94-97% at both. Bounds are clipped to the
metric's range (KL >= 0, agreement in [0, 1], ...), which never loses coverage. With one document there
is no interval: the bounds are the metric's range. Fewer than `FEW_DOCUMENTS` documents put a warning on
the estimate (`Estimate.warning`): the interval rests on few clusters.

Tail statistics of the per-token KL (p90 ... p99.9 as in llama.cpp's KLD report) get a percentile
interval from the same document resampling (`cluster_quantiles`); the maximum has no interval. RMS Δp
is sqrt(mean Δp²), its interval sqrt of the bootstrap-t interval of the mean of Δp².
Proportions over probes (`proportion`) get exact Clopper–Pearson intervals. Every resampling draws
from a seeded torch.Generator, so identical inputs always give identical intervals (a gate must not
flip on rerun).

Gate thresholds are checked against the unfavourable end of the interval (see `check_threshold`):
a candidate passes only when the data show it is within the limit, not merely when its point
estimate happens to be.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

log = logging.getLogger("tokq")

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

# Below this many documents an interval rests on few clusters: the estimate says so (Estimate.warning).
FEW_DOCUMENTS = 20

# Where each aggregated metric can lie: interval bounds are clipped to it (the true mean lies there too,
# so clipping never loses coverage), and with a single document the interval is the whole range.
INF = math.inf
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "kl": (0.0, INF), "kl_topk": (0.0, INF), "top1": (0.0, 1.0), "accept": (0.0, 1.0), "delta_p": (-1.0, 1.0),
    "rms_delta_p": (0.0, 1.0), "delta_nll": (-INF, INF), "ppl_ratio": (-INF, INF),
}

# KL tail statistics as llama.cpp's KLD report gives them: name -> quantile level of the per-token KL.
KL_QUANTILES = {"kl_p90": 0.90, "kl_p95": 0.95, "kl_p99": 0.99, "kl_p999": 0.999}

METHOD_MEAN = "studentized document bootstrap (bootstrap-t, cluster-robust SE, t floor)"
METHOD_PERCENTILE = "percentile document bootstrap"
METHOD_QUANTILE = "percentile document bootstrap of the quantile"
METHOD_MAX = "none: a sample maximum has no confidence interval"
METHOD_EXACT = "exact binomial (Clopper-Pearson)"

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
    """One statistic with its confidence interval.

    `n_tokens`/`n_docs` count the tokens and documents that contributed (after any mask), so a
    reader can tell a tight interval from a bucket that only two documents reach (for a proportion
    over probes, both count the probes). Values are NaN when no token contributed; a bound is NaN
    when the statistic has no interval (a maximum) and +-inf when the sample gives none (one
    document, no known range). `method` names how the interval was made; `warning` says why it may
    not hold (few documents).
    """

    value: float
    low: float
    high: float
    n_tokens: int
    n_docs: int
    confidence: float = DEFAULT_CONFIDENCE
    method: str | None = None
    warning: str | None = None

    def to_json(self) -> dict:
        """Plain dict; NaN and +-inf become None so the result is strict JSON."""
        out = {
            "value": _json_float(self.value),
            "low": _json_float(self.low),
            "high": _json_float(self.high),
            "n_tokens": int(self.n_tokens),
            "n_docs": int(self.n_docs),
            "confidence": float(self.confidence),
        }
        if self.method is not None:
            out["method"] = self.method
        if self.warning is not None:
            out["warning"] = self.warning
        return out


def few_documents_warning(n_docs: int) -> str | None:
    """The warning an interval backed by fewer than FEW_DOCUMENTS documents carries (None otherwise)."""
    if 0 < n_docs < FEW_DOCUMENTS:
        return (f"only {n_docs} document{'s' if n_docs != 1 else ''} back this interval (fewer than "
                f"{FEW_DOCUMENTS}): its coverage rests on few clusters; score more documents")
    return None


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


def rms_from(mean_square: Tensor | float) -> Tensor | float:
    """Root mean square from a mean of squares (the transform of rms_delta_p; increasing on >= 0)."""
    if isinstance(mean_square, Tensor):
        return torch.sqrt(mean_square.clamp(min=0.0))
    return math.sqrt(max(mean_square, 0.0))


def _resample_counts(generator: torch.Generator, resamples: int, num: int) -> Iterator[Tensor]:
    """Yield [rows, num] float64 blocks: how often each document is drawn in each resample."""
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(num, 1))
    done = 0
    while done < resamples:
        rows = min(rows_per_block, resamples - done)
        idx = torch.randint(0, num, (rows, num), generator=generator)
        flat = (idx + torch.arange(rows).unsqueeze(1) * num).flatten()  # row r's draws count in bins r*num ...
        yield torch.bincount(flat, minlength=rows * num).view(rows, num).to(torch.float64)
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
    ranges: dict[str, tuple[float, float]] | None = None,
    interval: str = "studentized",
) -> dict[str, Estimate]:
    """Token-weighted mean of each metric with a CI from a paired bootstrap over documents.

    Paired: A and B were measured on the same tokens, so each per-token value is already a paired
    difference (delta NLL, delta p) or a pair statistic (KL(A||B), top-1 agreement, acceptance);
    resampling *documents* (all of a document's tokens together) keeps the within-document
    correlation that a per-token bootstrap would ignore, and one draw serves every metric.

    metrics: name -> per-token values [N] (bool is fine). doc_index: int [N] in [0, num_docs).
    mask: optional bool [N]; only masked tokens count (e.g. one position bucket). Documents with no
    token under the mask contribute nothing: resampling is over the K documents that do (drawn K
    at a time with replacement), so an empty document neither dilutes nor randomises the interval.
    transforms: name -> increasing function applied to the mean (a 0-d float64 tensor) and to the
    interval's bounds, e.g. {"ppl_ratio": ppl_ratio_from} with metrics["ppl_ratio"] = delta_nll.
    ranges: name -> (lowest, highest) value the metric can take (before its transform): bounds are
    clipped to it, and with one document the interval is the whole range.
    interval: "studentized" (bootstrap-t, the default; see the module docstring) or "percentile" (the
    outer order statistics of the resampled means: kept for comparison, it undercovers with few
    documents).

    Vectorised: per-doc sums and counts are computed once; [R, K] matrices of draw counts times the
    [K, M] sums (and squares, for each resample's standard error) give all R statistics for all M
    metrics in a few matmuls. Deterministic given `seed` (a fresh torch.Generator per call).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if interval not in ("studentized", "percentile"):
        raise ValueError(f"interval must be 'studentized' or 'percentile', got {interval!r}")
    transforms = dict(transforms or {})
    ranges = dict(ranges or {})
    unknown = set(transforms) - set(metrics)
    if unknown:
        raise ValueError(f"transforms name metrics that are not given: {sorted(unknown)}")
    names = list(metrics)
    if not names:
        return {}
    n = int(torch.as_tensor(metrics[names[0]]).shape[0])
    doc_index = _check_doc_index(doc_index, n, num_docs)
    mask = _check_mask(mask, n)

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

    point, lows, highs = mean_interval(sums, counts, resamples, seed, confidence, interval)
    method = METHOD_MEAN if interval == "studentized" else METHOD_PERCENTILE
    out: dict[str, Estimate] = {}
    warning = few_documents_warning(k)
    for j, name in enumerate(names):
        lowest, highest = ranges.get(name, (-INF, INF))
        value, low, high = float(point[j]), float(lows[j]), float(highs[j])
        if k == 1:  # one document: no interval, whatever the method
            low, high = -INF, INF
        low, high = min(max(low, lowest), highest), max(min(high, highest), lowest)
        fn = transforms.get(name)
        if fn is not None:
            value, low, high = (float(fn(torch.tensor(x, dtype=torch.float64))) for x in (value, low, high))
        out[name] = Estimate(value, low, high, n_tokens, k, confidence, method, warning)
    return out


def _check_mask(mask: Tensor | None, n: int) -> Tensor | None:
    if mask is None:
        return None
    mask = torch.as_tensor(mask)
    if mask.dtype != torch.bool or mask.shape != (n,):
        raise ValueError(f"mask must be a bool tensor of shape ({n},), got {mask.dtype} {tuple(mask.shape)}")
    return mask


def mean_interval(sums: Tensor, counts: Tensor, resamples: int = 1000, seed: int = 0,
                  confidence: float = DEFAULT_CONFIDENCE,
                  interval: str = "studentized") -> tuple[Tensor, Tensor, Tensor]:
    """Token-weighted means [M] of K documents' per-metric sums [K, M] over their token counts [K] (> 0), with
    their interval's low and high bounds [M] (see `paired_bootstrap`, which calls this). Deterministic given
    `seed`."""
    sums, counts = torch.as_tensor(sums, dtype=torch.float64), torch.as_tensor(counts, dtype=torch.float64)
    point = sums.sum(dim=0) / counts.sum()
    generator = torch.Generator().manual_seed(int(seed))
    alpha = (1.0 - confidence) / 2.0
    if interval == "studentized":
        return (point, *_studentized_bounds(sums, counts, point, generator, resamples, alpha))
    if interval == "percentile":
        return (point, *_percentile_bounds(sums, counts, generator, resamples, alpha))
    raise ValueError(f"interval must be 'studentized' or 'percentile', got {interval!r}")


def _studentized_bounds(sums: Tensor, counts: Tensor, point: Tensor, generator: torch.Generator, resamples: int,
                        alpha: float) -> tuple[Tensor, Tensor]:
    """Bootstrap-t bounds [M] of the ratio estimator sum(sums) / sum(counts) over K documents.

    SE: the linearized ratio estimator's cluster-robust standard error, sqrt(K/(K-1) * sum_k e_k^2) / N
    with e_k = s_k - mean * n_k. Each resample is studentized by its own SE, computed from the same
    formula on the drawn documents (centred residuals keep the sums of squares free of cancellation).
    Order statistics are taken outward (never narrower than interpolation would give), and each side is
    at least as wide as the cluster-robust t interval with `effective_df` degrees of freedom: with few
    documents the bootstrap's t quantiles can come out short, most when the documents differ in size
    (simulated coverage at 8 documents of 200..2000 tokens: 93% without this floor, 96% with it).
    """
    k = int(sums.shape[0])
    if k < 2:
        inf = torch.full_like(point, INF)
        return -inf, inf
    from scipy.stats import t as student_t  # lazy: scipy is slow to import

    t_floor = float(student_t.ppf(1.0 - alpha, effective_df(counts)))
    factor = k / (k - 1)
    resid = sums - point.unsqueeze(0) * counts.unsqueeze(1)  # [K, M], sums to 0 over K
    se = torch.sqrt(factor * (resid**2).sum(dim=0)) / counts.sum()  # [M]
    resid_sq, resid_n, counts_sq = resid**2, resid * counts.unsqueeze(1), counts**2
    t_blocks = []
    for draw in _resample_counts(generator, resamples, k):
        total = (draw @ counts).unsqueeze(1)  # [rows, 1]
        shift = _columns(draw, resid) / total  # resampled mean - point, [rows, M]
        gross = _columns(draw, resid_sq) + shift**2 * (draw @ counts_sq).unsqueeze(1)
        squares = gross - 2 * shift * _columns(draw, resid_n)
        se_r = torch.sqrt(factor * squares.clamp(min=0.0)) / total
        # A resample without spread (one document drawn K times; the expanded square then leaves only rounding,
        # hence the relative test) has no t: it is left out (NaN), as usual for bootstrap-t. With K <= 3 such
        # draws exceed 2.5% and would otherwise make a bound infinite, or absurd.
        spread = (squares > 1e-9 * gross) & ((draw > 0).sum(dim=1, keepdim=True) > 1)
        t_blocks.append(torch.where(spread, shift / se_r.clamp(min=1e-300), math.nan))
    t = torch.cat(t_blocks, dim=0)  # [R, M]
    t_low = torch.nanquantile(t, alpha, dim=0, interpolation="lower").nan_to_num(nan=-t_floor).clamp(max=-t_floor)
    t_high = torch.nanquantile(t, 1.0 - alpha, dim=0, interpolation="higher").nan_to_num(nan=t_floor).clamp(min=t_floor)
    spread = se > 0  # no spread in the data (e.g. every token agrees): the interval is the point
    low = torch.where(spread, point - t_high * se, point)
    high = torch.where(spread, point - t_low * se, point)
    return low, high


def effective_df(counts: Tensor) -> float:
    """Degrees of freedom of the cluster-robust variance of a token-weighted mean over documents of `counts`
    tokens: Satterthwaite's (sum n_k^2)^2 / sum n_k^4 (a document's residual varies with its size squared when
    documents differ by their means), less one for the mean; K - 1 for equal sizes. Eight documents of which
    one holds most tokens inform the variance about as much as two or three do."""
    squares = torch.as_tensor(counts, dtype=torch.float64) ** 2
    return max(1.0, float(squares.sum() ** 2 / (squares**2).sum()) - 1.0)


def _columns(draw: Tensor, values: Tensor) -> Tensor:
    """draw [R, K] @ values [K, M], one matrix-vector product per column: M is a handful of metrics, and a
    skinny float64 GEMM can cost 100x more than that on a busy multi-threaded CPU."""
    return torch.stack([draw @ values[:, j] for j in range(values.shape[1])], dim=1)


def _percentile_bounds(sums: Tensor, counts: Tensor, generator: torch.Generator, resamples: int,
                       alpha: float) -> tuple[Tensor, Tensor]:
    """Outer order statistics [M] of the resampled ratio means (the percentile interval)."""
    blocks = []
    for draw in _resample_counts(generator, resamples, int(sums.shape[0])):
        blocks.append(_columns(draw, sums) / (draw @ counts).unsqueeze(1))
    stats = torch.cat(blocks, dim=0)  # [R, M]
    return (torch.quantile(stats, alpha, dim=0, interpolation="lower"),
            torch.quantile(stats, 1.0 - alpha, dim=0, interpolation="higher"))


# Quantiles of resampled token sets are read off a grid of pooled values: exact up to this many distinct
# values, else this many spread evenly by rank plus the top ones exactly (the tail quantiles live there).
_QUANTILE_GRID = 4096


def cluster_quantiles(
    values: Tensor,
    doc_index: Tensor,
    num_docs: int,
    levels: dict[str, float],
    mask: Tensor | None = None,
    resamples: int = 1000,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    lowest: float = -INF,
) -> dict[str, Estimate]:
    """Quantiles of the pooled per-token `values` (name -> level in (0, 1)) and their maximum ("max"), with
    percentile intervals from the same document resampling as the means.

    A quantile at level q is the smallest value v with at least q of the tokens <= v (the inverse of the
    empirical distribution), for the point and for each resample (whose tokens are the drawn documents'
    tokens, repeated as drawn). Per-document cumulative counts over a grid of pooled values make every
    resample one [R, K] @ [K, G] matmul; the grid is every distinct value up to `_QUANTILE_GRID` of them,
    else that many by rank plus the top `_QUANTILE_GRID` distinct values exactly (a resample's quantile in
    between rounds up to the next grid value: never below it). The maximum's Estimate has NaN bounds: no
    interval. With one document the bounds are [lowest, inf).
    """
    values = torch.as_tensor(values).to(torch.float64)
    n = int(values.shape[0])
    doc_index = _check_doc_index(doc_index, n, num_docs)
    mask = _check_mask(mask, n)
    if mask is not None:
        values, doc_index = values[mask], doc_index[mask]
    nan = float("nan")
    names = [*levels, "max"]
    if values.numel() == 0:
        return {name: Estimate(nan, nan, nan, 0, 0, confidence) for name in names}
    present, doc_index = torch.unique(doc_index, return_inverse=True)
    k, n = int(present.numel()), int(values.numel())
    warning = few_documents_warning(k)
    ordered = torch.sort(values).values
    points = {name: float(ordered[_rank(level, n)]) for name, level in levels.items()}
    out = {"max": Estimate(float(ordered[-1]), nan, nan, n, k, confidence, METHOD_MAX, warning)}
    if k == 1:
        for name, value in points.items():
            out[name] = Estimate(value, lowest, INF, n, k, confidence, METHOD_QUANTILE, warning)
        return {name: out[name] for name in names}

    distinct = torch.unique(ordered)  # sorted
    if distinct.numel() > 2 * _QUANTILE_GRID:
        by_rank = ordered[torch.linspace(0, n - 1, _QUANTILE_GRID).round().long()]
        distinct = torch.unique(torch.cat([by_rank, distinct[-_QUANTILE_GRID:]]))
    grid = distinct
    cell = torch.searchsorted(grid, values).clamp(max=grid.numel() - 1)  # first grid value >= the token
    per_doc = torch.zeros(k * grid.numel(), dtype=torch.float64)
    per_doc.index_add_(0, doc_index * grid.numel() + cell, torch.ones(n, dtype=torch.float64))
    cumulative = per_doc.view(k, grid.numel()).cumsum(dim=1)  # [K, G]: tokens <= grid[g] per document
    counts = cumulative[:, -1].clone()
    generator = torch.Generator().manual_seed(int(seed))
    level_t = torch.tensor(list(levels.values()), dtype=torch.float64)
    picks = []
    rows_at_once = max(1, _BLOCK_ELEMENTS // grid.numel())
    for draw in _resample_counts(generator, resamples, k):
        for part in draw.split(rows_at_once):
            cum = part @ cumulative  # [rows, G]
            target = (part @ counts).unsqueeze(1) * level_t.unsqueeze(0) * (1 - 1e-12)  # [rows, L]
            picks.append(torch.searchsorted(cum, target).clamp(max=grid.numel() - 1))
    resampled = grid[torch.cat(picks, dim=0)]  # [R, L]
    alpha = (1.0 - confidence) / 2.0
    lows = torch.quantile(resampled, alpha, dim=0, interpolation="lower")
    highs = torch.quantile(resampled, 1.0 - alpha, dim=0, interpolation="higher")
    for j, (name, value) in enumerate(points.items()):
        out[name] = Estimate(value, max(float(lows[j]), lowest), float(highs[j]), n, k, confidence, METHOD_QUANTILE,
                             warning)
    return {name: out[name] for name in names}


def _rank(level: float, n: int) -> int:
    """Index into n sorted values of the inverse empirical CDF at `level`."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"quantile levels must lie in (0, 1), got {level}")
    return min(n - 1, max(0, math.ceil(level * n * (1 - 1e-12)) - 1))


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
    doc_index = _check_doc_index(doc_index, n, num_docs)

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


def clopper_pearson(successes: int, trials: int, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """Two-sided exact (Clopper-Pearson) interval of a binomial proportion: [B(a/2; x, n-x+1), B(1-a/2; x+1, n-x)].

    It holds for any n (no normal approximation): with 0 of 5 the upper 95% bound is 1 - 0.025^(1/5) = 0.52,
    so five clean probes cannot show a flip rate below 0.25. NaN bounds for n = 0.
    """
    x, n = int(successes), int(trials)
    if n < 0 or not 0 <= x <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= trials, got {x} of {n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n == 0:
        return math.nan, math.nan
    from scipy.stats import beta  # lazy: scipy is slow to import

    alpha = 1.0 - confidence
    low = 0.0 if x == 0 else float(beta.ppf(alpha / 2, x, n - x + 1))
    high = 1.0 if x == n else float(beta.ppf(1 - alpha / 2, x + 1, n - x))
    return low, high


def proportion(successes: int, trials: int, confidence: float = DEFAULT_CONFIDENCE) -> Estimate:
    """successes / trials with its Clopper-Pearson interval, as an Estimate over `trials` items (probes)."""
    low, high = clopper_pearson(successes, trials, confidence)
    value = successes / trials if trials else math.nan
    return Estimate(value, low, high, int(trials), int(trials), confidence, METHOD_EXACT)


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
