"""Random sequences of calls, as a training step issues them, checked against NumPy.

Each example is a list of calls drawn by hypothesis (the same on every rank: derandomized,
no shrinking): collectives of every size class — EAGER packets (run in C when blocking),
streamed through the ring, read in place from rl.empty buffers — blocking and async with several in
flight, on the world and on a subgroup, and point-to-point around a ring. Before each call
one rank may arrive late, so that calls run in C hand over mid-plan to the Python engine,
and packets of the next call land while a rank is still in the last one. One rank can run
everything in Python while the others use C. Async calls are waited for in an order that
differs per rank. Every output is compared with NumPy when its call completes.
"""
import time

import numpy as np
import pytest
from hypothesis import given, strategies as st

import ringlet as rl
from ringlet import algorithms
from ringlet.runtime import engine
from conftest import run
from test_collectives import in_rank_settings

KINDS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
         "p2p"]
# Element counts around the shared-memory transport's thresholds (bytes by dtype): EAGER
# (<= 512 KiB, in C), streamed (<= the 1 MiB ring, or read in place from rl.empty), larger.
COUNTS = [0, 1, 3, 2048, 4097, 30_000, 32_768, 65_536, 65_537, 131_072, 140_000, 300_000]
DTYPES = [np.float64, np.int32, np.int64, np.uint8, np.float32]

call = st.fixed_dictionaries({
    "kind": st.sampled_from(KINDS),
    "algo": st.integers(0, 99),          # auto, or one of the collective's algorithms
    "count": st.sampled_from(COUNTS),
    "dtype": st.sampled_from(DTYPES),
    "async_op": st.booleans(),
    "shared": st.booleans(),              # buffers from rl.empty
    "sub": st.booleans(),                 # on the subgroup instead of the world
    "root": st.integers(0, 7),
    "late": st.integers(-1, 7),           # the rank that arrives late (-1: none)
    "wait_now": st.booleans(),            # wait for everything in flight after this call
})


def _inputs(seed, step, p, shape, dtype):
    """Every rank's input of one call (small integers: sums are exact in any order)."""
    return [np.random.default_rng([seed, step, r]).integers(0, 8, size=shape).astype(dtype)
            for r in range(p)]


def _alloc(shared, shape, dtype):
    return rl.empty(shape, dtype) if shared else np.empty(shape, dtype)


def _issue(step, c, seed, g, p2p_tag):
    """Start call ``c`` on group ``g``; returns (work or None, check())."""
    p, rank = g.size, g.rank
    kind, dtype, n = c["kind"], np.dtype(c["dtype"]), c["count"]
    root = c["root"] % p
    kw = {"group": g, "async_op": c["async_op"]}
    if kind != "p2p":
        algos = ["auto"] + list(algorithms.CATALOG[kind])
        kw["algorithm"] = algos[c["algo"] % len(algos)]
    full = (p, n)
    ins = _inputs(seed, step, p, full if kind in ("reduce_scatter", "all_to_all") else (n,), dtype)
    mine = _alloc(c["shared"], ins[rank].shape, dtype)
    mine[...] = ins[rank]
    total = np.sum(ins, axis=0, dtype=dtype)
    if kind == "all_reduce":
        work = rl.all_reduce(mine, **kw)
        return work, lambda: np.testing.assert_array_equal(mine, total)
    if kind == "reduce":
        work = rl.reduce(mine, root, **kw)
        return work, lambda: np.testing.assert_array_equal(mine, total if rank == root else ins[rank])
    if kind == "broadcast":
        work = rl.broadcast(mine, root, **kw)
        return work, lambda: np.testing.assert_array_equal(mine, ins[root])
    if kind == "all_gather":
        out = _alloc(c["shared"], full, dtype)
        work = rl.all_gather(out, mine, **kw)
        return work, lambda: np.testing.assert_array_equal(out, np.stack(ins))
    if kind == "reduce_scatter":
        out = _alloc(c["shared"], (n,), dtype)
        work = rl.reduce_scatter(out, mine, **kw)
        return work, lambda: np.testing.assert_array_equal(out, total[rank])
    if kind == "all_to_all":
        out = _alloc(c["shared"], full, dtype)
        work = rl.all_to_all(out, mine, **kw)
        return work, lambda: np.testing.assert_array_equal(out, np.stack([x[rank] for x in ins]))
    # p2p: each rank sends to the next and receives from the previous, on its own tag.
    out = _alloc(c["shared"], (n,), dtype)
    dst, src = (rank + 1) % p, (rank - 1) % p
    if p == 1:
        return None, lambda: None
    sent = rl.isend(mine, dst, group=g, tag=p2p_tag)
    if c["async_op"]:
        got = rl.irecv(out, src, group=g, tag=p2p_tag)
        work = _Both(sent, got)
    else:
        rl.recv(out, src, group=g, tag=p2p_tag)
        sent.wait()
        work = None
    return work, lambda: np.testing.assert_array_equal(out, ins[src])


class _Both:
    def __init__(self, *works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait(timeout)


def _sequences(rank, examples, python_rank):
    p = rl.get_world_size()
    if rank == python_rank:
        engine().fast = False          # this rank runs every call in the Python engine
    sub_ranks = list(range(0, p, 2)) if p > 2 else [0, 1]
    sub = rl.new_group(sub_ranks)
    world = rl.new_group(list(range(p)))
    order = np.random.default_rng(rank)           # each rank waits in its own order
    tags = iter(range(1 << 30))

    @in_rank_settings(examples)
    @given(calls=st.lists(call, min_size=3, max_size=12), seed=st.integers(0, 2 ** 31))
    def check(calls, seed):
        pending = []
        for step, c in enumerate(calls):
            g = sub if c["sub"] else world
            tag = next(tags)                       # every rank draws one per call
            if rank not in g.ranks:
                continue
            if c["late"] % p == rank and c["late"] >= 0:
                time.sleep(0.002)
            work, ok = _issue(step, c, seed, g, tag)
            if work is None:
                ok()
            else:
                pending.append((work, ok))
            if c["wait_now"]:
                for i in order.permutation(len(pending)):
                    pending[i][0].wait()
                    pending[i][1]()
                pending.clear()
        for i in order.permutation(len(pending)):
            pending[i][0].wait()
            pending[i][1]()

    check()
    rl.barrier()


@pytest.mark.parametrize("p,python_rank", [(2, -1), (3, 1), (4, -1)])
def test_random_call_sequences_match_numpy(p, python_rank):
    run(_sequences, p, 30 if p < 4 else 20, python_rank)
