"""A collective's one-way message of 128-512 KiB to a local peer goes as up to 4 EAGER
packets (limits.pieces): the compiled plan splits it, the cost model splits it alike, and results
stay right on every path (C, the Python engine, a mix of the two)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ringlet as rl
from ringlet import algorithms
from ringlet.cost.host import HostModel
from ringlet.cost.simulate import _HostSim
from ringlet.transport import fast, limits
from ringlet.work import compile_plan

from conftest import HOST_PROFILE, run

DTYPES = [np.int8, np.int16, np.float32, np.float64]


@settings(max_examples=200, deadline=None)
@given(count=st.integers(1, 700_000), itemsize=st.sampled_from([1, 2, 4, 8]),
       p=st.integers(1, 40))
def test_pieces_rule(count, itemsize, p):
    k = limits.pieces(count, itemsize, p)
    nbytes = count * itemsize
    split = 2 * limits.SHM_PIECE_BYTES < nbytes <= limits.SHM_EAGER_BYTES and \
        p <= limits.PIECES_MAX_RANKS
    assert bool(k) == split
    if k:       # 2 to SHM_PIECES packets, none (but the last) under SHM_PIECE_BYTES
        assert 2 <= -(-count // k) <= limits.SHM_PIECES
        assert k * itemsize >= min(limits.SHM_PIECE_BYTES, nbytes // limits.SHM_PIECES)


def _pieces_of(sched, p):
    """collectives._pieces_of without an engine: every peer local."""
    alone = sched.sent_alone()
    return lambda t: (limits.pieces(t.n, sched.itemsize, p)
                      if (t.src, t.dst, t.soff, t.doff, t.n) in alone else 0)


@settings(max_examples=80, deadline=None)
@given(collective=st.sampled_from(["broadcast", "scatter", "gather", "all_gather",
                                   "all_to_all", "reduce", "all_reduce", "reduce_scatter"]),
       p=st.integers(2, 6), count=st.integers(1, 300_000), itemsize=st.sampled_from([1, 4, 8]),
       data=st.data())
def test_plan_pieces_agree_between_sender_and_receiver(collective, p, count, itemsize, data):
    """Every rank's compiled plan splits the same messages into the same packets as its
    peers' (each decides from the schedule alone): in every round, what a rank sends to a
    peer is, packet by packet, what the peer expects from it. Split, a message's packets
    cover its bytes in order, at most SHM_PIECES of them, and only messages whose sender
    receives nothing in the round are split; a round's receives stay within what C tracks."""
    name = data.draw(st.sampled_from(sorted(algorithms.CATALOG[collective])))
    if name == "hierarchical":
        return
    sched = algorithms.build(collective, name, p, count, itemsize=itemsize, root=0)
    ranks = tuple(range(p))
    pieces_of = _pieces_of(sched, p)
    sent, expected = {}, {}
    for r in range(p):
        whole = compile_plan(sched.rank_plan(r), ranks)
        split = compile_plan(sched.rank_plan(r), ranks, pieces_of)
        assert len(whole) == len(split)
        for rr, w, s in zip(sched.rank_plan(r), whole, split):
            assert w.local == s.local and len(s.recvs) <= fast.MAX_RECVS
            for t in rr.sends:
                k = pieces_of(t)
                assert not k or not any(x.n for x in rr.recvs)     # one-way senders only
            for peer in ranks:
                out = [(x.s1 - x.s0) for x in s.sends if x.dst == peer]
                if out:
                    sent.setdefault((r, peer), []).append(out)
                    assert sum(out) == sum(x.s1 - x.s0 for x in w.sends if x.dst == peer)
                    assert len(out) <= limits.SHM_PIECES * len([x for x in w.sends
                                                                if x.dst == peer])
                into = [(x.d1 - x.d0) for x in s.recvs if x.src == peer]
                if into:
                    expected.setdefault((peer, r), []).append(into)
    assert sent == expected


