"""The GPU benchmark scripts in --smoke mode. benchmarks/gpu_kernels.py --smoke: the script itself (its correctness checks, timing loop
and JSON) runs end to end on tiny shapes under the Triton interpreter, so the script a GPU run depends on
is known to work before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_kernels_smoke(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "gpu-kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kernels.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    text = json.dumps(report)
    for kernel in ("triton_w4a16", "triton_w8a8_int8", "decode", "prefill"):
        assert kernel in text, f"{kernel} missing from the smoke run's JSON"
    assert "0 correctness failure(s)" in proc.stdout


def test_gpu_engine_smoke(tmp_path):
    """benchmarks/gpu_engine.py --smoke: random-weight models from the real configs, quantized in memory,
    served continuous and static (2 layers, a tiny workload, CPU)."""
    out = tmp_path / "gpu-engine.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_engine.py"), "--smoke", "--models",
                           "smollm2-135m", "--variants", "fp16", "int4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [(r["variant"], r["mode"]) for r in report["rows"]] == [
        ("smollm2-135m fp16", "continuous"), ("smollm2-135m fp16", "static"),
        ("smollm2-135m int4", "continuous"), ("smollm2-135m int4", "static")]
    assert all(r["metrics"]["output_tokens"] > 0 for r in report["rows"]) and not report["failures"]
