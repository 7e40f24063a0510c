#!/usr/bin/env bash
# tokq's serving engine on one CUDA GPU (benchmarks/gpu_engine.py): both zoo architectures (real configs,
# random weights: checkpoints cannot travel to the offline GPU machine), fp16 vs int4 vs W8A8 int8 vs fp8,
# continuous vs static batching. Budget: under 8 minutes on an H200. Writes benchmarks/results/gpu-engine.json
# and copies it and the log to $OUT when set (the device tool's output folder).
# Usage (on the GPU machine, from the repository root): bash benchmarks/gpu_engine.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh
export PYTHONUNBUFFERED=1
export TOKQ_TRITON_AUTOTUNE="${TOKQ_TRITON_AUTOTUNE:-0}"  # fixed tiles: no tuning time inside the 8-minute budget
status=0
timeout 450 "$GPU_PY" benchmarks/gpu_engine.py "$@" 2>&1 | tee /tmp/gpu-engine.log || status=$?
if [ -n "${OUT:-}" ]; then
  cp /tmp/gpu-engine.log "$OUT/" || true
  cp benchmarks/results/gpu-engine.json "$OUT/" 2>/dev/null || true
fi
exit $status
