#!/usr/bin/env bash
# OPTIONAL: make the peer venv that benchmarks/peer_quant.py compares tokq against (llm-compressor).
# It is a separate venv outside the repo, never a dependency of tokq; tokq's own install and tests
# do not need it.
#
# Usage: bash benchmarks/peer_venv.sh [DIR]        (default DIR: /work/peer-venv, or $TOKQ_PEER_VENV)
# Then:  .venv/bin/python benchmarks/peer_quant.py --peer-python DIR/bin/python
#
# Versions are pinned to the set peer_quant.py was last run with (recorded in each result file):
# llmcompressor 0.14.0.1 (which pins compressed-tensors 0.19.0 and transformers <=5.17), on the CPU
# build of torch, installed first and pinned as in scripts/install.sh so pip never pulls a CUDA build
# onto a CPU-only machine. On CPU, llm-compressor's AWQ needs one runtime patch (pinned memory without an
# accelerator); benchmarks/peer_llmcompressor_job.py applies it at run time, nothing here is modified.
set -euo pipefail
DIR="${1:-${TOKQ_PEER_VENV:-/work/peer-venv}}"
PY="${PYTHON:-python3}"
if [ ! -x "$DIR/bin/python" ]; then
  "$PY" -m venv "$DIR"
fi
VPY="$DIR/bin/python"
$VPY -m pip install --quiet --upgrade pip
bash "$(dirname "$0")/../scripts/install_torch.sh" "$VPY"
$VPY -m pip install --quiet \
  "llmcompressor==${TOKQ_PEER_LLMCOMPRESSOR_VERSION:-0.14.0.1}" \
  "compressed-tensors==0.19.0" "transformers==5.17.0"
$VPY - <<'EOF'
from importlib.metadata import version
print("peer venv ready:", ", ".join(f"{p} {version(p)}" for p in
      ("llmcompressor", "compressed-tensors", "transformers", "torch", "accelerate", "datasets")))
EOF
