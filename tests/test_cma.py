"""Cross-memory attach (transport/cma.py): a large message from a plain NumPy buffer is read
by its local receiver with process_vm_readv - whole where the sender receives too, and where
it sends one-way the sender writes the head into the receive buffer (process_vm_writev)
while the receiver reads the tail - or, where ranks outnumber cores, the receiver reads it
whole too. Every collective against NumPy with plain and rl.empty
buffers, odd sizes and dtypes, p = 2..4, and point-to-point; and the fallbacks when the
kernel refuses the read, the write or both (a seccomp filter, as in some containers), which
must stream what is missing through the ring instead and give the same result."""
import ctypes
import errno
import os
import platform
import struct

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import ringlet as rl
from ringlet import algorithms
from ringlet.bench import paged_empty
from ringlet.runtime import engine
from ringlet.transport import cma
from ringlet.transport.shm import ShmPeer
from conftest import run
from test_collectives import in_rank_settings, make_input, reference

RING = 64 << 10          # a small ring: exchanged messages above 64 KiB take the CMA path
# (and one-way messages split even where ranks outnumber cores, as they do at p = 3-4 here)
# Every distance between buffers read by CMA, as the counts of reads below assume: the
# probe of slow distances (cma.fast_offset) is timed, so it is tested on its own below.
ANY = {"RINGLET_CMA_OFFSETS": "0"}
SMALL_RING = {"RINGLET_SHM_RING": str(RING), "RINGLET_CMA_PUT": "1", **ANY}
OPS = ("broadcast", "all_gather", "all_to_all", "all_reduce", "reduce_scatter", "reduce",
       "gather", "scatter")
DTYPES = [np.int8, np.uint16, np.int32, np.int64, np.float32, np.float64, np.complex128]


def _reads() -> int:
    return sum(p.cma.reads for p in engine().peers.values() if isinstance(p, ShmPeer))


def _puts() -> int:
    return sum(p.cma.puts for p in engine().peers.values() if isinstance(p, ShmPeer))


def _call(rank, p, op, count, dtype, seed, alloc, algo="auto"):
    """Run ``op`` on buffers from ``alloc`` and check it against NumPy."""
    red = "SUM"
    root = seed % p
    ins = [make_input(seed, r, (p, count), dtype, red) for r in range(p)]

    def buf(a):
        b = alloc(a.shape, a.dtype)
        b[...] = a
        return b

    if op == "all_reduce":
        x = buf(ins[rank][0])
        rl.all_reduce(x, algorithm=algo)
        np.testing.assert_array_equal(x, reference(red, [a[0] for a in ins]))
    elif op == "reduce":
        x = buf(ins[rank][0])
        rl.reduce(x, root, algorithm=algo)
        want = reference(red, [a[0] for a in ins]) if rank == root else ins[rank][0]
        np.testing.assert_array_equal(x, want)
    elif op == "broadcast":
        x = buf(ins[rank][0])
        rl.broadcast(x, root, algorithm=algo)
        np.testing.assert_array_equal(x, ins[root][0])
    elif op == "all_gather":
        out = buf(np.zeros((p, count), dtype))
        rl.all_gather(out, buf(ins[rank][0]), algorithm=algo)
        np.testing.assert_array_equal(out, np.stack([a[0] for a in ins]))
    elif op == "reduce_scatter":
        out = buf(np.zeros(count, dtype))
        rl.reduce_scatter(out, buf(ins[rank]), algorithm=algo)
        np.testing.assert_array_equal(out, reference(red, ins)[rank])
    elif op == "all_to_all":
        out = buf(np.zeros((p, count), dtype))
        rl.all_to_all(out, buf(ins[rank]), algorithm=algo)
        np.testing.assert_array_equal(out, np.stack([ins[r][rank] for r in range(p)]))
    elif op == "gather":
        out = buf(np.zeros((p, count), dtype)) if rank == root else None
        rl.gather(buf(ins[rank][0]), out, root, algorithm=algo)
        if rank == root:
            np.testing.assert_array_equal(out, np.stack([a[0] for a in ins]))
    elif op == "scatter":
        out = buf(np.zeros(count, dtype))
        rl.scatter(out, buf(ins[root]) if rank == root else None, root, algorithm=algo)
        np.testing.assert_array_equal(out, ins[root][rank])


