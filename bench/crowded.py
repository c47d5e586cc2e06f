"""Crowded one-way messages (ranks outnumber cores: p = 3-4 on 2 cores) from plain buffers:
read whole by each receiver (RTS_CMA, the default, transport/cma.py) against streamed
through the ring (RINGLET_CMA_CROWDED=0, as before), and both against Open MPI - fresh jobs
in turns (bench/targets.py's interleaved: A, B, rl.empty A, rl.empty B, Open MPI, A, ...),
so a spell of load hits every side alike.

    python bench/crowded.py                                  # scatter, p = 4, 1 and 8 MiB
    python bench/crowded.py --ops scatter,broadcast,gather,reduce --p 3,4 --repeats 5
    python bench/crowded.py --env RINGLET_SPLIT --algos direct,binomial
    python bench/crowded.py --before /work/main --ops scatter,gather --p 2,4   # A: this tree

With --before, B is another checkout of ringlet (its own PYTHONPATH) instead of VAR=0: each
job of either side is started from a fresh Python that imports its tree.

Prints per row the median job (and the range over jobs) of each side, in microseconds, and
Open MPI's median over each side's (> 1: that side is faster), with the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

import targets
from targets import interleaved, theirs

from ringlet.bench import parse_sizes, run_ringlet


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_tree(tree, op, p, sizes, algo, iters, zc):
    """run_ringlet's rows, from a Python that imports ringlet from ``tree``."""
    code = ("import json, sys; from ringlet.bench import run_ringlet; "
            f"print(json.dumps(run_ringlet({op!r}, {p}, {sizes!r}, [{algo!r}], iters={iters!r}, "
            f"progress=False, zero_copy={zc!r})))")
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tree)
    if out.returncode:
        return f"{tree}: {out.stderr.strip().splitlines()[-1:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="scatter")
    ap.add_argument("--p", default="4", help="comma-separated group sizes")
    ap.add_argument("--sizes", default="1M,8M")
    ap.add_argument("--env", default="RINGLET_CMA_CROWDED",
                    help="the switch compared: VAR=1 (A) against VAR=0 (B)")
    ap.add_argument("--algos", default="auto", help="comma-separated: one row each")
    ap.add_argument("--repeats", type=int, default=5, help="fresh jobs per side")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--no-zc", action="store_true", help="skip the rl.empty sides")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain NumPy sides")
    ap.add_argument("--no-mpi", action="store_true")
    ap.add_argument("--only-a", action="store_true", help="skip the B sides (compare --algos)")
    ap.add_argument("--before", help="B: this checkout of ringlet (A: this one), not VAR=0")
    a = ap.parse_args(argv)
    targets.REPEATS = a.repeats
    sizes = parse_sizes(a.sizes)
    algos = a.algos.split(",")
    print(f"load before: {open('/proc/loadavg').read().split()[:3]}")
    for op in a.ops.split(","):
        for p in map(int, a.p.split(",")):
            jobs = {}
            for algo in algos:
                for zc in [False] * (not a.no_plain) + [True] * (not a.no_zc):
                    for on in ("1",) if a.only_a else ("1", "0"):
                        name = f"{'zc' if zc else 'plain'} {'A' if on == '1' else 'B'} {algo}"
                        if a.before:
                            tree = HERE if on == "1" else a.before
                            jobs[name] = (lambda zc=zc, tree=tree, algo=algo: _in_tree(
                                tree, op, p, sizes, algo, a.iters, zc))
                            continue
                        jobs[name] = (lambda zc=zc, on=on, algo=algo: run_ringlet(
                            op, p, sizes, [algo], iters=a.iters, progress=False,
                            zero_copy=zc, env={a.env: on}))
            if not a.no_mpi:
                jobs["mpi"] = theirs("mpi", op, p, sizes, a.iters)
            got = interleaved(jobs)
            what = f"A: {HERE}, B: {a.before}" if a.before else f"A: {a.env}=1, B: {a.env}=0"
            print(f"\n{op} p={p}  ({what}; us: median job (best job) of "
                  f"{a.repeats}; mpi/side on medians)  load "
                  f"{open('/proc/loadavg').read().split()[:3]}")
            mpi = got.get("mpi")
            mpi = {r["bytes"]: r for r in mpi} if isinstance(mpi, list) else {}
            for nbytes in sizes:
                head = f"  {nbytes >> 20} MiB" if nbytes >> 20 else f"  {nbytes} B"
                if nbytes in mpi:
                    head += f"  mpi {mpi[nbytes]['median_us']:.0f} ({mpi[nbytes]['time_us']:.0f})"
                print(head)
                for name, rows in got.items():
                    if name == "mpi":
                        continue
                    if isinstance(rows, str):
                        print(f"    {name}: {rows}")
                        continue
                    for r in rows:
                        if r["bytes"] != nbytes:
                            continue
                        ratio = (f"  mpi/side {mpi[nbytes]['median_us'] / r['median_us']:.2f}"
                                 if nbytes in mpi else "")
                        print(f"    {name:<22} ran {r.get('ran')}: {r['median_us']:.0f} "
                              f"({r['time_us']:.0f}){ratio}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    np.set_printoptions(precision=3)
    sys.exit(main())
