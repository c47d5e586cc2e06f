"""Buffer kinds side by side inside one job: plain NumPy buffers (read by cross-memory attach
where ringlet offers it), the same with CMA turned off for the block (two copies through
the ring), and rl.empty buffers, in alternating blocks of calls, so the job's placement on
the cores and the host's load fall on every kind alike.

    python bench/buffer_kinds.py --op all_gather -n 2 --size 8M [--blocks 6 --calls 15]

Prints per kind the median over blocks of each block's median call (slowest rank), the
blocks themselves, and rank 0's voluntary / involuntary context switches and minor page
faults per call: a block that slept on its peers shows ~1 or more voluntary switches per
call (issue 27: the slow mode of large calls is waits that outlast the 100 us spin and
sleep, and the wake-up that then costs hundreds of microseconds on a loaded VM).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np

from ringlet.cost.model import parse_size

KINDS = ("plain", "two_copy", "rl.empty")


def _call(rl, op, size, p, rank, kind):
    alloc = rl.empty if kind == "rl.empty" else np.empty
    per = max(size // 4 // p, 1)
    if op == "broadcast":
        x = alloc(size // 4, np.float32)
        x[:] = rank
        return lambda: rl.broadcast(x, 0)
    if op == "all_reduce":
        x = alloc(size // 4, np.float32)
        x[:] = rank
        return lambda: rl.all_reduce(x)
    if op == "all_gather":
        x, y = alloc(per, np.float32), alloc((p, per), np.float32)
        x[:] = rank
        return lambda: rl.all_gather(y, x)
    x, y = alloc((p, per), np.float32), alloc((p, per) if op == "all_to_all" else per, np.float32)
    x[:] = rank
    if op == "all_to_all":
        return lambda: rl.all_to_all(y, x)
    if op == "reduce_scatter":
        return lambda: rl.reduce_scatter(y, x)
    raise SystemExit("--op: one of broadcast, all_reduce, all_gather, all_to_all, reduce_scatter")


def _worker(rank, op, size, blocks, calls, out):
    import ringlet as rl
    from ringlet.runtime import engine
    from ringlet.transport.shm import ShmPeer
    p = rl.get_world_size()
    peers = [q for q in engine().peers.values() if isinstance(q, ShmPeer)]
    cma_min = {id(q): q.cma_min for q in peers}
    fns = {k: _call(rl, op, size, p, rank, k) for k in KINDS}
    for k in KINDS:
        for _ in range(3):
            fns[k]()
    res = {k: [] for k in KINDS}
    ran = {}
    use = {k: np.zeros(3) for k in KINDS}
    for _ in range(blocks):
        for k in KINDS:
            for q in peers:     # (the sender decides whether to offer CMA)
                q.cma_min = -1 if k == "two_copy" else cma_min[id(q)]
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            ts = []
            for _ in range(calls):
                rl.barrier()
                t0 = time.perf_counter()
                fns[k]()
                ts.append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            ran[k] = rl.stats()["collectives"].get(op, {}).get("algorithm")   # (before the max below)
            use[k] += [r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw,
                       r1.ru_minflt - r0.ru_minflt]
            t = np.array([np.median(ts)])
            rl.all_reduce(t, op=rl.ReduceOp.MAX, algorithm="recursive_doubling")
            res[k].append(t[0] * 1e6)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"res": res, "use": {k: (v / (blocks * calls)).tolist()
                                           for k, v in use.items()}, "ran": ran}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="all_gather")
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--size", default="8M")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--calls", type=int, default=15)
    a = ap.parse_args(argv)
    from ringlet.launch import spawn
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        spawn(_worker, a.n, args=(a.op, parse_size(a.size), a.blocks, a.calls, out))
        got = json.load(open(out))
    print(f"{a.op} p={a.n} {a.size}, load {os.getloadavg()[0]:.1f}")
    for k in KINDS:
        v = got["res"][k]
        vol, invol, flt = got["use"][k]
        print(f"  {k:<9} {got['ran'][k]:<18} median {np.median(v):8.1f} us   blocks {' '.join(f'{x:.0f}' for x in v)}"
              f"   per call: {vol:.2f} voluntary, {invol:.2f} involuntary switches, "
              f"{flt:.2f} minor faults")
    return 0


if __name__ == "__main__":
    sys.exit(main())
