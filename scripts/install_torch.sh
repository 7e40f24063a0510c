#!/usr/bin/env bash
# Install torch into the venv whose python is $1, unless it already has one: the CUDA build where
# nvidia-smi exists, else the CPU build pinned (an unpinned torch would pull a multi-GB CUDA build
# onto CPU-only machines). Shared by scripts/install.sh, benchmarks/peer_venv.sh and the CI examples.
# Usage: bash scripts/install_torch.sh PYTHON [pip options...]   (e.g. -c scripts/constraints.txt)
# The CPU build comes from wherever pip finds a `torch==2.13.0` CPU wheel: this machine's pip configuration,
# or TOKQ_TORCH_INDEX, an index URL that serves CPU-only torch wheels (PyTorch's CPU wheel index, the
# --index-url its install selector gives for Linux / pip / CPU). Without either, pip may fetch the CUDA build.
set -euo pipefail
VPY="$1"
shift
if ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install --quiet "$@" "torch>=2.5"
  else
    "$VPY" -m pip install --quiet ${TOKQ_TORCH_INDEX:+--index-url "$TOKQ_TORCH_INDEX"} "$@" \
      "torch==${TOKQ_TORCH_VERSION:-2.13.0}"
  fi
fi
