"""A one-way message read in place from rl.empty buffers: reduced (or copied) by both its
ends at once (split.py) against by its receiver alone, in one job, in alternating blocks of
calls, at each size - where limits.SPLIT_REDUCE_MIN and SPLIT_MIN come from.

    ringlet run -n 2 bench/reduce_split.py                          # reduce, 1-32 MiB
    ringlet run -n 2 bench/reduce_split.py --op broadcast --algorithm direct

The split arm splits every message from SPLIT_MIN (1 MiB) on, whatever its kind; the alone
arm none. Prints per size each arm's median block (the slowest rank's median call) and
split / alone (< 1: the split is faster). Inputs are written again before every call;
ranks are pinned as mpirun pins Open MPI's.
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="reduce", choices=("reduce", "broadcast"))
    ap.add_argument("--algorithm", default="dissemination")
    ap.add_argument("--sizes", default="1M,1536K,2M,3M,4M,8M,32M")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args(argv)

    import ringlet as rl
    from ringlet.bench import alternating_blocks, bind_like_mpirun, parse_sizes
    from ringlet.runtime import engine
    from ringlet.transport import split
    from ringlet.transport.shm import ShmPeer
    rl.init()
    rank = rl.get_rank()
    bind_like_mpirun(rank, rl.get_world_size())
    peers = [q for q in engine().peers.values() if isinstance(q, ShmPeer)]
    ends = [(q.split_sender, q.split_receiver) for q in peers]
    if any(s is None for s, _ in ends):
        raise SystemExit("the split is off here (no C fast path, or RINGLET_SPLIT=0)")
    least = split.REDUCE_MIN_BYTES

    def switch(arm):
        for q, (s, r) in zip(peers, ends):
            q.split_sender, q.split_receiver = (s, r) if arm == "split" else (None, None)
        split.REDUCE_MIN_BYTES = split.MIN_BYTES

    try:
        for size in parse_sizes(a.sizes):
            x = rl.empty(size // 4, np.float32)
            if a.op == "reduce":
                def call():
                    rl.reduce(x, 0, algorithm=a.algorithm)
            else:
                def call():
                    rl.broadcast(x, 0, algorithm=a.algorithm)
            res = alternating_blocks(rl, {arm: (call, lambda: x.fill(rank + 1))
                                          for arm in ("alone", "split")},
                                     a.blocks, a.calls, switch=switch)
            if rank == 0:
                s, o = (float(np.median(res[arm])) for arm in ("split", "alone"))
                print(f"{a.op} p=2 {size >> 10:>6} KiB  alone {o:7.0f} us  split {s:7.0f} us"
                      f"  split/alone {s / o:.2f}", flush=True)
    finally:
        for q, (s, r) in zip(peers, ends):
            q.split_sender, q.split_receiver = s, r
        split.REDUCE_MIN_BYTES = least
        rl.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
