#!/usr/bin/env bash
# Install tokq into ./.venv (created if missing). CPU machines get the CPU build of torch.
# Usage: bash scripts/install.sh [extras]   e.g. bash scripts/install.sh dev
# With the dev extra (the tests, CI: .ci/run -> scripts/test.sh) every dependency is installed at the
# known-good version in scripts/constraints.txt (pip -c; regenerate it with `bash scripts/update_constraints.sh`),
# so a new release of a dependency cannot break CI; scripts/test_newest.sh tries the newest versions.
# TOKQ_CONSTRAINTS=none installs the dev extra without the pins.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
PINS=""
if [[ ",$EXTRAS," == *,dev,* ]] && [ "${TOKQ_CONSTRAINTS:-}" != none ]; then
  PINS="-c scripts/constraints.txt"
  if command -v nvidia-smi >/dev/null 2>&1; then
    # torch's CUDA build pins its own triton (the constraints' triton is for the CPU build): leave it to torch.
    grep -v -i '^triton==' scripts/constraints.txt > .venv/constraints-gpu.txt
    PINS="-c .venv/constraints-gpu.txt"
  fi
fi
$VPY -m pip install --quiet --upgrade pip
# torch first (pinned on CPU machines): see scripts/install_torch.sh. $PINS also holds torch's own
# dependencies (sympy, networkx, ...) at the known-good versions.
# shellcheck disable=SC2086  # $PINS is empty or two words
bash scripts/install_torch.sh "$VPY" $PINS
if [ -n "$EXTRAS" ]; then
  # shellcheck disable=SC2086
  $VPY -m pip install --quiet $PINS -e ".[$EXTRAS]"
else
  $VPY -m pip install --quiet -e .
fi
echo "tokq installed in $(pwd)/.venv ($(.venv/bin/tokq version))"
