"""The substrate: process groups, point-to-point over shm and TCP, launch, trust, failure."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from ringlet.launch import free_port

import ringlet as rl
from ringlet.transport.shm import EAGER_BYTES
from ringlet.rendezvous import StoreServer, TCPStore, env_world, handshake_client
from ringlet.errors import AuthenticationError
from ringlet.runtime import engine
from conftest import ringlet_run, run, two_hosts, until_asleep

ALL_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
              np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
              np.dtype("S7"), np.dtype("datetime64[ns]"), np.dtype([("a", "<i4"), ("b", "<f8")])]


def _ring(rank, count):
    p = rl.get_world_size()
    assert rl.get_rank() == rank and rl.is_initialized()
    if p == 1:
        return
    x = np.arange(count, dtype=np.int64) + rank
    y = np.empty(count, np.int64)
    ws, wr = rl.isend(x, (rank + 1) % p), rl.irecv(y, (rank - 1) % p)
    wr.wait()
    ws.wait()
    assert wr.is_completed() and ws.is_completed()
    np.testing.assert_array_equal(y, np.arange(count) + (rank - 1) % p)


@pytest.mark.parametrize("n", range(1, 9))
def test_ring_exchange_every_size(n, backend):
    run(_ring, n, 1000 + n, backend=backend)


def _sizes(rank):
    other = 1 - rank
    for nbytes in (0, 1, 8, 16 << 10, (16 << 10) + 1, EAGER_BYTES, EAGER_BYTES + 1, 1 << 20,
                   256 << 20):
        if rank == 0:
            rl.send(np.full(nbytes, nbytes % 251, np.uint8), other)
        else:
            buf = np.zeros(nbytes, np.uint8)
            assert rl.recv(buf, other) == other
            assert (buf == nbytes % 251).all()


def test_zero_bytes_to_256mib(backend):
    run(_sizes, 2, backend=backend)


def _dtypes(rank):
    rng = np.random.default_rng(0)
    for dt in ALL_DTYPES:
        dt = np.dtype(dt)
        raw = rng.integers(0, 256, size=37 * dt.itemsize, dtype=np.uint8)
        ref = raw.view(dt).reshape(37)
        if rank == 0:
            rl.send(ref, 1)
        else:
            got = np.zeros(37, dt)
            rl.recv(got, 0)
            assert got.tobytes() == ref.tobytes(), dt


def test_every_dtype(backend):
    run(_dtypes, 2, backend=backend)


def _tags(rank):
    # Tag 7 is sent first but received last; per (pair, tag) order holds, small and large mixed.
    sizes = [10, 200_000, 3, 1 << 20, 0, 50_000]
    if rank == 0:
        works = [rl.isend(np.full(s, i, np.int32), 1, tag=7) for i, s in enumerate(sizes)]
        works += [rl.isend(np.full(s, 100 + i, np.int32), 1, tag=9) for i, s in enumerate(sizes)]
        for w in works:
            w.wait()
    else:
        for tag, base in ((9, 100), (7, 0)):
            for i, s in enumerate(sizes):
                buf = np.empty(s, np.int32)
                rl.recv(buf, 0, tag=tag)
                assert (buf == base + i).all(), (tag, i)


def test_tags_and_ordering(backend):
    run(_tags, 2, backend=backend)


def _neighbour(rank, nbytes):
    p = rl.get_world_size()
    out = np.full(nbytes, rank, np.uint8)
    inn = np.empty(nbytes, np.uint8)
    ws = rl.isend(out, (rank + 1) % p)          # everyone sends before anyone receives
    wr = rl.irecv(inn, (rank - 1) % p)
    ws.wait()
    wr.wait()
    assert inn[0] == (rank - 1) % p and inn[-1] == (rank - 1) % p


def test_ring_neighbour_no_deadlock_256mib(backend):
    run(_neighbour, 4 if backend == "auto" else 2, 256 << 20, backend=backend)


def _subgroups(rank):
    # Data-parallel groups {0,2},{1,3} and tensor-parallel groups {0,1},{2,3} on one world.
    dp = [rl.new_group([0, 2]), rl.new_group([1, 3])]
    tp = [rl.new_group([0, 1]), rl.new_group([2, 3])]
    mine_dp, mine_tp = dp[rank % 2], tp[rank // 2]
    assert rl.get_rank(mine_dp) == rank // 2 and rl.get_rank(mine_tp) == rank % 2
    assert dp[1 - rank % 2].rank == -1
    with pytest.raises(ValueError, match="not a member"):
        rl.send(np.zeros(1), 0, group=dp[1 - rank % 2])
    a = np.full(1000, rank, np.int64)
    b = np.full(1000, rank, np.int64)
    ra, rb = np.empty_like(a), np.empty_like(b)
    other_dp, other_tp = 1 - rl.get_rank(mine_dp), 1 - rl.get_rank(mine_tp)
    works = [rl.isend(a, other_dp, group=mine_dp), rl.isend(b, other_tp, group=mine_tp),
             rl.irecv(rb, other_tp, group=mine_tp), rl.irecv(ra, other_dp, group=mine_dp)]
    for w in works:
        w.wait()
    assert (ra == mine_dp.ranks[other_dp]).all() and (rb == mine_tp.ranks[other_tp]).all()
    # Same tag, same pair, different groups: never confused.
    s1, s2 = rl.new_group([0, 1, 2, 3]), rl.new_group([0, 1, 2, 3])
    if rank < 2:
        x1, x2 = np.empty(4, np.int64), np.empty(4, np.int64)
        other = 1 - rank
        w2 = rl.irecv(x2, other, group=s2)
        w1 = rl.irecv(x1, other, group=s1)
        rl.send(np.full(4, 1, np.int64), other, group=s1)
        rl.send(np.full(4, 2, np.int64), other, group=s2)
        w1.wait(), w2.wait()
        assert (x1 == 1).all() and (x2 == 2).all()


def test_overlapping_subgroups():
    run(_subgroups, 4)


def _mixed(rank):
    from ringlet.transport.shm import ShmPeer
    from ringlet.transport.tcp import TcpPeer
    peers = engine().peers
    for r, peer in peers.items():
        same = (r < 2) == (rank < 2)
        assert isinstance(peer, ShmPeer if same else TcpPeer), (rank, r, type(peer))
    _ring(rank, 300_000)


def test_emulated_two_hosts_mixed_transports():
    run(_mixed, 4, env=two_hosts(4))


def _naive_ring_by_hand(rank):
    # Seed 000, Code 4.2.2: a running sum walks the ring, then the total walks back.
    K = rl.get_world_size()
    local = np.random.default_rng(rank).integers(1, 10, size=3)
    rl.reset_stats()
    acc = local.copy()
    if rank > 0:
        rl.recv(acc, rank - 1)
        acc += local
    if rank < K - 1:
        rl.send(acc, rank + 1)
    total = acc
    if rank == K - 1:
        rl.send(total, 0)
    else:
        rl.recv(total, rank - 1 if rank > 0 else K - 1)
        if rank < K - 2:
            rl.send(total, rank + 1)
    ref = sum(np.random.default_rng(r).integers(1, 10, size=3) for r in range(K))
    np.testing.assert_array_equal(total, ref)
    sent = sum(v["messages"] for v in rl.stats()["sent"].values())
    if rank != 0:
        rl.send(np.array([sent], np.int64), 0, tag=5)
    else:
        total_msgs = sent
        for r in range(1, K):
            buf = np.empty(1, np.int64)
            rl.recv(buf, r, tag=5)
            total_msgs += int(buf[0])
        assert total_msgs == 2 * (K - 1), total_msgs


def test_stats_count_the_seed_hand_built_ring():
    run(_naive_ring_by_hand, 4)


# -- bad input --------------------------------------------------------------------------
def _bad_input(rank):
    other = 1 - rank
    with pytest.raises(ValueError, match="out of range"):
        rl.send(np.zeros(2), 5)
    with pytest.raises(ValueError, match="itself"):
        rl.send(np.zeros(2), rank)
    with pytest.raises(ValueError, match="contiguous"):
        rl.recv(np.zeros((4, 4))[:, 1], other)
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        rl.recv(ro, other)
    with pytest.raises(TypeError):
        rl.send([1, 2, 3], other)
    with pytest.raises(TypeError):
        rl.send(np.array([object()]), other)
    # Size mismatch: the receiver names both sizes and writes nothing past its buffer; a
    # large (rendezvous) send learns it too, a small one was already buffered and is done.
    for n in (8, 1 << 20):
        if rank == 0 and n > 8:
            with pytest.raises(ValueError, match=f"{n * 4} bytes"):
                rl.send(np.ones(n, np.float32), 1)
        elif rank == 0:
            rl.send(np.ones(n, np.float32), 1)
        else:
            guard = np.full(2 * n, 7, np.float32)
            with pytest.raises(ValueError, match=rf"{n * 4} bytes.*{n * 2} bytes"):
                rl.recv(guard[:n // 2], 0)
            assert (guard == 7).all()
    rl.barrier()


def _lane(rank):
    """Blocking sends and receives that repeat one C ran (same peer, tag and size) skip the
    full path's checks; they must still check each new buffer, keep tags apart and order,
    and move the right bytes."""
    from ringlet import runtime
    # (a partner late past C's spin budget - a loaded host - sends a call the full way)
    engine().fast_budget = 5.0
    other = 1 - rank
    x = np.zeros(4, np.float32)
    for i in range(3):                       # warm: the full path, then the lane
        if rank == 0:
            rl.send(x + i, 1)
        else:
            rl.recv(x, 0)
    full = []
    checked = runtime._p2p
    runtime._p2p = lambda *a: full.append(a) or checked(*a)
    for i in range(200):                     # a new buffer every call, as a training loop's
        if rank == 0:
            rl.send(np.full(4, i, np.float32), 1)
            y = np.empty(4, np.float32)
            rl.recv(y, 1)
            assert (y == -i).all(), (i, y)
        else:
            y = np.empty(4, np.float32)
            rl.recv(y, 0)
            assert (y == i).all(), (i, y)
            rl.send(-y, 0)
    assert len(full) <= 4, f"{len(full)} of 400 calls took the full path"
    # what the lane must not take: each raises as the full path says, before any byte moves
    wide = np.zeros((4, 2), np.float32)[:, 0]             # 4 float32, not contiguous
    with pytest.raises(ValueError, match="C-contiguous"):
        rl.send(wide, other)
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        rl.recv(frozen, other)
    with pytest.raises(TypeError, match="peer rank must be an int"):
        rl.send(x, float(other))
    with pytest.raises(TypeError, match="object arrays"):
        rl.send(np.empty(2, object), other)                # 16 bytes, as x
    # a message of another tag waiting first is not taken for this one; order within a tag
    if rank == 0:
        rl.send(np.full(4, 7, np.float32), 1, tag=5)
        for i in range(3):
            rl.send(np.full(4, i, np.float32), 1)
    else:
        got = []
        for _ in range(3):
            rl.recv(x, 0)
            got.append(x[0])
        rl.recv(x, 0, tag=5)
        assert got == [0, 1, 2] and (x == 7).all(), (got, x)
    np_peer = np.int64(other)                              # NumPy ints are ranks too
    if rank == 0:
        rl.send(np.full(4, 3, np.float32), np_peer)
    else:
        rl.recv(x, np_peer)
        assert (x == 3).all()
    runtime._p2p = checked


def test_repeated_blocking_calls_take_the_lane_and_still_check_their_buffers():
    run(_lane, 2)


def _group_lanes(rank):
    """Sends and receives on subgroups take lanes too, each group its own: two groups of
    the same two ranks, where group rank 0 is a different world rank, alternate calls of
    one shape and tag (a lane keyed without its group would send to the wrong rank); a
    destroyed group's lanes go with it."""
    from ringlet import runtime
    a, b = rl.new_group([0, 1]), rl.new_group([1, 0])     # b's rank 0 is world rank 1
    full = []
    checked = runtime._p2p
    runtime._p2p = lambda *args: full.append(args) or checked(*args)
    for i in range(50):
        for g in (a, b):
            me = g.rank
            x = np.full(4, 10 * i + me, np.float32)
            if me == 0:
                rl.send(x, 1, group=g)
                rl.recv(x, 1, group=g)
                assert (x == 10 * i + 1).all(), (i, x)
            else:
                y = np.empty(4, np.float32)
                rl.recv(y, 0, group=g)
                assert (y == 10 * i).all(), (i, y)
                rl.send(x, 0, group=g)
    runtime._p2p = checked
    assert len(full) <= 20, f"{len(full)} of 200 calls took the full path"   # (was: all)
    rl.barrier()
    rl.destroy_group(b)
    assert not any(k[-1] is b for k in runtime._S.lane)
    with pytest.raises(ValueError, match="not a live ringlet group"):
        rl.send(np.ones(4, np.float32), 1 - b.rank, group=b)


