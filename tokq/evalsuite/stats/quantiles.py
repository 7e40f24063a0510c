"""Quantiles of pooled per-token values (the KL tail: p90 ... p99.9 as in llama.cpp's KLD report) with
percentile intervals from the same document resampling as the means (`bootstrap`); the maximum has no interval."""

from __future__ import annotations

import math

import torch

from .bootstrap import BLOCK_ELEMENTS, check_doc_index, check_mask, resample_counts
from .estimate import DEFAULT_CONFIDENCE, INF, Estimate, few_documents_warning

Tensor = torch.Tensor

METHOD_QUANTILE = "percentile document bootstrap of the quantile"
METHOD_MAX = "none: a sample maximum has no confidence interval"

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
    doc_index = check_doc_index(doc_index, n, num_docs)
    mask = check_mask(mask, n)
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
    rows_at_once = max(1, BLOCK_ELEMENTS // grid.numel())
    for draw in resample_counts(generator, resamples, k):
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

