#!/usr/bin/env bash
# The README's first command: install tokq, pull the default model, build the default
# long-document set, quantize the model with AWQ, and compare the int4 model with its 16-bit base
# on the same windows (KL, top-1, perplexity ratio by position with CIs, decode path, passkey probes).
# Results land in ./tokq_out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install_docs.sh
TOKQ=.venv/bin/tokq
WINDOWS="${TOKQ_QUICKSTART_WINDOWS:-8}"
mkdir -p tokq_out
$TOKQ models pull smollm2-135m
$TOKQ data build-default --model smollm2-135m --json tokq_out/default-data.json
# int4 AWQ, group 64 (SmolLM2's hidden size 576 does not divide by 128), calibrated on the default set.
$TOKQ quantize --method awq --model smollm2-135m --group-size 64 --out tokq_out/smollm2-awq-int4 --force \
  --json tokq_out/quantize-smollm2-awq-int4.json
# fp16 = the 16-bit model the int4 checkpoint was quantized from (bf16 compute on this CPU)
$TOKQ compare fp16 tokq_out/smollm2-awq-int4 --window 2048 --sample-windows "$WINDOWS" --probe-max-context 1024 \
  --json tokq_out/compare-smollm2-awq-int4.json | tee tokq_out/compare-smollm2-awq-int4.md
echo "done: see tokq_out/ (smollm2-awq-int4/, quantize-*.json, compare-smollm2-awq-int4.{json,md}, default-data.json)"
