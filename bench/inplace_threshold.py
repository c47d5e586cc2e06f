"""Where reading an rl.empty message in place pays: the same message, from the same rl.empty
buffers, sent by the in-place protocol (RTS, the receiver copies straight from the sender's
buffer, CTS) and by the plain path (what a NumPy buffer's message takes: one EAGER packet,
streamed through the ring, or RTS/CTS/DATA - or CMA in a round that receives too), in
alternating blocks of calls inside one job, so load and placement fall on both alike.

    python bench/inplace_threshold.py [--sizes 256K,512K,768K,1M,2M,4M,8M] [--blocks 8 --calls 12]

Two patterns at p = 2, each with one message of SIZE per rank: "one-way" (broadcast,
algorithm direct: rank 0 sends, rank 1 receives) and "exchange" (all_to_all, pairwise:
both send and receive). Prints per size the median over blocks of each block's median call
(slowest rank) and its best block, for both paths, and in-place / plain. ZERO_COPY_MIN in
transport/limits.py is set from this: the in-place protocol is taken only above the size
where it measured faster in both patterns.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

from ringlet.bench import slowest_median_us
from ringlet.cost.model import parse_size

PATTERNS = {"one-way": ("broadcast", "direct"), "exchange": ("all_to_all", "pairwise")}
PATHS = ("plain", "in place")


def _worker(rank, sizes, blocks, calls, out):
    import ringlet as rl
    from ringlet.runtime import engine
    from ringlet.transport.shm import ShmPeer
    peers = [q for q in engine().peers.values() if isinstance(q, ShmPeer)]
    res = {}
    for pat, (op, algo) in PATTERNS.items():
        for size in sizes:
            n = size // 4
            if op == "broadcast":
                x = rl.empty(n, np.float32)
                x[:] = rank
                fn = lambda: rl.broadcast(x, 0, algorithm=algo)   # noqa: E731
            else:
                x, y = rl.empty((2, n), np.float32), rl.empty((2, n), np.float32)
                x[:] = rank
                fn = lambda: rl.all_to_all(y, x, algorithm=algo)   # noqa: E731
            got = {k: [] for k in PATHS}
            for b in range(blocks + 1):
                for k in PATHS:
                    for q in peers:   # the sender decides the protocol of its message
                        q.zc_min = q.zc_oneway_min = 0 if k == "in place" else 1 << 62
                    t = slowest_median_us(rl, fn, calls)
                    if b:      # (block 0 warms both paths up)
                        got[k].append(t)
            res[f"{pat} {size}"] = got
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256K,512K,768K,1M,2M,4M,8M")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=12)
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    from ringlet.launch import spawn
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        spawn(_worker, 2, args=(sizes, a.blocks, a.calls, out))
        got = json.load(open(out))
    print(f"p=2, {a.blocks} blocks of {a.calls} calls per path, load {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'pattern':9} {'message':>8} {'plain: median':>14} {'best':>7} {'in place: median':>17} "
          f"{'best':>7} {'in place / plain: median':>25} {'best':>6}")
    for key, got in got.items():
        pat, size = key.split()
        pl, ip = np.array(got["plain"]), np.array(got["in place"])
        print(f"{pat:9} {int(size) >> 10:>7}K {np.median(pl):14.1f} {pl.min():7.1f} "
              f"{np.median(ip):17.1f} {ip.min():7.1f} {np.median(ip) / np.median(pl):25.2f} "
              f"{ip.min() / pl.min():6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
