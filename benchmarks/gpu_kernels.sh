#!/usr/bin/env bash
# tokq's Triton kernels on one CUDA GPU: correctness against the reference, timings against fp16 cuBLAS
# and the measured copy bandwidth, one table (benchmarks/gpu_kernels.py). Budget: under 8 minutes on an
# H200 including set-up (autotuning included). Writes benchmarks/results/gpu-kernels.json, and copies it
# and the log to $OUT when that is set (the device tool's output folder).
# Usage (on the GPU machine, from the repository root): bash benchmarks/gpu_kernels.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh
export PYTHONUNBUFFERED=1
status=0
timeout 450 "$GPU_PY" benchmarks/gpu_kernels.py "$@" 2>&1 | tee /tmp/gpu-kernels.log || status=$?
if [ -n "${OUT:-}" ]; then
  cp /tmp/gpu-kernels.log "$OUT/" || true
  cp benchmarks/results/gpu-kernels.json "$OUT/" 2>/dev/null || true
fi
exit $status