def test_subgroups_sends_take_lanes_of_their_own():
    run(_group_lanes, 2)


def test_bad_input_rejected_before_any_byte_moves():
    run(_bad_input, 2)


def test_calls_before_init_and_after_destroy():
    assert not rl.is_initialized()
    with pytest.raises(rl.RingletError, match="not initialized"):
        rl.send(np.zeros(1), 0)
    with pytest.raises(rl.RingletError, match="not initialized"):
        rl.all_reduce(np.zeros(1))
    os.environ.pop("RINGLET_TOKEN", None)
    rl.init(init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        assert rl.get_world_size() == 1
    finally:
        rl.destroy()
    with pytest.raises(rl.RingletError, match="not initialized"):
        rl.recv(np.zeros(1), 0)


def test_multi_rank_init_requires_a_token(monkeypatch):
    monkeypatch.delenv("RINGLET_TOKEN", raising=False)
    with pytest.raises(rl.RingletError, match="RINGLET_TOKEN"):
        rl.init(init_method="tcp://127.0.0.1:1", rank=1, world_size=2)


# -- timeouts and failures ----------------------------------------------------------------
def _timeout(rank):
    if rank == 0:
        t = time.monotonic()
        with pytest.raises(rl.TimeoutError) as info:
            rl.recv(np.zeros(4), 1, timeout=1.0)
        assert time.monotonic() - t >= 1.0     # not before its time (how late is load's)
        msg = str(info.value)
        assert "recv" in msg and "rank 0" in msg and "[1]" in msg and "world" in msg, msg
    rl.barrier()


def test_timeout_names_operation_group_rank_and_peer():
    run(_timeout, 2)


def _late_messages(rank, n):
    if rank == 0:
        first = np.full(n, -1.0)
        with pytest.raises(rl.TimeoutError):
            rl.recv(first, 1, tag=5, timeout=0.3)
        rl.send(np.zeros(1), 1, tag=6)           # now send
        got = [np.zeros(n), np.zeros(n)]
        for x in got:
            rl.recv(x, 1, tag=5, timeout=30)
        # each message went to a receive that asked for it, none to the one that gave up
        assert [x[0] for x in got] == [1.0, 2.0] and (first == -1).all(), \
            ([x[0] for x in got], np.unique(first))
    else:
        rl.recv(np.zeros(1), 0, tag=6, timeout=30)
        for v in (1.0, 2.0):
            rl.send(np.full(n, v), 0, tag=5)
    rl.barrier()


@pytest.mark.parametrize("n", [4, 300_000])
def test_a_receive_that_timed_out_takes_no_later_message(n, backend):
    """A blocking receive that times out is withdrawn: the messages sent afterwards reach
    the receives that ask for them, in order, and not the buffer of the one that gave up."""
    run(_late_messages, 2, n, backend=backend)


def _late_send(rank, n):
    half = np.ones(EAGER_BYTES // 8)
    if rank == 0:
        for _ in range(2):                   # fill the shared-memory ring (two EAGER packets)
            rl.send(half, 1, tag=9)
        x = np.ones(n)
        with pytest.raises(rl.TimeoutError):
            rl.send(x, 1, tag=5, timeout=0.3)
        x[:] = 7.0                           # the caller has its buffer back
        rl.send(np.zeros(1), 1, tag=6)
    else:
        time.sleep(1.0)                      # (rank 0's send times out meanwhile)
        for _ in range(2):
            rl.recv(np.zeros_like(half), 0, tag=9)
        rl.recv(np.zeros(1), 0, tag=6)
        got = np.zeros(n)
        rl.recv(got, 0, tag=5, timeout=30)
        assert (got == 1.0).all(), np.unique(got)
    rl.barrier()


def test_a_send_that_timed_out_sends_what_it_was_given(backend):
    """A blocking send that times out stays posted, and its receiver still gets the bytes
    the send was given, not what the caller wrote into its buffer afterwards: what the send
    had yet to move was copied when it gave up. (800 KB: over shared memory it waits behind
    a full ring; over TCP, for its receiver's CTS.)"""
    run(_late_send, 2, 100_000, backend=backend)


def _streamed_after_offer(rank):
    from ringlet.transport import cma
    n = (4 << 20) // 8                          # offered by address (CMA), past 1 MiB
    if rank == 0:
        x = np.ones(n)
        with pytest.raises(rl.TimeoutError):
            rl.send(x, 1, tag=5, timeout=0.3)
        x[:] = 7.0
        rl.recv(np.zeros(1), 1, tag=6, timeout=30)
    else:
        time.sleep(1.0)
        # as where the two buffers lie at a distance the kernel copies slowly across: the
        # receiver asks for the bytes streamed instead of reading them in place
        cma.fast_offset = lambda dst, src: False
        got = np.zeros(n)
        rl.recv(got, 0, tag=5, timeout=30)
        assert (got == 1.0).all(), np.unique(got)
        rl.send(np.zeros(1), 0, tag=6)
    rl.barrier()


def test_a_send_offered_by_address_that_timed_out_streams_what_it_was_given():
    """A large send that offered its address, timed out, and was then asked for its bytes
    streamed (its receiver's buffer at a slow distance, or a receive that reduces) streams
    the copy made when it timed out, not the 7s the caller wrote since."""
    run(_streamed_after_offer, 2)


def _peer_death(rank, path):
    if rank == 1:                   # dies while rank 0 waits for it in recv
        if hasattr(engine().peers[0], "outbox"):
            until_asleep([0])       # (shared memory: its sleep flag says so)
        else:
            time.sleep(0.3)         # (TCP shows no sleep flag)
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.monotonic()
    try:
        rl.recv(np.zeros(1 << 20), 1, timeout=30)
    except rl.PeerFailure as exc:
        with open(path, "w") as f:
            json.dump({"rank": exc.rank, "msg": str(exc), "after": time.monotonic() - t}, f)
        raise


@pytest.mark.parametrize("env", [None, two_hosts(2)], ids=["shm", "tcp"])
def test_peer_death_raises_peer_failure_within_5s(tmp_path, env):
    path = str(tmp_path / "seen.json")
    with pytest.raises(rl.ProcessFailed) as info:
        run(_peer_death, 2, path, env=env)
    assert info.value.rank == 1 and "SIGKILL" in info.value.detail
    seen = json.load(open(path))
    assert seen["rank"] == 1 and "rank 1" in seen["msg"] and seen["after"] < 5.0, seen


def _fails(rank):
    if rank == 2:
        raise RuntimeError("boom on purpose")
    rl.recv(np.zeros(1), 2, timeout=60)   # would wait a minute: the launcher stops us


def test_spawn_names_first_failing_rank():
    t = time.monotonic()
    with pytest.raises(rl.ProcessFailed, match="rank 2 failed: RuntimeError: boom on purpose"):
        run(_fails, 3)
    assert time.monotonic() - t < 20


def test_ringlet_run_tears_down_and_names_failure(tmp_path):
    proc, took = ringlet_run(tmp_path,
                             "import numpy as np, ringlet as rl\n"
                             "rl.init()\n"
                             "if rl.get_rank() == 1:\n"
                             "    raise ValueError('bad shard 17')\n"
                             "rl.recv(np.zeros(1), 1, timeout=120)\n")
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith("ringlet run:")]
    assert lines[0] == "ringlet run: rank 1 failed first: ValueError: bad shard 17", proc.stderr
    # then what the others saw: rank 1's death
    assert sorted(line.split(":")[1] for line in lines[1:]) == ["   then rank 0", "   then rank 2"]
    assert all("PeerFailure: rank " in line and "rank 1 failed" in line
               for line in lines[1:]), proc.stderr
    assert took < 30


def test_ringlet_run_success(tmp_path):
    proc, _ = ringlet_run(tmp_path,
                          "import numpy as np, ringlet as rl, os\n"
                          "rl.init()\n"
                          "x = np.ones(10)\n"
                          "rl.all_reduce(x)\n"
                          "assert x[0] == rl.get_world_size() == int(os.environ['WORLD_SIZE'])\n"
                          "os.write(1, f\"rank {rl.get_rank()} local {os.environ['LOCAL_RANK']} ok\\n\".encode())\n"
                          "rl.destroy()\n")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n"))[-3:] == [f"[{r}] rank {r} local {r} ok" for r in range(3)]
    assert "Warning" not in proc.stderr, proc.stderr   # a clean job prints no warnings


# -- trust --------------------------------------------------------------------------------
def test_store_refuses_wrong_or_missing_token_and_keeps_serving():
    server = StoreServer("127.0.0.1", 0, "right-token")
    try:
        with pytest.raises(AuthenticationError):
            TCPStore("127.0.0.1", server.port, "wrong-token", timeout=5)
        with socket.create_connection(("127.0.0.1", server.port)) as s:   # no token at all
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 200)
            s.settimeout(5)
            while s.recv(4096):
                pass
        good = TCPStore("127.0.0.1", server.port, "right-token", timeout=5)
        good.set("k", b"v")
        assert good.get("k") == b"v" and good.add("n", 2) == 2
        good.close()
        assert server.refused >= 2
    finally:
        server.close()