def test_model_counts_messages_and_prices_the_pipeline():
    """The simulator splits the messages alike: the schedule's messages and bytes are
    still what it reports, and a one-way 512 KiB message costs less in pieces (its
    receiver copies one piece while the next goes in) than whole."""
    model = HostModel.from_params({**HOST_PROFILE, "cores": 2})
    whole = HostModel.from_params({**HOST_PROFILE, "cores": 2, "piece": 0})
    sched = algorithms.build("scatter", "direct", 2, (512 << 10) // 4, itemsize=4, root=0)
    a, b = _HostSim(sched, model).run(), _HostSim(sched, whole).run()
    assert a.messages == b.messages and a.bytes == b.bytes
    assert a.time < b.time - 2e-6     # (the receiver's copy of 3 of 4 pieces, less 3 alphas)
    big = algorithms.build("scatter", "direct", 2, (2 << 20) // 4, itemsize=4, root=0)
    assert _HostSim(big, model).run().time == _HostSim(big, whole).run().time   # (> eager)


def _pieces_job(rank, p, count, dtype, algorithm):
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(7)
    full = rng.integers(-100, 100, (p, count)).astype(dtype)
    x = full[0].copy() if rank == 0 else np.zeros(count, dtype)
    rl.broadcast(x, 0, algorithm=algorithm("broadcast"))
    assert np.array_equal(x, full[0])
    out = np.empty(count, dtype)
    rl.scatter(out, full.reshape(-1) if rank == 0 else None, 0, algorithm=algorithm("scatter"))
    assert np.array_equal(out, full[rank])
    g = np.empty((p, count), dtype)
    rl.all_gather(g, full[rank], algorithm=algorithm("all_gather"))
    assert np.array_equal(g, full)
    s = full[rank].copy()
    rl.all_reduce(s, algorithm=algorithm("all_reduce"))
    assert np.array_equal(s, full.sum(axis=0, dtype=dtype))
    a = np.empty((p, count), dtype)
    rl.all_to_all(a, np.stack([full[rank]] * p))
    assert np.array_equal(a, full)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("dtype,count", [(np.float64, 40_001), (np.int8, 300_007),
                                         (np.int16, 131_073), (np.float32, 99_999)])
def test_collectives_in_pieces_are_right(p, dtype, count):
    """Messages that do not divide into whole pieces (odd counts, 1-8 byte elements),
    by auto's picks and by the direct algorithms."""
    run(_pieces_job, p, p, count, dtype, lambda c: "auto")
    run(_pieces_job, p, p, count, dtype, lambda c: "direct")


def _mixed_job(rank):
    from ringlet.runtime import engine
    if rank == 0:
        engine().fast = False         # as RINGLET_NO_FASTPATH=1 on this rank alone
    _pieces_job(rank, 2, 100_003, np.float32, lambda c: "auto")
    if rank == 0:
        assert rl.stats()["collectives"]["broadcast"]["fast_calls"] == 0


def test_a_rank_without_c_agrees_on_the_packets():
    """One rank runs every call in the Python engine, the other in C: both split alike."""
    run(_mixed_job, 2)


def _counted_job(rank):
    def sent(n):      # packets rank 0 sends for one direct scatter of n bytes per rank
        x = np.zeros(2 * n // 4, np.float32) if rank == 0 else None
        before = rl.stats()["sent"].get(1, {}).get("messages", 0) if rank == 0 else 0
        rl.scatter(np.empty(n // 4, np.float32), x, 0, algorithm="direct")
        return rl.stats()["sent"].get(1, {}).get("messages", 0) - before if rank == 0 else 0
    small, big = sent(64 << 10), sent(512 << 10)
    if rank == 0:
        assert big - small == 3, (small, big)     # 512 KiB: 4 packets of 128 KiB


def test_a_large_eager_message_goes_in_four_packets():
    run(_counted_job, 2)


def _counts_differ(rank):
    """Ranks disagree on a pieced broadcast's count (4 packets against 3): every rank fails
    (the root, which only sends, at the latest in its next call), none takes the other's
    packets for its own."""
    x = np.full(100_000 if rank == 0 else 90_000, 7.0 if rank == 0 else 0.0, np.float32)
    with pytest.raises(rl.CollectiveMismatch):
        rl.broadcast(x, 0, timeout=10)
        rl.all_reduce(np.ones(3), timeout=10)
    assert rank == 0 or not (x == 7.0).any()


def test_ranks_that_disagree_on_a_pieced_message_fail():
    run(_counts_differ, 2)
