#!/usr/bin/env bash
# OPTIONAL: make the venv holding llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) that
# benchmarks/peer_server.py benchmarks tokq serve against. A separate venv outside the repo, never a
# dependency of tokq; tokq's own install and tests do not need it.
#
# Usage: bash benchmarks/peer_llama_venv.sh [DIR]   (default DIR: /work/peer-llama, or $TOKQ_PEER_LLAMA_VENV)
# Then:  .venv/bin/python benchmarks/peer_server.py --llama-python DIR/bin/python
#
# pip builds llama.cpp from source (cmake + a C++ compiler): 10-30 minutes on two cores. GGML_NATIVE
# compiles for this CPU's instruction set, as a peer measured on this machine should be.
set -euo pipefail
DIR="${1:-${TOKQ_PEER_LLAMA_VENV:-/work/peer-llama}}"
PY="${PYTHON:-python3}"
VERSION="${TOKQ_PEER_LLAMA_VERSION:-0.3.36}"
if [ ! -x "$DIR/bin/python" ]; then
  "$PY" -m venv "$DIR"
fi
VPY="$DIR/bin/python"
$VPY -m pip install --quiet --upgrade pip
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" MAKEFLAGS="${MAKEFLAGS:--j2}" \
  $VPY -m pip install "llama-cpp-python[server]==${VERSION}"
$VPY - <<'PYEOF'
from importlib.metadata import version
print("peer llama venv ready:", ", ".join(f"{p} {version(p)}" for p in
      ("llama_cpp_python", "fastapi", "uvicorn")))
PYEOF
