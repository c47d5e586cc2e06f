"""Never silently wrong, never left running (issue 20): destroy, the launcher, failed
inits, spawn inside spawn."""
import glob
import hashlib
import json
import os
import socket
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import ringlet as rl
from conftest import run
from ringlet.launch import free_port


def _destroy_completes(rank):
    x = np.full(1 << 18, rank + 1.0, np.float32)
    w = rl.all_reduce(x, async_op=True)
    got = np.zeros(4, np.int64)
    r = rl.irecv(got, (rank - 1) % 3)
    rl.isend(np.arange(4) + rank, (rank + 1) % 3)
    rl.destroy()
    assert w.is_completed()
    assert np.all(x == 6.0), x[:4]
    assert r.req.done and list(got) == list(np.arange(4) + (rank - 1) % 3)


def test_destroy_completes_outstanding_async_work():
    run(_destroy_completes, 3)


def _waited_after_destroy(rank):
    done = rl.all_reduce(np.ones(4), async_op=True)
    done.wait()
    never = rl.irecv(np.empty(16), 1 - rank, tag=99)        # nobody sends it
    called = []
    never.get_future().add_done_callback(lambda f: called.append(f.exception()))
    with pytest.raises(rl.RingletError, match="could not complete"):
        rl.destroy()
    assert done.wait(timeout=1) and done.is_completed()
    assert never.is_completed()
    for _ in range(2):
        with pytest.raises(rl.RingletError, match=r"recv from rank \d \(tag 99, world\): did "
                                                  r"not complete within 2 s, and rl.destroy"):
            never.wait(timeout=1)
    assert len(called) == 1 and isinstance(called[0], rl.RingletError), called


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_a_work_waited_after_destroy_says_destroy_ended_it(backend):
    """wait() raised AttributeError from the closed transport (TCP: a PeerFailure blaming
    the peer for this rank's own closed connection), and the future never completed."""
    rl.spawn(_waited_after_destroy, 2, backend=backend, env={"RINGLET_TIMEOUT": "2"},
             timeout=60)


def _destroy_names_lost_work(rank, path):
    x = np.ones(1 << 16, np.float32)
    rl.all_reduce(x)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    w = rl.all_reduce(x, async_op=True)
    with pytest.raises(rl.RingletError) as info:
        rl.destroy()
    msg = str(info.value)
    assert "all_reduce #2 of group world" in msg and "rank 2" in msg, msg
    assert w.done and isinstance(w.error, rl.PeerFailure)
    open(f"{path}.{rank}", "w").write(msg)


def test_destroy_names_async_work_a_dead_peer_lost(tmp_path):
    path = str(tmp_path / "lost")
    with pytest.raises(rl.ProcessFailed) as info:
        run(_destroy_names_lost_work, 3, path)
    assert info.value.rank == 2
    for r in (0, 1):
        assert "could not complete" in open(f"{path}.{r}").read()


# -- a failed init leaves nothing behind and says who did not join -----------------------
_BY_HAND = ("import ringlet as rl\n"
            "try:\n"
            "    rl.init()\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n"
            "    raise SystemExit(3)\n")


def _leftovers(*tokens):
    """Files of the jobs with these tokens in /dev/shm or /tmp: ringlet's names for shared
    memory and launcher directories carried the token's hash (other jobs' files on this
    machine do not count)."""
    jobs = [hashlib.sha256(t.encode()).hexdigest()[:8] for t in tokens]
    return {p for p in glob.glob("/dev/shm/*") + glob.glob("/tmp/*") if any(j in p for j in jobs)}


