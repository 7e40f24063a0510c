#!/usr/bin/env bash
# The README's first command: the whole main job on the embedded default. Installs tokq, pulls
# SmolLM2-135M, builds the default long-document set, then `tokq gate` builds the variant from its recipe
# in examples/quickstart/tokq.toml (GPTQ int4, calibrated on those documents; a rerun reuses it while the
# recipe and the base are unchanged; a W8A8 variant is one line to uncomment there), compares it with the
# 16-bit base (KL, top-1, perplexity ratio by position with CIs, decode path, passkey probes), benches both
# on a serving workload, and gives the verdict of that file's rules.
# Everything lands in ./tokq_out/ (the gate's report in tokq_out/gate/). Exit 0 when the job ran,
# whatever the verdict (the verdict is printed; `tokq gate` itself exits 1 on FAIL and 3 when
# inconclusive, for CI).
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
# The gate builds the variants from tokq.toml's recipes (int4 GPTQ group 64: SmolLM2's hidden size 576 does
# not divide by 128). A checkpoint an
# older quickstart quantized by hand records no recipe hash, and the gate refuses it: remove those.
for ckpt in "$OUT/smollm2-gptq-int4" "$OUT/smollm2-awq-int4" "$OUT/smollm2-w8a8"; do
  if [ -d "$ckpt" ] && ! grep -q '"recipe_sha256"' "$ckpt/tokq_quantization.json" 2>/dev/null; then
    rm -rf "$ckpt"
  fi
done
set +e
$TOKQ gate --config "$OUT/tokq.toml" --report-dir "$OUT/gate"
CODE=$?
set -e
if [ "$CODE" -eq 2 ] || [ "$CODE" -ge 4 ]; then
  echo "tokq gate could not run (exit $CODE): see the error above" >&2
  exit "$CODE"
fi
VERDICT=$(case "$CODE" in 0) echo PASS ;; 1) echo FAIL ;; *) echo "INCONCLUSIVE (rerun or lengthen the run)" ;; esac)
echo "verdict: $VERDICT (the rules are listed above; tokq gate exits $CODE)"
echo "report:  $(pwd)/$OUT/gate/report.html"
echo "done in $(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 )) s: see $OUT/ (gate/, smollm2-gptq-int4/, docs/)"
