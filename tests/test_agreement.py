"""Ranks that disagree on a rooted collective's root raise CollectiveMismatch at that very
call, on every rank, for every algorithm — never a hang, never a silently wrong result."""
import re

import numpy as np
import pytest

import ringlet as rl
from ringlet import algorithms
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


@pytest.mark.parametrize("collective", ROOTED)
@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_rooted_schedules_start_with_a_barrier_every_rank_hears_through(collective, p):
    """The first lg p rounds are zero-element messages after which every rank has heard,
    through a chain of rounds, from every other rank (so no disagreement goes unseen)."""
    lg = (p - 1).bit_length()
    for algorithm in algorithms.CATALOG[collective]:
        s = rl.schedule(collective, p, 100, algorithm=algorithm, root=p - 1)
        heard = np.eye(p, dtype=bool)           # heard[i, j]: rank i has heard from rank j
        for rnd in s.rounds[:lg]:
            c = rnd.cols
            assert (c["n"] == 0).all() and (c["src"] != c["dst"]).all()
            new = heard.copy()
            for a, b in zip(c["src"], c["dst"]):
                new[b] |= heard[a]
            heard = new
        assert heard.all(), (collective, algorithm, p)
        assert any((r.cols["n"] > 0).any() for r in s.rounds[lg:]), "the data rounds follow"