def test_store_logs_a_flood_of_strangers_in_few_lines(caplog):
    """200 refused connections wrote 200 lines into the job's log."""
    server = StoreServer("127.0.0.1", 0, "right-token")
    try:
        with caplog.at_level("WARNING", logger="ringlet"):
            for _ in range(120):
                with socket.create_connection(("127.0.0.1", server.port)) as s:
                    s.sendall(b"x" * 200)
                    s.settimeout(5)
                    while s.recv(4096):
                        pass
            deadline = time.monotonic() + 10
            while server.refused < 120 and time.monotonic() < deadline:
                time.sleep(0.01)
        lines = [r.getMessage() for r in caplog.records if "refused connection" in r.getMessage()]
        assert server.refused == 120 and len(lines) == 4, lines
        assert "100 refused so far" in lines[-1]
    finally:
        server.close()


def test_a_stranger_dripping_bytes_is_cut_off_at_the_handshakes_deadline(monkeypatch):
    """Each read had its own 10 s timeout: a byte every 8 s held the connection (and the
    store's thread for it) for good - 6000 such strangers, 5862 threads."""
    from ringlet import rendezvous
    monkeypatch.setattr(rendezvous, "HANDSHAKE_SECONDS", 0.5)
    a, b = socket.socketpair()
    import threading
    stop = threading.Event()

    def drip():
        b.recv(64)
        while not stop.is_set():
            try:
                b.sendall(b"R")
            except OSError:
                return
            time.sleep(0.1)
    t = threading.Thread(target=drip, daemon=True)
    t.start()
    start = time.monotonic()
    try:
        with pytest.raises(OSError, match="the handshake took over 0.5 s"):
            rendezvous.handshake_server(a, b"token")
        assert time.monotonic() - start < 2.0
    finally:
        stop.set()
        a.close()
        b.close()


