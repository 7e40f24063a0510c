#!/usr/bin/env bash
# OPTIONAL: make the venv holding llama.cpp (llama-cpp-python[server]) that benchmarks/vs_llamacpp.py and
# benchmarks/peer_server.py measure tokq against. A separate venv outside the repo, never a dependency of tokq;
# tokq's own install and tests do not need it.
#
# Usage: bash benchmarks/peer_llama_venv.sh [DIR]   (default DIR: /work/peer-llama, or $TOKQ_PEER_LLAMA_VENV)
# Then:  .venv/bin/python benchmarks/vs_llamacpp.py --llama-python DIR/bin/python
#
# pip builds llama.cpp from source (cmake + a C++ compiler): ~8 minutes on two cores (2-core Xeon, 2026-12). The
# default flags build AVX2 + FMA + F16C code without AVX-512 or AMX: the one build that runs on both CPUs this
# project meets (an AVX2-only AMD EPYC and an AVX-512/AMX Xeon, where llama.cpp 0.3.36's native build segfaults
# in decode). CMAKE_ARGS overrides them (e.g. -DGGML_NATIVE=ON on a CPU where the native build works); --no-cache-dir
# keeps pip from reusing a wheel built with other flags.
set -euo pipefail
DIR="${1:-${TOKQ_PEER_LLAMA_VENV:-/work/peer-llama}}"
PY="${PYTHON:-python3}"
VERSION="${TOKQ_PEER_LLAMA_VERSION:-0.3.36}"
if [ ! -x "$DIR/bin/python" ]; then
  "$PY" -m venv "$DIR"
fi
VPY="$DIR/bin/python"
$VPY -m pip install --quiet --upgrade pip
PORTABLE="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
PORTABLE="$PORTABLE -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS="${CMAKE_ARGS:-$PORTABLE}" MAKEFLAGS="${MAKEFLAGS:--j2}" \
  $VPY -m pip install --no-cache-dir "llama-cpp-python[server]==${VERSION}"
$VPY - <<'PYEOF'
from importlib.metadata import version
print("peer llama venv ready:", ", ".join(f"{p} {version(p)}" for p in
      ("llama_cpp_python", "fastapi", "uvicorn")))
PYEOF
