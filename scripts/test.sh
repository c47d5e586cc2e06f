#!/usr/bin/env bash
# Run the whole test suite in a fresh virtual environment (created on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,plot]"
exec .venv/bin/python -m pytest -q "$@"
