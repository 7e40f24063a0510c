#!/usr/bin/env bash
# The README's first command: install tokq, pull the default model, build the default
# long-document set, and run tokq's main job on them. Results land in ./tokq_out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install_docs.sh
TOKQ=.venv/bin/tokq
mkdir -p tokq_out
$TOKQ models pull smollm2-135m
$TOKQ data build-default --model smollm2-135m --json tokq_out/default-data.json
$TOKQ score smollm2-135m --window 2048 --sample-windows "${TOKQ_QUICKSTART_WINDOWS:-16}" --json tokq_out/score-smollm2-135m.json
echo "done: see tokq_out/ (score-smollm2-135m.json, default-data.json)"
