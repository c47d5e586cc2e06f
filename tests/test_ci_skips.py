"""Under CI (CI=true) a skipped test fails, unless its reason is one the README names: a
promise whose test silently skips is a promise nobody checks."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import CI_MAY_SKIP

HERE = Path(__file__).parent

INNER = """import pytest

def test_needs_a_frobnicator():
    pytest.skip("no frobnicator here")

def test_needs_open_mpi():
    pytest.skip("Open MPI is not installed")

def test_runs():
    pass
"""


def test_a_skip_fails_in_ci_unless_the_readme_names_its_reason(tmp_path):
    readme = (HERE.parent / "README.md").read_text()
    assert CI_MAY_SKIP and all(f'"{reason}"' in readme for reason in CI_MAY_SKIP)
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(INNER)
    for ci, want in (("true", "1 failed, 1 passed, 1 skipped"), ("", "1 passed, 2 skipped")):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "test_inner.py"], cwd=tmp_path, capture_output=True, text=True,
                              env=dict(os.environ, CI=ci), timeout=120)
        assert want in proc.stdout, (ci, proc.stdout, proc.stderr)
        if ci:
            assert "skipped in CI, which must run it: " in proc.stdout, proc.stdout
            assert "FAILED test_inner.py::test_needs_a_frobnicator" in proc.stdout, proc.stdout
