"""Large TCP messages moved by helper threads (transport/tcp.py's Threads): a writer and a
reader per peer over a connection of their own, chosen by the receiver (RINGLET_TCP_THREADS,
the smallest message they move). Real ranks on two labelled hosts over loopback, against
NumPy; a peer killed mid-message; no thread left after destroy."""
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import ringlet as rl
from ringlet import algorithms
from ringlet.transport import limits
from ringlet.transport.tcp import TcpPeer
from conftest import ringlet_run, run
from test_collectives import in_rank_settings, matches_numpy

COLLECTIVES = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
               "all_to_all", "gather", "scatter"]
SMALL = limits.TCP_EAGER_BYTES + 1      # every message past the eager limit: threaded


def threads_env(p, thread_min=SMALL, **more):
    return {"RINGLET_HOST_ID_SPLIT": str(p // 2), "RINGLET_TCP_THREADS": str(thread_min),
            "RINGLET_TCP_LANES": "1", **more}


def _tcp_peers():
    from ringlet.runtime import engine
    return [q for q in engine().peers.values() if isinstance(q, TcpPeer)]


def _ringlet_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("ringlet-tcp")]


def _collectives(rank, collective, examples):
    p = rl.get_world_size()
    tcp = _tcp_peers()
    assert tcp and all(q.threads is not None for q in tcp)
    algos = list(algorithms.CATALOG[collective])

    @in_rank_settings(examples)
    @given(algo=st.sampled_from(algos), nbytes=st.integers(SMALL, 9 << 20),
           dtype=st.sampled_from([np.uint8, np.int16, np.float32, np.int64, np.complex128]),
           op=st.sampled_from(["SUM", "MAX"]), root=st.integers(0, p - 1),
           seed=st.integers(0, 2 ** 31))
    @example(algo=algos[0], nbytes=9 << 20, dtype=np.float32, op="SUM", root=0, seed=1)
    def check(algo, nbytes, dtype, op, root, seed):
        matches_numpy(collective, rank, p, algo, nbytes, dtype, op, root, seed)

    check()
    # the test would pass without the threads too: check they moved messages
    moved = np.array([sum(q.threads.moved[i] for q in tcp) for i in (0, 1)], np.int64)
    rl.all_reduce(moved)
    assert moved[0] == moved[1] > 0, f"threads sent/received {moved} messages"


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_threaded_messages_match_numpy(collective):
    run(_collectives, 4, collective, 4, env=threads_env(4), timeout=240)


def _exchange(rank, nbytes, asynchronous):
    peer = 1 - rank
    src = (np.arange(nbytes, dtype=np.int64) * (rank + 3))
    dst = np.zeros(nbytes, np.int64)
    for _ in range(3):        # the same connection, message after message
        w = rl.irecv(dst, peer)
        s = rl.isend(src, peer)
        if asynchronous:       # the progress thread drives it while we sleep
            time.sleep(0.05)
        s.wait()
        w.wait()
        np.testing.assert_array_equal(dst, np.arange(nbytes) * (peer + 3))
        dst[:] = 0
    (q,) = _tcp_peers()
    assert q.threads.moved == [3, 3], q.threads.moved
    assert len(_ringlet_threads()) == 2, _ringlet_threads()


@pytest.mark.parametrize("nbytes", [SMALL + 15, (3 << 20) + 8, 9 << 20])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_point_to_point_over_the_threads(nbytes, asynchronous):
    run(_exchange, 2, nbytes // 8, asynchronous, env=threads_env(2))


def _below_threshold(rank):
    x = np.ones(1 << 18, np.float32)      # 1 MiB messages, under the 2 MiB threshold
    rl.all_reduce(x, algorithm="direct")
    assert (x == 2).all()
    (q,) = _tcp_peers()
    assert q.threads.moved == [0, 0] and not _ringlet_threads(), "threads for a small message"


def test_messages_under_the_threshold_stay_on_the_engine():
    run(_below_threshold, 2, env=threads_env(2, 2 << 20))


def _killed_mid_message(rank, path):
    x = np.ones(256 << 20, np.uint8)    # long enough to be in flight when the sender dies
    if rank == 1:
        w = rl.isend(x, 0)
        rl.barrier()
        tcp, deadline = _tcp_peers()[0], time.monotonic() + 10
        while not tcp.threads.sending:  # until the writer has it (rank 0's CTS asked)
            tcp.engine.progress()
            assert time.monotonic() < deadline and not w.is_completed()
        time.sleep(0.02)                # (it writes meanwhile)
        with open(path + ".killed", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    rl.barrier()
    w = rl.irecv(x, 1)
    try:
        w.wait(timeout=30)
    except rl.PeerFailure as exc:
        with open(f"{path}.{rank}", "w") as f:
            json.dump({"rank": exc.rank, "msg": str(exc), "t": time.time(),
                       "threads": _ringlet_threads()}, f)
        raise


def test_a_peer_killed_mid_threaded_message_fails_the_receive_at_once(tmp_path):
    path = str(tmp_path / "seen")
    with pytest.raises(rl.ProcessFailed) as info:
        run(_killed_mid_message, 2, path, env=threads_env(2, RINGLET_PROGRESS="0"))
    assert info.value.rank == 1 and "SIGKILL" in info.value.detail
    killed = float(open(path + ".killed").read())
    seen = json.load(open(path + ".0"))
    assert seen["rank"] == 1 and "rank 1 failed" in seen["msg"], seen
    assert seen["t"] - killed < 5.0, f"the receive failed {seen['t'] - killed:.2f} s after the kill"


LIFE = """
import os, threading
rank = int(os.environ["RANK"])
os.environ["RINGLET_HOST_ID"] = "hostA" if rank < 2 else "hostB"
os.environ["RINGLET_TCP_THREADS"] = "{mins}".split(",")[rank]
import numpy as np, ringlet as rl
from ringlet.runtime import engine
from ringlet.transport.tcp import TcpPeer
rl.init()
mins = [int(n) for n in "{mins}".split(",")]
socks = []
for r, peer in engine().peers.items():
    if isinstance(peer, TcpPeer):   # a pair has the threads' connection if both ask for it
        assert (peer.threads is not None) == bool(mins[rank] and mins[r]), (rank, r)
        if peer.threads is not None:
            socks.append(peer.threads.sock)
x = np.arange(3 << 20, dtype=np.float32) * (rank + 1)
rl.all_reduce(x, algorithm="direct")      # every pair, both ways
assert np.array_equal(x, np.arange(3 << 20, dtype=np.float32) * 10)
rl.destroy()
left = [t.name for t in threading.enumerate() if t.name.startswith("ringlet-tcp")]
assert not left, left
assert all(s.fileno() == -1 for s in socks)
print("ok", rank)
"""


def test_threads_per_pair_and_none_left_after_destroy(tmp_path):
    proc, _ = ringlet_run(tmp_path, LIFE.replace("{mins}", "0,65537,1048576,65537"), n=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.split("\n"))[-4:] == [f"[{r}] ok {r}" for r in range(4)], proc.stdout


def test_threshold_is_checked():
    from ringlet.transport.tcp import tcp_thread_min
    for bad in ("-1", "4M"):
        os.environ["RINGLET_TCP_THREADS"] = bad
        try:
            with pytest.raises(ValueError, match="RINGLET_TCP_THREADS"):
                tcp_thread_min()
        finally:
            del os.environ["RINGLET_TCP_THREADS"]
    assert tcp_thread_min() == limits.TCP_THREAD_MIN
