#!/usr/bin/env bash
# Run the whole test suite in a fresh virtual environment (created on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,plot,examples]"
# torch (the local CPU wheel) for tests/test_torch.py: the backend is tested, not skipped
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
exec .venv/bin/python -m pytest -q "$@"
