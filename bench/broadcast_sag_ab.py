"""Broadcast's scatter_allgather as it was (its ring all-gather also carried chunks back
to the root and to scatter parents, which held them) against now (only the chunks a rank
lacks), in alternating blocks inside one job, so both meet the same host state.

    ringlet run -n 2 bench/broadcast_sag_ab.py plain 1048576,8388608
    ringlet run -n 4 bench/broadcast_sag_ab.py empty 1048576,8388608

Prints per size the median block of each (ringlet.bench.alternating_blocks: the slowest
rank's median call, the input written again before every call) and before/now block pair by block pair (> 1: now is
faster). Checks the result of the last call. Not a unit test. (Registers the old
schedule under a name of its own through ringlet.algorithms' private tables, built by
the same builder with the ring all-gather that ignores what ranks hold.)
"""
import inspect
import sys

import numpy as np

import ringlet as rl
from ringlet import algorithms
from ringlet.algorithms import broadcast
from ringlet.algorithms._common import ring_all_gather
from ringlet.bench import alternating_blocks, bind_like_mpirun

BLOCKS = 8


def sag_before(p, count, *, itemsize=4, root=0):
    """scatter_allgather as it was: the same builder, with a ring all-gather that carries
    every chunk to every rank (it ignores what each holds)."""
    def carry_all(*args, held=None, **kw):
        return ring_all_gather(*args, **kw)
    broadcast.ring_all_gather = carry_all
    try:
        s = broadcast.scatter_allgather(p, count, itemsize=itemsize, root=root)
    finally:
        broadcast.ring_all_gather = ring_all_gather
    s.algorithm = "sag_before"
    return s


def main(kind: str, sizes: list) -> None:
    algorithms.CATALOG["broadcast"]["sag_before"] = sag_before
    algorithms._PARAMS[id(sag_before)] = frozenset(inspect.signature(sag_before).parameters)
    rl.init()
    rank, p = rl.get_rank(), rl.get_world_size()
    if p <= 2:
        bind_like_mpirun(rank, p)
    for size in sizes:
        n = size // 4
        buf = np.empty(n, np.float32) if kind == "plain" else rl.empty(n, np.float32)

        def reset():
            buf[...] = rank + 1

        arms = {a: (lambda a=a: rl.broadcast(buf, 0, algorithm=a), reset)
                for a in ("sag_before", "scatter_allgather")}
        res = alternating_blocks(rl, arms, BLOCKS, max(5, min(60, int(2e8 / size))))
        assert (buf == 1).all(), "wrong result"
        if rank == 0:
            before, now = np.array(res["sag_before"]), np.array(res["scatter_allgather"])
            print(f"{kind} p={p} {size >> 10} KiB  before {np.median(before):.0f} us  "
                  f"now {np.median(now):.0f} us  before/now per block pair "
                  f"{np.round(before / now, 2).tolist()}", flush=True)
    rl.destroy()


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2].split(",")])