def _intruded(rank, port):
    x = np.full(1000, rank, np.float64)
    rl.all_reduce(x)
    assert (x == sum(range(rl.get_world_size()))).all()


def test_job_runs_while_a_stranger_knocks():
    """A stranger hammering the job's store with wrong tokens is refused; the job completes."""
    import threading
    from ringlet import launch
    stop = threading.Event()
    refused = []
    orig = launch.StoreServer

    class Watched(orig):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            refused.append(self)
            threading.Thread(target=self._knock, daemon=True).start()

        def _knock(self):
            while not stop.is_set():
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                        s.settimeout(2)
                        handshake_client(s, b"not-the-token")
                except (AuthenticationError, OSError, ConnectionError):
                    pass
                time.sleep(0.01)

    launch.StoreServer = Watched
    try:
        run(_intruded, 3, 0)
    finally:
        launch.StoreServer = orig
        stop.set()
    assert refused and refused[0].refused > 0


def test_shm_segments_have_no_name():
    """A rank's rings are an anonymous memfd: no file under /dev/shm to leak, whatever
    happens to the job (issue 20); only a process of the same user opens it, by /proc."""
    from ringlet.transport.shm import create_segment, open_segment
    before = set(os.listdir("/dev/shm"))
    seg, fd = create_segment(4096)
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:ringlet-rings")
        assert set(os.listdir("/dev/shm")) == before
        other = open_segment(os.getpid(), fd, 4096)
        other[:4] = b"ring"
        assert seg[:4] == b"ring"
        other.close()
    finally:
        seg.close()
        os.close(fd)


