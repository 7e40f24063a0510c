#!/usr/bin/env bash
# Sourced by the GPU scripts: picks a Python that has a CUDA torch and makes `import tokq` work there.
# The GPU machine is offline and its image's python3 already holds torch, triton, transformers,
# safetensors, typer and rich: tokq is installed into it without dependencies and without the package
# index. Elsewhere (a GPU box with network) ./.venv from scripts/install.sh is used if it sees a GPU.
# Sets GPU_PY.
GPU_PY=""
for candidate in .venv/bin/python python3; do
  if command -v "$candidate" >/dev/null 2>&1 && \
     "$candidate" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    GPU_PY="$candidate"; break
  fi
done
if [ -z "$GPU_PY" ]; then
  echo "no Python with a CUDA-enabled torch found (tried .venv/bin/python, python3): run this on a GPU machine" >&2
  exit 1
fi
# A script runs with its own folder first on sys.path, not the working directory: the check below must not
# pass only because tokq/ sits in the working directory.
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
if ! "$GPU_PY" -c "import tokq.kernels.triton" 2>/dev/null; then
  "$GPU_PY" -m pip install --quiet --no-deps --no-index --no-build-isolation -e . >/dev/null 2>&1 || {
    echo "could not install tokq into $GPU_PY (pip install --no-deps --no-index -e . failed)" >&2; exit 1; }
fi
"$GPU_PY" -c "import torch, triton; print(f'{torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}')"
export GPU_PY
