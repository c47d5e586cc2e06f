"""Single copy on one host, measured side by side: ringlet with plain NumPy buffers read by
cross-memory attach (CMA, transport/cma.py), the same with it off (RINGLET_CMA=0: two
copies through the ring), rl.empty buffers (read in place through a shared mapping) and
Open MPI (which uses CMA here), taken in turns (A B C D, A B C D, ...), each a fresh job.

    python bench/single_copy.py                       # 8 MiB, p = 2 and 4, 3 turns
    python bench/single_copy.py --sizes 1M,8M,64M --turns 5 --ops all_gather
    python bench/single_copy.py --base /work/wt/start # + another tree, plain and rl.empty

Prints per row the median over turns of each variant's time (each a job's median call,
slowest rank) and the ratios a user would see: Open MPI / ringlet (> 1: ringlet faster).
Not a unit test: the load average is printed beside every turn.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from ringlet.bench import parse_sizes, run_peer, run_ringlet

VARIANTS = ("cma", "no_put", "two_copy", "rl.empty", "mpi")
BASE_JOB = ("import json, sys; from ringlet.bench import run_ringlet; "
            "print(json.dumps(run_ringlet(sys.argv[1], int(sys.argv[2]), [int(sys.argv[3])], "
            "['auto'], iters=json.loads(sys.argv[4]), zero_copy=sys.argv[5] == '1', "
            "progress=False)[0]))")


def one(variant, op, p, size, iters, base=None):
    if variant.startswith("base"):     # the other tree, in its own interpreter
        env = dict(os.environ, PYTHONPATH=base)
        out = subprocess.run([sys.executable, "-c", BASE_JOB, op, str(p), str(size),
                              json.dumps(iters), "1" if variant == "base rl.empty" else "0"],
                             capture_output=True, text=True, env=env, cwd="/", check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        return row["time_us"], row.get("ran")
    if variant == "mpi":
        got = run_peer("mpi", op, p, [size], iters)
        return float("nan") if isinstance(got, str) else got[0]["time_us"]
    env = {"two_copy": {"RINGLET_CMA": "0"}, "no_put": {"RINGLET_CMA_PUT": "0"}}.get(variant)
    row = run_ringlet(op, p, [size], ["auto"], iters=iters, env=env,
                      zero_copy=variant == "rl.empty", progress=False)[0]
    return row["time_us"], row.get("ran")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="broadcast,all_gather,all_to_all,reduce_scatter,all_reduce")
    ap.add_argument("--p", default="2,4")
    ap.add_argument("--sizes", default="8M")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--base", help="another ringlet tree (built in place) to run in turns too")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="which to run (mpi is needed for the ratios): cma (one-way messages "
                         "split, the default), no_put (RINGLET_CMA_PUT=0: one-way messages "
                         "stream), two_copy (RINGLET_CMA=0), rl.empty, mpi")
    a = ap.parse_args(argv)
    variants = tuple(a.variants.split(",")) + (("base", "base rl.empty") if a.base else ())
    print(f"{'row':<28} {'variant':<9} {'median us':>10} {'ran':<20} turns (us)")
    for op in a.ops.split(","):
        for p in map(int, a.p.split(",")):
            for size in parse_sizes(a.sizes):
                times = {v: [] for v in variants}
                ran, loads = {}, []
                for _ in range(a.turns):
                    loads.append(os.getloadavg()[0])
                    for v in variants:
                        got = one(v, op, p, size, a.iters, a.base)
                        if isinstance(got, tuple):
                            got, ran[v] = got
                        times[v].append(got)
                row = f"{op} p={p} {size >> 20} MiB"
                med = {v: float(np.median(t)) for v, t in times.items()}
                for v in variants:
                    print(f"{row:<28} {v:<9} {med[v]:>10.1f} {ran.get(v, ''):<20} "
                          f"{' '.join(f'{t:.0f}' for t in times[v])}")
                mpi = med.get("mpi", float("nan"))
                print(f"{row:<28} x Open MPI (median): "
                      + "  ".join(f"{v} {mpi / med[v]:.2f}" for v in variants if v != "mpi")
                      + "; load " + " ".join(f"{x:.1f}" for x in loads), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
