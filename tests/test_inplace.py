"""rl.empty messages read in place only where that measured faster (transport/limits.py):
above ZERO_COPY_MIN in a round whose sender receives too, above ZERO_COPY_ONEWAY_MIN from a
sender that only sends, above ZERO_COPY_P2P_MIN from a point-to-point send; below, and in
a call auto runs on the plain path, exactly as a NumPy buffer's message. Large sends go before a round's local steps (work._independent). Every
changed path against NumPy: both buffer kinds, odd sizes, dtypes, p = 2..4."""
import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import ringlet as rl
from ringlet import algorithms, collectives
from ringlet.runtime import engine
from ringlet.transport import limits
from ringlet.transport.shm import ShmPeer
from conftest import run
from test_cma import _call
from test_collectives import in_rank_settings

KiB = 1 << 10


def _maps() -> int:
    return len(engine().remote_maps.maps)


def _thresholds(rank):
    peer = engine().peers[1 - rank]
    assert isinstance(peer, ShmPeer)
    assert peer.zc_min == limits.ZERO_COPY_MIN
    assert peer.zc_oneway_min == limits.ZERO_COPY_ONEWAY_MIN
    assert peer.p2p_zc_min == limits.ZERO_COPY_P2P_MIN
    read = [0]                  # messages this rank read in place (a view of a peer's buffer)
    real = engine().remote_maps.view

    def counted(*a, **kw):
        read[0] += 1
        return real(*a, **kw)
    engine().remote_maps.view = counted
    # point-to-point, at its limit: the plain path (nothing mapped), the same bytes; and a
    # blocking send of it completes before its receiver asks (both send, then receive)
    n = limits.ZERO_COPY_P2P_MIN
    x = rl.empty(n, np.uint8)
    x[...] = 7 + rank
    y = rl.empty(n, np.uint8)
    rl.send(x, 1 - rank, timeout=20)
    rl.recv(y, 1 - rank, timeout=20)
    assert read[0] == 0, "a point-to-point message at ZERO_COPY_P2P_MIN was read in place"
    assert (y == 8 - rank).all()
    # ... and a plain one up to the ring's size (p2p_cma_min): through the ring, not by CMA
    a = np.full(1 << 20, 3 + rank, np.uint8)
    b = np.zeros_like(a)
    rl.send(a, 1 - rank, timeout=20)
    rl.recv(b, 1 - rank, timeout=20)
    assert (b == 4 - rank).all() and peer.cma.reads == 0

    # a collective's one-way message (broadcast, direct) at its limit: the plain path too
    def one_way(m):
        b = rl.empty(m, np.uint8)
        b[...] = 5 if rank == 0 else 0
        rl.broadcast(b, 0, algorithm="direct")
        assert (b == 5).all()
    one_way(limits.ZERO_COPY_ONEWAY_MIN)
    assert read[0] == 0, "a one-way message at ZERO_COPY_ONEWAY_MIN was read in place"

    def exchange(m):     # (all_to_all: both send and receive)
        y = rl.empty((2, m), np.uint8)
        x2 = rl.empty((2, m), np.uint8)
        x2[...] = np.array([[10 * rank], [10 * rank + 1]], np.uint8)
        rl.all_to_all(y, x2, algorithm="pairwise")
        assert (y == np.array([[rank], [10 + rank]], np.uint8)).all()
    exchange(limits.ZERO_COPY_MIN)       # at the exchange limit: the plain path
    assert read[0] == 0, "an exchanged message at ZERO_COPY_MIN was read in place"
    exchange(limits.ZERO_COPY_MIN + 64 * KiB)
    # above it one copy: read in place by the engine, or by CMA in C (fast.run says why)
    one_copy = read[0] + peer.cma.reads
    assert one_copy == 1, "an exchanged message above ZERO_COPY_MIN was copied twice"
    # above their limits, read in place: a one-way message, then a point-to-point one
    for m, send in ((limits.ZERO_COPY_ONEWAY_MIN + 64 * KiB, one_way),
                    (limits.ZERO_COPY_P2P_MIN + 64 * KiB, None)):
        before = read[0]
        if send is not None:
            send(m)
        else:
            big = rl.empty(m, np.uint8)
            big[...] = 9 if rank == 0 else 0
            rl.send(big, 1) if rank == 0 else rl.recv(big, 0)
            assert (big == 9).all()
        assert read[0] == before + (rank == 1), f"a {m} B one-way message was not read in place"


