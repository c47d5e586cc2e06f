"""What one large exchange costs each rank, counted rather than timed: ringlet (plain NumPy
or rl.empty buffers) against Open MPI (mpi4py under mpirun) for the same call. On a loaded
host times settle little; counts of CPU time, page faults, context switches and syscalls do.

    python bench/exchange_counts.py                        # all_gather, all_to_all; p = 2; 8 MiB
    python bench/exchange_counts.py --ops all_to_all -p 4 --calls 200
    python bench/exchange_counts.py --syscalls             # + syscalls per call (perf stat)

Each rank warms up, then runs ``--calls`` calls, each after a barrier (as every benchmark
here times them), and reports per call (mean over its ranks): the median call's wall time,
its user and system CPU time, minor page faults and voluntary / involuntary context
switches (getrusage around the timed calls; the barriers are in both sides' counts).
``--fresh``: every input is written again before each call (outside the counts).
``--syscalls``: the job runs twice under ``perf stat -e`` syscall tracepoints, with
``--calls`` calls and with none; the difference over the calls is printed per call and rank.
Ranks are pinned as mpirun pins Open MPI's (ringlet.bench.bind_like_mpirun).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

MiB = 1 << 20
SYSCALLS = ("process_vm_readv", "process_vm_writev", "sched_yield", "futex", "mmap",
            "munmap", "madvise", "poll", "ppoll", "epoll_wait", "read", "write", "recvfrom",
            "sendto", "nanosleep", "clock_nanosleep")


def _timed(call, barrier, calls: int, warm: int = 5, reset=None) -> dict:
    """Counts of this process over ``calls`` calls (each after a barrier; ``reset`` before
    it, outside the counts: a fresh measurement's rewrite of the inputs)."""
    for _ in range(warm):
        barrier()
        call()
    barrier()
    t0 = time.perf_counter()
    ts = []
    tot = np.zeros(6)   # user, sys, minflt, vcsw (in the barrier and call), vcsw in call, ivcsw
    for _ in range(calls):
        if reset is not None:
            reset()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        barrier()
        v = resource.getrusage(resource.RUSAGE_SELF)
        a = time.perf_counter()
        call()
        ts.append(time.perf_counter() - a)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        tot += (r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime,
                r1.ru_minflt - r0.ru_minflt, r1.ru_nvcsw - r0.ru_nvcsw,
                r1.ru_nvcsw - v.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw)
    n = max(calls, 1)
    return {"wall_us": float(np.median(ts)) * 1e6 if ts else 0.0,
            "user_us": tot[0] / n * 1e6, "sys_us": tot[1] / n * 1e6, "minflt": tot[2] / n,
            "vcsw": tot[3] / n, "vcsw_call": tot[4] / n, "ivcsw": tot[5] / n,
            "loop_us": (time.perf_counter() - t0) / n * 1e6}


def _ringlet_rank(rank, op, size, zc, calls, out, fresh=False):
    import ringlet as rl
    from ringlet.bench import _make_call, bind_like_mpirun
    p = rl.get_world_size()
    bind_like_mpirun(rank, p)
    call, reset, check = _make_call(rl, op, size, p, rank, np.dtype(np.float32), "auto", zc,
                                    fresh=fresh)
    got = _timed(call, rl.barrier, calls, reset=reset)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(dict(got, wrong=check(),
                       ran=rl.stats()["collectives"].get(op, {}).get("algorithm")), f)


def _mpi_rank(op, size, calls, out, fresh=False):
    from mpi4py import MPI

    from ringlet.peers import mpi_call
    comm = MPI.COMM_WORLD
    call, x = mpi_call(comm, op, size)
    got = _timed(call, comm.Barrier, calls,
                 reset=(lambda: x.fill(1.0)) if fresh and x is not None else None)
    with open(f"{out}.{comm.rank}", "w") as f:
        json.dump(dict(got, wrong=0, ran="open mpi"), f)


def _job(lib, op, p, size, zc, calls, out, fresh=False):
    """Run one job of ``calls`` calls; the command line for an outside wrapper."""
    if lib == "mpi":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe",   # (binds as peer_bench)
                "-np", str(p), sys.executable, os.path.abspath(__file__), "_mpi",
                op, str(size), str(calls), out, str(int(fresh))]
    return [sys.executable, os.path.abspath(__file__), "_ringlet", op, str(p), str(size),
            str(int(zc)), str(calls), out, str(int(fresh))]


