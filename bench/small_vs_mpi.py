"""Small blocking calls by the clock, this tree, another checkout and Open MPI (mpi4py)
side by side, taken in turns (this, base, Open MPI, then the next turn in another order),
with the load average printed: 8 B all_reduce at p = 2 and p = 4, 8 B one-way
point-to-point (half of a blocking ping-pong's round trip) between 2 ranks, barrier at
p = 2 and p = 4, and then every other collective with 8 B per rank at p = 2 and 4
(``--cases 1,2,3``: the first three only).

    .venv/bin/python bench/small_vs_mpi.py [--base OTHER_CHECKOUT] [--turns 3]

Every side runs the same loop, measured the same way: microseconds per call of rank 0 in
the best of 12 blocks of 500 calls (ping-pongs), each block after a barrier - on a shared
host the best block is what the code costs, the rest is who else had the cores. Open MPI
runs under ``mpirun --oversubscribe`` (at p = 4 on 2 cores it yields the core while it
waits, as ringlet does). Takes ~1 min per turn on a quiet host. Needs mpirun and mpi4py
for the Open MPI column (bench/install_peers.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

LOOPS = r"""
import json, sys, time
import numpy as np

def blocks(call, barrier, n=500, k=12):
    for _ in range(n):
        call()
    best = []
    for _ in range(k):
        barrier()
        t = time.perf_counter()
        for _ in range(n):
            call()
        best.append((time.perf_counter() - t) / n * 1e6)
    return min(best)

def job(rank, size, kind, calls, send, recv, barrier, path):
    # calls: kind -> f(x, y, z), that collective on 8 B per rank: x, and y and z of p x 8 B
    x, y, z = np.ones(2, np.float32), np.ones((size, 2), np.float32), np.ones((size, 2), np.float32)
    if kind == "barrier":
        us = blocks(barrier, barrier)
    elif kind == "p2p":          # one way: half a round trip
        if rank == 0:
            us = blocks(lambda: (send(x, 1), recv(x, 1)), barrier) / 2
        else:
            us = blocks(lambda: (recv(x, 0), send(x, 0)), barrier)
    else:
        us = blocks(lambda: calls[kind](x, y, z), barrier)
    if rank == 0:
        open(path, "w").write(json.dumps(us))
"""

RINGLET = LOOPS + r"""
import ringlet as rl
kind, p, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
CALLS = {"all_reduce": lambda x, y, z: rl.all_reduce(x),
         "broadcast": lambda x, y, z: rl.broadcast(x, 0),
         "reduce": lambda x, y, z: rl.reduce(x, 0), "all_gather": lambda x, y, z: rl.all_gather(y, x),
         "reduce_scatter": lambda x, y, z: rl.reduce_scatter(x, y),
         "gather": lambda x, y, z: rl.gather(x, y, dst=0),
         "scatter": lambda x, y, z: rl.scatter(x, y, src=0),
         "all_to_all": lambda x, y, z: rl.all_to_all_single(z, y)}
def main(rank):
    job(rank, p, kind, CALLS, lambda a, r: rl.send(a, r), lambda a, r: rl.recv(a, r), rl.barrier,
        path)
rl.spawn(main, p, timeout=600)
"""

MPI = LOOPS + r"""
from mpi4py import MPI
c = MPI.COMM_WORLD
kind, path = sys.argv[1], sys.argv[3]
CALLS = {"all_reduce": lambda x, y, z: c.Allreduce(MPI.IN_PLACE, x),
         "broadcast": lambda x, y, z: c.Bcast(x, 0),
         "reduce": lambda x, y, z: c.Reduce(MPI.IN_PLACE if c.Get_rank() == 0 else x, x, root=0),
         "all_gather": lambda x, y, z: c.Allgather(x, y),
         "reduce_scatter": lambda x, y, z: c.Reduce_scatter_block(y, x),
         "gather": lambda x, y, z: c.Gather(x, y, root=0),
         "scatter": lambda x, y, z: c.Scatter(y, x, root=0),
         "all_to_all": lambda x, y, z: c.Alltoall(y, z)}
job(c.Get_rank(), c.Get_size(), kind, CALLS, lambda a, r: c.Send(a, r), lambda a, r: c.Recv(a, r),
    c.Barrier, path)
"""

CASES = (("8 B all_reduce p=2", "all_reduce", 2), ("8 B all_reduce p=4", "all_reduce", 4),
         ("8 B p2p one-way p=2", "p2p", 2), ("barrier p=2", "barrier", 2),
         ("barrier p=4", "barrier", 4)) + tuple(
    (f"8 B {k} p={p}", k, p) for k in ("broadcast", "reduce", "all_gather", "reduce_scatter",
                                       "gather", "scatter", "all_to_all") for p in (2, 4))


def measure(side: str, tree: str | None, kind: str, p: int) -> float | None:
    path = tempfile.mktemp(prefix="small_vs_mpi.", suffix=".json")
    if side == "Open MPI":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(p),
               sys.executable, "-c", MPI, kind, str(p), path]
        env = dict(os.environ)
    else:
        cmd = [sys.executable, "-c", RINGLET, kind, str(p), path]
        env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run(cmd, check=True, timeout=900, cwd="/", env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(path) as f:
        value = json.load(f)
    os.unlink(path)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="another checkout to measure beside this tree")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--cases", default="", help="comma-separated case numbers (1-based)")
    a = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = {"this": here}
    if a.base:
        sides["base"] = a.base
    try:
        import mpi4py  # noqa: F401
        if shutil.which("mpirun"):
            sides["Open MPI"] = None
    except ImportError:
        print("(no mpi4py: the Open MPI column is left out)")
    cases = [CASES[int(i) - 1] for i in a.cases.split(",")] if a.cases else list(CASES)
    got = {(c, s): [] for c, _, _ in cases for s in sides}
    loads = [os.getloadavg()[0]]
    names = list(sides)
    for turn in range(a.turns):
        order = names[turn % len(names):] + names[:turn % len(names)]
        for case, kind, p in cases:
            for side in order:
                got[(case, side)].append(measure(side, sides[side], kind, p))
        loads.append(os.getloadavg()[0])
    print(f"load average (1 min) at the start and after each turn: "
          f"{' '.join(f'{v:.1f}' for v in loads)}")
    print(f"{'case (us per call, turns sorted)':34}" + "".join(f"{s:>26}" for s in names))
    for case, _, _ in cases:
        cells = [" ".join(f"{v:.1f}" for v in sorted(got[(case, s)])) for s in names]
        print(f"{case:34}" + "".join(f"{c:>26}" for c in cells))
    for other in names[1:]:
        print(f"this / {other}, median of turns (best):")
        for case, _, _ in cases:
            t, o = sorted(got[(case, "this")]), sorted(got[(case, other)])
            print(f"  {case:32} {t[len(t) // 2] / o[len(o) // 2]:.2f} ({t[0] / o[0]:.2f})")


if __name__ == "__main__":
    main()
