#!/usr/bin/env bash
# Install the libraries the benchmarks compare ringlet with, into one Python:
#   Open MPI (the mpirun launcher and headers, from the system's packages) + mpi4py,
#   and PyTorch's CPU build (whose Gloo backend is the other peer).
# Usage: bash bench/install_peers.sh [PYTHON]   (default .venv/bin/python, else python3)
# Safe to run again: what is there is kept. A peer that is missing is reported and skipped
# by `ringlet bench --compare` and bench/*.py, so this is needed only for comparisons.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if ! command -v mpirun >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  else
    echo "install Open MPI (mpirun and its headers) with your system's package manager" >&2
    exit 1
  fi
fi
"$PY" -m pip install -q --disable-pip-version-check mpi4py "torch==2.13.0"
"$PY" -c "import mpi4py, torch; print('peers ready: mpi4py', mpi4py.__version__, '/ torch', torch.__version__, '(Gloo)')"