def test_one_way_and_exchanged_messages_read_in_place_above_their_limits():
    run(_thresholds, 2)


def _freed_buffers(rank):
    import gc
    n = 2 * limits.ZERO_COPY_P2P_MIN
    for i in range(12):                 # a fresh buffer a step, as `grad = rl.zeros(...)`
        x = rl.empty(n, np.uint8)
        x[...] = i if rank == 0 else 0
        rl.send(x, 1) if rank == 0 else rl.recv(x, 0)
        assert (x == i).all()
        del x
        gc.collect()
        rl.barrier()
    if rank == 1:   # the receiver read each in place, and holds no freed one's pages
        assert _maps() == 1, f"{_maps()} mappings of rank 0's buffers, 11 of them freed"


def test_a_peers_freed_buffers_are_unmapped():
    """Each mapping of a peer's rl.empty buffer kept its pages alive after the peer freed
    it, until 256 were cached: 16 MiB buffers sent one a step pinned 32 MiB of the host's
    memory a step (4.8 GiB after 150 steps)."""
    run(_freed_buffers, 2)


def test_cost_model_prices_the_same_limits():
    """The cost model reads a message of a one-way round in place only above the one-way
    limit, in an exchange above ZERO_COPY_MIN (limits.facts -> HostModel)."""
    from ringlet.cost.host import HostModel
    from ringlet.cost.simulate import _read_in_place
    from ringlet.schedule import BUFFER_NAMES
    m = HostModel.from_params({"alpha": 1e-6, "beta": 1e-11, **limits.facts(True)["shm"]})
    assert m.zero_copy_oneway_min == limits.ZERO_COPY_ONEWAY_MIN
    buf = BUFFER_NAMES.index("buf")
    nb = np.array([limits.ZERO_COPY_ONEWAY_MIN, limits.ZERO_COPY_ONEWAY_MIN + 1,
                   limits.ZERO_COPY_MIN, limits.ZERO_COPY_MIN + 1], float)
    src, dst = np.array([0, 0, 0, 1]), np.array([1, 1, 1, 0])
    one_way = _read_in_place(nb[:2], np.full(2, buf), [buf], m.zero_copy_min, -1, src[:2],
                             dst[:2], None, m.zero_copy_oneway_min)[0]
    assert one_way.tolist() == [False, True]
    swap = _read_in_place(nb[2:], np.full(2, buf), [buf], m.zero_copy_min, -1, src[2:],
                          dst[2:], None, m.zero_copy_oneway_min)[0]
    assert swap.tolist() == [False, True]


def _plain_path(rank):
    """auto: when the plain path is predicted faster than any pick read in place, an
    rl.empty call runs it - nothing is read in place, and a rank with NumPy buffers agrees
    with it (same fingerprint)."""
    from ringlet import cost
    real = cost.choose

    def choose(*a, shared=(), **kw):   # in place priced 10x dearer: plain wins
        name, rows = real(*a, shared=shared, **kw)
        if shared:
            rows = [r._replace(total=r.total * 10) for r in rows]
        return name, rows

    cost.choose = choose
    try:
        n = (4 << 20) // 4 + 1
        alloc = rl.empty if rank == 0 else np.empty        # one rank each kind
        x = alloc(n, np.float32)
        x[...] = np.arange(n, dtype=np.float32) + rank
        y = alloc((2, n), np.float32)
        rl.all_gather(y, x)
        np.testing.assert_array_equal(y, np.stack([np.arange(n, dtype=np.float32) + r
                                                   for r in range(2)]))
        if rank == 0:
            key = next(k for k in collectives._CALLS if k[0] == "all_gather" and k[-1])
            assert collectives._CALLS[key].in_place is False
    finally:
        cost.choose = real
    got = np.array([_maps()], np.int64)
    rl.all_reduce(got)
    assert got[0] == 0, "a call auto ran on the plain path read a message in place"