@pytest.mark.parametrize("fault", ["wrong_token", "missing"])
def test_failed_init_names_the_absent_rank_and_leaves_nothing(fault):
    port = free_port()
    before = _leftovers("a" * 64, "b" * 64)
    base = dict(os.environ, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                RINGLET_TOKEN="a" * 64,   # (long enough for the wrong token to knock first)
                RINGLET_TIMEOUT="8")
    ranks = [0, 1] if fault == "missing" else [0, 1, 2]
    procs = {r: subprocess.Popen([sys.executable, "-c", _BY_HAND], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 env=dict(base, RANK=str(r),
                                          RINGLET_TOKEN="b" * 64 if r == 2 else "a" * 64))
             for r in ranks}
    out = {r: p.communicate(timeout=60)[0] for r, p in procs.items()}
    assert all(p.returncode == 3 for p in procs.values()), out
    for r in (0, 1):
        assert "rank(s) [2] of 3 did not join" in out[r], out[r]
        if fault == "wrong_token":
            assert "failed to authenticate" in out[r] and "RINGLET_TOKEN" in out[r], out[r]
        else:
            assert "never started" in out[r], out[r]
    if fault == "wrong_token":
        assert "AuthenticationError" in out[2] and "RINGLET_TOKEN" in out[2], out[2]
    assert _leftovers("a" * 64, "b" * 64) <= before


# -- ringlet run: signals reach every rank, ranks die with the launcher ---------------------
_WAITS = ("import os, signal, sys, time, ringlet as rl\n"
          "rl.init()\n"
          "if rl.get_rank() == 1 and 'stubborn' in sys.argv:\n"
          "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "open(os.path.join(sys.argv[1], str(rl.get_rank())), 'w').write(str(os.getpid()))\n"
          "while True:\n"
          "    time.sleep(0.05)\n")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True


TOKEN = "c0ffee" * 10 + "beef"   # the launcher uses an exported token: its files are known


def _launch(tmp_path, source, n, *args, opts=()):
    script = tmp_path / "job.py"
    script.write_text(source)
    return subprocess.Popen([sys.executable, "-m", "ringlet.cli", "run", "-n", str(n), *opts,
                             str(script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, RINGLET_TOKEN=TOKEN))


def _pids(tmp_path, n, launcher):
    """Every rank's pid, once each has written its file (in one call, but a file may be
    seen empty for a moment after it appears)."""
    deadline = time.monotonic() + 60
    while True:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "ranks did not start"
        files = [tmp_path / "pids" / str(r) for r in range(n)]
        texts = [f.read_text() if f.exists() else "" for f in files]
        if all(t.strip().isdigit() for t in texts):
            return [int(t) for t in texts]
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_ringlet_run_reaches_every_rank(tmp_path, sig):
    (tmp_path / "pids").mkdir()
    before = _leftovers(TOKEN)
    launcher = _launch(tmp_path, _WAITS, 3, str(tmp_path / "pids"), "stubborn",
                       opts=("--grace", "1"))
    pids = _pids(tmp_path, 3, launcher)
    launcher.send_signal(sig)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + sig, err
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
    assert f"got {signal.Signals(sig).name}" in err, err
    if sig == signal.SIGTERM:   # rank 1 ignores it: killed after the grace period
        assert "killed rank(s) [1]" in err, err
    assert _leftovers(TOKEN) <= before


def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    (tmp_path / "pids").mkdir()
    before = _leftovers(TOKEN)
    launcher = _launch(tmp_path, _WAITS, 3, str(tmp_path / "pids"))
    pids = _pids(tmp_path, 3, launcher)
    launcher.kill()
    launcher.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if not _gone(p)]
        time.sleep(0.05)
    assert _leftovers(TOKEN) <= before