def _collect(out, p) -> dict:
    rows = []
    for r in range(p):
        with open(f"{out}.{r}") as f:
            rows.append(json.load(f))
    keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float)) and k != "wrong"]
    got = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    got["wall_us"] = max(r["wall_us"] for r in rows)       # the slowest rank's median
    got["wrong"] = sum(r["wrong"] for r in rows)
    got["ran"] = rows[0]["ran"]
    return got


def _perf_syscalls(cmd, env) -> dict:
    events = ",".join(f"syscalls:sys_enter_{s}" for s in SYSCALLS)
    with tempfile.NamedTemporaryFile("r", suffix=".perf") as f:
        subprocess.run(["perf", "stat", "-x,", "-o", f.name, "-e",
                        "raw_syscalls:sys_enter,page-faults,context-switches," + events, "--"]
                       + cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        got = {}
        for line in f.read().splitlines():
            parts = line.split(",")
            if len(parts) > 2 and parts[0].strip().isdigit():
                got[parts[2].split(":")[-1].replace("sys_enter_", "")] = int(parts[0])
        return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="all_gather,all_to_all")
    ap.add_argument("-p", type=int, default=2)
    ap.add_argument("--size", type=float, default=8, help="MiB")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--kinds", default="plain,rl.empty,mpi",
                    help="plain, rl.empty, rl.empty-4k (RINGLET_HUGE=0), mpi")
    ap.add_argument("--syscalls", action="store_true")
    ap.add_argument("--fresh", action="store_true",
                    help="write every input again before each call (outside the counts)")
    a = ap.parse_args(argv)
    size = int(a.size * MiB)
    with open("/proc/loadavg") as f:
        print(f"load {f.read().split()[0]}; per call and rank (wall: slowest rank's median)")
    print(f"{'row':34s} {'ran':14s} {'wall us':>8s} {'user us':>8s} {'sys us':>8s} "
          f"{'minflt':>7s} {'vcsw':>6s} {'in call':>7s} {'ivcsw':>6s}" + ("  syscalls" if a.syscalls else ""))
    for op in a.ops.split(","):
        for kind in a.kinds.split(","):
            lib = "mpi" if kind == "mpi" else "ringlet"
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "out")
                zc = kind.startswith("rl.empty")
                env = dict(os.environ, **({"RINGLET_HUGE": "0"} if kind == "rl.empty-4k" else {}))
                cmd = _job(lib, op, a.p, size, zc, a.calls, out, a.fresh)
                sc = ""
                if a.syscalls:
                    full = _perf_syscalls(cmd, env)
                    base = _perf_syscalls(_job(lib, op, a.p, size, zc, 0,
                                               os.path.join(d, "base"), a.fresh), env)
                    per = {k: (full.get(k, 0) - base.get(k, 0)) / a.calls / a.p for k in full}
                    sc = "  " + " ".join(f"{k}={v:.1f}" for k, v in per.items() if abs(v) >= 0.05)
                else:
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
                got = _collect(out, a.p)
            print(f"{op} p={a.p} {a.size:g} MiB {kind:11s} {got['ran'] or '':14s} "
                  f"{got['wall_us']:8.0f} {got['user_us']:8.0f} {got['sys_us']:8.0f} "
                  f"{got['minflt']:7.1f} {got['vcsw']:6.2f} {got['vcsw_call']:7.2f} {got['ivcsw']:6.2f}" + sc
                  + ("" if not got["wrong"] else f"  WRONG {got['wrong']}"), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_ringlet":
        op, p, size, zc, calls, out, fresh = sys.argv[2:]
        from ringlet.launch import spawn
        spawn(_ringlet_rank, int(p), args=(op, int(size), zc == "1", int(calls), out,
                                           fresh == "1"))
    elif len(sys.argv) > 1 and sys.argv[1] == "_mpi":
        op, size, calls, out, fresh = sys.argv[2:]
        _mpi_rank(op, int(size), int(calls), out, fresh == "1")
    else:
        sys.exit(main())
