"""Rooted collectives' agreement, three ways in one job, in alternating blocks of calls, so
the job's placement, its memory and the host's load fall on all alike:

* ``first``: the barrier's rounds all before the data (as until 2026-12-02);
* ``last``: the algorithm's first round riding the barrier's last round (as for a first
  round of messages up to ``algorithms.EARLY_MIN_BYTES``);
* ``early``: the library's default (``algorithms.agree_alongside``): a larger first round
  posted right after the barrier's first round and waited for after its last
  (``Schedule.early``) where lg p >= 2, else as ``last``.

    ringlet run -n 4 bench/agreement_order.py                 # gather, scatter; 1 and 8 MiB
    ringlet run -n 4 bench/agreement_order.py --ops gather,scatter,broadcast,reduce \\
        --kinds plain,rl.empty --algorithm auto --blocks 10 --ways last,early

Each block switches every rank's schedules (the caches of built schedules, prepared calls
and C lanes are emptied, so the block's warm call builds them again). Prints per row each
way's median block - a block's time is the slowest rank's median call - and each other
way's time over the last one named, on the median block and over the block pairs (> 1:
the last way is faster). Ranks are pinned as mpirun pins Open MPI's
(ringlet.bench.bind_like_mpirun); inputs are written again before every call.
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


WAYS = ("first", "last", "early")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="gather,scatter")
    ap.add_argument("--sizes", default="1M,8M")
    ap.add_argument("--kinds", default="plain", help="plain,rl.empty")
    ap.add_argument("--algorithm", default="direct")
    ap.add_argument("--ways", default="first,last,early",
                    help="a subset of first,last,early; the others are compared with the last named")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args(argv)
    ways = a.ways.split(",")
    if not ways or set(ways) - set(WAYS):
        ap.error(f"--ways: a subset of {','.join(WAYS)}")

    import ringlet as rl
    from ringlet import algorithms, collectives
    from ringlet.bench import _make_call, alternating_blocks, bind_like_mpirun, paged_empty
    from ringlet.bench import parse_sizes
    from ringlet.runtime import drop_lanes
    rl.init()
    rank, p = rl.get_rank(), rl.get_world_size()
    bind_like_mpirun(rank, p)
    alongside, bound = algorithms.agree_alongside, algorithms.EARLY_MIN_BYTES

    def switch(way):
        algorithms.agree_alongside = _first if way == "first" else alongside
        algorithms.EARLY_MIN_BYTES = 1 << 62 if way == "last" else bound
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
                    res = alternating_blocks(rl, {w: (call, reset) for w in ways},
                                             a.blocks, a.calls, switch=switch)
                    if check():
                        raise AssertionError(f"{op} {size} {kind}: wrong result")
                    if rank == 0:
                        base = np.array(res[ways[-1]])
                        line = [f"{op:10} p={p} {size >> 10:>6} KiB {kind:8}"]
                        line += [f"{w} {np.median(res[w]):7.0f} us" for w in ways]
                        for w in ways[:-1]:
                            t = np.array(res[w])
                            pairs = np.sort(t / base)
                            line.append(f"{w}/{ways[-1]} {np.median(t) / np.median(base):.2f} "
                                        f"(pairs {pairs[0]:.2f}-{np.median(pairs):.2f}-"
                                        f"{pairs[-1]:.2f})")
                        print("  ".join(line), flush=True)
    finally:
        switch("early")
        rl.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
