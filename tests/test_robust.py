"""Never silently wrong, never left running (issue 20): destroy, the launcher, failed
inits, spawn inside spawn."""
import glob
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

import ringlet as rl
from conftest import run


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


def _leftovers():
    return set(glob.glob("/dev/shm/ringlet-*")) | set(glob.glob("/tmp/ringlet-*"))


@pytest.mark.parametrize("fault", ["wrong_token", "missing"])
def test_failed_init_names_the_absent_rank_and_leaves_nothing(fault):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = _leftovers()
    base = dict(os.environ, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                RINGLET_TOKEN="a" * 64, RINGLET_TIMEOUT="4")
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
    assert _leftovers() <= before
