"""Where a large call's time goes, ringlet's and Open MPI's, in one job: each timed call is
cut at its kernel copies - the time before the first large process_vm_readv/writev, in
them, and after the last - from strace's timestamps, for both libraries in alternating
blocks of one mpirun job (plain NumPy buffers, written again before every call).

    python bench/call_phases.py                       # all_gather p = 2 8 MiB
    python bench/call_phases.py --op all_to_all -p 2 --size 8M --blocks 8

Why: ringlet's p = 2 8 MiB plain all_gather ran 0.85x Open MPI in one job (issue 27) with
the same copies (one 4 MiB read by cross-memory attach and a 4 MiB local copy per rank).
Cut this way, the difference was the time before the read: the Python engine's setup of a
call whose messages it read by CMA, which the C fast path has run since (docs/results.md,
"Where the p = 2 8 MiB plain rows lose"). Each call
is marked by a syscall (getresuid: ringlet, getresgid: Open MPI) and only those and the
copies are traced (strace --seccomp-bpf: ~7 us per traced syscall, the same for both).
Needs strace and Open MPI with mpi4py (bench/install_peers.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np

MARK = {"ringlet": "getresuid", "mpi": "getresgid"}
LARGE = 64 << 10      # a read or write of at least this many bytes is a message's copy
_LINE = re.compile(r"^\s*\d+\s+([0-9.]+) (\w+)\(.*= (-?\d+)[^<]*<([0-9.]+)>")


def _child(a) -> None:
    from mpi4py import MPI

    import ringlet as rl
    from ringlet.bench import _make_call, alternating_blocks, mpi_arm, paged_empty
    from ringlet.cost.model import parse_size
    comm = MPI.COMM_WORLD
    rl.init()
    size = parse_size(a.size)
    call, reset, check = _make_call(rl, a.op, size, rl.get_world_size(), rl.get_rank(),
                                    np.dtype(np.float32), a.algorithm, fresh=True,
                                    plain=paged_empty)
    mcall, mreset = mpi_arm(comm, a.op, size, True)

    def marked(fn, mark):
        def run():
            mark()
            fn()
            mark()
        return run

    arms = {"ringlet": (marked(call, os.getresuid), reset),
            "mpi": (marked(mcall, os.getresgid), mreset)}
    got = alternating_blocks(rl, arms, a.blocks, a.calls)
    wrong = check()
    if rl.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"blocks": got, "wrong": wrong,
                       "algorithm": rl.stats()["collectives"].get(a.op, {}).get("algorithm")}, f)
    rl.destroy()


def phases(path: str) -> dict:
    """{arm: [(total, before, in copies, after, copies) per marked call]} (us) of one
    rank's strace log: a call spans its two marks; its copies are its large reads and
    writes."""
    open_at, calls, copies = {}, {k: [] for k in MARK}, []
    arm_of = {v: k for k, v in MARK.items()}
    with open(path) as f:
        for line in f:
            m = _LINE.match(line)
            if not m:
                continue
            name, t, ret, dur = m[2], float(m[1]) * 1e6, int(m[3]), float(m[4]) * 1e6
            if name in arm_of:
                arm = arm_of[name]
                if arm not in open_at:
                    open_at[arm], copies = t + dur, []
                else:
                    t0 = open_at.pop(arm)
                    if copies:
                        inside = sum(d for _, d in copies)
                        calls[arm].append((t - t0, copies[0][0] - t0, inside,
                                           t - (copies[-1][0] + copies[-1][1]), len(copies)))
                    else:
                        calls[arm].append((t - t0, float("nan"), 0.0, float("nan"), 0))
            elif name.startswith("process_vm_") and ret >= LARGE:
                copies.append((t, dur))
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="all_gather")
    ap.add_argument("-p", type=int, default=2)
    ap.add_argument("--size", default="8M")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a)
        return 0
    from ringlet.bench import mpi_job_rows
    if not shutil.which("strace"):
        print("needs strace (apt-get install strace)")
        return 1
    traced = ",".join(["process_vm_readv", "process_vm_writev", *MARK.values()])
    with tempfile.TemporaryDirectory() as d:
        # each rank under strace, its log named by its rank (mpirun sets OMPI_COMM_WORLD_RANK)
        strace = ("sh", "-c", f"exec strace -f --seccomp-bpf -e trace={traced} -e signal=none "
                  f'-ttt -T -o {d}/rank$OMPI_COMM_WORLD_RANK.log "$0" "$@"')
        try:
            job = mpi_job_rows(__file__, a.p, ["--op", a.op, "--size", a.size, "--algorithm",
                                               a.algorithm, "--blocks", str(a.blocks),
                                               "--calls", str(a.calls)], strace)
        except RuntimeError as exc:
            print(exc)
            return 1
        logs = {r: phases(os.path.join(d, f"rank{r}.log")) for r in range(a.p)}
    print(f"{a.op} p={a.p} {a.size}, plain buffers written again before every call; ringlet "
          f"ran {job['algorithm']} ({job['wrong']} wrong elements on rank 0); under strace")
    print("median block (slowest rank's median call), us: " + "  ".join(
        f"{k} {np.median(v):.0f}" for k, v in job["blocks"].items()))
    print(f"{'rank':>4} {'library':8} {'calls':>5} {'total':>7} {'before':>7} {'copies':>7} "
          f"{'after':>7} {'copies/call':>11}   (median us of the marked calls)")
    for r, calls in logs.items():
        for arm, rows in calls.items():
            if rows:
                med = np.nanmedian(np.array(rows), axis=0)
                print(f"{r:4} {arm:8} {len(rows):5} {med[0]:7.0f} {med[1]:7.0f} {med[2]:7.0f} "
                      f"{med[3]:7.0f} {med[4]:11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
