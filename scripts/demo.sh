#!/usr/bin/env bash
# The main job: a demonstration across 4 local ranks, in a fresh virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/ringlet run -n 4 examples/demo.py "$@"
