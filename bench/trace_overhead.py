"""What tracing costs: per-call time of a small all_reduce with tracing off and on, side by
side in turns, and - with --baseline - off against a checkout without the tracing hooks.

    .venv/bin/python bench/trace_overhead.py [-n 2] [--turns 5] [--baseline /path/to/tree]

Rows: 8 B all_reduce on one rank (the hooks' cost per call, with no other rank to wait
for: the steadiest on a busy host), on -n ranks (the C fast path), an 8 B send/recv round
trip (point-to-point hooks) and 64 KiB all_reduce with the fast path off (the Python
engine). On-cost per message = (on - off) / messages a rank sends and receives per call.
Each turn's median and 10th percentile, the slowest rank's; compare within one run only.
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
    t = np.array([np.median(ts), np.percentile(ts, 10)])
    if rl.get_world_size() > 1:
        rl.all_reduce(t, op=rl.ReduceOp.MAX, algorithm="recursive_doubling")
    if rank == 0:
        open(out, "w").write(json.dumps([float(x) for x in t]))
rl.spawn(job, int(sys.argv[5]))
"""


def measure(tree, n, nbytes, iters, algo, trace_dir=None, no_fast=False) -> list:
    """[median, 10th percentile] of the per-call microseconds, the slowest rank's."""
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
        return [x * 1e6 for x in json.load(open(out))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--baseline", default=None, help="a ringlet tree without the hooks")
    ap.add_argument("--cases", default=None, help="comma-separated case numbers (0-3)")
    a = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cases = [("8 B all_reduce, 1 rank (no other rank's noise)", 1, 8, "auto", False),
             ("8 B all_reduce, C fast path", a.n, 8, "auto", False),
             ("8 B send + recv round trip, C fast path", 2, 8, "p2p", False),
             ("64 KiB ring all_reduce, Python engine", a.n, 64 << 10, "ring", True)]
    if a.cases:
        cases = [cases[int(i)] for i in a.cases.split(",")]
    for name, n, nbytes, algo, no_fast in cases:
        msgs = {"ring": 2 * (2 * (n - 1)), "p2p": 2, "auto": 2 * (n - 1)}[algo]  # per rank and call
        rows = {"off": [], "on": []} | ({"baseline": []} if a.baseline else {})
        for _ in range(a.turns):
            with tempfile.TemporaryDirectory() as tdir:
                if a.baseline:
                    rows["baseline"].append(measure(a.baseline, n, nbytes, a.iters, algo,
                                                    no_fast=no_fast))
                rows["off"].append(measure(here, n, nbytes, a.iters, algo, no_fast=no_fast))
                rows["on"].append(measure(here, n, nbytes, a.iters, algo, tdir, no_fast))
        print(f"{name}, p = {n}: per-call us, {a.turns} turns (median / 10th percentile)")
        for k, v in rows.items():
            print(f"  {k:<9}" + " ".join(f"{m:7.2f}/{q:<7.2f}" for m, q in v))
        for stat, i in (("median", 0), ("10th pct", 1)):
            diffs = [on[i] - off[i] for on, off in zip(rows["on"], rows["off"])]
            line = f"  on - off, {stat}: " + " ".join(f"{d:+.2f}" for d in diffs) + " us"
            if msgs:
                line += f"; per message ({msgs} per rank and call): " + " ".join(
                    f"{d / msgs:+.2f}" for d in diffs) + " us"
            print(line)
            if a.baseline:
                print(f"  off - baseline, {stat}: " + " ".join(
                    f"{o[i] - b[i]:+.2f}" for o, b in zip(rows["off"], rows["baseline"])) + " us")
    print(hook_cost())
    return 0


def hook_cost(reps: int = 2000, repeat: int = 31) -> str:
    """The recording itself, in one process (no other rank's noise), the best of
    ``repeat`` runs: a call's record (made, then ended), and a round's hooks per message
    for a send and a receive of a plain array."""
    import timeit

    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ringlet import tracing
    from ringlet.transport.shm import EAGER_BYTES, STREAM_BYTES, ZERO_COPY_MIN

    class Peer:      # the attributes path_of reads, as a shared-memory peer has them
        zero_copy, zc_min, eager, stream_max = True, ZERO_COPY_MIN, EAGER_BYTES, STREAM_BYTES

    from ringlet.schedule import PlanRound
    from ringlet.transport.fast import FastRun
    from ringlet.work import CallId
    what = CallId("all_reduce", 1, "world", "ring")
    with tempfile.TemporaryDirectory() as d:
        tracing.start(d, 0, 2)
        bufs = {"buf": np.zeros(1 << 14, np.float32)}
        sends = ((1, "buf", 0, 4096),)
        recvs = ((1, True, "buf", 4096, 8192, None, 0, 0),)
        plan = PlanRound((), sends, recvs)

        def call():
            tracing.Call(what, 1, 1 << 16, 2, plan,
                         {1: Peer()}).end(0.0, None)
        c = tracing.Call(what, 1, 1 << 16, 2, plan, {1: Peer()})

        def messages():
            c.posted(sends, bufs)
            c.round_done(recvs, bufs)
        cbufs = dict(bufs, tmp=np.zeros(0, np.float32))

        peers, ran = {1: Peer()}, FastRun(1, -1, 0.0, 0.0, 1)

        def c_call():      # a call of one round the C fast path ran: 1 send, 1 receive
            tracing.Call(what, 1, 1 << 16, 2, (plan,), peers).ran_in_c(ran, 1, cbufs)
        try:
            per_call = min(timeit.repeat(call, number=reps, repeat=repeat)) / reps
            per_msg = min(timeit.repeat(messages, number=reps, repeat=repeat)) / (2 * reps)
            per_c = min(timeit.repeat(c_call, number=reps, repeat=repeat)) / reps
        finally:
            tracing.stop()
    return (f"recording, in one process (best of {repeat}): {per_call * 1e6:.2f} us per call, "
            f"{per_msg * 1e6:.2f} us per message (send or receive) in Python; a call of 2 "
            f"messages in C {per_c * 1e6:.2f} us in all")


if __name__ == "__main__":
    sys.exit(main())
