#!/usr/bin/env bash
# The README's first command: the whole main job on the embedded default. Installs tokq, pulls
# SmolLM2-135M, builds the default long-document set, quantizes the model twice (AWQ int4 and
# SmoothQuant W8A8, calibrated on those documents), then `tokq gate` compares each with the 16-bit base
# (KL, top-1, perplexity ratio by position with CIs, decode path, passkey probes), benches both on a
# serving workload, and gives the verdict of examples/quickstart/tokq.toml's rules.
# Everything lands in ./tokq_out/ (the gate's report in tokq_out/gate/). Exit 0 when the job ran,
# whatever the verdict (the verdict is printed; `tokq gate` itself exits 1 on FAIL, for CI).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
bash scripts/install.sh
bash scripts/install_docs.sh
TOKQ=.venv/bin/tokq
OUT=tokq_out
mkdir -p "$OUT"
cp examples/quickstart/tokq.toml "$OUT/tokq.toml"
$TOKQ models pull smollm2-135m
$TOKQ data build-default --model smollm2-135m --out "$OUT/docs" --force --json "$OUT/default-data.json"
# int4 AWQ, group 64 (SmolLM2's hidden size 576 does not divide by 128), calibrated on the documents.
$TOKQ quantize --method awq --scheme w4a16 --group-size 64 --model smollm2-135m --calib "$OUT/docs" \
  --out "$OUT/smollm2-awq-int4" --force --json "$OUT/quantize-smollm2-awq-int4.json"
# W8A8 int8: SmoothQuant migrates activation outliers into the weights, then int8 x int8 GEMMs.
$TOKQ quantize --method smoothquant --scheme w8a8-int8 --model smollm2-135m --calib "$OUT/docs" \
  --out "$OUT/smollm2-w8a8" --force --json "$OUT/quantize-smollm2-w8a8.json"
set +e
$TOKQ gate --config "$OUT/tokq.toml" --out "$OUT/gate"
CODE=$?
set -e
if [ "$CODE" -ge 2 ]; then
  echo "tokq gate could not run (exit $CODE): see the error above" >&2
  exit "$CODE"
fi
VERDICT=$([ "$CODE" -eq 0 ] && echo PASS || echo FAIL)
echo "verdict: $VERDICT (the failing rules are listed above; tokq gate exits $CODE)"
echo "report:  $(pwd)/$OUT/gate/report.html"
echo "done in $(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 )) s: see $OUT/ (gate/, smollm2-awq-int4/, smollm2-w8a8/, docs/, quantize-*.json)"
