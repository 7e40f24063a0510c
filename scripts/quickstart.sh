#!/usr/bin/env bash
# The README's first command: install tokq, pull the default model, build the default
# long-document set, quantize the model with AWQ and score both models on the same windows.
# Results land in ./tokq_out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install_docs.sh
TOKQ=.venv/bin/tokq
WINDOWS="${TOKQ_QUICKSTART_WINDOWS:-16}"
mkdir -p tokq_out
$TOKQ models pull smollm2-135m
$TOKQ data build-default --model smollm2-135m --json tokq_out/default-data.json
# int4 AWQ, group 64 (SmolLM2's hidden size 576 does not divide by 128), calibrated on the default set.
$TOKQ quantize --method awq --model smollm2-135m --group-size 64 --out tokq_out/smollm2-awq-int4 --force \
  --json tokq_out/quantize-smollm2-awq-int4.json
$TOKQ score smollm2-135m --window 2048 --sample-windows "$WINDOWS" --json tokq_out/score-smollm2-135m.json
$TOKQ score tokq_out/smollm2-awq-int4 --window 2048 --sample-windows "$WINDOWS" --json tokq_out/score-smollm2-awq-int4.json
echo "done: see tokq_out/ (smollm2-awq-int4/, quantize-*.json, score-*.json, default-data.json)"
