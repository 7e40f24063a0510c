"""The full-vocabulary KL (evalsuite.full_kl): the sample design's inclusion probability, the exact tail gap on
sampled rows, the coverage of the estimate's interval in seeded simulations (tiny models' per-token values and a
synthetic population), the baseline cache round trip, `tokq compare` end to end against --topk = vocabulary,
and the lower-bound-only verdict that is never a pass."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_compare import compare, docs, models  # noqa: F401 (fixtures)
from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tokq.engine.checkpoint import load_model
from tokq.evalsuite import baseline_cache
from tokq.evalsuite.ab import BaselineWindow, token_metrics
from tokq.evalsuite.full_kl import (
    a_tail,
    full_row_kl,
    kind_of,
    lower_bound_verdict,
    systematic_sample,
    tail_gap,
)
from tokq.evalsuite.stats.bootstrap import paired_bootstrap
from tokq.evalsuite.stats.estimate import Estimate

VOCAB = BASE["vocab_size"]


def test_systematic_sample_has_the_stated_inclusion_probability():
    counts = [37, 5, 120, 64]
    hits = torch.zeros(sum(counts))
    for seed in range(2000):
        sample = systematic_sample(counts, 23, seed)
        assert sample.size == 23 and sample.prob == 23 / sum(counts)
        flat = torch.cat([r + sum(counts[:i]) for i, r in enumerate(sample.rows)])
        assert flat.unique().numel() == 23
        assert all(bool((r < n).all()) for r, n in zip(sample.rows, counts, strict=True))
        hits[flat] += 1
    # every row drawn with probability 23 / 226 (binomial sd over 2000 draws ~ 13)
    assert (hits - 2000 * 23 / 226).abs().max() < 5 * (2000 * 0.1 * 0.9) ** 0.5
    assert systematic_sample(counts, 500, 0).prob == 1.0 and systematic_sample(counts, 500, 0).size == sum(counts)
    assert systematic_sample(counts, 0, 0).size == 0 and systematic_sample(counts, 0, 0).prob == 0.0
    assert torch.equal(systematic_sample(counts, 23, 7).rows[2], systematic_sample(counts, 23, 7).rows[2])


def _rows(n: int, seed: int, sharp: float = 3.0, noise: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g) * sharp
    return logits.log_softmax(-1), (logits + noise * torch.randn(n, VOCAB, generator=g)).log_softmax(-1)


def _estimate_parts(la: torch.Tensor, lb: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kl_topk, gap) per row, through the code compare uses: token_metrics, a_tail, tail_gap."""
    vals, ids = la.topk(k, -1)
    actual = torch.zeros(la.shape[0], 1, dtype=torch.long)
    base = BaselineWindow(la.gather(1, actual)[:, 0], ids, vals)
    gathered = lb.gather(1, ids)
    m = token_metrics(base, lb.gather(1, actual)[:, 0], lb.max(-1).values, gathered)
    return m["kl_topk"].double(), tail_gap(a_tail(la, ids), ids, vals, gathered, lb)


def test_tail_gap_completes_the_lower_bound_to_the_exact_kl():
    la, lb = _rows(64, 0)
    exact = full_row_kl(la, lb)
    for k in (1, 8, 64, VOCAB):
        kl_topk, gap = _estimate_parts(la, lb, k)
        error = kl_topk + gap - exact  # bf16 rounding of A's tail probabilities: per row < 2^-9, zero mean
        assert (gap > -2e-5).all() and (error.abs() <= 1e-2 * exact + 1e-7).all(), k  # >= 0 up to rounding
        assert abs(float(error.mean())) < 2e-4 * float(exact.mean()), k
        if k < 64:
            assert gap.mean() > 0.01 * exact.mean()  # the lower bound misses something real here
    # A against itself with fp32 kernel-noise-sized differences: the full KL stays second order (bf16 rounding of
    # A's tail and fp32 normalisation errors do not show up as a first-order KL floor).
    assert torch.equal(_estimate_parts(la, la.clone(), 8)[1], torch.zeros(64, dtype=torch.float64))  # B = A: 0
    noisy = (la + 1e-6 * torch.randn(la.shape, generator=torch.Generator().manual_seed(3))).log_softmax(-1)
    kl_topk, gap = _estimate_parts(la, noisy, 8)
    assert (kl_topk + gap).abs().max() < 1e-9 and full_row_kl(la, noisy).abs().max() < 1e-9


