"""Instructions per small call, this tree against another checkout: a count a loaded host
does not disturb, where timings (bench/blocking_ab.py) drown in other jobs' noise.

    .venv/bin/python bench/instructions.py --base OTHER_CHECKOUT [--turns 2] [--fastpath]

Each side runs 8 B all_reduce at p = 2 under ``valgrind --tool=callgrind``, counting
only the loop of calls (collection toggled on and off around it by a client request,
from a helper compiled here with ``cc``). Waiting is what makes a count vary, so both
ranks share one core (``taskset``) and a rank that must wait sleeps at once (no spin,
no yield): the two then take turns, the same way each run. Spinning in C cannot be
turned off, so ``--fastpath`` counts vary a little more. Prints instructions per call
of each rank, turn by turn; needs valgrind (with its headers) and a C compiler.
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

HELPER = r"""
#include <valgrind/callgrind.h>
void toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""

JOB = r"""
import ctypes, sys
import numpy as np, ringlet as rl
from ringlet.runtime import engine

helper, n = ctypes.CDLL(sys.argv[1]), int(sys.argv[2])

def job(rank):
    x = np.ones(2, np.float32)
    engine().spin = 0.0
    for _ in range(200):
        rl.all_reduce(x)
    rl.barrier()
    helper.toggle()
    for _ in range(n):
        rl.all_reduce(x)
    helper.toggle()
    rl.barrier()

rl.spawn(job, 2, timeout=3000)
"""


def count(tree: str, helper: str, calls: int, fastpath: bool, cpu: int) -> list[float]:
    """Instructions per call of each rank (those that collected anything)."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=tree, RINGLET_YIELD_US="0",
                   RINGLET_NO_FASTPATH="0" if fastpath else "1")
        subprocess.run(["taskset", "-c", str(cpu), "valgrind", "--tool=callgrind",
                        "--trace-children=yes", "--collect-atstart=no",
                        f"--callgrind-out-file={out}/cg.%p", sys.executable, "-c", JOB,
                        helper, str(calls)],
                       check=True, env=env, cwd="/", stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=3600)
        per_rank = []
        for path in sorted(glob.glob(f"{out}/cg.*")):
            with open(path) as f:
                total = next(int(line.split()[1]) for line in f if line.startswith("totals:"))
            if total:
                per_rank.append(total / calls)
        return per_rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the checkout to compare against")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--fastpath", action="store_true",
                    help="count the C fast path (default: RINGLET_NO_FASTPATH=1)")
    ap.add_argument("--cpu", type=int, default=0, help="the core both ranks share")
    a = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        helper = os.path.join(d, "toggle.so")
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", helper, "-x", "c", "-"],
                       input=HELPER.encode(), check=True)
        got: dict = {"base": [], "this": []}
        for turn in range(a.turns):
            for side in (("base", "this") if turn % 2 == 0 else ("this", "base")):
                tree = a.base if side == "base" else here
                got[side] += count(tree, helper, a.calls, a.fastpath, a.cpu)
    path = "C fast path" if a.fastpath else "Python path"
    print(f"8 B all_reduce p=2, {path}: instructions per call, each rank of each turn")
    for side in ("base", "this"):
        print(f"  {side}: {' '.join(f'{v:,.0f}' for v in sorted(got[side]))}")
    mid = {s: sorted(v)[len(v) // 2] for s, v in got.items()}
    print(f"  this/base (medians): {mid['this'] / mid['base']:.3f}")


if __name__ == "__main__":
    main()
