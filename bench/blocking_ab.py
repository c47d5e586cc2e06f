"""Blocking calls side by side: this tree against another checkout, in turns, in one run.

    .venv/bin/python bench/blocking_ab.py --base OTHER_CHECKOUT [--turns 3]

OTHER_CHECKOUT is a directory holding another ringlet tree (built in place:
``python setup.py build_ext --inplace``), run by this interpreter; or that checkout's python.

Each side runs the same job in its own interpreter (its own ringlet): 8 B all_reduce at
p = 2 and p = 4 (microseconds per call in the best of 12 blocks of 500 calls) and 64 MiB
all_reduce at p = 2 (best of 8 calls, and bus bandwidth); and buffers ringlet.train fills
and sends itself (MoE's dispatch + combine, a ZeRO-3 unit's gather; best of 8): on a host shared with other
jobs the best is what the code costs, the rest is who else had the cores. Turns alternate the sides so
that the host's noise falls on both alike. Used to check that background progress costs
blocking calls nothing (issue 22).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

JOB = r"""
import json, os, sys, time
import numpy as np, ringlet as rl

def small(rank, path):
    x = np.ones(2, np.float32)
    for _ in range(500):
        rl.all_reduce(x)
    blocks = []
    for _ in range(12):
        rl.barrier()
        t = time.perf_counter()
        for _ in range(500):
            rl.all_reduce(x)
        blocks.append((time.perf_counter() - t) / 500)
    if rank == 0:
        open(path, "w").write(json.dumps(min(blocks) * 1e6))

def big(rank, path):
    x = np.ones(16 << 20, np.float32)
    rl.all_reduce(x)
    times = []
    for _ in range(8):
        rl.barrier()
        t = time.perf_counter()
        rl.all_reduce(x)
        times.append(time.perf_counter() - t)
    if rank == 0:
        open(path, "w").write(json.dumps(min(times) * 1e6))

def train(rank, path):
    # MoE's dispatch + combine of 16 MiB of tokens per rank (each to the other rank), and
    # a ZeRO-3 unit of 64 MiB gathered: buffers ringlet fills and sends itself
    from ringlet import train as tr
    x = np.ones((16384, 256), np.float32)
    idx = np.full(len(x), 1 - rank)
    z = tr.ZeroOptimizer([np.ones(16 << 20, np.float32)], stage=3, lr=0.1)
    best = [float("inf")] * 2
    for _ in range(8):
        rl.barrier()
        t = time.perf_counter()
        tr.combine(*tr.dispatch(x, idx, 2, capacity_factor=10))
        best[0] = min(best[0], time.perf_counter() - t)
        rl.barrier()
        t = time.perf_counter()
        z.gather(0)
        z.free(0)
        best[1] = min(best[1], time.perf_counter() - t)
    if rank == 0:
        open(path, "w").write(json.dumps({"moe": best[0] * 1e6, "zero3": best[1] * 1e6}))

kind, p, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rl.spawn({"small": small, "big": big}.get(kind, train), p, args=(path,), timeout=300)
"""

CASES = [("8 B all_reduce p=2 (us)", "small", 2), ("8 B all_reduce p=4 (us)", "small", 4),
         ("64 MiB all_reduce p=2 (us)", "big", 2),
         ("MoE dispatch+combine 16 MiB p=2", "moe", 2), ("ZeRO-3 gather 64 MiB p=2", "zero3", 2)]


def measure(side: tuple, kind: str, p: int) -> float:
    python, tree = side
    path = f"/tmp/blocking_ab.{os.getpid()}.json"
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    subprocess.run([python, "-c", JOB, kind, str(p), path], check=True, timeout=600,
                   cwd="/", stderr=subprocess.DEVNULL, env=env)
    with open(path) as f:
        value = json.load(f)
    os.unlink(path)
    return value[kind] if isinstance(value, dict) else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True,
                    help="the checkout to compare against: its directory, or its python")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--cases", default="",
                    help="comma-separated case numbers to run (1-based, as listed); default all")
    ap.add_argument("--no-fastpath", action="store_true",
                    help="both sides run the pure-Python path (RINGLET_NO_FASTPATH=1)")
    a = ap.parse_args()
    cases = [CASES[int(i) - 1] for i in a.cases.split(",")] if a.cases else CASES
    if a.no_fastpath:
        os.environ["RINGLET_NO_FASTPATH"] = "1"
    print(f"load average at start: {os.getloadavg()[0]:.2f}"
          + (" (RINGLET_NO_FASTPATH=1)" if a.no_fastpath else ""))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = (sys.executable, a.base) if os.path.isdir(a.base) else (a.base, None)
    sides = {"base": base, "this": (sys.executable, here)}
    got = {(c, s): [] for c, _, _ in cases for s in sides}
    for turn in range(a.turns):
        for name, kind, p in cases:
            for side in (("base", "this") if turn % 2 == 0 else ("this", "base")):
                got[(name, side)].append(measure(sides[side], kind, p))
    print(f"{'case':34} {'base (sorted turns)':>34} {'this (sorted turns)':>34}  this/base "
          f"(median, best)")
    for name, kind, _ in cases:
        b, t = sorted(got[(name, "base")]), sorted(got[(name, "this")])
        fmt = (lambda v: f"{v:.1f}") if kind == "small" else (lambda v: f"{v / 1e3:.1f}ms")
        print(f"{name:34} {' '.join(map(fmt, b)):>34} {' '.join(map(fmt, t)):>34}  "
              f"{t[len(t) // 2] / b[len(b) // 2]:.2f}, {t[0] / b[0]:.2f}")
        if kind == "big":
            bus = lambda v: 64 * 2**20 / (v * 1e-6) / 1e9   # busbw at p = 2: 2(p-1)/p = 1
            print(f"{'  busbw GB/s (median)':34} {bus(b[len(b) // 2]):>34.2f} "
                  f"{bus(t[len(t) // 2]):>34.2f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
