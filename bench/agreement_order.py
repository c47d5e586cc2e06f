"""Rooted collectives' agreement: the barrier's rounds all before the data (as until
2026-12-02) against the algorithm's first round riding the barrier's last
(``algorithms.agree_alongside``, the default), in one job, in alternating blocks of calls,
so the job's placement, its memory and the host's load fall on both alike.

    ringlet run -n 4 bench/agreement_order.py                 # gather, scatter; 1 and 8 MiB
    ringlet run -n 4 bench/agreement_order.py --ops gather,scatter,broadcast,reduce \\
        --kinds plain,rl.empty --algorithm auto --blocks 10

Each block switches every rank's schedules (the caches of built schedules, prepared calls
and C lanes are emptied, so the block's warm call builds them again). Prints per row each
way's median block - a block's time is the slowest rank's median call - and first /
alongside on the median block and over the block pairs (> 1: riding the last round is
faster). Ranks are pinned as mpirun pins Open MPI's (ringlet.bench.bind_like_mpirun);
inputs are written again before every call.
"""
from __future__ import annotations

import argparse

import numpy as np


def _first(s) -> None:
    """The barrier's rounds before the algorithm's: the order before agree_alongside."""
    from ringlet.algorithms import barrier
    agree = barrier.dissemination(s.p).rounds
    s.alone = list(s.rounds)
    s.rounds[:0] = agree
    s.agreement = len(agree)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="gather,scatter")
    ap.add_argument("--sizes", default="1M,8M")
    ap.add_argument("--kinds", default="plain", help="plain,rl.empty")
    ap.add_argument("--algorithm", default="direct")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args(argv)

    import ringlet as rl
    from ringlet import algorithms, collectives
    from ringlet.bench import _make_call, alternating_blocks, bind_like_mpirun, paged_empty
    from ringlet.bench import parse_sizes
    from ringlet.runtime import drop_lanes
    rl.init()
    rank, p = rl.get_rank(), rl.get_world_size()
    bind_like_mpirun(rank, p)
    alongside = algorithms.agree_alongside

    def switch(way):
        algorithms.agree_alongside = alongside if way == "alongside" else _first
        algorithms._build.cache_clear()
        collectives._CALLS.clear()
        drop_lanes()

    try:
        for op in a.ops.split(","):
            for size in parse_sizes(a.sizes):
                for kind in a.kinds.split(","):
                    call, reset, check = _make_call(
                        rl, op, size, p, rank, np.dtype(np.float32), a.algorithm,
                        zero_copy=kind == "rl.empty", fresh=True, plain=paged_empty)
                    res = alternating_blocks(rl, {w: (call, reset) for w in ("first", "alongside")},
                                             a.blocks, a.calls, switch=switch)
                    if check():
                        raise AssertionError(f"{op} {size} {kind}: wrong result")
                    if rank == 0:
                        f, g = (np.array(res[w]) for w in ("first", "alongside"))
                        pairs = np.sort(f / g)
                        print(f"{op:10} p={p} {size >> 10:>6} KiB {kind:8}  first "
                              f"{np.median(f):7.0f} us  alongside {np.median(g):7.0f} us  "
                              f"first/alongside {np.median(f) / np.median(g):.2f} (pairs "
                              f"{pairs[0]:.2f}-{np.median(pairs):.2f}-{pairs[-1]:.2f})",
                              flush=True)
    finally:
        switch("alongside")
        rl.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
