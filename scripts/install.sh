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
# torch first (pinned on CPU machines): see scripts/install_torch.sh.
bash scripts/install_torch.sh "$VPY"
if [ -n "$EXTRAS" ]; then
  $VPY -m pip install --quiet -e ".[$EXTRAS]"
else
  $VPY -m pip install --quiet -e .
fi
echo "tokq installed in $(pwd)/.venv ($(.venv/bin/tokq version))"