def test_ringlet_run_tags_output_and_sums_up_the_failure(tmp_path):
    source = ("import os, signal, sys, numpy as np, ringlet as rl\n"
              "rl.init()\n"
              "print('hello', sys.argv[1:])\n"
              "x = np.ones(10)\n"
              "rl.all_reduce(x)\n"
              "if rl.get_rank() == 2:\n"
              "    raise ValueError('bad batch')\n"
              "rl.all_reduce(x, timeout=30)\n")
    proc = _launch(tmp_path, source, 3, "--lr", "1")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert sorted(out.splitlines()) == [f"[{r}] hello ['--lr', '1']" for r in range(3)], out
    assert "[2] ValueError: bad batch" in err, err
    summary = err[err.index("ringlet run: rank 2 failed first"):].splitlines()
    assert summary[0] == "ringlet run: rank 2 failed first: ValueError: bad batch", err
    assert len(summary) == 3 and all(
        s.startswith(f"ringlet run:   then rank {r}: PeerFailure: rank {r}: all_reduce #2 of "
                     f"group world") and "rank 2 failed" in s
        for r, s in zip((0, 1), summary[1:])), summary
    untagged = _launch(tmp_path, source, 3, "x", opts=("--no-tag-output",))
    out, err = untagged.communicate(timeout=60)
    assert out.count("hello") == out.count("['x']") == 3 and "[0]" not in out + err, out   # (may interleave)
    assert "ringlet run: rank 2 failed first: ValueError: bad batch" in err


