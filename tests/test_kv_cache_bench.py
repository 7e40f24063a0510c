"""benchmarks/kv_cache_quant.py's target check, table and plot on synthetic variants (no model, no torch work): the
issue-18 ratio must be computed as the docstring states, from the decode-path estimates."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports mixed_precision's helpers as a sibling
    try:
        spec = importlib.util.spec_from_file_location("kv_cache_quant_bench", ROOT / "benchmarks" / "kv_cache_quant.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def est(value, low, high):
    return {"value": value, "low": low, "high": high, "n_tokens": 512, "n_docs": 8}


def variant(prefill, decode, note):
    return {"prefill": {"kl": est(*prefill), "top1": est(0.97, 0.96, 0.98)},
            "prefill_buckets": {"0-511": {"kl": est(*prefill)}, "4K-8K": {"kl": est(*prefill)}},
            "decode": {"kl": est(*decode), "top1": est(0.95, 0.9, 0.99)} if decode else None,
            "decode_from": 8128, "kv_cache": note, "base_cache_hit": True}


def record(unit_decode, cal_decode):
    return {"model": "m", "device": "cpu", "threads": 1, "tokq_commit": "abc",
            "evaluation": {"window": 8192, "windows_scored": 16, "documents_scored": 14, "decode_tokens": 64,
                           "decode_windows": 8, "decode_from": 8128},
            "split": {"choice_documents": 40}, "calibration": {"num_samples": 16, "seq_len": 2048},
            "variants": {"fp8-unit": variant((0.01, 0.008, 0.012), unit_decode, "fp8 KV with scale 1"),
                         "fp8-calibrated": variant((0.004, 0.003, 0.005), cal_decode, "fp8 KV, calibrated")}}


def test_decode_ratio_check(bench):
    met = bench.decode_ratio_check(record((0.02, 0.016, 0.024), (0.006, 0.005, 0.007))["variants"])
    assert met["ratio"] == pytest.approx(0.3) and met["met"]
    assert met["conservative_ratio"] == pytest.approx(0.007 / 0.016) and met["met_by_bounds"]
    # the point ratio meets the target, but the intervals cannot tell
    near = bench.decode_ratio_check(record((0.02, 0.01, 0.03), (0.009, 0.006, 0.012))["variants"])
    assert near["met"] and not near["met_by_bounds"]
    missed = bench.decode_ratio_check(record((0.02, 0.016, 0.024), (0.015, 0.012, 0.018))["variants"])
    assert not missed["met"] and missed["ratio"] == pytest.approx(0.75)
    assert bench.decode_ratio_check(record(None, (0.01, 0.009, 0.011))["variants"]) is None


def test_markdown_and_plot(bench, tmp_path):
    r = record((0.02, 0.016, 0.024), (0.006, 0.005, 0.007))
    r["target"] = bench.decode_ratio_check(r["variants"])
    text = bench.kv_markdown(r)
    assert "| fp8-unit | fp8 KV with scale 1 | 0.01 [0.008, 0.012]" in text
    assert "ratio 0.300 (met)" in text and text.index("| 0-511 |") < text.index("| 4K-8K |")
    assert [bench.bucket_start(b) for b in ("0-511", "4K-8K", "16K-32K")] == [0, 4096, 16384]
    bench.plot_kl_by_position(r, tmp_path / "kv.png")
    assert (tmp_path / "kv.png").stat().st_size > 10_000


def test_late_prefill_ratio_uses_the_last_bucket(bench):
    r = record(None, None)
    r["variants"]["fp8-unit"]["prefill_buckets"]["4K-8K"]["kl"] = est(0.04, 0.03, 0.05)
    r["variants"]["fp8-calibrated"]["prefill_buckets"]["4K-8K"]["kl"] = est(0.01, 0.008, 0.012)
    check = bench.late_prefill_ratio_check(r["variants"])
    assert check["bucket"] == "4K-8K" and check["ratio"] == pytest.approx(0.25) and check["met_by_bounds"]
    assert bench.decode_ratio_check(r["variants"]) is None  # no decode path run
    r["target_late_prefill"] = check
    assert "Decode path off" in bench.kv_markdown({**r, "evaluation": {**r["evaluation"], "decode_windows": 0}})


def test_error_bars_leave_an_estimate_without_interval_bare(bench) -> None:
    # one document scored: the aggregation gives no interval, and the plot must still draw the point
    bars = bench.error_bars([est(0.01, 0.005, 0.02), {"value": 0.03, "low": None, "high": None}])
    assert bars == [[pytest.approx(0.005), 0.0], [pytest.approx(0.01), 0.0]]
    assert bench._est({"value": 0.03, "low": None, "high": None}) == "0.03"
