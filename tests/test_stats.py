"""Paired document bootstrap, position buckets, McNemar and the threshold rule on synthetic data."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tokq.evalsuite.stats import (
    POSITION_BUCKETS,
    Estimate,
    aggregate,
    bucket_of,
    buckets_up_to,
    check_threshold,
    mcnemar_exact,
    paired_bootstrap,
    per_document_means,
    ppl_ratio_from,
)


def synthetic(num_docs: int, seed: int, mean: float = 0.3, doc_sd: float = 0.2, token_sd: float = 0.5,
              min_len: int = 20, max_len: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of random sizes; each token = mean + per-doc random effect + token noise.

    The per-doc effect is independent of the size, so the population token-weighted mean is `mean`.
    """
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(min_len, max_len + 1, (num_docs,), generator=g)
    doc_index = torch.repeat_interleave(torch.arange(num_docs), sizes)
    effect = torch.randn(num_docs, generator=g, dtype=torch.float64) * doc_sd
    values = mean + effect[doc_index] + torch.randn(doc_index.shape[0], generator=g, dtype=torch.float64) * token_sd
    return values, doc_index


def test_bucket_edges():
    pos = torch.tensor([0, 511, 512, 1023, 1024, 2047, 2048, 4095, 4096, 131071])
    assert bucket_of(pos).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 8]
    assert POSITION_BUCKETS[int(bucket_of(torch.tensor([2048])))][2] == "2K-4K"
    with pytest.raises(ValueError):
        bucket_of(torch.tensor([131072]))
    with pytest.raises(ValueError):
        bucket_of(torch.tensor([-1]))


def test_buckets_up_to_window():
    assert [b[2] for b in buckets_up_to(2048)] == ["0-511", "512-1K", "1K-2K"]
    assert len(buckets_up_to(8192)) == 5
    assert len(buckets_up_to(2049)) == 4  # position 2048 reaches 2K-4K
    assert len(buckets_up_to(512)) == 1
    assert len(buckets_up_to(131072)) == len(POSITION_BUCKETS)


def test_per_document_sums_and_counts():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    doc_index = torch.tensor([0, 0, 2, 2])
    sums, counts = per_document_means(values, doc_index, 4)
    assert sums.tolist() == [3.0, 0.0, 7.0, 0.0]
    assert counts.tolist() == [2, 0, 2, 0]


def test_value_is_token_weighted_mean_and_ci_contains_truth():
    values, doc_index = synthetic(800, seed=1)
    est = paired_bootstrap({"x": values, "flag": values > 0.3}, doc_index, 800, resamples=500)
    assert est["x"].value == pytest.approx(float(values.mean()), rel=1e-12)
    assert est["flag"].value == pytest.approx(float((values > 0.3).double().mean()), rel=1e-12)
    assert est["x"].low < 0.3 < est["x"].high
    assert est["x"].low < est["x"].value < est["x"].high
    assert est["x"].n_tokens == values.shape[0] and est["x"].n_docs == 800


def test_width_shrinks_like_one_over_sqrt_docs():
    small_v, small_d = synthetic(50, seed=2)
    large_v, large_d = synthetic(800, seed=3)
    small = paired_bootstrap({"x": small_v}, small_d, 50, resamples=1000)["x"]
    large = paired_bootstrap({"x": large_v}, large_d, 800, resamples=1000)["x"]
    ratio = (small.high - small.low) / (large.high - large.low)
    assert 2.5 < ratio < 6.5, ratio  # sqrt(800 / 50) = 4


def test_seeded_and_deterministic():
    values, doc_index = synthetic(100, seed=4)
    a = paired_bootstrap({"x": values}, doc_index, 100, resamples=300, seed=7)["x"]
    b = paired_bootstrap({"x": values}, doc_index, 100, resamples=300, seed=7)["x"]
    c = paired_bootstrap({"x": values}, doc_index, 100, resamples=300, seed=8)["x"]
    assert a == b
    assert c.value == a.value
    assert (c.low, c.high) != (a.low, a.high)
    assert abs(c.low - a.low) < 0.5 * (a.high - a.low)


def test_coverage_of_95_percent_interval():
    truth, covered, trials = 0.3, 0, 200
    for t in range(trials):
        values, doc_index = synthetic(60, seed=1000 + t, mean=truth, max_len=120)
        est = paired_bootstrap({"x": values}, doc_index, 60, resamples=300, seed=t)["x"]
        covered += est.low <= truth <= est.high
    assert 0.88 * trials <= covered <= 0.99 * trials, covered


def test_documents_without_masked_tokens_are_ignored():
    values, doc_index = synthetic(40, seed=5)
    # Only even documents have tokens under the mask; odd documents must not affect the estimate.
    mask = doc_index % 2 == 0
    masked = paired_bootstrap({"x": values}, doc_index, 40, mask=mask, resamples=400, seed=3)["x"]
    kept_values, kept_docs = values[mask], doc_index[mask] // 2
    direct = paired_bootstrap({"x": kept_values}, kept_docs, 20, resamples=400, seed=3)["x"]
    assert masked == direct
    assert masked.n_docs == 20 and masked.n_tokens == int(mask.sum())
    assert masked.value == pytest.approx(float(kept_values.mean()), rel=1e-12)
    # Extra documents that have no tokens at all change nothing either.
    padded = paired_bootstrap({"x": kept_values}, kept_docs * 3, 60, resamples=400, seed=3)["x"]
    assert padded == direct


