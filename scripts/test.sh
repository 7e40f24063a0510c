#!/usr/bin/env bash
# The README's second command: install what the tests need, then run the whole suite
# (unit tests on tiny random models + integration tests on the real zoo models).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
