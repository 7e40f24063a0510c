#!/usr/bin/env bash
# The scheduled CI job: install the newest release of every dependency (no scripts/constraints.txt) into a
# separate venv, ./.venv-newest, and run the unit tests there, so a release that breaks tokq (a transformers
# that changes what it imports) shows up here first instead of in CI, which installs the known-good pins.
# torch stays where scripts/install_torch.sh puts it (the pinned CPU build; the newest CUDA build where
# nvidia-smi exists). The integration tests on the real zoo models are left out unless you pass other args.
# Usage: bash scripts/test_newest.sh [pytest args]     (default: -m "not integration")
# When it passes, adopt the versions: `bash scripts/install.sh` into ./.venv with TOKQ_CONSTRAINTS=none, run
# `bash scripts/test.sh`, then `bash scripts/update_constraints.sh` and commit scripts/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-newest
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install --quiet --upgrade pip
bash scripts/install_torch.sh "$VPY"
# --upgrade-strategy eager: every dependency to its newest release, not only the ones missing; torch held at
# the build install_torch.sh chose (eager would replace a CPU build with the newest CUDA one, and its triton).
"$VPY" -c 'import torch; print(f"torch=={torch.__version__}")' > "$VENV/torch-pin.txt"
"$VPY" -m pip install --quiet --upgrade --upgrade-strategy eager -c "$VENV/torch-pin.txt" -e ".[dev]"
echo "versions not in scripts/constraints.txt (torch is install_torch.sh's, not listed):"
"$VPY" -m pip freeze --exclude-editable 2>/dev/null | grep -v -i -E '^(#|-e |torch==)' | LC_ALL=C sort \
  | LC_ALL=C comm -13 <(grep '==' scripts/constraints.txt | LC_ALL=C sort) - | sed 's/^/  /' || true
if [ "$#" -eq 0 ]; then
  set -- -m "not integration"
fi
exec "$VPY" -m pytest -q "$@"
