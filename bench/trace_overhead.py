"""What tracing costs: per-call time of a small all_reduce with tracing off and on, side by
side in turns, and - with --baseline - off against a checkout without the tracing hooks.

    .venv/bin/python bench/trace_overhead.py [-n 2] [--turns 5] [--baseline /path/to/tree]

Rows: 8 B all_reduce (the C fast path: the hooks' cost per call), an 8 B send/recv round
trip (point-to-point hooks) and 64 KiB all_reduce with the fast path off (the Python
engine: on-cost per message = (on - off) / messages a rank sends and receives per call).
Medians of each turn, the slowest rank's; compare within one run only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import json, sys, time, numpy as np, ringlet as rl
nbytes, iters, algo, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
def job(rank):
    x = np.zeros(max(nbytes // 4, 2), np.float32)   # sums stay 0: no overflow
    if algo == "p2p":       # a round trip: rank 0 sends and receives, rank 1 the reverse
        peer = 1 - rank
        def step():
            if rank == 0:
                rl.send(x, peer); rl.recv(x, peer)
            elif rank == 1:
                rl.recv(x, peer); rl.send(x, peer)
    else:
        def step():
            rl.all_reduce(x, algorithm=algo)
    for _ in range(200):
        step()
    ts = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter(); step(); ts[i] = time.perf_counter() - t0
    t = np.array([np.median(ts)])
    rl.all_reduce(t, op=rl.ReduceOp.MAX, algorithm="recursive_doubling")
    if rank == 0:
        open(out, "w").write(json.dumps(float(t[0])))
rl.spawn(job, int(sys.argv[5]))
"""


def measure(tree, n, nbytes, iters, algo, trace_dir=None, no_fast=False) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "t.json")
        env = dict(os.environ, PYTHONPATH=tree)
        env.pop("RINGLET_TRACE", None)
        if trace_dir:
            env["RINGLET_TRACE"] = trace_dir
        if no_fast:
            env["RINGLET_NO_FASTPATH"] = "1"
        subprocess.run([sys.executable, "-c", WORKER, str(nbytes), str(iters), algo, out, str(n)],
                       env=env, check=True, cwd=d)
        return json.load(open(out)) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--baseline", default=None, help="a ringlet tree without the hooks")
    ap.add_argument("--cases", default=None, help="comma-separated case numbers (0, 1, 2)")
    a = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cases = [("8 B all_reduce, C fast path", 8, "auto", False),
             ("8 B send + recv round trip, C fast path", 8, "p2p", False),
             ("64 KiB ring all_reduce, Python engine", 64 << 10, "ring", True)]
    if a.cases:
        cases = [cases[int(i)] for i in a.cases.split(",")]
    for name, nbytes, algo, no_fast in cases:
        msgs = 2 * (2 * (a.n - 1)) if algo == "ring" else None   # sends + receives per rank
        rows = {"off": [], "on": []} | ({"baseline": []} if a.baseline else {})
        for _ in range(a.turns):
            with tempfile.TemporaryDirectory() as tdir:
                if a.baseline:
                    rows["baseline"].append(measure(a.baseline, a.n, nbytes, a.iters, algo,
                                                    no_fast=no_fast))
                rows["off"].append(measure(here, a.n, nbytes, a.iters, algo, no_fast=no_fast))
                rows["on"].append(measure(here, a.n, nbytes, a.iters, algo, tdir, no_fast))
        print(f"{name}, p = {a.n}: per-call median us, {a.turns} turns")
        for k, v in rows.items():
            print(f"  {k:<9}" + " ".join(f"{x:7.2f}" for x in v))
        diffs = [on - off for on, off in zip(rows["on"], rows["off"])]
        line = f"  on - off per call: " + " ".join(f"{d:+.2f}" for d in diffs) + " us"
        if msgs:
            line += f"; per message ({msgs} per rank per call): " + " ".join(
                f"{d / msgs:+.2f}" for d in diffs) + " us"
        print(line)
        if a.baseline:
            print("  off - baseline per call: " + " ".join(
                f"{o - b:+.2f}" for o, b in zip(rows["off"], rows["baseline"])) + " us")
    print(hook_cost())
    return 0


def hook_cost(reps: int = 20000) -> str:
    """The recording itself, in one process (no other rank's noise): what a round's
    hooks cost per message, for a send and a receive of a plain array."""
    import time

    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ringlet import tracing
    from ringlet.transport.shm import EAGER_BYTES, STREAM_BYTES, ZERO_COPY_MIN

    class Peer:      # the attributes path_of reads, as a shared-memory peer has them
        zero_copy, zc_min, eager, stream_max = True, ZERO_COPY_MIN, EAGER_BYTES, STREAM_BYTES

    with tempfile.TemporaryDirectory() as d:
        tracing.start(d, 0, 2)
        bufs = {"buf": np.zeros(1 << 14, np.float32)}
        sends = ((1, "buf", 0, 4096),)
        recvs = ((1, True, "buf", 4096, 8192, None, 0, 0),)
        call = tracing.Call(("all_reduce", 1, "world", "ring"), 1, 1 << 16, 2,
                            ((), recvs, sends), {1: Peer()})
        t0 = time.perf_counter()
        for _ in range(reps):
            call.posted(sends, bufs)
            call.round_done(recvs, bufs)
        per = (time.perf_counter() - t0) / (2 * reps)
        tracing.stop()
    return f"recording, in one process: {per * 1e6:.2f} us per message (send or receive)"


if __name__ == "__main__":
    sys.exit(main())