def _property(rank, examples, split=True):
    """``split``: one-way messages are split (forced by RINGLET_CMA_PUT=1); else, crowded,
    each receiver reads them whole."""
    p = rl.get_world_size()
    before, puts = _reads(), _puts()
    into_roots = [0]     # a gather's root is written whole, crowded or not (work.EARLY_ROOT)

    @in_rank_settings(examples)
    @given(op=st.sampled_from(OPS), dtype=st.sampled_from(DTYPES),
           nbytes=st.integers(RING // 2, 6 * RING), seed=st.integers(0, 2 ** 31),
           shared=st.booleans(), algo=st.sampled_from(["auto", "auto", "ring", "direct"]))
    def check(op, dtype, nbytes, seed, shared, algo):
        # (complex arrays move but do not reduce: ringlet refuses to, before any byte moves)
        assume(not (np.dtype(dtype).kind == "c" and op in ("all_reduce", "reduce",
                                                          "reduce_scatter")))
        count = max(nbytes // np.dtype(dtype).itemsize, 1) | 1      # odd element counts
        if algo not in algorithms.CATALOG[op]:
            algo = "auto"
        was = _puts()
        _call(rank, p, op, count, np.dtype(dtype), seed, rl.empty if shared else np.empty, algo)
        if op == "gather":
            into_roots[0] += _puts() - was

    check()
    for op in ("all_to_all", "all_gather"):     # exchanges: these offer their address
        _call(rank, p, op, 3 * RING + 5, np.dtype(np.uint8), 3, np.empty)
    for op in ("broadcast", "scatter"):          # one-way: the sender writes the head
        _call(rank, p, op, 3 * RING + 5, np.dtype(np.uint8), 3, np.empty)
    rl.barrier()
    got = np.array([_reads() - before, _puts() - puts - into_roots[0]], np.int64)
    rl.all_reduce(got)
    assert got[0] > 0, "no message took the cross-memory path"
    if split:
        assert got[1] > 0, "no one-way message was split between sender and receiver"
    elif engine().crowded:
        assert got[1] == 0, "a crowded one-way message was split, not read whole"


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_collective_reads_plain_buffers_in_place(p):
    run(_property, p, 40 if p < 4 else 25, env=SMALL_RING)


@pytest.mark.parametrize("p", [3, 4])
def test_crowded_one_way_messages_are_read_whole(p):
    """The default where ranks outnumber cores (p = 3-4 on this 2-core host): one-way
    messages are read whole by their receivers, every collective as NumPy says."""
    run(_property, p, 30 if p < 4 else 20, False, env={"RINGLET_SHM_RING": str(RING), **ANY})


def _large(rank):
    """At the default ring: 8 MiB calls move 4 MiB (p = 2) messages by CMA."""
    p = rl.get_world_size()
    before = _reads()
    n = (8 << 20) // 4 + 3
    for op in ("all_gather", "all_to_all", "broadcast", "reduce_scatter"):
        _call(rank, p, op, n // p, np.dtype(np.float32), 7, np.empty)
    assert _reads() > before


def test_large_messages_at_the_default_ring():
    run(_large, 2, env={"RINGLET_CMA_PUT": "1", **ANY})


def _crowded(rank, whole):
    """By default a one-way message is split where each rank has a core, and read whole by
    its receiver where ranks outnumber cores (there the split lost; ``whole`` false,
    RINGLET_CMA_CROWDED=0: it streams, as before)."""
    p = rl.get_world_size()
    before, puts = _reads(), _puts()
    _call(rank, p, "broadcast", 3 * RING + 5, np.dtype(np.uint8), 0, np.empty)
    _call(rank, p, "scatter", 3 * RING + 5, np.dtype(np.uint8), 0, np.empty)
    got = np.array([_reads() - before, _puts() - puts], np.int64)
    rl.all_reduce(got)
    assert (got[1] == 0) == engine().crowded
    if engine().crowded:
        assert (got[0] > 0) == whole
    # a direct gather's root posts its receives before it copies its own block, and each
    # sender that offers its block writes it whole into the root meanwhile (work.EARLY_ROOT),
    # crowded or not - an offer that comes after the copy is split where each rank has a
    # core (the root reads its tail); where a crowded sender offers nothing (whole false)
    # it streams
    before, puts = _reads(), _puts()
    _call(rank, p, "gather", 3 * RING + 5, np.dtype(np.uint8), 0, np.empty, "direct")
    got = np.array([_reads() - before, _puts() - puts], np.int64)
    rl.all_reduce(got)
    crowded = engine().crowded
    assert got[1] == (p - 1 if whole or not crowded else 0), got
    assert got[0] <= (0 if crowded else p - 1), got


@pytest.mark.parametrize("p,whole", [(2, True), (3, True), (3, False), (4, True)])
def test_split_only_where_ranks_have_cores(p, whole):
    run(_crowded, p, whole,
        env={"RINGLET_SHM_RING": str(RING), "RINGLET_CMA_CROWDED": str(int(whole)), **ANY})


def _crowded_exchange(rank, crowded):
    """An all_to_all, p = 3, of plain blocks a little larger than one EAGER packet and
    smaller than the peers' ``cma_min``, set here to the ring's size (as it was built on
    the AMD VMs; now it is one EAGER packet, limits.py): where ranks outnumber cores
    (``crowded``, forced on every rank) each block is read whole by CMA
    (protocol.CROWDED_EXCHANGE_CMA), with the flag cleared or a core per rank it streams
    through the ring; the model prices it the same way (simulate._read_in_place). Every
    element is where NumPy puts it."""
    from ringlet.cost.simulate import _read_in_place
    from ringlet.transport import limits, protocol
    engine().crowded = crowded
    cma_min = limits.RING_BYTES
    for q in engine().peers.values():
        if q.cma_min >= 0:
            q.cma_min = cma_min
    p = rl.get_world_size()
    count = (limits.SHM_EAGER_BYTES + 4096) // 4
    assert count * 4 <= cma_min
    got = []
    for flag in (True, False):
        protocol.CROWDED_EXCHANGE_CMA = flag
        before = _reads()
        _call(rank, p, "all_to_all", count, np.dtype(np.float32), 1, paged_empty, "direct")
        reads = np.array([_reads() - before], np.int64)
        rl.all_reduce(reads)
        got.append(int(reads[0]))
    protocol.CROWDED_EXCHANGE_CMA = True
    assert got == ([p * (p - 1), 0] if crowded else [0, 0]), got
    src, dst = np.nonzero(~np.eye(p, dtype=bool))
    nb = np.full(len(src), count * 4)
    _, by_cma = _read_in_place(nb, np.zeros(len(src), np.int64), (), -1, cma_min,
                               src, dst, np.zeros(len(src), bool), None, crowded, None,
                               limits.SHM_EAGER_BYTES)
    assert by_cma.all() == crowded and by_cma.any() == crowded


def test_crowded_exchange_reads_blocks_past_one_eager_packet_by_cma():
    run(_crowded_exchange, 3, True, env=ANY)
    run(_crowded_exchange, 3, False, env=ANY)


def _gather_written_whole(rank, early):
    """A gather's root (work.EARLY_ROOT) posts its receives first: each sender writes its
    whole block into the root's output while the root copies its own, for every
    algorithm, root and p, crowded or not. With the order off (``early`` false) the root
    copies its own block first and takes the stream, as before. From rl.empty buffers each
    message is split between its ends (split.py): the sender copies while the root copies
    its own block, the root then what is left. Every element is where NumPy puts it."""
    from ringlet import work
    work.EARLY_ROOT = early
    p = rl.get_world_size()
    peers = [q for q in engine().peers.values() if isinstance(q, ShmPeer)]
    for seed in range(p):
        was = sum(q.split_receiver.splits for q in peers)
        _call(rank, p, "gather", (2 << 20) + 3, np.dtype(np.float32), seed, rl.empty, "direct")
        splits = np.array([sum(q.split_receiver.splits for q in peers) - was], np.int64)
        rl.all_reduce(splits)
        assert splits[0] == p - 1, (seed, splits)
    for algo in ("direct", "binomial", "dissemination"):
        for seed in range(p):                     # (the root: seed % p)
            before, puts = _reads(), _puts()
            _call(rank, p, "gather", (2 << 20) + 3, np.dtype(np.float32), seed, paged_empty,
                  algo)
            got = np.array([_reads() - before, _puts() - puts], np.int64)
            rl.all_reduce(got)
            if early and algo == "direct":        # (the trees forward blocks onward too)
                # every block written by its sender: whole, or (an offer that came after
                # the root's copy, where each rank has a core) split, the root reading the tail
                assert got[1] == p - 1, (algo, seed, got)
                assert got[0] <= (0 if engine().crowded else p - 1), (algo, seed, got)
            elif early:     # (a later round's receive, with no copy of its own: as ever)
                assert got[1] > 0, (algo, seed, got)
            else:
                assert got[1] == 0, (algo, seed, got)


@pytest.mark.parametrize("p,early", [(2, True), (3, True), (4, True), (2, False), (3, False)])
def test_a_gathers_root_is_written_whole_while_it_copies(p, early):
    run(_gather_written_whole, p, early, env=ANY)


def _gather_no_put(rank):
    p = rl.get_world_size()
    _call(rank, p, "gather", (2 << 20) + 3, np.dtype(np.float32), 1, paged_empty, "direct")
    assert _puts() == 0


def test_a_gathers_root_streams_where_writes_are_off():
    """RINGLET_CMA_PUT=0: the root posted first asks for the stream, not a write."""
    run(_gather_no_put, 3, env={"RINGLET_CMA_PUT": "0", **ANY})


def _p2p(rank, examples):
    """Point-to-point sends are one-way: split, and every byte lands, whatever the size,
    dtype, alignment of the views and whether the receive was posted first."""
    other = 1 - rank

    @in_rank_settings(examples)
    @given(nbytes=st.integers(RING + 1, 6 * RING), dtype=st.sampled_from(DTYPES),
           skip=st.integers(0, 3), late=st.booleans(), seed=st.integers(0, 2 ** 31))
    def check(nbytes, dtype, skip, late, seed):
        count = max(nbytes // np.dtype(dtype).itemsize, 1)
        want = make_input(seed, 0, (count + skip,), np.dtype(dtype), "SUM")[skip:]
        if rank == 0:
            src = np.empty(count + skip, dtype)[skip:]     # (an unaligned view too)
            src[...] = want
            rl.send(src, other)
        else:
            dst = np.zeros(count + skip, dtype)[skip:]
            if late:                # the RTS is waiting when the receive is posted
                import time
                time.sleep(0.002)
            rl.recv(dst, other)
            np.testing.assert_array_equal(dst, want)

    before = _puts()
    check()
    if rank == 0:
        assert _puts() > before


def test_point_to_point_one_way_is_split():
    run(_p2p, 2, 30, env=SMALL_RING)


# -- the fallback: the kernel refuses the read --------------------------------------------
# audit arch, process_vm_readv's number (process_vm_writev's is the next)
_SYSCALL = {"x86_64": (0xC000003E, 310), "aarch64": (0xC00000B7, 270)}


def _forbid(read: bool, write: bool) -> None:
    """Install a seccomp filter on this process that fails process_vm_readv (``read``)
    and/or process_vm_writev (``write``) with EPERM (what a container's default profile
    does), everything else allowed."""
    arch, nr = _SYSCALL[platform.machine()]
    ld, jeq, ret = 0x20, 0x15, 0x06          # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EPERM
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, allow),   # another arch: allow
            (ld, 0, 0, 0)]
    for n in [nr] * read + [nr + 1] * write:
        prog += [(jeq, 0, 1, n), (ret, 0, 0, deny)]
    prog.append((ret, 0, 0, allow))
    raw = b"".join(struct.pack("<HBBI", *i) for i in prog)
    buf = ctypes.create_string_buffer(raw)

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0                # PR_SET_NO_NEW_PRIVS
    fprog = Prog(len(prog), ctypes.addressof(buf))
    assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER


def _refused(rank, read, write, split=True):
    p = rl.get_world_size()
    if rank == 1:
        _forbid(read, write)
        probe = np.zeros(4, np.uint8)
        if read:
            assert cma.read(1, 0, probe) == -errno.EPERM      # the filter is on
        if write:
            assert cma.write(1, 0, probe) == -errno.EPERM
    for seed, op in enumerate(OPS * 2):
        for dtype in (np.float64, np.int16):
            _call(rank, p, op, (3 * RING) // np.dtype(dtype).itemsize + 1, np.dtype(dtype),
                  seed, np.empty)
    peers = {r: q for r, q in engine().peers.items() if isinstance(q, ShmPeer)}
    if rank == 1:
        assert all(q.cma.ok != read for q in peers.values())
        assert all(q.cma.put_ok != write for q in peers.values())
        if read:
            assert all(q.cma.refused == errno.EPERM and q.cma.reads == 0 for q in peers.values())
        if write:
            assert all(q.cma.put_refused == errno.EPERM and q.cma.puts == 0
                       for q in peers.values())
    else:       # the others still read and write in place (each other, and rank 1's)
        assert all(q.cma.ok and q.cma.put_ok for q in peers.values())
        assert sum(q.cma.reads for q in peers.values()) > 0
        if split:
            assert sum(q.cma.puts for q in peers.values()) > 0
        if read and not write and split:   # rank 1 cannot read: heads became whole messages
            assert peers[1].cma.puts > 0


@pytest.mark.skipif(platform.machine() not in _SYSCALL, reason="seccomp filter for x86_64/aarch64")
@pytest.mark.parametrize("read,write", [(True, False), (False, True), (True, True)],
                         ids=["read", "write", "both"])
def test_a_refused_read_or_write_streams_through_the_ring_instead(read, write):
    run(_refused, 3, read, write, env=SMALL_RING)


@pytest.mark.skipif(platform.machine() not in _SYSCALL, reason="seccomp filter for x86_64/aarch64")
def test_a_refused_whole_read_of_a_crowded_one_way_message_streams_instead():
    """Crowded (p = 3 on 2 cores), one-way messages are read whole: those to the rank that
    cannot read stream through the ring, the rest are still read."""
    run(_refused, 3, True, False, False, env={"RINGLET_SHM_RING": str(RING), **ANY})


def _off(rank):
    _call(rank, rl.get_world_size(), "all_gather", 3 * RING, np.dtype(np.uint8), 1, np.empty)
    assert _reads() == 0


def test_cma_off_by_environment():
    run(_off, 2, env=dict(SMALL_RING, RINGLET_CMA="0"))


def _no_split(rank):
    _call(rank, rl.get_world_size(), "broadcast", 3 * RING, np.dtype(np.uint8), 1, np.empty)
    assert _puts() == 0


def test_split_off_by_environment():
    run(_no_split, 2, env=dict(SMALL_RING, RINGLET_CMA_PUT="0"))


# -- slow distances: the kernel's copy at a destination just past the source in its page ----
def test_a_slow_distance_is_counted_modulo_the_page():
    saved = cma._slow
    try:
        cma._slow = {16}
        a = 1 << 30
        assert not cma.fast_offset(a + 16, a)
        assert not cma.fast_offset(a + 5 * 4096 + 16, a)
        assert cma.fast_offset(a + 48, a) and cma.fast_offset(a, a + 16)   # (4080 bytes)
    finally:
        cma._slow = saved


def test_the_probe_names_only_distances_it_probed():
    slow = cma._probe_distances(16 << 10, reps=3)   # (a few ms: the best of 3 reads)
    near = set(range(cma.PROBED)) | set(range(4096 - cma.PROBED, 4096))
    assert slow <= near and len(slow) < len(near) // 2


def _carved(shape_send, shape_recv, shift):
    """Two float32 arrays 64 bytes into their pages, the receive one ``shift`` further."""
    return paged_empty(shape_send, np.float32), paged_empty(shape_recv, np.float32, 64 + shift)


def _slow_counts():
    return sum(q.cma.slow_offsets for q in engine().peers.values() if isinstance(q, ShmPeer))


def _at_a_slow_distance(rank):
    """Messages whose receive buffer lies at a distance the probe called slow take the ring
    (exchange: read declined; one-way: the offer declined) and arrive whole; at a fast
    distance the same calls read in place."""
    p = rl.get_world_size()
    n = (3 << 20) // 4       # messages of 3 MiB (above the default ring: by CMA), whole pages
    for slow, want_reads in (({16}, False), (set(), True)):
        cma._slow = slow
        before, declined = _reads(), _slow_counts()
        x, y = _carved((n,), (p, n), 16)
        x[:] = rank + 1
        rl.all_gather(y, x)
        np.testing.assert_array_equal(y, np.repeat(np.arange(1, p + 1, dtype=np.float32), n)
                                      .reshape(p, n))
        b, c = _carved((n,), (n,), 16)
        b[:] = 7 if rank == 0 else 0
        rl.broadcast(b if rank == 0 else c, 0)
        if rank:
            np.testing.assert_array_equal(c, np.full(n, 7, np.float32))
        got = np.array([_reads() - before, _slow_counts() - declined], np.int64)
        rl.all_reduce(got)
        assert (got[0] > 0) == want_reads and (got[1] > 0) == (not want_reads), (slow, got)


def test_a_message_at_a_slow_distance_takes_the_ring():
    run(_at_a_slow_distance, 2, env={"RINGLET_CMA_PUT": "1"})


def _exchange_calls(rank, p, n, turns, late=None):
    """all_gather and all_to_all of ``n`` float32 per block from plain buffers, ``turns``
    times each, checked; rank ``late(turn)`` (if any) comes 0.3 s after the others."""
    import time
    for turn in range(turns):
        x = np.full(n, rank + turn, np.float32)
        y = np.empty((p, n), np.float32)
        a = np.repeat(np.arange(p, dtype=np.float32)[:, None] * 10 + rank + turn, n, axis=1)
        b = np.empty((p, n), np.float32)
        rl.barrier()
        if late is not None and late(turn) == rank:
            time.sleep(0.3)
        rl.all_gather(y, x)
        rl.barrier()
        rl.all_to_all(b, a)
        np.testing.assert_array_equal(y, np.repeat(np.arange(p, dtype=np.float32)[:, None]
                                                   + turn, n, axis=1))
        np.testing.assert_array_equal(b, np.repeat(np.arange(p, dtype=np.float32)[:, None]
                                                   + 10 * rank + turn, n, axis=1))


def _counts():
    """(bytes the C fast path received, messages the Python engine received, CMA reads)."""
    peers = [q for q in engine().peers.values() if isinstance(q, ShmPeer)]
    return (sum(int(q.fast_counts[3]) for q in peers), sum(q.msgs_recv for q in peers),
            sum(q.cma.reads for q in peers))


def _exchange_in_c(rank):
    p = rl.get_world_size()
    n = (3 << 20) // 4                      # 3 MiB blocks: past CMA_MIN, read by CMA
    _exchange_calls(rank, p, n, 1)          # (prepared, the slow distances probed)
    for attempt in range(5):
        c0, py0, r0 = _counts()
        _exchange_calls(rank, p, n, 3)
        c1, py1, r1 = _counts()
        # every block read by CMA; some (ranks in step after a barrier: most) in C - a
        # call C gives up on while a peer is away past its budget (the host stalled the
        # peer) goes on in the engine, so a stalled spell is measured again
        assert r1 - r0 == 3 * 2 * (p - 1), (r1 - r0, c1 - c0, py1 - py0)
        in_c = np.array([c1 - c0 >= (p - 1) * 4 * n], np.int64)
        rl.all_reduce(in_c, op=rl.ReduceOp.MIN)
        if in_c[0]:
            return
    raise AssertionError(f"no block read in C in 5 tries: {(c1 - c0, py1 - py0)}")


@pytest.mark.parametrize("p", [2, 3])
def test_an_exchanges_plain_messages_are_read_by_cma_in_the_c_fast_path(p):
    """all_gather and all_to_all past one EAGER packet from plain buffers run whole in C
    (the engine's setup cost 110-190 us of a p = 2 8 MiB call): each block read once by
    process_vm_readv, none through the Python engine."""
    run(_exchange_in_c, p, env=ANY)


def _handed_over(rank):
    from ringlet.work import CollectiveWork
    adopted = []
    adopt = CollectiveWork._adopt_sends

    def counting(self, rnd, pending):
        adopted.append(len(pending))
        return adopt(self, rnd, pending)

    CollectiveWork._adopt_sends = counting
    p = rl.get_world_size()
    _exchange_calls(rank, p, (3 << 20) // 4, 2 * p, late=lambda turn: turn % p)
    # a rank that sends to the late one wrote its RTS, copied, waited past C's budget and
    # handed its send, still unanswered, to the engine: each rank did so in the 2 turns
    # it sent to the late one (at least: a ring's rank sends to one neighbour)
    assert len(adopted) >= 2 and all(k >= 1 for k in adopted), adopted


@pytest.mark.parametrize("p", [2, 3])
def test_a_send_c_leaves_unanswered_is_handed_to_the_engine(p):
    """A rank that comes 0.3 s late: the others' C fast path wrote the RTS of its CMA
    message, gave up waiting within its budget and handed the send over (FastRun.pending);
    the engine waits for the answer, and every result is right."""
    run(_handed_over, p, env=ANY)


def _c_meets_python(rank):
    if rank == 1:
        engine().fast = False               # this rank's calls all run in the Python engine
    p = rl.get_world_size()
    _exchange_calls(rank, p, (3 << 20) // 4, 3)
    c, py, reads = _counts()
    assert reads > 0 and (py > 0 if rank == 1 else c > 0), (c, py, reads)


def test_cma_messages_of_c_and_of_the_engine_meet():
    """One rank in C, the other in the Python engine: the same packets (RTS_CMA, CTS_DONE)
    each way, the same results."""
    run(_c_meets_python, 2, env=ANY)


def _reduced_streams(rank):
    """A message its receiver reduces is not offered by CMA (that receive declines the
    read: its DATA would follow only after the round trip): up to the ring's size it
    streams at once, as it did before plain messages past one EAGER packet went by CMA;
    the all_gather half of the same ring all_reduce, which copies, still does. Every
    element is NumPy's."""
    from ringlet.transport import limits, protocol
    seen = []
    real = protocol.Peer.post_send

    def spy(self, req):
        real(self, req)
        seen.append((req.nbytes, req.reduced, bool(req.cma), req.stream))
    protocol.Peer.post_send = spy
    try:
        n = 2 * (limits.SHM_EAGER_BYTES + 256 * 1024) // 4     # halves of 768 KiB
        x = np.arange(n, dtype=np.float32) + rank
        rl.all_reduce(x, algorithm="ring")
        np.testing.assert_array_equal(x, 2 * np.arange(n, dtype=np.float32) + 1)
        y = np.zeros(n // 2, np.float32)
        rl.reduce_scatter(y, np.full(n, rank + 1.0, np.float32), algorithm="ring")
        assert (y == 3).all()
    finally:
        protocol.Peer.post_send = real
    big = [s for s in seen if s[0] > limits.SHM_EAGER_BYTES]
    assert (n * 2, True, False, True) in big and (n * 2, False, True, False) in big, big
    assert all(not c for _, reduced, c, _ in big if reduced), big


def test_a_message_its_receiver_reduces_streams_instead_of_an_offer_by_cma():
    run(_reduced_streams, 2, env=ANY)
