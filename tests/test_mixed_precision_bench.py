"""benchmarks/mixed_precision.py's target checks, table and plot on a synthetic frontier (no model, no torch work):
the two issue-17 targets must be computed from the points exactly as the docstring states."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("mixed_precision_bench", ROOT / "benchmarks" / "mixed_precision.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def est(value, low=None, high=None):
    return {"value": value, "low": value * 0.9 if low is None else low, "high": value * 1.1 if high is None else high,
            "n_tokens": 1000, "n_docs": 10}


def point(name, kind, fmt, size, kl, *, method="awq", role=None, target=None, high=None):
    p = {"name": name, "kind": kind, "method": method, "format": fmt, "counts": {fmt: 120} if kind == "uniform" else
         {"w4a16": 100, "w8a16": 15, "bf16": 5},
         "bytes": {"safetensors": size, "candidate_linears": size - 50_000_000, "ratio_to_16bit": size / 270e6},
         "quality": {"kl": est(kl, high=high), "top1": est(0.9), "delta_nll": est(kl), "ppl_ratio": est(1 + kl)}}
    if role:
        p["role"] = role
    if target is not None:
        p["target_kl"] = target
    return p


def frontier():
    return [
        point("rtn-w4a16", "uniform", "w4a16", 110_000_000, 0.37, method="rtn"),
        point("awq-w4a16", "uniform", "w4a16", 110_000_000, 0.20),
        point("gptq-w4a16", "uniform", "w4a16", 110_000_000, 0.19, method="gptq"),
        point("rtn-w8a16", "uniform", "w8a16", 165_000_000, 0.004, method="rtn"),
        # +1.5% bytes, KL 0.12: 40% lower than AWQ's 0.20
        point("mix-equal-size", "mixed", "mixed", 111_650_000, 0.12, role="equal-size"),
        # T = 0.095 (0.5 x 0.19): meets (upper 0.09) at 130 MB vs int8's 165 MB: 21.2% fewer bytes
        point("mix-kl-0.095", "mixed", "mixed", 130_000_000, 0.08, role="target-kl", target=0.095, high=0.09),
        # T = 0.019: its upper bound 0.025 misses the target: not met whatever its size
        point("mix-kl-0.019", "mixed", "mixed", 150_000_000, 0.018, role="target-kl", target=0.019, high=0.025),
    ]


def test_equal_size_check_reduction_and_size(bench):
    check = bench.equal_size_check(frontier())
    assert check["reference"] == "awq-w4a16" and check["mixed"] == "mix-equal-size"
    assert check["size_ratio"] == pytest.approx(1.015)
    assert check["kl_reduction"] == pytest.approx(0.4)
    assert check["same_size"] and check["met"]


def test_equal_size_check_fails_when_too_big_or_too_little_gain(bench):
    pts = frontier()
    pts[4]["bytes"]["safetensors"] = 113_000_000  # +2.7%: not the same size, however good
    assert bench.equal_size_check(pts)["met"] is False
    pts = frontier()
    pts[4]["quality"]["kl"] = est(0.16)  # 20% lower only
    check = bench.equal_size_check(pts)
    assert check["kl_reduction"] == pytest.approx(0.2) and check["met"] is False
    assert bench.equal_size_check(pts[:4])["met"] is None  # no mixed point: not measured


def test_target_kl_checks(bench):
    check = bench.target_kl_checks(frontier())
    first, second = check["rows"]
    assert first["int4_all_miss"] and first["mixed_meets"]
    assert first["smallest_uniform_meeting"] == "rtn-w8a16"
    assert first["bytes_saving"] == pytest.approx(1 - 130 / 165)
    assert first["met"]
    assert first["linear_bytes_saving"] == pytest.approx(1 - 80 / 115) and first["met_on_linear_bytes"]
    assert second["int4_all_miss"] and not second["mixed_meets"] and not second["met"]
    assert check["met"] is True


def test_target_kl_bytes_on_file_vs_linears(bench):
    """A large 16-bit embedding (Gemma 3's) dilutes the file saving: reported on both counts."""
    pts = frontier()
    for p in pts:
        p["bytes"]["safetensors"] += 300_000_000
    row = bench.target_kl_checks(pts)["rows"][0]
    assert row["bytes_saving"] == pytest.approx(1 - 430 / 465) and row["met"] is False
    assert row["met_on_linear_bytes"] is True


def test_target_kl_uses_upper_bound_and_int4_must_miss(bench):
    pts = frontier()
    pts[2]["quality"]["kl"] = est(0.05, high=0.09)  # GPTQ int4 now meets T = 0.095: not a target int4 misses
    rows = bench.target_kl_checks(pts)["rows"]
    assert rows[0]["int4_all_miss"] is False and rows[0]["smallest_uniform_meeting"] == "gptq-w4a16"
    assert rows[0]["met"] is False
    pts = frontier()
    pts[5]["bytes"]["safetensors"] = 150_000_000  # 9.1% fewer bytes than int8: below the 15% target
    assert bench.target_kl_checks(pts)["rows"][0]["met"] is False
    assert bench.target_kl_checks(pts)["met"] is False


def test_markdown_and_plot(bench, tmp_path):
    pts = frontier()
    record = {"model": "synthetic", "tokq_commit": "abc", "device": "cpu", "threads": 2, "points": pts,
              "evaluation": {"windows": 16, "window": 1024, "documents": 30}, "split": {"choice_documents": 30},
              "targets": {"equal_size": bench.equal_size_check(pts), "target_kl": bench.target_kl_checks(pts)},
              "durations": {"total": 1.0}, "loadavg_before": [0, 0, 0], "loadavg_after": [0, 0, 0]}
    md = bench.frontier_markdown(record)
    assert "| mix-equal-size | mixed | 100 w4a16, 15 w8a16, 5 bf16 |" in md
    assert "16 x 1024-token windows from 10 of 30 held-out documents" in md
    assert "reduction 40.0%" in md and "**met**" in md
    assert "21.2% fewer bytes (30.4% fewer on the candidate Linears alone)" in md
    png = tmp_path / "f.png"
    bench.plot_frontier(json.loads(json.dumps(record)), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_defaults_follow_quantize_mix_and_quick_is_small(bench):
    from tokq.api.quantize_mix import MIX_WINDOW, SENSITIVITY_WINDOWS

    full = bench.parse_args([])
    assert (full.sens_windows, full.sens_window) == (SENSITIVITY_WINDOWS, MIX_WINDOW)
    assert full.target_fractions == [0.5, 0.25, 0.1]
    quick = bench.parse_args(["--quick", "--windows", "3"])
    assert quick.windows == 3 and quick.window < full.window and quick.num_samples < full.num_samples
    assert quick.target_fractions == [0.5]
    with pytest.raises(SystemExit):
        bench.parse_args(["--target-fractions", "1.5"])
