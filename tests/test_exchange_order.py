"""An exchange round (all_gather's ring, all_to_all) posts its receives before its local
copy and looks for the peers' messages between pieces of that copy (work._local_polling):
the messages (read by CMA from plain buffers, in place from rl.empty ones, streamed when
the kernel refuses the read, or over TCP) must land exactly as NumPy says, at p = 2..4, for odd sizes
and dtypes, and the path must really be taken."""
import platform

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ringlet as rl
from ringlet import work
from conftest import run
from test_cma import DTYPES, _SYSCALL, _call, _forbid
from test_collectives import in_rank_settings

BIG = work.BIG      # the path needs sends above it


def _count_polling():
    """Patch CollectiveWork._local_polling to count its calls, and the calls after which
    every receive of the round was done already (read during the copy)."""
    seen = {"calls": 0, "received": 0}
    orig = work.CollectiveWork._local_polling

    def counted(self, steps, reqs):
        orig(self, steps, reqs)
        seen["calls"] += 1
        seen["received"] += all(r.done for r in reqs if isinstance(r, work.RecvRequest))
    work.CollectiveWork._local_polling = counted
    return seen


def _property(rank, examples):
    """(Exchanges of CMA messages run in the C fast path, plain or rl.empty, which looks
    between 512 KiB pieces of its copies too: half the examples take the engine's own way,
    with C off.)"""
    from ringlet.runtime import engine
    p = rl.get_world_size()
    work.POLL_CHUNK = 64 << 10        # many looks per copy
    seen = _count_polling()
    fast = engine().fast          # (False between hosts)

    @in_rank_settings(examples)
    @given(op=st.sampled_from(["all_gather", "all_to_all"]), dtype=st.sampled_from(DTYPES),
           nbytes=st.integers(BIG + 1, 3 * BIG), seed=st.integers(0, 2 ** 31),
           shared=st.booleans(), algo=st.sampled_from(["auto", "ring", "direct", "pairwise"]),
           in_c=st.booleans())
    def check(op, dtype, nbytes, seed, shared, algo, in_c):
        engine().fast = fast and in_c
        count = max(nbytes // np.dtype(dtype).itemsize, 1) | 1      # odd element counts
        if algo not in rl.algorithms.CATALOG[op]:
            algo = "auto"
        _call(rank, p, op, count, np.dtype(dtype), seed, rl.empty if shared else np.empty, algo)

    check()
    assert seen["calls"] > 0, "no exchange round took the receive-during-copy path"


@pytest.mark.parametrize("p", [2, 3, 4])
def test_exchanges_receive_during_the_local_copy(p):
    run(_property, p, 20 if p < 4 else 12)


def test_exchanges_over_tcp_receive_during_the_local_copy():
    """Between hosts the messages come as DATA over TCP, taken between pieces of the copy."""
    run(_property, 3, 8, backend="tcp")


def _reads_during_copy(rank, shared):
    """With the peer on time, its message is read while this rank still copies its own
    block (8 MiB blocks: a copy of hundreds of microseconds) in most calls. (Plain
    buffers' exchanges run in the C fast path, which looks between 512 KiB pieces of its
    copies too: the engine's own way is tested here with C off.)"""
    from ringlet.runtime import engine
    engine().fast = False
    seen = _count_polling()
    p = rl.get_world_size()
    for seed in range(6):
        _call(rank, p, "all_gather", 2 << 20, np.dtype(np.float32), seed,
              rl.empty if shared else np.empty, "ring")
    assert seen["calls"] == 6
    got = np.array([seen["received"]], np.int64)
    rl.all_reduce(got)
    assert got[0] >= 1, "the peer's message was never taken during the local copy"


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "rl.empty"])
def test_the_peer_message_is_read_during_the_copy(shared):
    run(_reads_during_copy, 2, shared)


def _refused(rank):
    """Rank 1 cannot read by CMA: what it receives streams through the ring, taken between
    the pieces of its copy (by the engine: C leaves calls that would read from a peer
    once a read from it was refused)."""
    p = rl.get_world_size()
    if rank == 1:
        _forbid(True, False)
    work.POLL_CHUNK = 64 << 10
    seen = _count_polling()
    for seed, op in enumerate(["all_gather", "all_to_all"] * 2):
        for dtype in (np.float64, np.int16):
            _call(rank, p, op, (3 * BIG) // np.dtype(dtype).itemsize + 1, np.dtype(dtype),
                  seed, np.empty)
    if rank == 1:   # (the others read each other's and rank 1's blocks in the C fast path)
        assert seen["calls"] > 0


@pytest.mark.skipif(platform.machine() not in _SYSCALL, reason="seccomp filter for x86_64/aarch64")
def test_a_refused_read_streams_during_the_copy():
    run(_refused, 3, env={"RINGLET_SHM_RING": str(256 << 10)})


def _signal_only(rank, shared):
    """A dissemination scatter's root at p = 2 sends its peer's block and copies its own in
    one round whose only receive is the peer's empty signal: not an exchange (nothing to
    read during the copy), so it copies at once, as direct's root does (the polled copy
    had made it 10-20% slower at 8 MiB from rl.empty); the blocks land as NumPy says."""
    seen = _count_polling()
    alloc = rl.empty if shared else np.empty
    count = 2 << 20
    inp = alloc(2 * count, np.float32) if rank == 0 else None
    if rank == 0:
        inp[...] = np.arange(2 * count, dtype=np.float32)
    out = alloc(count, np.float32)
    for _ in range(3):
        out[...] = -1
        rl.scatter(out, inp, src=0, algorithm="dissemination")
        np.testing.assert_array_equal(out, np.arange(rank * count, (rank + 1) * count,
                                                     dtype=np.float32))
    assert seen["calls"] == 0, "a round receiving only an empty signal polled its copy"


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "rl.empty"])
def test_a_round_receiving_only_a_signal_copies_at_once(shared):
    run(_signal_only, 2, shared)