def test_empty_mask_gives_nan_estimate():
    values, doc_index = synthetic(5, seed=6)
    est = paired_bootstrap({"x": values}, doc_index, 5, mask=torch.zeros_like(values, dtype=torch.bool))["x"]
    assert est.n_tokens == 0 and est.n_docs == 0 and math.isnan(est.value)
    assert est.to_json()["value"] is None


def test_ppl_ratio_is_exp_of_mean_delta_nll():
    delta, doc_index = synthetic(120, seed=7, mean=0.02, doc_sd=0.01, token_sd=0.1)
    est = paired_bootstrap({"delta_nll": delta, "ppl_ratio": delta}, doc_index, 120, resamples=400,
                           transforms={"ppl_ratio": ppl_ratio_from})
    d, r = est["delta_nll"], est["ppl_ratio"]
    assert r.value == pytest.approx(math.exp(float(delta.mean())), rel=1e-12)
    assert r.low == pytest.approx(math.exp(d.low), rel=1e-12)
    assert r.high == pytest.approx(math.exp(d.high), rel=1e-12)
    assert ppl_ratio_from(0.0) == 1.0


def test_aggregate_is_json_ready_with_buckets_and_documents():
    g = torch.Generator().manual_seed(8)
    window, num_docs = 2048, 6
    position = torch.arange(1, window).repeat(num_docs)
    doc_index = torch.arange(num_docs).repeat_interleave(window - 1)
    n = position.shape[0]
    per_token = {
        "kl": torch.rand(n, generator=g) * 0.01,
        "top1": torch.rand(n, generator=g) > 0.05,
        "delta_nll": torch.randn(n, generator=g) * 0.05 + 0.01,
        "delta_p": torch.randn(n, generator=g) * 0.01,
        "accept": 1 - torch.rand(n, generator=g) * 0.1,
    }
    doc_ids = [f"doc{i}" for i in range(num_docs)] + ["empty"]
    out = aggregate(per_token, doc_index, position, doc_ids, window, resamples=200, seed=1)
    json.dumps(out, allow_nan=False)
    assert set(out["overall"]) == {"kl", "top1", "delta_nll", "delta_p", "accept", "ppl_ratio"}
    assert list(out["buckets"]) == ["0-511", "512-1K", "1K-2K"]
    assert out["buckets"]["0-511"]["kl"]["n_tokens"] == 511 * num_docs
    assert out["n_tokens"] == n and out["n_docs"] == num_docs
    assert (out["resamples"], out["seed"], out["confidence"]) == (200, 1, 0.95)
    ppl = out["overall"]["ppl_ratio"]
    assert ppl["value"] == pytest.approx(math.exp(float(per_token["delta_nll"].double().mean())), rel=1e-9)
    docs = out["documents"]
    assert [d["doc_id"] for d in docs] == doc_ids
    assert docs[0]["tokens"] == window - 1
    assert docs[0]["kl"] == pytest.approx(float(per_token["kl"][: window - 1].double().mean()), rel=1e-9)
    assert docs[-1]["tokens"] == 0 and docs[-1]["kl"] is None


def test_mcnemar_exact_known_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 0) == pytest.approx(0.0625)
    assert mcnemar_exact(0, 5) == pytest.approx(0.0625)
    assert mcnemar_exact(3, 3) == 1.0
    # Hand-computed: 2 * (C(12,0) + C(12,1) + C(12,2)) / 2^12 = 158 / 4096.
    assert mcnemar_exact(10, 2) == pytest.approx(158 / 4096, rel=1e-12)
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(10, 2), (7, 19), (40, 41), (1, 30)]:
        assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(min(b, c), b + c, 0.5).pvalue, rel=1e-9)


def test_threshold_uses_unfavourable_bound_not_point():
    est = Estimate(value=0.008, low=0.006, high=0.012, n_tokens=1000, n_docs=20)
    fail = check_threshold(est, 0.01, "max", "kl")
    assert not fail.passed and fail.bound_used == 0.012 and fail.bucket is None
    assert fail.rule == "upper 95% bound 0.012 > max 0.01"
    ok = check_threshold(est, 0.015, "max", "kl", bucket="0-511")
    assert ok.passed and ok.bucket == "0-511" and "<=" in ok.rule

    agree = Estimate(value=0.97, low=0.94, high=0.99, n_tokens=1000, n_docs=20)
    low_fail = check_threshold(agree, 0.95, "min", "top1")
    assert not low_fail.passed and low_fail.bound_used == 0.94
    assert low_fail.rule == "lower 95% bound 0.94 < min 0.95"
    assert check_threshold(agree, 0.93, "min", "top1").passed
    json.dumps(low_fail.to_json(), allow_nan=False)

    nan = float("nan")
    assert not check_threshold(Estimate(nan, nan, nan, 0, 0), 0.01, "max", "kl").passed


def test_threshold_on_the_point_estimate_when_asked():
    est = Estimate(value=0.008, low=0.006, high=0.012, n_tokens=1000, n_docs=20)
    point = check_threshold(est, 0.01, "max", "kl", on="point")  # the bound (0.012) would fail it
    assert point.passed and point.bound_used == 0.008
    assert point.rule == "estimate 0.008 <= max 0.01 (95% CI [0.006, 0.012])"
    assert not check_threshold(est, 0.007, "max", "kl", on="point").passed
    agree = Estimate(value=0.97, low=0.94, high=0.99, n_tokens=1000, n_docs=20)
    assert check_threshold(agree, 0.95, "min", "top1", on="point").passed
    with pytest.raises(ValueError, match="on must be one of"):
        check_threshold(est, 0.01, "max", "kl", on="upper")
    with pytest.raises(ValueError):
        check_threshold(est, 0.01, "below", "kl")
