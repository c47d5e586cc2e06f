"""The ``ringlet`` command as a shell runs it: every command piped into a reader that
goes away (``ringlet tiers | head``) stops quietly, without a traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = "import ringlet as rl\nrl.init()\nfor i in range(20000):\n    print(rl.get_rank(), i)\nrl.destroy()\n"

COMMANDS = [["--help"], ["tiers"], ["tiers", "--help"], ["plan"], ["plan", "--models"],
            ["explain", "all_reduce", "--size", "1M", "-n", "4"],
            ["place", "--hosts", "2", "--ranks-per-host", "2", "--tp", "2", "--tp-bytes", "1M"],
            ["draw", "all_reduce", "-n", "8", "--algo", "ring"],
            ["bench", "-n", "2", "--sizes", "8:64K", "--iters", "5"],
            ["calibrate", "--help"], ["trace", "--help"], ["run", "--help"],
            ["run", "-n", "2", "{script}"], ["trace", "summary", "{traces}"],
            ["trace", "merge", "--help"]]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    script = d / "job.py"
    script.write_text("import numpy as np, ringlet as rl\nrl.init()\nx = np.ones(4)\n"
                      "for _ in range(100):\n    rl.all_reduce(x)\nrl.destroy()\n")
    subprocess.run([sys.executable, "-m", "ringlet.cli", "run", "-n", "2", "--trace",
                    str(d / "tr"), str(script)], check=True, timeout=120, capture_output=True)
    return d


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a)[:40])
def test_reader_going_away_is_not_an_error(args, traces):
    spam = traces / "spam.py"
    spam.write_text(SCRIPT)
    argv = [a.format(script=spam, traces=traces / "tr") for a in args]
    p = subprocess.Popen([sys.executable, "-m", "ringlet.cli", *argv],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()              # the reader is gone before the first line
    try:
        err = p.stderr.read().decode()
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert rc in (0, 141), (rc, err)


def test_run_without_a_script_says_what_is_missing():
    """ARGS are optional: the error names SCRIPT only (argparse listed ARGS as required)."""
    p = subprocess.run([sys.executable, "-m", "ringlet.cli", "run", "-n", "2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "ARGS are optional" in p.stderr and "no SCRIPT given" in p.stderr
    assert "required" not in p.stderr


def test_the_readmes_main_job_runs_and_checks_every_collective():
    # scripts/demo.sh's job: 4 local ranks, every collective checked against NumPy there.
    import os
    demo = os.path.join(os.path.dirname(__file__), "..", "examples", "demo.py")
    p = subprocess.run([sys.executable, "-m", "ringlet.cli", "run", "-n", "4", demo],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    assert "all correct on every rank" in out and "every rank holds the sum?    : True" in out
    assert "WRONG" not in out and "MISMATCH" not in out
    assert "== done: every call worked on every rank" in out
    assert "slowest rank's median of 7 calls" in out and "priced" in out


@pytest.mark.parametrize("args, says", [
    (["plan", "--plot", "/nonexistent/dir/p.png"], "there is no directory /nonexistent/dir"),
    (["explain", "all_reduce", "-n", "4", "--plot", "/"], "it is a directory"),
    (["trace", "plot", ".", "-o", "/nonexistent/t.png"], "there is no directory"),
    (["bench", "-n", "1", "--sizes", "8"], "-n must be at least 2 ranks"),
    (["bench", "-n", "2", "--sizes", "8", "--iters", "0"], "--iters must be >= 1"),
    (["bench", "-n", "2", "--sizes", "8", "--compare", "foo"], "unknown peer(s) foo"),
    (["explain", "all_reduce", "--tier", "5,abc"], "a custom link is ALPHA_US,GBPS"),
    (["tiers", "--link", "my=-5,10"], "needs ALPHA_US >= 0 microseconds and GBPS > 0"),
    (["tiers", "--link", "=5,10"], "a custom tier needs a NAME"),
    (["trace"], "merge|summary|plot"),
    # calibrate's settings: --passes 0 failed with a traceback, --sizes 0 / --budget -1 ran
    (["calibrate", "--passes", "0", "--output", "/tmp/x.json"], "--passes must be at least 1"),
    (["calibrate", "--sizes", "0", "--output", "/tmp/x.json"], "--sizes must be at least 1"),
    (["calibrate", "--budget", "-1", "--output", "/tmp/x.json"], "--budget must be > 0"),
    (["calibrate", "-n", "abc", "--output", "/tmp/x.json"], "-n takes comma-separated"),
    # a format matplotlib cannot write: had failed with a traceback after the benchmark
    (["bench", "-n", "2", "--sizes", "8", "--plot", "out.txt"], ".txt is not a picture format"),
    (["bench", "-n", "2", "--sizes", "1K", "--dtype", "S8"],
     "all_reduce sums: cannot reduce dtype |S8"),
], ids=lambda a: " ".join(a)[:30] if isinstance(a, list) else "")
def test_arguments_that_cannot_work_are_refused_before_any_work(args, says):
    """A file that cannot be written, a dtype the collective cannot reduce: an argparse
    error (exit 2, one line), before any rank starts or any table is computed."""
    p = subprocess.run([sys.executable, "-m", "ringlet.cli", *args], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and says in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def test_plan_plot_of_several_models_is_refused(tmp_path, capsys):
    """--plot with a table of several models wrote no file and exited 0."""
    from ringlet.cli import main
    out = tmp_path / "p.png"
    assert main(["plan", "--models", "--plot", str(out)]) == 2
    assert "--plot draws gamma against K for one model" in capsys.readouterr().err
    assert main(["plan", "-P", "1e8,7e9", "--plot", str(out)]) == 2
    assert not out.exists()


def test_explain_refuses_a_bad_range_before_its_table_and_names_ties(capsys):
    """--range 1M:8 printed the whole table, then failed; two algorithms priced alike were
    "1.00x faster" one than the other."""
    from ringlet.cli import main
    assert main(["explain", "all_reduce", "--size", "1M", "-n", "4", "--range", "1M:8"]) == 2
    out, err = capsys.readouterr()
    assert "--range wants 0 < LO < HI" in err and "winner" not in out
    assert main(["explain", "all_reduce", "--size", "1M", "-n", "4",
                 "--algorithms", "ring,gloo_ring"]) == 0
    assert "a tie with" in capsys.readouterr().out


def test_a_picture_named_without_an_extension_is_a_png_and_says_so(tmp_path):
    """``-o noext`` wrote noext.png and said "wrote noext"."""
    out = tmp_path / "noext"
    p = subprocess.run([sys.executable, "-m", "ringlet.cli", "draw", "all_reduce", "-o",
                        str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and f"wrote {out}.png" in p.stdout, p.stdout + p.stderr
    assert (tmp_path / "noext.png").exists() and not out.exists()
