"""Ranks that disagree on a rooted collective's root raise CollectiveMismatch at that very
call, on every rank, for every algorithm — never a hang, never a silently wrong result."""
import itertools
import re

import numpy as np
import pytest

import ringlet as rl
from ringlet import algorithms, fingerprint
from ringlet.transport import protocol
from conftest import run

ROOTED = ("broadcast", "reduce", "gather", "scatter")


def _call(collective, algorithm, root, n, rank, p):
    x = np.full(n, rank + 1.0)
    if collective == "broadcast":
        rl.broadcast(x, root, algorithm=algorithm, timeout=20)
    elif collective == "reduce":
        rl.reduce(x, root, algorithm=algorithm, timeout=20)
    elif collective == "gather":
        out = np.zeros((p, n)) if rank == root else None
        rl.gather(x, out, dst=root, algorithm=algorithm, timeout=20)
    else:
        inp = np.zeros((p, n)) if rank == root else None
        rl.scatter(x, inp, src=root, algorithm=algorithm, timeout=20)


def _roots_disagree(rank, views):
    p = rl.get_world_size()
    for collective in ROOTED:
        for algorithm in algorithms.CATALOG[collective]:
            for n in (10, 300_000):             # one EAGER packet (C fast path); streamed
                for view in views:
                    root = view(rank, p)
                    where = f"rank {rank}: {collective}/{algorithm} n={n}"
                    with pytest.raises(rl.CollectiveMismatch) as info:
                        _call(collective, algorithm, root, n, rank, p)
                    msg = str(info.value)
                    differ = re.search(r"they differ in ([a-z_]+(?:, [a-z_]+)*)", msg)
                    assert differ and differ.group(1) == "root", (where, msg)
                    # both views are named, with the ranks that hold them
                    assert msg.count("root=") == 2, (where, msg)
                    # and the group goes on: the next call runs with everyone agreeing
                    y = np.full(4, rank + 1.0)
                    rl.all_reduce(y, timeout=20)
                    assert (y == p * (p + 1) / 2).all(), (where, y)


def _last_rank_differs(rank, p):
    return p - 1 if rank == p - 1 else 0


def _each_its_own(rank, p):
    return rank


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ranks_that_disagree_on_the_root_raise_at_the_call(p):
    run(_roots_disagree, p, (_last_rank_differs, _each_its_own))


def test_ranks_that_disagree_on_the_root_raise_over_tcp(backend):
    run(_roots_disagree, 3, (_last_rank_differs,), backend=backend)


def _subgroup_roots_disagree(rank):
    g = rl.new_group([1, 2, 3])
    if rank in (1, 2, 3):
        with pytest.raises(rl.CollectiveMismatch) as info:
            rl.broadcast(np.ones(4), src=2 if rank == 3 else 1, group=g, timeout=20)
        msg = str(info.value)
        # roots are the group's ranks, the ranks named the world's: both said
        assert "root=1 (world rank 2)" in msg and "root=2 (world rank 3)" in msg, msg
    rl.barrier()


def test_a_subgroups_root_is_named_with_its_world_rank():
    run(_subgroup_roots_disagree, 4)


def _algorithms_disagree(rank):
    """The last rank runs binomial (barrier first), the others dissemination (data on the
    barrier's messages): both send the same signals in round 0, so every rank raises at
    that very call, saying they differ in algorithm, and the group goes on."""
    p = rl.get_world_size()
    for collective in ROOTED:
        for n in (10, 300_000):                 # one EAGER packet (C fast path); streamed
            algorithm = "binomial" if rank == p - 1 else "dissemination"
            with pytest.raises(rl.CollectiveMismatch) as info:
                _call(collective, algorithm, 0, n, rank, p)
            assert "they differ in algorithm" in str(info.value), (collective, n, str(info.value))
            y = np.full(4, rank + 1.0)
            rl.all_reduce(y, timeout=20)
            assert (y == p * (p + 1) / 2).all()


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ranks_that_disagree_on_laying_data_on_the_barrier_raise_at_the_call(p):
    run(_algorithms_disagree, p)


