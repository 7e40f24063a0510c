#!/usr/bin/env bash
# Install torch into the venv whose python is $1, unless it already has one: the CUDA build where
# nvidia-smi exists, else the CPU build pinned (an unpinned torch would pull a multi-GB CUDA build
# onto CPU-only machines). Shared by scripts/install.sh and benchmarks/peer_venv.sh.
set -euo pipefail
VPY="$1"
if ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install --quiet "torch>=2.5"
  else
    "$VPY" -m pip install --quiet "torch==${TOKQ_TORCH_VERSION:-2.13.0}"
  fi
fi