def test_ringlet_run_rejects_a_bad_backend_before_any_rank_starts(tmp_path):
    proc = _launch(tmp_path, "open('started', 'w')\n", 2, opts=("--backend", "nccl"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'nccl'" in err, err
    assert not os.path.exists("started")
    assert "SCRIPT [ARGS ...]" in subprocess.run(
        [sys.executable, "-m", "ringlet.cli", "run", "--help"], capture_output=True,
        text=True).stdout


@pytest.mark.parametrize("value", ["abc", "-1", "inf"])
def test_a_bad_ringlet_timeout_is_named(tmp_path, value):
    script = tmp_path / "job.py"
    script.write_text("import ringlet as rl\nrl.init()\n")
    p = subprocess.run([sys.executable, "-m", "ringlet.cli", "run", "-n", "2", str(script)],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, RINGLET_TOKEN=TOKEN, RINGLET_TIMEOUT=value))
    assert p.returncode != 0
    assert f"RINGLET_TIMEOUT='{value}': must be a positive, finite number" in p.stderr, p.stderr


# -- init inside rl.spawn ---------------------------------------------------------------
def _inits_itself(rank):
    world = rl.init()                    # as a function written for torch's mp.spawn would
    assert world.rank == rank and world.size == 3
    assert rl.init(backend=None, rank=rank, world_size=3) is world
    x = np.full(4, float(rank))
    rl.all_reduce(x)
    assert list(x) == [3.0] * 4
    with pytest.raises(rl.RingletError, match="rl.spawn already initialised this rank as rank"):
        rl.init(world_size=5)
    rl.destroy()


def test_init_inside_spawn_returns_the_spawned_world():
    run(_inits_itself, 3)


# -- a mismatch seen only by receivers reaches a rank that finished the call -----------------
def _root_went_on(rank):
    x = np.full(1, 5, np.float64 if rank == 2 else np.int64)   # same bytes, another dtype
    with pytest.raises(rl.CollectiveMismatch):
        rl.broadcast(x, 0, timeout=10)     # the root only sends: it may finish this call...
        rl.all_reduce(np.ones(3), timeout=10)   # ... and must fail in its next, not time out


def test_a_root_that_finished_a_mismatched_call_fails_in_its_next():
    run(_root_went_on, 3)


def test_ringlet_run_keep_going_lets_the_others_finish(tmp_path):
    source = ("import sys, time, ringlet as rl\n"
              "rl.init()\n"
              "if rl.get_rank() == 1:\n"
              "    raise SystemExit(4)\n"
              "time.sleep(2)\n"
              "print('finished')\n")
    proc = _launch(tmp_path, source, 3, opts=("--grace", "0.5", "--keep-going"))
    out, err = proc.communicate(timeout=60)
    # (the first failure's exit status, as mpirun passes it on)
    assert proc.returncode == 4 and sorted(out.splitlines()) == ["[0] finished", "[2] finished"], \
        (out, err)
    assert "rank 1 was lost: SystemExit: 4" in err and "failed first" not in err, err
    assert "the other ranks (0, 2) kept going and exited normally" in err, err


def test_ringlet_run_keep_going_when_no_rank_kept_going_says_so(tmp_path):
    """Every rank failing under --keep-going ended with "the other ranks () kept going and
    exited normally"."""
    proc = _launch(tmp_path, "import ringlet as rl\nrl.init()\nraise SystemExit(3)\n", 2,
                   opts=("--grace", "0.5", "--keep-going"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "no rank kept going" in err and "()" not in err, err


def test_ringlet_run_points_at_a_hung_rank_the_others_timed_out_on(tmp_path):
    """A rank hung outside ringlet: the summary led with a rank that timed out waiting on
    a neighbour, and named the hung one last, "still running". It now says where to look."""
    source = ("import time, numpy as np, ringlet as rl\nrl.init(timeout=2)\n"
              "x = np.ones(4)\nrl.all_reduce(x)\n"
              "if rl.get_rank() == 2:\n    time.sleep(60)\nrl.all_reduce(x)\n")
    proc = _launch(tmp_path, source, 3, opts=("--grace", "1"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "rank(s) [2] did not report to the ranks that timed out" \
        in err, err


def test_ringlet_run_refuses_a_grace_that_is_not_a_number(tmp_path):
    """--grace nan passed the check (nan < 0 is false) and the survivors of a failure were
    never stopped."""
    proc = _launch(tmp_path, "print('ran')\n", 2, opts=("--grace", "nan"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--grace must be a number" in err and "ran" not in out, err


@pytest.mark.parametrize("opts, says", [
    (("--master-port", "99999"), "--master-port must be a TCP port"),
    (("--master-port", "-5"), "--master-port must be a TCP port"),
    (("--master-addr", "nosuchhost.invalid", "--master-port", "29556"),
     "cannot start the job's store at --master-addr nosuchhost.invalid"),
    (("--master-port", "TAKEN"), "Address already in use"),
])
def test_ringlet_run_says_why_its_store_cannot_start(tmp_path, opts, says):
    """These had ended in tracebacks (OverflowError, socket.gaierror, OSError)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    opts = tuple(str(taken.getsockname()[1]) if o == "TAKEN" else o for o in opts)
    try:
        proc = _launch(tmp_path, "print('ran')\n", 2, opts=opts)
        out, err = proc.communicate(timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 2 and says in err and "Traceback" not in err \
        and "ran" not in out, err


def test_spawn_timeout_says_the_job_ran_out_of_time_and_stops_at_it():
    """spawn(timeout=3) failed "killed by SIGALRM" (nothing sent one) 5 s of grace late."""
    start = time.monotonic()
    with pytest.raises(rl.ProcessFailed, match=r"still running when the job's timeout \(2 s\) "
                                               r"ran out, outside any ringlet call"):
        rl.spawn(_sleeps, 2, timeout=2)
    assert time.monotonic() - start < 5.5


def _sleeps(rank):
    time.sleep(60)


def _one_sleeps(rank):
    if rank == 1:
        time.sleep(60)
    rl.barrier()


def test_spawn_timeout_blames_the_rank_the_others_waited_for():
    """Rank 1 sleeps while ranks 0 and 2 wait for it in a barrier: the timeout blamed rank
    0 (the lowest still running), naming neither the sleeper nor the barrier."""
    with pytest.raises(rl.ProcessFailed) as info:
        rl.spawn(_one_sleeps, 3, timeout=6)
    msg = str(info.value)
    assert info.value.rank == 1 and "outside any ringlet call" in msg, msg
    assert "rank 0: barrier #1 of group world" in msg and "rank 2: barrier #1" in msg, msg


def test_only_a_fresh_state_of_the_latest_world_says_a_rank_waits():
    from ringlet.launch import _waiting_at
    state = lambda what, at: json.dumps({"waiting": what, "at": at}).encode()   # noqa: E731
    kv = {b"g0/state/0": state("rank 0: barrier #1", 100.0),     # a shrunk-away world's
          b"g1/state/0": state("rank 0: all_reduce #7", 99.5),
          b"g0/state/1": state("rank 1: broadcast #2", 90.0),    # long ago: since moved on
          b"g0/state/2": state("rank 2: barrier #1", 100.0)}
    assert _waiting_at(kv, [0, 1], 100.5) == {0: "rank 0: all_reduce #7"}
    assert _waiting_at({b"g0/state/0": b"not json", b"g0/state/1": b"[1]", b"g0/x/1": b"1"},
                       [0, 1], 100.0) == {}


def test_a_rank_in_destroy_or_in_init_waits_inside_ringlet():
    """A rank that returned and waits in destroy() for a sleeping one publishes no state:
    the timeout had blamed it as "outside any ringlet call"."""
    from ringlet.launch import _out_of_time, _waiting_at
    kv = {b"g0/joined/job/0": b"1", b"g0/joined/job/1": b"1", b"g0/left/0": b"1"}
    waiting = _waiting_at(kv, [0, 1], 100.0)
    assert list(waiting) == [0] and "destroy()" in waiting[0]
    rank, why = _out_of_time(waiting, [0, 1], 4.0)
    assert rank == 1 and "outside any ringlet call" in why and "rank 0: destroy()" in why
    # rank 2 never joined: the others wait for it in init()
    waiting = _waiting_at({b"g0/joined/j/0": b"1", b"g0/joined/j/1": b"1"}, [0, 1, 2], 100.0)
    assert sorted(waiting) == [0, 1] and "waiting for rank(s) [2] to join" in waiting[1]
    assert _out_of_time(waiting, [0, 1, 2], 4.0)[0] == 2


def _recv_from_a_rank_that_dies(rank, path):
    if rank == 1:
        os._exit(3)
    with pytest.raises(rl.PeerFailure, match=r"rank 0: recv from rank 1 \(tag 5, world\): "
                                             r"rank 1 failed"):
        rl.recv(np.empty(4), 1, tag=5, timeout=30)
    open(path, "w").close()


def test_a_peer_failure_in_a_receive_names_the_receive(tmp_path):
    """It read "PeerFailure: rank 1 failed: process N exited", where a collective's names
    its call."""
    path = str(tmp_path / "named")
    with pytest.raises(rl.ProcessFailed) as info:
        run(_recv_from_a_rank_that_dies, 2, path)
    assert info.value.rank == 1 and os.path.exists(path)


def test_ringlet_run_blames_a_rank_that_left_while_the_others_needed_it(tmp_path):
    """A rank exiting normally (status 0) in the middle of the others' calls: the summary
    names it, not the first of the ranks that failed for want of it."""
    source = ("import sys, numpy as np, ringlet as rl\n"
              "rl.init()\n"
              "if rl.get_rank() == 1:\n"
              "    sys.exit(0)\n"
              "rl.all_reduce(np.ones(4), timeout=30)\n")
    proc = _launch(tmp_path, source, 3)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    summary = err[err.index("ringlet run: rank 1 left first"):].splitlines()
    assert summary[0].startswith("ringlet run: rank 1 left first: exited normally (status 0) "
                                 "while the other ranks still needed it"), err
    assert all(line.startswith(f"ringlet run:   then rank {r}: PeerFailure: rank {r}: "
                               f"all_reduce #1 of group world") and "rank 1 failed" in line
               for r, line in zip((0, 2), summary[1:])), summary


def _returns_early(rank):
    if rank != 1:
        rl.all_reduce(np.ones(4), timeout=30)


def test_spawn_blames_a_rank_that_returned_while_the_others_needed_it():
    with pytest.raises(rl.ProcessFailed, match="rank 1 failed: exited normally") as info:
        rl.spawn(_returns_early, 3, timeout=60)
    assert info.value.rank == 1


# -- a call with a dead member fails even while it waits on a live one ----------------------
def _doomed(rank, path):
    rl.barrier()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:                      # busy outside ringlet until rank 2 has its answer
        deadline = time.monotonic() + 30
        while not os.path.exists(path + ".2") and time.monotonic() < deadline:
            time.sleep(0.01)
        open(path + ".1", "w").write("entered")
    with pytest.raises(rl.PeerFailure) as info:
        rl.barrier(timeout=20)         # rank 2 waits on rank 1 first, on rank 0 later
    assert info.value.rank == 0, info.value
    if rank == 2:
        assert not os.path.exists(path + ".1")
        open(path + ".2", "w").write("failed")


def test_a_call_with_a_dead_member_fails_while_waiting_on_a_live_one(tmp_path):
    with pytest.raises(rl.ProcessFailed) as info:
        run(_doomed, 4, str(tmp_path / "doomed"))
    assert info.value.rank == 0
    assert os.path.exists(tmp_path / "doomed.2")


def test_ringlet_run_piped_into_head_does_not_block_its_ranks(tmp_path):
    source = ("import ringlet as rl\n"
              "rl.init()\n"
              "for i in range(20000):\n"
              "    print('line', i)\n"
              "rl.barrier()\n")
    proc = _launch(tmp_path, source, 2)
    first = proc.stdout.readline()
    proc.stdout.close()                       # as `| head -1` does
    assert first.endswith("line 0\n")
    assert proc.wait(timeout=60) == 0


# -- a call refused because a member died says so, not "mismatched" -------------------------
def _refused_after_a_death(rank, path):
    rl.barrier()
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    x = np.ones(4)
    with pytest.raises(rl.PeerFailure) as info:
        rl.reduce(x, 0, algorithm="direct", timeout=20)   # ranks 1 and 2 only send: they finish
        w = rl.irecv(np.zeros(1), 0, tag=99)   # drive progress: the root's news of rank 3 arrive,
        end = time.monotonic() + (0.8 if rank == 2 else 0.3)   # then rank 1's refusal of the next
        while time.monotonic() < end:
            w.is_completed()
        rl.all_reduce(x, timeout=20)
    assert info.value.rank == 3, info.value
    open(f"{path}.{rank}", "w").write("ok")


def test_a_call_refused_after_a_death_names_the_dead_rank(tmp_path):
    path = str(tmp_path / "refused")
    with pytest.raises(rl.ProcessFailed) as info:
        run(_refused_after_a_death, 4, path)
    assert info.value.rank == 3
    assert all(os.path.exists(f"{path}.{r}") for r in range(3))


def _splits_on_one_rank(rank):
    p = rl.get_world_size()
    x, y = np.ones(2 * p), np.zeros(2 * p)
    with pytest.raises(rl.CollectiveMismatch, match="in_splits/out_splits on some ranks only"):
        if rank == 0:
            rl.all_to_all_single(y, x, [2] * p, [2] * p, timeout=20)
        else:
            rl.all_to_all_single(y, x, timeout=20)
    # Rank 0 took two numbers (the table's, the exchange's), the others one: their next call
    # fails, naming why - it had read "rank 0 gave up on it (its timeout ran out)", in 10 ms
    # of a 20 s timeout - and the one after pairs.
    z = np.full(3, rank + 1.0)
    if rank != 0:
        with pytest.raises(rl.RingletError, match="rank 0 abandoned it: .*uneven all_to_all"):
            rl.all_reduce(z, timeout=20)
    rl.all_reduce(z, timeout=20)
    assert (z == p * (p + 1) / 2).all()


def test_splits_given_on_some_ranks_only_are_named_as_such():
    # (the error spoke of an all_gather and an all_to_all: calls the user never made)
    run(_splits_on_one_rank, 2)