def _agreed(rank):
    """A rooted call whose ranks agree still gives the right answer, and its schedule
    shows the agreement rounds the cost model prices."""
    p = rl.get_world_size()
    for collective in ROOTED:
        for algorithm in algorithms.CATALOG[collective]:
            for root in range(p):
                x = np.full(5, rank + 1.0)
                if collective == "broadcast":
                    rl.broadcast(x, root, algorithm=algorithm)
                    assert (x == root + 1).all()
                elif collective == "reduce":
                    rl.reduce(x, root, algorithm=algorithm)
                    assert (x == (p * (p + 1) / 2 if rank == root else rank + 1)).all()
                elif collective == "gather":
                    out = np.zeros((p, 5)) if rank == root else None
                    rl.gather(x, out, dst=root, algorithm=algorithm)
                    if rank == root:
                        assert (out == np.arange(1, p + 1)[:, None]).all()
                else:
                    inp = np.arange(p * 5, dtype=float).reshape(p, 5) if rank == root else None
                    rl.scatter(x, inp, src=root, algorithm=algorithm)
                    assert (x == np.arange(rank * 5, rank * 5 + 5)).all()


def test_agreeing_ranks_still_get_the_right_answer():
    run(_agreed, 3)


def _agreed_large(rank, n):
    """Large rooted calls, whose first round moves beside the agreement (posted right after
    its first round, ``Schedule.early``) where lg p >= 2: every algorithm, every root, from
    plain and rl.empty buffers, gives the right answer - a data message and a signal on one
    pair are matched in the order both ends posted them."""
    p = rl.get_world_size()
    for alloc in (np.empty, rl.empty):
        def full(shape, value):
            a = alloc(shape, np.float64)
            a[...] = value
            return a
        for collective in ROOTED:
            for algorithm in algorithms.CATALOG[collective]:
                for root in range(p):
                    where = (collective, algorithm, root, alloc.__module__)
                    x = full(n, rank + 1.0)
                    if collective == "broadcast":
                        rl.broadcast(x, root, algorithm=algorithm, timeout=30)
                        assert (x == root + 1).all(), where
                    elif collective == "reduce":
                        rl.reduce(x, root, algorithm=algorithm, timeout=30)
                        assert (x == (p * (p + 1) / 2 if rank == root else rank + 1)).all(), where
                    elif collective == "gather":
                        out = full((p, n), 0.0) if rank == root else None
                        rl.gather(x, out, dst=root, algorithm=algorithm, timeout=30)
                        if rank == root:
                            assert (out == np.arange(1, p + 1)[:, None]).all(), where
                    else:
                        inp = full((p, n), np.arange(p)[:, None] + 10.0) if rank == root else None
                        rl.scatter(x, inp, src=root, algorithm=algorithm, timeout=30)
                        assert (x == rank + 10.0).all(), where