def _tiny_model_tokens(tmp_path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token of 24 documents: exact KL(A‖B), kl_topk (k = 8) and the gap, from a tiny random model A and B = A
    with noisy weights (sharpened head so the top-k covers a realistic share)."""
    make_hf_checkpoint("llama", tmp_path / "a", seed=0)
    weights = load_file(str(tmp_path / "a" / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if name == "lm_head.weight":
            weights[name] = w * 6
        elif w.dim() == 2:
            weights[name] = w + 0.2 * w.std() * torch.randn(w.shape, generator=g)
    (tmp_path / "b").mkdir()
    save_file(weights, str(tmp_path / "b" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    sharpened = load_file(str(tmp_path / "a" / "model.safetensors"))
    sharpened["lm_head.weight"] = sharpened["lm_head.weight"] * 6
    save_file(sharpened, str(tmp_path / "a" / "model.safetensors"), metadata={"format": "pt"})
    model_a, model_b = load_model(tmp_path / "a", dtype="fp32"), load_model(tmp_path / "b", dtype="fp32")
    parts: dict[str, list[torch.Tensor]] = {"exact": [], "kl_topk": [], "gap": [], "doc": []}
    lengths = torch.randint(30, 140, (24,), generator=g)
    with torch.no_grad():
        for d, n in enumerate(lengths.tolist()):
            ids = torch.randint(0, VOCAB, (1, n), generator=g)
            la, lb = model_a.logits(ids)[0].float().log_softmax(-1), model_b.logits(ids)[0].float().log_softmax(-1)
            kl_topk, gap = _estimate_parts(la, lb, 8)
            parts["exact"].append(full_row_kl(la, lb))
            parts["kl_topk"].append(kl_topk)
            parts["gap"].append(gap)
            parts["doc"].append(torch.full((n,), d))
    return tuple(torch.cat(parts[k]) for k in ("exact", "kl_topk", "gap", "doc"))


def _coverage(exact_mean: float, kl_topk: torch.Tensor, gap: torch.Tensor, doc: torch.Tensor, budget: int,
              sims: int) -> tuple[float, float]:
    """(share of seeded simulations whose estimate's 95% CI covers `exact_mean`, mean estimate)."""
    docs_n = int(doc.max()) + 1
    counts = torch.bincount(doc, minlength=docs_n).tolist()
    covered, estimates = 0, []
    for seed in range(sims):
        sample = systematic_sample(counts, budget, seed)
        picked = torch.cat([r + sum(counts[:d]) for d, r in enumerate(sample.rows)])
        kl = kl_topk.clone()
        kl[picked] += gap[picked] / sample.prob
        est = paired_bootstrap({"kl": kl}, doc, docs_n, resamples=400, seed=seed)["kl"]
        covered += est.low <= exact_mean <= est.high
        estimates.append(est.value)
    return covered / sims, sum(estimates) / sims


def test_interval_covers_the_exact_kl_on_tiny_models(tmp_path):
    exact, kl_topk, gap, doc = _tiny_model_tokens(tmp_path)
    assert ((kl_topk + gap - exact).abs() <= 1e-2 * exact + 1e-6).all()  # bf16 rounding of A's tail (zero mean)
    truth = float(exact.mean())
    assert float(kl_topk.mean()) < 0.9 * truth  # k = 8 misses over a tenth: the lower bound alone cannot cover
    rate, mean_estimate = _coverage(truth, kl_topk, gap, doc, budget=80, sims=300)
    print(f"exact {truth:.4f}, lower bound {float(kl_topk.mean()):.4f}, mean estimate {mean_estimate:.4f}, "
          f"coverage {rate:.3f}")
    assert rate >= 0.93
    assert abs(mean_estimate - truth) < 0.01 * truth  # unbiased over the seeds


def test_interval_covers_the_population_kl_in_synthetic_simulations():
    """Documents drawn afresh each time from a known population (document effects, skewed per-token KL, a gap
    share around 15%): the estimate's interval covers the population's mean full KL about as often as the exact
    values' own interval does, and at least 93% of the time."""
    covered = {"estimate": 0, "exact": 0}
    sims, docs_n = 300, 40
    truth = 0.1 * 1.0 * 1.0  # E[doc effect] * E[gamma(2, 0.5)] * scale
    for seed in range(sims):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(40, 200, (docs_n,), generator=g)
        doc = torch.repeat_interleave(torch.arange(docs_n), lengths)
        effect = torch.distributions.Gamma(8.0, 8.0).sample((docs_n,))  # mean 1
        per_token = torch.distributions.Gamma(2.0, 2.0).sample((len(doc),))  # mean 1
        exact = 0.1 * effect[doc] * per_token
        share = torch.distributions.Beta(1.5, 8.5).sample((len(doc),))  # mean 0.15, skewed
        kl_topk, gap = exact * (1 - share), exact * share
        sample = systematic_sample(lengths.tolist(), 100, seed)
        picked = torch.cat([r + int(lengths[:d].sum()) for d, r in enumerate(sample.rows)])
        estimate = kl_topk.clone()
        estimate[picked] += gap[picked] / sample.prob
        ests = paired_bootstrap({"estimate": estimate, "exact": exact}, doc, docs_n, resamples=400, seed=seed)
        for name, est in ests.items():
            covered[name] += est.low <= truth <= est.high
    rates = {k: v / sims for k, v in covered.items()}
    print(rates)
    assert rates["estimate"] >= 0.93 and rates["estimate"] >= rates["exact"] - 0.03


def test_cache_round_trip_keeps_a_tail(tmp_path):
    la, _ = _rows(10, 5)
    vals, ids = la.topk(4, -1)
    rows = torch.tensor([1, 4, 9])
    window = BaselineWindow(la[:, 0], ids, vals, rows, a_tail(la[rows], ids[rows]), 0.3)
    parts = dict(model="m" * 64, data="d" * 64)
    key = baseline_cache.cache_key(**parts)
    plain = BaselineWindow(la[:, 0].clone(), ids.clone(), vals.clone())
    empty = BaselineWindow(la[:, 1], ids.flip(0), vals.flip(0), torch.empty(0, dtype=torch.long),
                           a_tail(la[:0], ids[:0]), 0.3)
    baseline_cache.store(key, [window, empty, plain], {}, key_parts=parts)
    loaded, _ = baseline_cache.load(key, key_parts=parts)
    assert torch.equal(loaded[0].full_rows, rows) and loaded[0].full_prob == 0.3
    assert torch.equal(loaded[0].tail.probs, window.tail.probs) and loaded[0].tail.probs.dtype == torch.bfloat16
    assert torch.equal(loaded[0].tail.plogp, window.tail.plogp) and torch.equal(loaded[0].tail.lognorm,
                                                                                window.tail.lognorm)
    assert loaded[1].full_rows.numel() == 0 and loaded[2].full_rows is None and loaded[2].tail is None
    sliced = loaded[0].rows_from(4)
    assert sliced.full_rows.tolist() == [0, 5] and torch.equal(sliced.tail.probs, window.tail.probs[1:])


def test_lower_bound_verdict_is_never_a_pass():
    assert kind_of(8, 211, None) == "lower_bound" and kind_of(211, 211, None) == "exact"
    assert kind_of(8, 211, 1.0) == "exact" and kind_of(8, 211, 0.2) == "estimated"
    below = lower_bound_verdict(Estimate(0.02, 0.01, 0.03, 100, 5), 0.05)
    straddle = lower_bound_verdict(Estimate(0.06, 0.04, 0.08, 100, 5), 0.05)
    above = lower_bound_verdict(Estimate(0.09, 0.07, 0.11, 100, 5), 0.05)
    assert not below["passed"] and below["inconclusive"] and "inconclusive" in below["rule"]
    assert not straddle["passed"] and straddle["inconclusive"]
    assert not above["passed"] and not above["inconclusive"] and "0.07 > max 0.05" in above["rule"]
    point = lower_bound_verdict(Estimate(0.06, 0.04, 0.08, 100, 5), 0.05, on="point")
    assert not point["passed"] and not point["inconclusive"]
    assert lower_bound_verdict(Estimate(*[float("nan")] * 3, 0, 0), 0.05)["inconclusive"]


def test_compare_estimate_against_the_exact_kl(capsys, models, docs, tmp_path):  # noqa: F811
    """A against another random model: the estimate's CI covers the exact KL (--topk = the vocabulary), the
    top-k lower bound lies below it, the JSON says which is which; every position in full is exact again."""
    extra = ("--decode-windows", "0")
    _, exact, _ = compare(capsys, models["a"], models["other"], docs, tmp_path / "x", "--topk", VOCAB, *extra)
    _, est, text = compare(capsys, models["a"], models["other"], docs, tmp_path / "e", "--topk", 8, "--full-kl-rows",
                           200, *extra)
    truth = exact["prefill"]["overall"]["kl"]
    kl, low_bound = est["prefill"]["overall"]["kl"], est["prefill"]["overall"]["kl_topk"]
    assert exact["kl_estimator"]["prefill"]["kind"] == "exact"
    assert "exact over the whole vocabulary" in exact["kl_method"]
    assert est["kl_estimator"]["prefill"]["kind"] == "estimated" and est["kl_estimator"]["prefill"]["full_rows"] == 200
    assert "estimated" in est["kl_method"] and "KL lower bound (top-k + rest)" in text
    assert low_bound["high"] < truth["value"] and kl["low"] <= truth["value"] <= kl["high"]
    assert abs(truth["value"] - exact["prefill"]["overall"]["kl_topk"]["value"]) < 1e-5  # k = vocabulary: both exact
    # every position in full: exact again, to bf16 rounding of A's tail
    _, full, _ = compare(capsys, models["a"], models["other"], docs, tmp_path / "f", "--topk", 8, "--full-kl-rows",
                         100000, *extra)
    assert full["kl_estimator"]["prefill"]["kind"] == "exact"
    assert abs(full["prefill"]["overall"]["kl"]["value"] - truth["value"]) < 1e-4 * truth["value"]


def test_lower_bound_only_compare_is_inconclusive_or_fails(capsys, models, docs, tmp_path):  # noqa: F811
    args = ("--topk", 8, "--full-kl-rows", 0, "--decode-windows", "0")
    code, result, text = compare(capsys, models["a"], models["other"], docs, tmp_path / "i", *args, "--max-kl", 100)
    rule = result["thresholds"][0]
    assert result["kl_estimator"]["prefill"]["kind"] == "lower_bound" and "lower bound" in result["kl_method"]
    assert code == 3 and not result["passed"] and rule["inconclusive"] and "INCONCLUSIVE" in text  # exit 3: undecided
    low = result["prefill"]["overall"]["kl"]["low"]
    code, result, text = compare(capsys, models["a"], models["other"], docs, tmp_path / "f", *args, "--max-kl",
                                 low / 2)
    assert code == 1 and not result["thresholds"][0]["inconclusive"] and "REGRESSION" in text
    saved = json.loads((tmp_path / "f" / "cmp.json").read_text())
    assert saved["prefill"]["overall"]["kl"] == saved["prefill"]["overall"]["kl_topk"]


@pytest.mark.parametrize("rows", [-1])
def test_negative_full_kl_rows_exits_2(capsys, models, docs, tmp_path, rows):  # noqa: F811
    code, result, text = compare(capsys, models["a"], models["a"], docs, tmp_path, "--full-kl-rows", rows)
    assert code == 2 and result is None and "--full-kl-rows -1: must be >= 0" in text.replace("\n", " ")
