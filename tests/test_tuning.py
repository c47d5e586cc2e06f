"""algorithm="auto" tuned on the job's own calls (RINGLET_TUNE, ringlet/tuning.py): the
candidates run in turn and stay correct, every rank (of the world or a subgroup) decides
alike from the agreed (slowest rank's) times, rank 0's setting counts, async calls are not
timed, a rank lost mid-trial is named, and bad values fail before the job forms."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ringlet as rl
from ringlet import collectives, tuning

from conftest import ringlet_run, run


# -- the bookkeeping, without processes ---------------------------------------------------
class _Call:
    def __init__(self, name):
        self.algorithm, self.in_place = name, True


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.lists(st.floats(1e-6, 1e-2), min_size=2, max_size=4), st.data())
def test_trials_take_turns_and_decide_the_least_agreed_time(per, predicted, data):
    calls = [_Call(f"a{i}") for i in range(len(predicted))]
    trials = tuning.Trials(calls, per, predicted)
    ran, runs = [], tuning.BLOCKS * len(calls) * (per + 1)
    for i in range(runs):
        ran.append(trials.current().algorithm)
        done = trials.record(data.draw(st.floats(1e-6, 1e-2)))
        assert done == (i == runs - 1)
    # blocks of 1 + per calls, each candidate's in turn, the model's winner first; the
    # first call of a block is not timed
    assert ran == [c.algorithm for c in calls for _ in range(per + 1)] * tuning.BLOCKS
    assert [[len(b) for b in t] for t in trials.times] == [[per] * tuning.BLOCKS] * len(calls)
    assert trials.first is calls[0]
    own = trials.medians()
    assert own.shape == (len(calls), tuning.BLOCKS)
    assert np.allclose(own, [[np.median(b) for b in t] for t in trials.times])
    # the agreed times are the slowest rank's: of the candidates that beat the model's
    # winner by more than KEEP in every block, the least mean wins (ties to the model's
    # order); none: the model's winner
    extra = data.draw(st.lists(st.sampled_from([0.0, 1e-3, 5e-3]), min_size=own.size,
                               max_size=own.size))
    agreed = np.maximum(own, np.reshape(extra, own.shape))
    best = tuning.decide(trials, agreed, "test")
    overall = agreed.mean(axis=1)
    beat = [j for j in range(len(calls))
            if all(agreed[j, b] * (1 + tuning.KEEP) < agreed[0, b] for b in range(tuning.BLOCKS))]
    want = min(beat, key=lambda j: (overall[j], j)) if beat else 0
    assert best == want
    d = tuning.decisions()[-1]
    assert d["chosen"] == calls[best].algorithm and d["model"] == "a0"
    assert [c["measured_s"] for c in d["candidates"]] == pytest.approx(list(overall))
    assert np.allclose([c["blocks_s"] for c in d["candidates"]], agreed)
    assert d["calls_each"] == per
    line = tuning.describe(d)
    assert ("kept" in line) == (best == 0) and f"1 + {per} calls each" in line


def test_bad_tune_values_are_refused_before_the_job_forms(monkeypatch):
    for bad, says in (("many", "whole number"), ("-2", ">= 0")):
        monkeypatch.setenv("RINGLET_TUNE", bad)
        with pytest.raises(ValueError, match=f"RINGLET_TUNE.*{says}"):
            tuning.trials_from_env()
        with pytest.raises(ValueError, match="RINGLET_TUNE"):
            rl.init(rank=0, world_size=1)
        assert not rl.is_initialized()
    monkeypatch.setenv("RINGLET_TUNE", "")
    assert tuning.trials_from_env() == 0


# -- real ranks -------------------------------------------------------------------------
PER = 2


def _shapes(rank, p):
    """Calls that each run one collective with fresh inputs and check its result against
    NumPy."""
    rng = np.random.default_rng(7)
    base = rng.integers(-50, 50, size=(p, 3000)).astype(np.float64)

    def all_reduce():
        x = base[rank, :37].copy()
        rl.all_reduce(x)
        assert np.array_equal(x, base[:, :37].sum(0))

    def all_gather():
        out = np.empty((p, 3000))
        rl.all_gather(out, base[rank].copy())
        assert np.array_equal(out, base)

    def broadcast():
        x = base[2].copy() if rank == 2 else np.zeros(3000)
        rl.broadcast(x, 2)
        assert np.array_equal(x, base[2])

    def reduce_max():
        x = base[rank, :512].copy()
        rl.reduce(x, 1, op=rl.ReduceOp.MAX)
        if rank == 1:
            assert np.array_equal(x, base[:, :512].max(0))

    def all_to_all():
        inp = base[rank, :p * 100].reshape(p, 100).copy()
        out = np.empty_like(inp)
        rl.all_to_all(out, inp)
        assert np.array_equal(out, base[:, rank * 100:(rank + 1) * 100])

    def gather():
        out = np.empty((p, 600)) if rank == 1 else None
        rl.gather(base[rank, :600].copy(), out, dst=1)
        if rank == 1:
            assert np.array_equal(out, base[:, :600])

    def scatter():
        out = np.empty(500)
        rl.scatter(out, base[0, :p * 500].reshape(p, 500).copy() if rank == 0 else None, src=0)
        assert np.array_equal(out, base[0, rank * 500:(rank + 1) * 500])

    return [all_reduce, all_gather, broadcast, reduce_max, all_to_all, gather, scatter]


def _tuned_job(rank, per):
    p = rl.get_world_size()
    assert rl.runtime._S.tune == per
    shapes = _shapes(rank, p)
    before = len(tuning.decisions())
    # every shape decided (by the call after its last trial)
    for _ in range(tuning.BLOCKS * (per + 1) * tuning.MOST + 1):
        for call in shapes:
            call()
    mine = tuning.decisions()[before:]
    # the shapes with more than one candidate were decided, each from the agreed times
    assert 1 <= len(mine) <= len(shapes) and not collectives._TRIALS
    for d in mine:
        agreed = np.array([c["blocks_s"] for c in d["candidates"]])
        assert agreed.shape == (len(d["candidates"]), tuning.BLOCKS)
        assert d["chosen"] == d["candidates"][tuning.pick(agreed)]["algorithm"]
        assert d["model"] == d["candidates"][0]["algorithm"] and d["calls_each"] == per
        assert 2 <= len(d["candidates"]) <= tuning.MOST
    # every rank decided alike, from the same agreed times
    flat = np.array([t for d in mine for c in d["candidates"] for t in c["blocks_s"]])
    table = np.empty((p, flat.size))
    rl.all_gather(table, flat, algorithm="ring")
    assert (table == table[0]).all()
    names = "|".join(f"{d['call']}:{d['chosen']}" for d in mine).encode()
    lengths = np.empty(p, np.int64)
    rl.all_gather(lengths, np.array([len(names)]), algorithm="ring")
    assert (lengths == len(names)).all()
    got = np.empty((p, len(names)), np.uint8)
    rl.all_gather(got, np.frombuffer(names, np.uint8).copy(), algorithm="ring")
    assert (got == got[0]).all()
    # decided shapes keep running their choice, correctly
    for call in shapes:
        call()
    for key, chosen in collectives._TUNED.items():
        assert collectives._CALLS[key] is chosen
    assert sorted(c.algorithm for c in collectives._TUNED.values()) == \
        sorted(d["chosen"] for d in mine)


@pytest.mark.parametrize("p", [3, 4])
def test_tuned_auto_runs_every_candidate_correctly_and_ranks_decide_alike(p):
    run(_tuned_job, p, PER, env={"RINGLET_TUNE": str(PER)})


def test_tuned_auto_over_tcp():
    run(_tuned_job, 3, 1, backend="tcp", env={"RINGLET_TUNE": "1"})


def _async_not_timed(rank):
    p = rl.get_world_size()
    x = np.ones(40)
    rl.all_reduce(x)                    # the first call of the shape: its trials begin
    key = next(k for k in collectives._TRIALS if k[0] == "all_reduce")
    trials = collectives._TRIALS[key]
    m = len(trials.calls)
    assert trials.n == 1 and m >= 2
    for _ in range(3):
        y = np.full(40, float(rank))
        rl.all_reduce(y, async_op=True).wait()
        assert (y == sum(range(p))).all()
    assert trials.n == 1                # async calls run the model's pick, untimed
    runs = tuning.BLOCKS * m * (3 + 1)  # RINGLET_TUNE=3: decided by the call after the last
    for i in range(2, runs + 2):
        x = np.ones(40)
        rl.all_reduce(x)
        assert (x == p).all()
        assert (key in collectives._TRIALS) == (i <= runs)
    assert collectives._CALLS[key] is collectives._TUNED[key]


def test_async_calls_run_the_models_pick_and_are_not_timed():
    run(_async_not_timed, 4, env={"RINGLET_TUNE": "3"})


def _off(rank):
    assert rl.runtime._S.tune == 0
    before = len(tuning.decisions())
    for _ in range(10):
        x = np.ones(40)
        rl.all_reduce(x)
    assert not collectives._TRIALS and len(tuning.decisions()) == before


def test_off_by_default():
    env = {k: v for k, v in os.environ.items() if k == "RINGLET_TUNE"}
    assert not env, "the test environment must not set RINGLET_TUNE"
    run(_off, 3)


def _uneven_not_tuned(rank):
    p = rl.get_world_size()
    splits = [[(r + c) % 3 + 1 for c in range(p)] for r in range(p)]   # row r: what r sends
    inp = np.arange(sum(splits[rank]), dtype=np.float32) + 100 * rank
    out = np.empty(sum(row[rank] for row in splits), np.float32)
    before = len(tuning.decisions())
    for _ in range(6):
        rl.all_to_all_single(out, inp, out_splits=[row[rank] for row in splits],
                             in_splits=splits[rank])
    # (its splits' exchange, an all_gather of the same shape everywhere, may be tuned)
    assert not any(k[0] == "all_to_all_single" for k in collectives._TRIALS)
    assert not any(d["call"].startswith("all_to_all_single")
                   for d in tuning.decisions()[before:])
    want = np.concatenate([(np.arange(sum(splits[r]), dtype=np.float32) + 100 * r)
                           [sum(splits[r][:rank]):sum(splits[r][:rank + 1])] for r in range(p)])
    assert np.array_equal(out, want)


def test_uneven_all_to_all_single_keeps_the_models_pick():
    run(_uneven_not_tuned, 3, env={"RINGLET_TUNE": "2"})


def test_rank_0s_setting_counts_for_the_whole_job(tmp_path):
    source = (
        "import os\n"
        "if os.environ['RANK'] == '0':\n"
        "    os.environ['RINGLET_TUNE'] = '2'\n"
        "else:\n"
        "    os.environ.pop('RINGLET_TUNE', None)\n"
        "import numpy as np, ringlet as rl\n"
        "from ringlet import tuning\n"
        "rl.init()\n"
        "for _ in range(tuning.BLOCKS * 3 * tuning.MOST + 1):\n"   # (+1: decided by the next)
        "    x = np.ones(1000)\n"
        "    rl.all_reduce(x)\n"
        "    assert (x == rl.get_world_size()).all()\n"
        "print('decided', rl.get_rank(), [d['chosen'] for d in tuning.decisions()], flush=True)\n"
        "rl.destroy()\n")
    proc, _ = ringlet_run(tmp_path, source, 3)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = sorted(re.search(r"decided (\d) (.*)$", l).groups()
                   for l in proc.stdout.splitlines() if "decided" in l)
    assert [r for r, _ in lines] == ["0", "1", "2"]
    assert len({d for _, d in lines}) == 1 and lines[0][1] != "[]"


def test_the_algo_debug_log_names_the_candidate_each_trial_ran(tmp_path):
    """RINGLET_DEBUG=algo logged auto's reason, naming the model's pick, on every trial
    call whichever candidate it ran."""
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np, ringlet as rl\n"
        "from ringlet import tuning\n"
        "rl.init()\n"
        "for _ in range(tuning.BLOCKS * 2 * tuning.MOST + 1):\n"
        "    rl.all_reduce(np.ones(1 << 16, np.float32))\n"
        "rl.destroy()\n")
    # (the launcher's ranks import ringlet before the script runs: set in their environment)
    env = dict(os.environ, RINGLET_TUNE="1", RINGLET_DEBUG="algo")
    proc = subprocess.run([sys.executable, "-m", "ringlet.cli", "run", "-n", "2", str(script)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = proc.stdout + proc.stderr
    ran = re.findall(r"rank 0, world #(\d+): on trial \(RINGLET_TUNE\): (\w+), candidate "
                     r"(\d) of (\d)", log)
    n = int(ran[0][3])
    assert n >= 2 and len(ran) == tuning.BLOCKS * n * 2, log[-3000:]
    # blocks of 1 + 1 calls, each candidate's in turn: every candidate named on its own calls
    names = [name for _, name, _, _ in ran]
    assert len(set(names[:2 * n])) == n and names[:2 * n] == names[2 * n:4 * n]
    assert [int(k) for _, _, k, _ in ran[:2 * n]] == [k for k in range(1, n + 1) for _ in "ab"]


def _killed_during_trials(rank, path, at):
    x = np.ones(2000, np.float32)

    def die(*args, **kwargs):
        with open(path + ".killed", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 2 and at == "agreement":     # gone as the others agree on the times
        collectives.all_reduce = die        # (what _trial calls; rl.all_reduce is not it)
    calls = 0
    try:
        while True:
            if rank == 2 and calls == at:   # gone between two trial calls
                die()
            rl.all_reduce(x, timeout=30)
            calls += 1
    except rl.PeerFailure as exc:
        with open(f"{path}.{rank}", "w") as f:
            json.dump({"rank": exc.rank, "t": time.time(), "calls": calls}, f)
        raise


@pytest.mark.parametrize("at", [1, 5, "agreement"])
def test_a_rank_lost_during_trials_is_named_not_waited_for(tmp_path, at):
    """Survivors of a rank killed between trial calls, or as they agree on the times,
    raise PeerFailure naming it, within seconds."""
    path = str(tmp_path / "seen")
    with pytest.raises(rl.ProcessFailed) as info:
        run(_killed_during_trials, 3, path, at, env={"RINGLET_TUNE": "2"})
    assert info.value.rank == 2
    killed = float(open(path + ".killed").read())
    for r in (0, 1):
        seen = json.load(open(f"{path}.{r}"))
        assert seen["rank"] == 2 and seen["t"] - killed < 5.0, seen
        if at == "agreement":   # raised by the call after the last trial (2 blocks of
            # 1 + 2 calls for each candidate), which agrees on the times
            assert seen["calls"] % (tuning.BLOCKS * 3) == 0 and seen["calls"] >= 12, seen


def test_explain_names_the_candidates_a_tuned_job_would_time(capsys):
    from ringlet import commands
    from ringlet.cost import choose
    assert commands.explain_main(["all_gather", "--size", "64K", "-n", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    _, rows = choose("all_gather", 64 << 10, 4)
    n = tuning.shortlist([r.total for r in rows])
    assert 2 <= n <= tuning.MOST
    assert f"a job times {', '.join(r.algorithm for r in rows[:n])} on its first" in out
    # not where explain prices another link than a job here would, or fewer algorithms
    for extra in (["--tier", "nvlink"], ["--algorithms", "ring,direct"]):
        assert commands.explain_main(["all_gather", "--size", "64K", "-n", "4"] + extra) == 0
        assert "RINGLET_TUNE" not in capsys.readouterr().out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1e-7, 1.0), min_size=1, max_size=9))
def test_the_shortlist_is_the_fastest_predicted_within_the_spread(predicted):
    predicted = sorted(predicted)
    n = tuning.shortlist(predicted)
    assert 1 <= n <= tuning.MOST
    assert all(t <= tuning.SPREAD * predicted[0] for t in predicted[:n])
    assert n == tuning.MOST or n == len(predicted) or \
        predicted[n] > tuning.SPREAD * predicted[0]


def _subgroup(rank):
    g = rl.new_group([1, 2, 3])
    before = len(tuning.decisions())
    if rank == 0:
        return
    me = g.rank
    for i in range(tuning.BLOCKS * 3 * tuning.MOST + 2):
        out = np.empty((3, 700), np.float32)
        rl.all_gather(out, np.full(700, me + i, np.float32), group=g)
        assert (out == (np.arange(3) + i)[:, None]).all()
    mine = tuning.decisions()[before:]
    assert len(mine) == 1 and "group" in mine[0]["call"] and "p=3" in mine[0]["call"]
    times = np.array([c["measured_s"] for c in mine[0]["candidates"]])
    table = np.empty((3, times.size))
    rl.all_gather(table, times, group=g, algorithm="ring")
    assert (table == table[0]).all()


def test_a_subgroup_tunes_among_its_members():
    run(_subgroup, 4, env={"RINGLET_TUNE": "2"})


def _new_sizes_share_prices(rank):
    from ringlet.cost import tune
    rl.all_reduce(np.ones(7000, np.float32))
    before = len(tune._CACHE)
    for n in range(7000, 7100):       # 28000 .. 28396 B: priced at 28160 or 28672 B
        x = np.full(n, rank + 1.0, np.float32)
        rl.all_reduce(x)
        assert (x == 3.0).all()
    assert len(tune._CACHE) - before <= 2, len(tune._CACHE) - before


def test_calls_of_ever_new_sizes_share_the_models_prices():
    """Auto priced every new size with a simulation of every algorithm (5-30 ms a size);
    calls of ever new sizes (objects, uneven exchanges) paid it each time. It prices at
    the size rounded up to 6 binary digits (cost.tune.priced_size)."""
    run(_new_sizes_share_prices, 2)


def _trial_timed_out(rank):
    for step in range(tuning.BLOCKS * 3 * tuning.MOST + 4):
        x = np.full(8, 10.0 ** (step % 5))
        if rank == 1 and step == 2:
            time.sleep(1.5)      # late to one trial call: the others time out
        try:
            rl.all_reduce(x, timeout=0.5 if step == 2 else 30)
        except rl.RingletError:
            assert step == 2
            continue
        assert (x == rl.get_world_size() * 10.0 ** (step % 5)).all(), (step, x)


def test_a_trial_call_that_timed_out_keeps_the_ranks_in_step():
    """A rank whose trial call timed out did not count that run: from then on it ran
    another candidate than its peers, and every call of the shape failed with
    CollectiveMismatch (56 of 56 in a review). A failed run counts now, as never faster."""
    run(_trial_timed_out, 3, env={"RINGLET_TUNE": "2"})
