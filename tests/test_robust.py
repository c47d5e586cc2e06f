"""Never silently wrong, never left running (issue 20): destroy, the launcher, failed
inits, spawn inside spawn."""
import os
import signal

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