def test_env_understands_torchrun_openmpi_pmi_slurm():
    assert env_world({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})["rank"] == 3
    ompi = env_world({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                      "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (ompi["rank"], ompi["world_size"], ompi["local_rank"]) == (2, 4, 0)
    pmi = env_world({"PMI_RANK": "5", "PMI_SIZE": "6"})
    assert (pmi["rank"], pmi["world_size"]) == (5, 6)
    slurm = env_world({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
                       "MASTER_ADDR": "node1", "MASTER_PORT": "1234"})
    assert (slurm["rank"], slurm["world_size"], slurm["local_rank"]) == (7, 16, 3)
    assert (slurm["master_addr"], slurm["master_port"]) == ("node1", 1234)


def _torch(rank):
    import torch
    t = torch.full((5,), float(rank))
    if rank == 0:
        rl.send(t, 1)
    else:
        rl.recv(t, 0)
        assert t.tolist() == [0.0] * 5
    t = torch.ones(3)
    rl.all_reduce(t)
    assert t.tolist() == [2.0] * 3


def test_cpu_torch_tensors():
    pytest.importorskip("torch")
    run(_torch, 2)


SCRIPT = (
    "import numpy as np, ringlet as rl, os\n"
    "rl.init()\n"
    "x = np.full(100_000, rl.get_rank() + 1.0)\n"
    "rl.all_reduce(x)\n"
    "p = rl.get_world_size()\n"
    "assert (x == p * (p + 1) / 2).all()\n"
    "os.write(1, f'rank {rl.get_rank()} of {p} ok\\n'.encode())\n"
    "rl.destroy()\n")


def test_ringlet_run_two_nodes(tmp_path):
    """Two launchers as two emulated nodes: TCP between them, shm inside each."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = []
    for node in range(2):
        env = dict(os.environ, RINGLET_TOKEN="two-node-secret", RINGLET_HOST_ID=f"node{node}")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ringlet.cli", "run", "-n", "2", "--nnodes", "2",
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
             str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    lines = sorted(l for out, _ in outs for l in out.splitlines())
    assert lines == [f"[{r}] rank {r} of 4 ok" for r in range(4)], lines


def test_multi_node_needs_a_shared_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RINGLET_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "ringlet.cli", "run", "-n", "1", "--nnodes", "2",
                           "--master-port", "1234", "x.py"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "RINGLET_TOKEN" in proc.stderr


@pytest.mark.skipif(not __import__("shutil").which("mpirun"), reason="Open MPI is not installed")
def test_same_script_runs_under_mpirun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, RINGLET_TOKEN="mpi-secret", MASTER_PORT=str(free_port()))
    proc = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "3",
                           "-x", "RINGLET_TOKEN", "-x", "MASTER_PORT", "-x", "PYTHONPATH",
                           sys.executable, str(script)],
                          env=dict(env, PYTHONPATH=os.path.dirname(os.path.dirname(rl.__file__))),
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(proc.stdout.split("\n"))[-3:] == [f"rank {r} of 3 ok" for r in range(3)]


@pytest.mark.parametrize("nbytes", [10_000, 50_000])   # header and payload: one copy, a gather
def test_a_send_completes_only_when_its_last_byte_reaches_the_kernel(nbytes):
    """A send reported done with bytes still queued in user space needs its sender to keep
    driving progress — a sender that then computes, or waits at destroy's barrier, would
    leave its peer waiting forever (seen as a rare 256 MiB TCP exchange timeout). What the
    kernel did not take waits as views of the caller's buffer: they must arrive intact."""
    from ringlet.transport.protocol import SendRequest
    from ringlet.transport.tcp import TcpPeer

    class Trickle:                      # a socket whose kernel takes 1000 bytes per call
        def __init__(self, sock):
            self.sock = sock

        def send(self, data):
            return self.sock.send(memoryview(data)[:1000])

        def sendmsg(self, parts):
            return self.sock.send(b"".join(bytes(p) for p in parts)[:1000])

        def __getattr__(self, name):
            return getattr(self.sock, name)

    class Engine:
        def __init__(self):
            self.calls = self     # (what it reports about calls: here, peer_failed only)

        def protocol_violation(self, peer, why):
            raise AssertionError(why)

        def peer_failed(self, rank, exc):
            pass

    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    peer = TcpPeer(Engine(), 1, a)
    peer.sock = Trickle(a)
    data = (np.arange(nbytes) % 251).astype(np.uint8)
    req = SendRequest(1, 5, data)   # eager: one packet
    peer.post_send(req)
    assert not req.done, "reported done with most of its bytes still queued"
    while not req.done:
        peer.progress()
    got = b""
    b.settimeout(2)
    while len(got) < 64 + nbytes:
        got += b.recv(65536)
    assert got[64:] == data.tobytes()
    a.close(), b.close()


def _flood(rank, n, nbytes, limit):
    """Rank 0 broadcasts n eager messages as fast as it can; rank 1 dawdles between calls.
    What rank 1 holds unasked-for must stay bounded (by what one poll reads), not grow
    with n: it takes a parked message without polling, so it never reads further ahead."""
    x = np.full(nbytes // 4, rank, np.float32)
    peak = 0
    for i in range(n):
        x[...] = i if rank == 0 else -1
        rl.broadcast(x, src=0)
        assert x[0] == x[-1] == i
        if rank == 1:
            time.sleep(1e-4)
            peak = max(peak, sum(p.unexpected_bytes for p in engine().peers.values()))
    assert peak <= limit, f"rank {rank} parked {peak >> 20} MiB"
    rl.barrier()
    assert sum(p.unexpected_bytes for p in engine().peers.values()) == 0


@pytest.mark.parametrize("env", [None, "streamed", two_hosts(2)], ids=["shm", "shm-streamed", "tcp"])
def test_a_fast_sender_cannot_make_a_slow_receiver_hoard(env):
    from ringlet.transport import shm, tcp
    if env is None:     # at most what the ring holds
        nbytes, limit = shm.EAGER_BYTES, 2 * shm.RING_BYTES
    elif env == "streamed":   # ... and the streamed message it holds the start of
        # (plain buffers past one EAGER packet are read by CMA: streamed with it off)
        nbytes, limit = shm.STREAM_BYTES, 2 * shm.RING_BYTES + shm.STREAM_BYTES
        env = {"RINGLET_CMA": "0"}
    else:               # at most one poll's worth of packets
        nbytes, limit = tcp.EAGER_BYTES, tcp.POLL_BUDGET * (tcp.EAGER_BYTES + 64)
    run(_flood, 2, 1500 if nbytes <= shm.EAGER_BYTES else 300, nbytes, limit, env=env)


def _streamed(rank, tmp):
    """Messages above the eager limit but within STREAM_BYTES go without waiting for CTS.
    The receiver may not have asked yet: it parks what arrives (all of the message, or its
    start while the sender is held up) and hands it over, copied or reduced, when asked;
    a receive of the wrong size fails alone and the link goes on."""
    from ringlet.transport.shm import STREAM_BYTES
    eng, other = engine(), 1 - rank
    peer = eng.peers[eng.rank ^ 1]
    assert peer.stream_max == STREAM_BYTES > EAGER_BYTES
    big = STREAM_BYTES // 4                  # float32 elements: several fragments
    mid = (EAGER_BYTES + 4096) // 4          # just past the eager limit
    payload = {n: np.arange(n, dtype=np.float32) + 7 for n in (big, mid)}
    for n in (mid, big):
        x = payload[n]
        # 1. asked for after all of it arrived: parked whole, then copied
        if rank == 1:
            rl.send(x, other, tag=1)
            rl.send(np.ones(1), other, tag=2)
        else:
            rl.recv(np.empty(1), other, tag=2)   # behind tag 1 in the ring: parks it
            assert peer.unexpected and peer.unexpected_bytes == x.nbytes
            y = np.zeros_like(x)
            rl.recv(y, other, tag=1)
            np.testing.assert_array_equal(y, x)
            assert peer.unexpected_bytes == 0 and not peer.incoming
        rl.barrier()
        # 2. asked for while the sender is held up mid-message (a whole-ring message does
        #    not fit beside its headers): the start is parked, the rest goes straight into
        #    the receive - which reduces it (dst = acc + data). Files say when, so that
        #    neither rank makes progress while the other must not.
        sent, asked = os.path.join(tmp, f"sent{n}"), os.path.join(tmp, f"asked{n}")
        if rank == 1:
            w = rl.isend(x, other, tag=3)        # fills the ring; the rest waits in our queue
            open(sent, "w").close()
            _await_file(asked)                   # (no progress meanwhile)
            w.wait()
            rl.send(np.ones(1), other, tag=4)
        else:
            y = np.zeros(n, np.float32)
            _await_file(sent)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 0.1:   # progress: parks what the ring holds
                eng.progress()
            parked = [item.parked for q in peer.unexpected.values() for item in q]
            if n == big:
                assert len(parked) == 1 and 0 < parked[0].offset < parked[0].nbytes
            acc = np.full(n, 0.5, np.float32)
            req = eng.irecv(other, 3, y, np.add, acc)   # (world group: wire tag = user tag)
            open(asked, "w").close()
            eng.wait(lambda: req.done, 10, lambda limit: "reduce-receive")
            assert req.error is None
            np.testing.assert_array_equal(y, x + 0.5)
            rl.recv(np.empty(1), other, tag=4)
        rl.barrier()
        # 3. the wrong size: that receive fails (parked or posted first), the next arrives
        for late in (True, False):
            if rank == 1:
                rl.send(x, other, tag=5)
                rl.send(x, other, tag=6)
            else:
                if late:
                    t0 = time.monotonic()
                    while time.monotonic() - t0 < 0.1:
                        eng.progress()
                with pytest.raises(ValueError, match="bytes but the receive buffer has"):
                    rl.recv(np.zeros(n + 1, np.float32), other, tag=5)
                y = np.zeros_like(x)
                rl.recv(y, other, tag=6)
                np.testing.assert_array_equal(y, x)
            rl.barrier()
    assert not peer.dead and not peer.incoming and peer.unexpected_bytes == 0


def _await_file(path, limit=30.0):
    t0 = time.monotonic()
    while not os.path.exists(path):
        assert time.monotonic() - t0 < limit, f"{path} never appeared"
        time.sleep(0.001)


def test_streamed_messages_parked_claimed_reduced_and_refused(tmp_path):
    # The sender must be held up mid-message: no background progress moves its isend.
    run(_streamed, 2, str(tmp_path), env={"RINGLET_PROGRESS": "0"})


def _other_tag(rank):
    x = np.ones(4, np.float32)
    if rank == 0:
        rl.send(x, 1, tag=1)
        rl.barrier()
    else:
        with pytest.raises(rl.TimeoutError, match=r"rank 0 has sent messages that no receive "
                                                  r"has taken \(1 on tag 1\)"):
            rl.recv(x, 0, tag=2, timeout=1)
        rl.recv(x, 0, tag=1)
        rl.barrier()


def test_a_receive_that_times_out_names_messages_on_other_tags():
    """A send on tag 1 against a recv on tag 2: the timeout said nothing of the message
    waiting on tag 1."""
    run(_other_tag, 2)


def _recv_timing_out_as_its_message_lands(rank):
    n = (128 << 20) // 4
    if rank == 0:
        time.sleep(0.25)
        rl.send(np.full(n, 7.0, np.float32), 1, timeout=30)
    else:
        a, b = np.zeros(n, np.float32), np.zeros(n, np.float32)
        try:
            rl.recv(a, 0, timeout=0.3)       # the message starts landing about then
            got = a
        except rl.TimeoutError:              # withdrawn before it matched: the next gets it
            rl.recv(b, 0, timeout=20)
            got = b
        assert (got == 7.0).all()
    rl.barrier(timeout=30)


def test_a_recv_that_times_out_as_its_message_lands_loses_nothing():
    """A blocking recv whose message had matched it and was landing raised TimeoutError,
    the message went on into the buffer the caller had back, and the send returned: the
    next recv waited for a message already spent (lost in 3-4 of 8 trials in a review).
    It now waits while the bytes keep coming."""
    for _ in range(3):
        run(_recv_timing_out_as_its_message_lands, 2, backend="tcp")
