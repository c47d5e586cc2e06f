"""Instructions a blocking 8 B all_reduce costs its caller, this tree against another
checkout: counted by valgrind's callgrind, so the host's load does not move them.

    .venv/bin/python bench/blocking_callgrind.py --base OTHER_CHECKOUT [--p 2] [--tree DIR]

Rank 0 runs under callgrind, the other ranks natively. Rank 0 is then ~50x slower than
its peers, so their packets are always there when it looks (it does not spin: the calls
of the C wait loop's ``stall`` are printed to show it) and what is counted is the work of
a call, not its waiting. Each side runs the job twice, with N1 and N2 calls; the
difference divided by N2 - N1 is one call, start-up and teardown cancelled. Only rank 0's
main thread is counted (``--separate-threads``). ``--top`` lists the C functions (the
interpreter's among them) whose inclusive count per call differs most between the sides.

Needs valgrind. Used to locate what a blocking call pays since background progress
landed (issue 22), where the wall clock of a loaded host cannot resolve 0.4 us.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import secrets
import subprocess
import sys
import tempfile

JOB = r"""
import gc, sys, numpy as np, ringlet as rl
rl.init()
gc.disable()    # a collection falls in one side's window of calls and not the other's by chance
from ringlet.runtime import _S
_S.engine.spin = _S.engine.fast_budget = 60.0   # no rank sleeps or leaves C to wait (see the docstring)
if rl.get_rank() != 0:
    _S.engine.crowded = True    # (and the peers yield the core as they spin)
x = np.ones(2, np.float32)
if sys.argv[2] == "after-async":    # the progress thread exists, idle, during the loop
    rl.all_reduce(x, async_op=True).wait()
for _ in range(int(sys.argv[1])):
    rl.all_reduce(x)
rl.destroy()
"""


def run_job(python: str, tree: str | None, n: int, p: int, out: str, port: int,
            mode: str) -> tuple[str, list]:
    """Run the job once; return rank 0's main-thread callgrind file and its other threads'."""
    base = dict(os.environ, WORLD_SIZE=str(p), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                RINGLET_TOKEN=secrets.token_hex(16), PYTHONHASHSEED="0", RINGLET_TIMEOUT="900",
                OPENBLAS_NUM_THREADS="1")
    if tree:
        base["PYTHONPATH"] = tree
    procs = [subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--separate-threads=yes",
         f"--callgrind-out-file={out}.%p", python, "-c", JOB, str(n), mode],
        env=dict(base, RANK="0"), cwd="/", stdout=subprocess.DEVNULL,
        stderr=open(f"{out}.stderr", "w"))]
    for r in range(1, p):
        procs.append(subprocess.Popen([python, "-c", JOB, str(n), mode], env=dict(base, RANK=str(r)),
                                      cwd="/", stderr=subprocess.DEVNULL))
    for proc in procs:
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"a rank failed (exit {proc.returncode}): {proc.args[-2:]}; "
                             f"rank 0's stderr (valgrind's and Python's): {out}.stderr")
    files = sorted(glob.glob(f"{out}.{procs[0].pid}-*"))
    if not files or not files[0].endswith("-01"):
        raise SystemExit(f"no callgrind output for rank 0 at {out}.{procs[0].pid}-01")
    return files[0], files[1:]


def totals(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise SystemExit(f"{path}: no totals line")


ENTRIES = ("run", "lane_run")     # the C fast path's ways in: a call's plan, a Lane's call


def fastpath_run(path: str) -> tuple[int, int, int]:
    """(calls into the C fast path - ``run`` or a Lane's ``lane_run`` -, their inclusive
    instructions, calls of its wait loop's ``stall``) in a callgrind file, from its call
    lines (no other function of the process has those names)."""
    runs = cost = stalls = 0
    names: dict = {}
    caller = None
    lines = open(path).read().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(c?fn)=\((\d+)\)(?: (.*))?$", line)
        if not m:
            continue
        if m.group(3):
            names[m.group(2)] = m.group(3)
        name = names.get(m.group(2))
        if m.group(1) == "fn":
            caller = name
        elif lines[i + 1].startswith("calls="):
            n = int(lines[i + 1].split("=")[1].split()[0])
            if name in ENTRIES and caller not in ENTRIES:
                runs, cost = runs + n, cost + int(lines[i + 2].split()[1])
            elif name == "stall":
                stalls += n
    return runs, cost, stalls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="the other checkout's directory (none: count --tree only)")
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--n", type=int, nargs=2, default=(200, 1200), metavar=("N1", "N2"))
    ap.add_argument("--tree", help="the tree to measure (default: this one)")
    ap.add_argument("--after-async", action="store_true",
                    help="one async all_reduce before the calls: the progress thread exists "
                         "(idle) while they run; its instructions per call are printed too")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ringlet.launch import free_port
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="blocking_callgrind.")
    n1, n2 = a.n
    print(f"p = {a.p}; rank 0's main thread; per call = (count at N2 - count at N1) / "
          f"({n2} - {n1})")
    mode = "after-async" if a.after_async else "plain"
    print(f"{'side':6}{'instructions':>14}{'in C run':>10}{'outside':>10}{'C runs':>8}"
          f"{'C waits':>9}{'other threads':>15}")
    got = {}
    sides = (("base", a.base),) if a.base else ()
    for side, tree in (*sides, ("this", a.tree or here)):
        runs = [run_job(sys.executable, tree, n, a.p, f"{tmp}/{side}.{n}", free_port(), mode)
                for n in (n1, n2)]
        files = [main for main, _ in runs]
        others = (sum(map(totals, runs[1][1])) - sum(map(totals, runs[0][1]))) / (n2 - n1)
        (r1, c1, s1), (r2, c2, s2) = (fastpath_run(f) for f in files)
        k = n2 - n1
        total = (totals(files[1]) - totals(files[0])) / k
        inside = (c2 - c1) / k
        got[side] = (total, inside, total - inside)
        print(f"{side:6}{total:>14,.0f}{inside:>10,.0f}{total - inside:>10,.0f}"
              f"{(r2 - r1) / k:>8.2f}{(s2 - s1) / k:>9.2f}{others:>15,.0f}", flush=True)
    if a.base:
        (bt, bi, bo), (tt, ti, to) = got["base"], got["this"]
        print(f"{'diff':6}{tt - bt:>+14,.0f}{ti - bi:>+10,.0f}{to - bo:>+10,.0f}   "
              f"(this/base: {tt / bt:.3f} total, {to / bo:.3f} outside C)")
    print(f"(callgrind files in {tmp})")


if __name__ == "__main__":
    main()