def test_auto_takes_the_plain_path_when_it_is_predicted_faster():
    run(_plain_path, 2)


ONE_WAY_OPS = ("broadcast", "scatter", "gather", "all_gather", "all_to_all", "reduce")


def _property(rank, examples):
    p = rl.get_world_size()

    @in_rank_settings(examples)
    @given(op=st.sampled_from(ONE_WAY_OPS),
           dtype=st.sampled_from([np.uint8, np.int16, np.int32, np.float32, np.float64]),
           nbytes=st.integers(400 * KiB, 1300 * KiB), seed=st.integers(0, 2 ** 31),
           shared=st.booleans(),
           algo=st.sampled_from(["auto", "direct", "ring", "recursive_doubling", "pairwise",
                                 "binomial"]))
    def check(op, dtype, nbytes, seed, shared, algo):
        count = max(nbytes // np.dtype(dtype).itemsize, 1) | 1      # odd element counts
        if algo not in algorithms.CATALOG[op]:
            algo = "auto"
        _call(rank, p, op, count, np.dtype(dtype), seed, rl.empty if shared else np.empty, algo)

    check()
    # in-place all_gather: "in" is a block of "out" (a send that overlaps a local step's
    # destination waits for it)
    for algo in ("ring", "recursive_doubling", "direct", "bruck"):
        n = (700 * KiB) // 4 + 1
        out = rl.empty((p, n), np.float32)
        out[rank] = np.arange(n) * (rank + 1)
        rl.all_gather(out, out[rank], algorithm=algo)
        np.testing.assert_array_equal(out, np.stack([np.arange(n, dtype=np.float32) * (r + 1)
                                                     for r in range(p)]))


def test_changed_paths_against_numpy_p2():
    run(_property, 2, 30)


def test_changed_paths_against_numpy_p3():
    run(_property, 3, 15)


def test_changed_paths_against_numpy_p4():
    run(_property, 4, 12)


# -- a one-way message copied by both ends (transport/split.py) ----------------------------
def test_split_copy_claims_every_chunk_once():
    """Two threads (the C call releases the GIL) copy one message from both ends: every
    chunk once, and a call naming another message copies nothing."""
    import threading
    from ringlet.transport import fast, split
    from ringlet.transport.fast import _fastpath
    n = 37 * split.CHUNK + 12345
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    ctrl = np.zeros(2, np.uint64)
    chunks = -(-n // split.CHUNK)
    ctrl[0] = split.claim_word(70001, chunks)
    addr = lambda a: a.__array_interface__["data"][0]   # noqa: E731
    got = {}

    def side(front):
        got[front] = _fastpath.split_copy(addr(dst), addr(src), n, split.CHUNK, addr(ctrl),
                                          front, 70001, -1)
    ts = [threading.Thread(target=side, args=(f,)) for f in (True, False)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert got[True] + got[False] == chunks == int(ctrl[1])
    np.testing.assert_array_equal(dst, src)
    ctrl[0], ctrl[1] = split.claim_word(5, 3), 0
    assert _fastpath.split_copy(addr(dst), addr(src), n, split.CHUNK, addr(ctrl), False, 6,
                                -1) == 0
    assert int(ctrl[1]) == 0
    # a reduction: dst = dst + src, float32, chunks from both ends
    a = np.random.default_rng(1).standard_normal(n // 4 * 4 // 4).astype(np.float32)
    b = np.random.default_rng(2).standard_normal(a.size).astype(np.float32)
    want = a + b
    ctrl[0], ctrl[1] = split.claim_word(9, -(-a.nbytes // split.CHUNK)), 0
    k = fast.kernel(np.add, a.dtype)
    done = sum(_fastpath.split_copy(addr(a), addr(b), a.nbytes, split.CHUNK, addr(ctrl), f, 9, k)
               for f in (True, False))
    assert done == int(ctrl[1]) == -(-a.nbytes // split.CHUNK)
    np.testing.assert_array_equal(a, want)


def _split_job(rank, slow_receiver):
    """Broadcast from rl.empty buffers, p = 2: the receiver splits every message over
    MIN_BYTES, and every reduction from REDUCE_MIN_BYTES; with ``slow_receiver`` it starts
    its own copy late, so the sender (waiting for CTS_DONE) must have copied chunks - and
    the result is right either way, odd sizes and dtypes included."""
    from ringlet.transport import split
    peer = engine().peers[1 - rank]
    if slow_receiver and rank == 1:
        import time
        real = split.fast._fastpath

        class Late:
            def split_copy(self, *a):
                time.sleep(0.05)
                return real.split_copy(*a)
        split.fast._fastpath = Late()
    try:
        # (dissemination's rounds receive empty signals: its sends are one-way all the same)
        for algorithm, (dtype, count) in itertools.product(
                ("direct", "dissemination"),
                ((np.float32, (8 << 20) // 4 + 3), (np.uint8, (1 << 20) + 4097),
                 (np.float64, 3 * split.CHUNK // 8 * 5 + 1))):
            x = rl.empty(count, dtype)
            want = (np.arange(count) % 251).astype(dtype)
            x[...] = want if rank == 0 else 0
            rl.broadcast(x, 0, algorithm=algorithm)
            np.testing.assert_array_equal(x, want)
        # a reduction: the root's buffer gets op(root's, leaf's), the sender's chunks too;
        # split from REDUCE_MIN_BYTES (the last, smaller, one: the receiver reduces alone)
        least = split.REDUCE_MIN_BYTES
        for dtype, op, count, algorithm in (
                (np.float32, "SUM", least // 4 + 7, "binomial"),
                (np.int16, "MAX", least // 2 + 3, "binomial"),
                (np.float64, "PROD", least // 8 + 1, "binomial"),
                (np.float32, "SUM", least // 4 + 7, "dissemination"),
                (np.float32, "SUM", least // 8, "binomial")):
            mine = ((np.arange(count) * (rank + 3)) % 7 + 1).astype(dtype)
            x = rl.empty(count, dtype)
            x[...] = mine
            rl.reduce(x, 0, op=op, algorithm=algorithm)
            if rank == 0:
                other = ((np.arange(count) * 4) % 7 + 1).astype(dtype)
                f = {"SUM": np.add, "MAX": np.maximum, "PROD": np.multiply}[op]
                np.testing.assert_array_equal(x, f(mine, other))
    finally:
        if slow_receiver and rank == 1:
            split.fast._fastpath = real
    counts = np.array([peer.split_receiver.splits, peer.split_sender.helped], np.int64)
    rl.all_reduce(counts)
    assert counts[0] == 10, "the receiver did not split the one-way messages"
    if slow_receiver:
        assert counts[1] > 0, "the sender copied no chunk of a split message"


def test_one_way_messages_are_copied_by_both_ends():
    run(_split_job, 2, False)


def test_sender_copies_while_the_receiver_is_late():
    run(_split_job, 2, True)


def _no_split_into_plain(rank):
    """A receive into a plain NumPy buffer is not split (the sender cannot map it); one
    with RINGLET_SPLIT=0 neither; both give the right bytes."""
    n = (2 << 20) + 5
    x = rl.empty(n, np.uint8) if rank == 0 else np.zeros(n, np.uint8)
    x[...] = 3 if rank == 0 else 0
    rl.broadcast(x, 0, algorithm="direct")
    assert (x == 3).all()
    peer = engine().peers[1 - rank]
    assert peer.split_receiver is None or peer.split_receiver.splits == 0


def test_no_split_into_a_plain_buffer_or_when_off():
    run(_no_split_into_plain, 2)
    run(_no_split_into_plain, 2, env={"RINGLET_SPLIT": "0"})


def _busy_sender_split(rank, crowded):
    """A scatter's root, from rl.empty into rl.empty, p = 3: it has other copies in its
    round, so where ranks outnumber cores (``crowded``, forced on every rank) it offers no
    help with a block under SPLIT_BUSY_MIN (protocol.CROWDED_BUSY_HELP), and from it on it
    does; with a core per rank it helps with both. Every block lands where NumPy puts it."""
    from ringlet.transport import split
    engine().crowded = crowded
    p = rl.get_world_size()
    peers = [q for q in engine().peers.values() if isinstance(q, ShmPeer)]
    got = []
    for block in (limits.SPLIT_MIN + 4096, limits.SPLIT_BUSY_MIN + 4):
        count = block // 4
        assert split.MIN_BYTES <= count * 4 and limits.ZERO_COPY_ONEWAY_MIN < count * 4
        x = rl.empty((p, count), np.float32) if rank == 0 else None
        if rank == 0:
            x[...] = np.arange(p * count, dtype=np.float32).reshape(p, count) % 1009
        y = rl.empty(count, np.float32)
        was = sum(q.split_receiver.splits for q in peers)
        rl.scatter(y, x, 0, algorithm="direct")
        np.testing.assert_array_equal(
            y, np.arange(rank * count, (rank + 1) * count, dtype=np.float32) % 1009)
        splits = np.array([sum(q.split_receiver.splits for q in peers) - was], np.int64)
        rl.all_reduce(splits)
        got.append(int(splits[0]))
    assert got == ([0, p - 1] if crowded else [p - 1, p - 1]), got


def test_a_busy_sender_helps_only_large_blocks_where_ranks_outnumber_cores():
    run(_busy_sender_split, 3, True)
    run(_busy_sender_split, 3, False)


def test_idle_spin_reads_the_runnable_count():
    """A waiter spins past SPIN_FREE only while /proc/loadavg's runnable count is at most
    the cores (engine.IDLE_SPIN): the count parses, and an unreadable file reads as busy."""
    import os
    from ringlet.transport import engine as eng
    fd = os.open("/proc/loadavg", os.O_RDONLY)
    try:
        assert 1 <= eng._runnable(fd) < 1 << 20
    finally:
        os.close(fd)
    assert eng._runnable(-1) == 1 << 30


def _idle_spin(rank):
    """With the cores idle (the runnable count patched to 1), a rank waiting on its large
    message in flight does not sleep before IDLE_SPIN has passed (it would after SPIN_FREE)."""
    import time
    from ringlet.transport import engine as eng_mod
    eng = engine()
    n = 2 << 20
    x = rl.empty(n, np.uint8)
    x[...] = 1 + rank
    if rank == 0:
        eng_mod._runnable = lambda fd: 1
        slept = []
        real = eng._sleep
        rl.barrier()
        eng._sleep = lambda s: (slept.append(time.monotonic()), real(s))
        t0 = time.monotonic()
        rl.send(x, 1)
        del eng._sleep
        assert eng_mod.IDLE_SPIN >= 5e-4
        if slept:
            assert slept[0] - t0 >= 0.9 * eng_mod.IDLE_SPIN, \
                f"slept {1e6 * (slept[0] - t0):.0f} us into the wait, cores idle"
    else:
        rl.barrier()
        t = time.perf_counter()
        while time.perf_counter() - t < 5e-4:    # late by 500 us: past SPIN_FREE
            pass
        rl.recv(x, 0)
        assert (x == 1).all()


def test_waiter_spins_while_the_cores_are_idle():
    run(_idle_spin, 2)
