#!/usr/bin/env bash
# The README's second command: install what the tests need, then run the whole suite
# (unit tests on tiny random models + integration tests on the real zoo models).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
# Headless Chromium for the test that screenshots report.html (Debian `chromium`); the test skips, saying
# so, where it cannot be installed (no root, no apt).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get install -y -q chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; } \
    || echo "warning: could not install chromium; the report screenshot test will be skipped"
fi
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
