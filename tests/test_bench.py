"""`ringlet bench` end to end: real ranks, nccl-tests columns, the JSON rows, and what
each row says it ran."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ringlet.algorithms import CATALOG
from ringlet.bench import FACTOR, OPS, _finish_row, counts

pytestmark = pytest.mark.timeout(180)


def bench(*args, timeout=150, env=None):
    return subprocess.run([sys.executable, "-m", "ringlet.cli", "bench", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def test_bench_prints_nccl_columns_checks_results_and_records_what_ran(tmp_path):
    out = tmp_path / "rows.jsonl"
    r = bench("-n", "2", "--op", "all_reduce", "--algo", "ring,direct,auto", "--sizes", "8,64K",
              "--iters", "3", "--warmup", "1", "--check", "--json", str(out))
    assert r.returncode == 0, r.stderr
    header = next(line.split() for line in r.stdout.splitlines() if line.split()[:1] == ["size"])
    assert header == ["size", "count", "dtype", "op", "algorithm", "time(us)", "algbw", "busbw",
                      "pred(us)", "err", "#wrong"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(x["algorithm"], x["bytes"]) for x in rows] == [
        (a, b) for a in ("ring", "direct", "auto") for b in (8, 65536)]
    for x in rows:
        assert x["wrong"] == 0 and x["time_us"] > 0
        assert x["algbw_GBps"] == pytest.approx(x["bytes"] / x["time_us"] / 1e3)
        assert x["busbw_GBps"] == pytest.approx(x["algbw_GBps"] * 2 * (2 - 1) / 2)
        # "ran" is the algorithm the timed calls used (it once reported the bench's own
        # max-reduction afterwards, recursive_doubling, for every all_reduce row).
        if x["algorithm"] == "auto":
            assert x["ran"] in CATALOG["all_reduce"]
        else:
            assert x["ran"] == x["algorithm"]
    auto_lines = [line for line in r.stdout.splitlines() if "auto:" in line]
    assert len(auto_lines) == 2 and all(f"auto:{x['ran']}" in line for x, line in
                                        zip([x for x in rows if x["algorithm"] == "auto"], auto_lines))


# nccl-tests' bus-bandwidth factors and size conventions, written out here from its
# sources (src/<collective>.cu: *GetBw and *GetCollByteCount), not read from ringlet.bench.
# Size S: all_reduce, broadcast, reduce: the buffer; all_to_all: a rank's whole send
# buffer (count * nranks); all_gather, reduce_scatter, gather, scatter: the whole array
# (a rank's block is S / n).
PUBLISHED = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
             "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
             "gather": lambda n: (n - 1) / n, "scatter": lambda n: (n - 1) / n,
             "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}
BLOCKED = {"all_to_all", "all_gather", "reduce_scatter", "gather", "scatter"}


def test_bus_factors_and_sizes_are_the_published_nccl_tests_ones():
    assert sorted(PUBLISHED) == sorted(OPS)
    for op, factor in PUBLISHED.items():
        for n in (1, 2, 3, 8, 64):
            assert FACTOR[op](n) == pytest.approx(factor(n)), (op, n)
            # a row as the bench finishes it: 3 MiB in 1.5 ms
            row = _finish_row({"op": op, "bytes": 3 << 20, "time_us": 1500.0}, n)
            assert row["algbw_GBps"] == pytest.approx((3 << 20) / 1.5e-3 / 1e9), (op, n)
            assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor(n)), (op, n)
            per, total = counts(op, 64 * 24 * 4, n, 4)           # S divisible by every n here
            assert total * 4 == 64 * 24 * 4, (op, n)
            assert per == (total // n if op in BLOCKED else total), (op, n)


def test_bench_rows_carry_the_published_factor_for_their_group_size(tmp_path):
    """At p = 3 all_reduce's factor is 4/3 (at p = 2 it is 1, like broadcast's)."""
    out = tmp_path / "rows.jsonl"
    r = bench("-n", "3", "--op", "all_reduce", "--sizes", "96K", "--iters", "2", "--warmup", "1",
              "--json", str(out))
    assert r.returncode == 0, r.stderr
    (x,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert x["p"] == 3 and x["bytes"] == 96 << 10
    assert x["busbw_GBps"] == pytest.approx(x["bytes"] / x["time_us"] / 1e3 * 4 / 3)


def test_long_warmups_of_in_place_sums_do_not_overflow():
    # 300 unreset all_reduces of float32 (rank + 1) once summed past 3.4e38 (p = 2 doubles it).
    # NumPy says so; the C fast path's kernels would overflow silently.
    r = bench("-n", "2", "--op", "all_reduce", "--sizes", "8", "--iters", "3", "--warmup", "300",
              "--check", env={"RINGLET_NO_FASTPATH": "1"})
    assert r.returncode == 0, r.stderr
    assert "overflow" not in r.stderr, r.stderr
    assert r.stdout.split()[-1] == "0"     # #wrong


def test_bench_reports_a_missing_peer_and_goes_on(tmp_path):
    """Without torch, Gloo is reported skipped and ringlet's rows still print; with it
    (the test command installs it), Gloo runs beside them."""
    shim = tmp_path / "no-torch" / "torch"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('torch hidden by the test')\n")
    args = ("-n", "2", "--op", "broadcast", "--sizes", "1K", "--iters", "2", "--compare", "gloo")
    path = os.pathsep.join([str(shim.parent), os.environ.get("PYTHONPATH", "")])
    for hidden in (True, False):
        r = bench(*args, env={"PYTHONPATH": path} if hidden else None)
        assert r.returncode == 0, r.stderr
        text = r.stdout + r.stderr
        if hidden:
            assert "gloo: skipped" in text and "torch is not installed" in text, text
        else:
            assert "gloo: skipped" not in text and "xgloo" in r.stdout, text
        assert any(line.split()[:1] == ["1K"] for line in r.stdout.splitlines()), text


def test_bench_rejects_an_unknown_algorithm_before_starting_ranks():
    r = bench("-n", "2", "--op", "broadcast", "--algo", "binomial,pipelined", "--sizes", "8",
              timeout=30)
    assert r.returncode == 2
    assert "unknown broadcast algorithm(s) pipelined" in r.stderr and "pipeline" in r.stderr
    assert "rank" not in r.stderr          # refused by the command line, not by a rank


def test_bench_sizes_read_units_as_the_cost_commands_do():
    """`--sizes 8MB` is 8 * 10^6 bytes in `ringlet bench` as in `ringlet plan`/`explain`;
    8M and 8MiB are 8 * 2^20 (they used to disagree on MB)."""
    from ringlet.bench import parse_sizes
    from ringlet.cost import parse_size
    assert parse_sizes("8MB,8M,8MiB,1K") == [8_000_000, 8 << 20, 8 << 20, 1024]
    assert parse_size("8MB") == 8_000_000
    assert parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert parse_sizes("1K:64K:4") == [1024, 4096, 16384, 65536]
    with pytest.raises(ValueError, match="cannot read size"):
        parse_sizes("8 parsecs")
    r = bench("-n", "2", "--sizes", "8parsecs", timeout=30)
    assert r.returncode == 2 and "--sizes: cannot read size '8parsecs'" in r.stderr


@pytest.mark.parametrize("args,says", [
    (("--sizes", "8:1K:1"), "the step 1 of '8:1K:1' must be at least 2"),   # (looped for ever)
    (("--sizes", "64K:8"), "give LO:HI"),                                  # (printed nothing)
    (("-n", "0"), "-n must be at least 2 ranks"),                           # (a traceback)
    (("--dtype", "foo"), "--dtype: unknown dtype 'foo'"),                  # (a rank's TypeError)
])
def test_bench_refuses_bad_arguments_before_starting_ranks(args, says):
    r = bench(*args, timeout=30)
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_bench_rows_say_the_bytes_the_call_moved(tmp_path):
    """Asked sizes that are no whole number of elements per block, a row says what the
    call moved, and its bandwidth and prediction are of that (they were of the size asked:
    100 B of an all_gather at p = 3 moves 96, 8 B moves 12)."""
    out = tmp_path / "rows.jsonl"
    r = bench("-n", "3", "--op", "all_gather", "--sizes", "8,100", "--iters", "2",
              "--warmup", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["bytes"] for x in rows] == [12, 96]
    from ringlet import cost
    for x in rows:
        assert x["algbw_GBps"] == pytest.approx(x["bytes"] / x["time_us"] / 1e3)
        assert x["busbw_GBps"] == pytest.approx(x["algbw_GBps"] * 2 / 3)   # (p - 1) / p
        moved = cost.predict_host("all_gather", x["bytes"], 3, x["ran"], "shm")
        assert x["pred_us"] == pytest.approx(moved * 1e6, rel=1e-6)


def test_bench_plot_and_columns_aligned_whatever_the_algorithm_name(tmp_path):
    import matplotlib.image
    png = tmp_path / "b.png"
    r = bench("-n", "2", "--op", "all_reduce", "--algo", "recursive_doubling,ring,auto",
              "--sizes", "8,1K", "--iters", "2", "--warmup", "1", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    table = [line for line in r.stdout.splitlines() if not line.startswith("#")]
    # every column ends where its header ends
    head = table[0]
    ends = [i + 1 for i in range(len(head)) if head[i] != " " and (i + 1 == len(head) or head[i + 1] == " ")]
    for line in table[1:]:
        assert len(line) == len(head)
        assert all(line[e - 1] != " " for e in ends[:-1]), (head, line)
    img = matplotlib.image.imread(png)
    assert img.shape[1] > 800 and img[..., :3].std() > 0.05
    assert "\r" not in r.stderr          # no progress bar when output is not a terminal


def _fresh_rank(rank, out):
    import numpy as np

    import ringlet as rl
    from ringlet.bench import _make_call
    p = rl.get_world_size()
    wrong = {}
    for op in OPS:
        for fresh in (False, True):
            call, reset, check = _make_call(rl, op, 4096, p, rank, np.dtype(np.float32), "auto",
                                            fresh=fresh)
            reset(); call()
            # The program overwrites what it sends between steps; a fresh reset writes the
            # input the measurement started from again, so the next call is right.
            for a in call.inputs:
                a[...] = 0
            reset(); call()
            got = np.array([check()], np.int64)
            rl.all_reduce(got)
            wrong[f"{op} fresh={fresh}"] = int(got[0])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(wrong, f)


def test_a_fresh_measurement_writes_every_input_again_before_each_call(tmp_path):
    from ringlet.launch import spawn
    out = tmp_path / "wrong.json"
    spawn(_fresh_rank, 2, args=(str(out),), timeout=120)
    wrong = json.loads(out.read_text())
    for op in OPS:
        assert wrong[f"{op} fresh=True"] == 0, op
    # Unwritten, a zeroed input stays zero: the collectives that do not overwrite their
    # input are wrong after it, so the check above can fail.
    stale = [op for op in OPS if wrong[f"{op} fresh=False"]]
    assert set(stale) >= {"all_gather", "all_to_all", "reduce_scatter", "gather", "scatter"}


def test_benchmarks_say_which_profile_auto_picked_with(tmp_path, monkeypatch):
    """targets.py and in_job_vs_mpi.py print it first: their rows depend on it."""
    from ringlet.bench import auto_priced_by
    from ringlet.cost.profile import default_profile
    assert "default profile (uncalibrated" in auto_priced_by()       # conftest: no profile
    path = default_profile().save(tmp_path / "profile.json")
    monkeypatch.setenv("RINGLET_PROFILE", str(path))
    assert auto_priced_by().startswith(f"auto picks on the calibrated profile {path}")


def _ab_rank(rank, out):
    import numpy as np

    import ringlet as rl
    from ringlet.bench import _make_call, ab_row, write_rows
    arms = {alg: _make_call(rl, "all_reduce", 4096, 2, rank, np.dtype(np.float32), alg)
            for alg in ("ring", "direct")}
    write_rows(rank, ab_row(rl, "all_reduce", 4096, arms, 2, 2), out)


def test_an_ab_row_names_the_algorithm_its_arms_ran_not_the_timings_own(tmp_path):
    # Each block's time is agreed by a small all_reduce (recursive doubling): read after
    # the blocks, an all_reduce row named that one, whatever its arms had run.
    from ringlet.launch import spawn
    out = tmp_path / "row.json"
    spawn(_ab_rank, 2, args=(str(out),), timeout=120)
    row = json.loads(out.read_text())
    assert row["ran"] == "ring" and row["wrong"] == 0
    assert len(row["res"]["ring"]) == len(row["res"]["direct"]) == 2


def test_a_rows_median_carries_an_interval_and_a_verdict_against_its_target():
    import numpy as np

    from ringlet.bench import median_interval, verdict
    assert median_interval([1.3] * 12) == (1.3, 1.3, 1.3)
    rng = np.random.default_rng(5)
    wide = rng.normal(1.1, 0.3, 12)
    med, lo, hi = median_interval(wide)
    assert lo < med < hi and med == np.median(wide)
    assert median_interval(wide) == (med, lo, hi)          # the same table twice
    assert verdict((med, lo, hi), 1.0) == ("met" if lo >= 1.0 else "unsure")
    assert verdict((1.4, 1.25, 1.5), 1.2) == "met"
    assert verdict((1.1, 0.9, 1.15), 1.2) == "missed"
    assert verdict((1.1, 0.9, 1.3), 1.2) == "unsure"
    # more blocks of the same spread: a narrower interval
    many = rng.normal(1.1, 0.3, 200)
    _, lo2, hi2 = median_interval(many)
    assert hi2 - lo2 < hi - lo


def test_bench_says_which_sizes_it_rounded_and_what_err_is():
    """--sizes 0 and 3 had read as rows of 4 B, unsaid; the err column's sign was nowhere."""
    r = bench("-n", "2", "--op", "all_reduce", "--sizes", "0,3,8", "--iters", "2",
              "--warmup", "1")
    assert r.returncode == 0, r.stderr
    assert "--sizes 0, 3 B moved as whole float32 elements" in r.stderr, r.stderr
    assert "err: pred / time - 1" in r.stdout
    assert [line.split()[0] for line in r.stdout.splitlines()
            if line and line.split()[0].isdigit()] == ["4", "8"], r.stdout


@pytest.mark.parametrize("ys, major, minor", [
    ((1.6, 8.5), [], ["2", "3", "4", "6"]),           # less than a decade: between decades
    ((7.0, 9.5), [], ["7", "8", "9"]),
    ((0.004, 5.0), ["0.01", "0.1", "1"], []),          # several: the decades only
])
def test_a_plots_log_values_read_as_plain_numbers(ys, major, minor):
    """bench --plot's time axis (1.6-8.5 us) was labelled 2x10^0, 3x10^0, ... 6x10^0; the
    labels are matplotlib's own choice of ticks (one labelled only 2, 3, 4 and 6 left a
    7-9.5 axis with none)."""
    pytest.importorskip("matplotlib")
    from ringlet.plotting import pyplot, value_axis
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([8, 30000], ys)
    value_axis(ax)
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    shown = lambda ts: [t.get_text() for t in ts                          # noqa: E731
                        if t.get_text() and lo <= t.get_position()[1] <= hi]
    assert shown(ax.get_yticklabels()) == major
    assert shown(ax.get_yticklabels(minor=True)) == minor
    plt.close(fig)
