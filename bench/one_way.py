"""One-way large messages from plain buffers inside one job: split by cross-memory attach
(the sender writes the head into the receive buffer while the receiver reads the tail,
transport/cma.py) against streamed through the ring, in alternating blocks of calls, so
both see the same processes, buffers and spell of load. Fresh jobs against Open MPI:
bench/single_copy.py.

    python bench/one_way.py                          # broadcast, scatter, gather, p2p; p = 2
    python bench/one_way.py --ops scatter --p 4 --size 8M --blocks 10
    python bench/one_way.py --whole --ops scatter,gather,broadcast,reduce --p 3,4 --size 1M,8M

The senders decide per message (their ``cma.put_ok``), so a block turns it off on every
rank. Splitting is forced on (RINGLET_CMA_PUT=1) so that crowded ranks (p > cores) can be
compared too. Ranks are pinned as mpirun pins Open MPI's (ringlet.bench.bind_like_mpirun). Prints per row the median and best call (slowest rank) of each, and the ratio
stream / split (> 1: the split is faster), with the load average. ``--whole``: where ranks
outnumber cores, read whole by the receiver (cma.Reader.reads_whole, the default there)
against streamed, the split left as it is by default.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import ringlet as rl
from ringlet.bench import bind_like_mpirun, parse_sizes
from ringlet.runtime import engine
from ringlet.transport.shm import ShmPeer


def _split(on: bool, whole: bool) -> None:
    for q in engine().peers.values():
        if isinstance(q, ShmPeer):
            if whole:
                q.cma.whole_crowded = on
            else:
                q.cma.put_ok = on


def _job(rank, op, nbytes, blocks, per, whole=False):
    p = rl.get_world_size()
    bind_like_mpirun(rank, p)
    m = nbytes // 4 // p * p
    if op == "broadcast":
        x = np.ones(m, np.float32)
        call = lambda: rl.broadcast(x, 0)  # noqa: E731
    elif op == "scatter":
        y = np.zeros(m // p, np.float32)
        x = np.ones((p, m // p), np.float32) if rank == 0 else None
        call = lambda: rl.scatter(y, x, 0)  # noqa: E731
    elif op == "gather":
        x = np.ones(m // p, np.float32)
        y = np.zeros((p, m // p), np.float32) if rank == 0 else None
        call = lambda: rl.gather(x, y, 0)  # noqa: E731
    elif op == "reduce":
        x = np.ones(m, np.float32)
        call = lambda: rl.reduce(x, 0)  # noqa: E731
    else:   # p2p: rank 0 sends to rank 1
        x = np.ones(m, np.float32)
        call = ((lambda: rl.send(x, 1)) if rank == 0 else (lambda: rl.recv(x, 0))
                if rank == 1 else (lambda: None))
    times = {True: [], False: []}
    for _ in range(blocks):
        for on in (True, False):
            _split(on, whole)
            for i in range(per + 2):            # (2 warm-up calls per block)
                rl.barrier()
                t0 = time.perf_counter()
                call()
                if i >= 2:
                    times[on].append(time.perf_counter() - t0)
    out = np.array([np.median(times[True]), np.min(times[True]),
                    np.median(times[False]), np.min(times[False])]) * 1e6
    rl.all_reduce(out, op=rl.ReduceOp.MAX)
    if rank == 0:
        name = "whole" if whole else "split"
        print(f"{op:<9} p={p} {nbytes >> 20:>3} MiB  {name} {out[0]:7.0f} (best {out[1]:6.0f})  "
              f"stream {out[2]:7.0f} (best {out[3]:6.0f})  stream/{name} {out[2] / out[0]:.2f}  "
              f"load {os.getloadavg()[0]:.1f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="broadcast,scatter,gather,p2p")
    ap.add_argument("--p", default="2")
    ap.add_argument("--size", default="8M")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--per", type=int, default=10, help="timed calls per block")
    ap.add_argument("--whole", action="store_true",
                    help="whole reads against the stream where ranks outnumber cores")
    a = ap.parse_args(argv)
    for size in parse_sizes(a.size):
        for p in map(int, a.p.split(",")):
            for op in a.ops.split(","):
                rl.spawn(_job, p, args=(op, size, a.blocks, a.per, a.whole),
                         env=None if a.whole else {"RINGLET_CMA_PUT": "1"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