@pytest.mark.parametrize("p", [3, 5])
def test_large_rooted_calls_moving_beside_their_agreement_get_the_right_answer(p):
    n = (algorithms.EARLY_MIN_BYTES // 8) * 3 // 2       # 768 KiB of float64 per block
    for collective in ROOTED:                            # (the schedules are the early kind)
        s = algorithms.build(collective, "direct", p, n, itemsize=8)
        assert s.early == s.agreement == (p - 1).bit_length(), collective
    run(_agreed_large, p, n)


def test_the_early_bound_is_the_fast_paths_eager_packet():
    """A plan whose every message is one shared-memory EAGER packet may run in C, which
    takes rounds in turn: only larger first rounds are posted early."""
    from ringlet.transport import limits
    assert algorithms.EARLY_MIN_BYTES == limits.SHM_EAGER_BYTES


@pytest.mark.parametrize("collective", ROOTED)
@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_rooted_schedules_carry_a_barrier_every_rank_hears_through(collective, p):
    """Round k of the first lg p rounds has a message from rank r to r + 2^k for every r -
    the dissemination barrier's pairs, the same for every algorithm and root (so ranks
    that disagree on them meet too) - after which every rank has heard, through a chain of
    rounds, from every other rank (so no disagreement goes unseen). The algorithm's first
    round rides the barrier's last (``algorithms.agree_alongside``): there a barrier's
    message is the algorithm's own where it sends on that pair, an empty signal where it
    does not (never both). Without the signals, the schedule is the algorithm's own;
    the "dissemination" algorithms (``Schedule.agrees``) lay their data on the signals and
    send nothing after them."""
    lg = (p - 1).bit_length()
    barrier = algorithms.build("barrier", "dissemination", p, 0)
    big = algorithms.EARLY_MIN_BYTES // 4 + 1      # first rounds above it: posted early
    for algorithm, root, count in itertools.product(algorithms.CATALOG[collective],
                                                    (0, p - 1), (100, big)):
        s = rl.schedule(collective, p, count, algorithm=algorithm, root=root)
        heard = np.eye(p, dtype=bool)       # heard[i, j]: rank i has heard from rank j
        for rnd, signal in zip(s.rounds[:lg], barrier.rounds):
            c = rnd.cols
            msg = c["src"] != c["dst"]
            pairs = list(zip(c["src"][msg].tolist(), c["dst"][msg].tolist()))
            assert len(pairs) == len(set(pairs)), "two messages on one pair in a round"
            want = list(zip(signal.cols["src"].tolist(), signal.cols["dst"].tolist()))
            assert set(want) <= set(pairs), (collective, algorithm, p, root)
            new = heard.copy()
            for a, b in want:
                new[b] |= heard[a]
            heard = new
        assert heard.all(), (collective, algorithm, p, root)
        later = [(r.cols["src"] != r.cols["dst"]) & (r.cols["n"] > 0) for r in s.rounds[lg:]]
        if s.agrees:
            assert s.agreement == 0 and not any(m.any() for m in later), "no message after"
            assert any((r.cols["n"] > 0).any() for r in s.rounds[:lg]), "the data rides them"
            continue
        assert s.agreement == lg
        alone = s.without_agreement()
        bare = algorithms.CATALOG[collective][algorithm](p, count, root=root)
        first = bare.rounds[0].cols
        large = (first["n"][first["src"] != first["dst"]] * 4 >
                 algorithms.EARLY_MIN_BYTES).any()
        if lg > 1 and large:
            # the barrier whole, then the algorithm, its first round posted with round 0
            assert s.early == lg and not any((r.cols["n"] > 0).any() for r in s.rounds[:lg])
            assert len(s.rounds) == lg + len(bare.rounds)
        else:       # its first round rides the barrier's last
            assert s.early == -1 and len(s.rounds) == lg - 1 + len(bare.rounds)
        assert len(alone.rounds) == len(bare.rounds)
        for a, b in zip(alone.rounds, bare.rounds):
            assert all((a.cols[k] == b.cols[k]).all() for k in a.cols)
        # what the signals added: empty messages only
        added = sum(len(r) for r in s.rounds) - sum(len(r) for r in alone.rounds)
        assert added == sum(int((r.cols["n"] == 0).sum()) for r in s.rounds) - \
            sum(int((r.cols["n"] == 0).sum()) for r in alone.rounds)


def test_only_the_dissemination_algorithms_agree_as_they_move_the_data():
    """``Schedule.agrees`` is what ``algorithms.SELF_AGREEING`` says, and the closed forms
    price it: a dissemination algorithm costs its binomial twin's textbook form, which
    every other rooted algorithm pays its agreement's signals on top of (those of a small
    call: a large first round hides them)."""
    from ringlet.cost import model
    pcie = model.tier("pcie")
    for collective in ROOTED:
        for algorithm in algorithms.CATALOG[collective]:
            s = algorithms.build(collective, algorithm, 4, 8)
            assert s.agrees == ((collective, algorithm) in algorithms.SELF_AGREEING)
        for p in (2, 3, 4, 8):
            for nbytes in (4096, 8 << 20):
                bare = model.closed_form(collective, nbytes, p, "dissemination", pcie)
                twin = model.closed_form(collective, nbytes, p, "binomial", pcie)
                textbook = model._FORMS[(collective, "binomial")](p, nbytes, pcie.alpha,
                                                                 pcie.beta, 0.0)
                assert bare == pytest.approx(textbook)
                assert twin[1:] == pytest.approx(bare[1:])
                assert twin.latency >= bare.latency + (p > 2 and nbytes == 4096) * pcie.alpha


# -- the policy on its own: what the transport reports, what fails, who is told -----------
class _Mechanism:
    """The engine as the policy sees it (its mechanism), recording what it is asked."""

    rank = 0

    def retired(self, gid):
        return False

    def __init__(self, peers):
        self.peers = {r: None for r in peers}
        self.works, self.dead, self.waiting = [], {}, {}
        self.aborts_sent, self.failed_tags, self.failed_peers = [], [], []

    def send_aborts(self, tag, ranks, mine, theirs, culprit):
        self.aborts_sent += [(tag, r, culprit) for r in ranks if r != self.rank and r not in self.dead]
        self.abort_words = theirs

    def fail_tag(self, tag, exc):
        self.failed_tags.append(tag)

    def fail_receives(self, rank, which, exc):
        pass

    def fail_peer(self, rank, exc):
        self.failed_peers.append(rank)

    def failure_of(self, rank):
        return self.dead.get(rank)

    def unasked_unlike(self, tag, fp):
        return next(((r, f) for r, f in self.waiting.get(tag, ()) if f != fp), None)


class _Call:
    def __init__(self, tag, fp, world_of, what="all_reduce #1 of group world (ring)"):
        self.tag, self.fp, self.world_of, self.what = tag, fp, world_of, what
        self.error = None

    def fail(self, exc):
        self.error = exc

    def _waiting_on(self):
        return ()


def _fp(count, collective="all_reduce"):
    algos = tuple(algorithms.CATALOG[collective])
    return fingerprint.encode(collective, algos[0], algos, np.dtype(np.float32), count,
                                 None, rl.ReduceOp.SUM)


def _policy(peers=(1, 2, 3)):
    from ringlet.agreement import Agreement
    eng = _Mechanism(peers)
    calls = Agreement(lambda fp: fingerprint.decode(fp, lambda c: tuple(algorithms.CATALOG[c])))
    calls.attach(eng)
    return calls, eng


def test_a_mismatch_fails_the_call_here_and_tells_every_other_member():
    calls, eng = _policy()
    tag = (1 << 47) | 1
    work = _Call(tag, _fp(10), (0, 1, 2))
    calls.start(work)
    calls.mismatch(tag, work.fp, _fp(12), 2)
    assert isinstance(work.error, rl.CollectiveMismatch)
    msg = str(work.error)
    assert msg.startswith(work.what) and "rank 0 called" in msg and "rank 2 called" in msg
    assert "they differ in count" in msg, msg
    assert sorted(r for _, r, _ in eng.aborts_sent) == [1, 2]   # its members, not rank 3
    assert eng.failed_tags == [tag] and not calls.active
    calls.abort_received(tag, _fp(12), _fp(10), 0, 2)    # the peers' ABORTs: old news now
    assert len(eng.failed_tags) == 1


def test_an_abort_for_a_call_not_entered_yet_fails_it_as_it_starts():
    calls, eng = _policy()
    tag = (1 << 47) | 5
    calls.abort_received(tag, _fp(10), _fp(11), 2, 1)
    work = _Call(tag, _fp(10), (0, 1, 2))
    calls.start(work)
    assert isinstance(work.error, rl.CollectiveMismatch), work.error
    assert "(reported by rank 1)" in str(work.error)


def test_a_message_waiting_with_another_fingerprint_fails_the_call_as_it_starts():
    calls, eng = _policy()
    tag = (1 << 47) | 2
    eng.waiting[tag] = [(1, _fp(10)), (3, _fp(99))]
    work = _Call(tag, _fp(10), (0, 1, 3))
    calls.start(work)
    assert isinstance(work.error, rl.CollectiveMismatch) and "rank 3 called" in str(work.error)


def test_a_dead_member_fails_its_calls_and_the_survivors_are_told():
    calls, eng = _policy()
    mine, other = _Call((1 << 47) | 7, _fp(4), (0, 1, 2)), _Call((2 << 48) | (1 << 47) | 1, _fp(4), (0, 3))
    calls.start(mine)
    calls.start(other)
    eng.dead[2] = dead = rl.PeerFailure("rank 2 failed", rank=2)
    calls.peer_failed(2, dead)
    assert mine.error is dead and other.error is None
    assert [(r, c) for _, r, c in eng.aborts_sent] == [(1, protocol.DEAD)]


def test_a_rank_that_left_is_reported_as_left_by_the_members_told():
    """Rank 2 left the job (destroy) while this rank waited for it: the ABORT this rank
    sends its other members says so (protocol.LEFT), and a member told by it says "left
    the job" too - not "failed", as if it had died (test_failures' rank that left, over
    TCP, heard of it from rank 0 first)."""
    from ringlet.transport.protocol import peer_failure
    calls, eng = _policy()
    work = _Call((1 << 47) | 11, _fp(4), (0, 1, 2, 3))
    calls.start(work)
    eng.dead[2] = gone = peer_failure(2, "it has left the job (it called destroy())", left=True)
    calls.peer_failed(2, gone)
    assert eng.abort_words == (2, protocol.LEFT)
    other, eng2 = _policy()
    work2 = _Call((1 << 47) | 11, _fp(4), (0, 1, 2, 3))
    other.start(work2)
    other.abort_received(work2.tag, _fp(4), eng.abort_words, protocol.DEAD, 0)
    err = work2.error
    assert isinstance(err, rl.PeerFailure) and err.rank == 2 and err.left, err
    assert "left the job" in str(err) and "reported by rank 0" in str(err), str(err)
    calls3, eng3 = _policy()                      # a death stays a death
    work3 = _Call((1 << 47) | 11, _fp(4), (0, 1, 2, 3))
    calls3.start(work3)
    calls3.abort_received(work3.tag, _fp(4), (2, 0), protocol.DEAD, 0)
    assert not work3.error.left and str(work3.error) == "rank 2 failed (reported by rank 0)"


def test_a_death_heard_from_a_peer_is_passed_on_to_the_other_members():
    """Rank 1 reported rank 2's death to this rank: rank 3, waiting on this rank, may not
    have heard of it from rank 1 yet, and this rank's exit would reach it first (blamed
    as this rank's failure) unless this rank tells it before it goes."""
    calls, eng = _policy()
    work = _Call((1 << 47) | 9, _fp(4), (0, 1, 2, 3))
    calls.start(work)
    eng.dead[2] = told = rl.PeerFailure("rank 2 failed (reported by rank 1)", rank=2)
    calls.peer_failed(2, told)
    assert work.error is told
    assert sorted((r, c) for _, r, c in eng.aborts_sent) == [(1, protocol.DEAD), (3, protocol.DEAD)]


def test_a_mismatch_names_a_root_only_for_a_rooted_collective():
    cat = lambda c: tuple(algorithms.CATALOG[c])   # noqa: E731
    f32 = np.dtype(np.float32)
    ar = fingerprint.encode("all_reduce", "ring", cat("all_reduce"), f32, 10, None, rl.ReduceOp.SUM)
    bc = fingerprint.encode("broadcast", "binomial", cat("broadcast"), f32, 10, 3, None)
    a, b = fingerprint.decode(ar, cat), fingerprint.decode(bc, cat)
    assert a["root"] is None and b["root"] == 3
    msg = fingerprint.diff(a, fingerprint.decode((ar[0], 9), cat), 0, 1)
    assert "root" not in msg and "count=10" in msg and "they differ in count" in msg, msg
    # plainly different dtypes: no hint about dtypes that print alike
    f64 = fingerprint.encode("all_reduce", "ring", cat("all_reduce"), np.dtype(np.float64), 10,
                             None, rl.ReduceOp.SUM)
    msg = fingerprint.diff(a, fingerprint.decode(f64, cat), 0, 1)
    assert msg.endswith("they differ in dtype"), msg


def _layouts_disagree(rank):
    """dtypes of one kind character that differ in byte order, a datetime's unit or a
    structured dtype's fields: each was broadcast with no error, the bytes read as the
    other dtype (rank 1 got 6.9e-41 for 1.5)."""
    pairs = [("<f4", ">f4"), ("M8[s]", "M8[ms]"),
             ([("a", "f4"), ("b", "f8")], [("a", "i4"), ("b", "f8")])]
    for mine, theirs in pairs:
        x = np.zeros(3, np.dtype(mine if rank == 0 else theirs))
        with pytest.raises(rl.CollectiveMismatch, match="differ in the dtype's layout"):
            rl.broadcast(x, 0, timeout=20)
        y = np.ones(2, np.dtype(mine))           # the same dtype on both: it runs
        rl.all_gather(np.empty(4, y.dtype).reshape(2, 2), y, timeout=20)


def test_ranks_whose_dtypes_differ_in_layout_raise_at_the_call():
    run(_layouts_disagree, 2)
    f, d = fingerprint.layout_code, np.dtype
    assert f(d("<f4")) != f(d(">f4")) and f(d("M8[s]")) != f(d("M8[ms]"))
