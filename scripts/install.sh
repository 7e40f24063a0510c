#!/usr/bin/env bash
# Install tokq into ./.venv (created if missing). CPU machines get the CPU build of torch.
# Usage: bash scripts/install.sh [extras]   e.g. bash scripts/install.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
$VPY -m pip install --quiet --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build onto CPU-only machines.
if ! $VPY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $VPY -m pip install --quiet "torch>=2.5"
  else
    $VPY -m pip install --quiet "torch==${TOKQ_TORCH_VERSION:-2.13.0}"
  fi
fi
if [ -n "$EXTRAS" ]; then
  $VPY -m pip install --quiet -e ".[$EXTRAS]"
else
  $VPY -m pip install --quiet -e .
fi
echo "tokq installed in $(pwd)/.venv ($(.venv/bin/tokq version))"
