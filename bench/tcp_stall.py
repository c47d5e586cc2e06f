"""Stress TCP between emulated hosts until a call stalls: the collectives mix of
bench/hosts.py's table (the calls that timed out there first: reduce_scatter
recursive_halving and all_reduce rabenseifner), over and over, on 2 x 2 namespace hosts
joined by a tbf-shaped 1 Gbit/s link, with busy loops beside it and a short
RINGLET_TIMEOUT so a stall shows fast. Needs root.

    .venv/bin/python bench/tcp_stall.py [--jobs 5] [--iters 20] [--timeout 15] [--load 4]
        [--rate 1gbit] [--sizes 64M,16M,1M,64K] [--env RINGLET_TCP_RCVBUF=...]

Each job prints, per call, the slowest rank's time; a job that fails prints its ranks'
errors (a stalled call's TimeoutError says what each rank waited for). The summary: jobs,
calls, stalls, the slowest call.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIX = [("reduce_scatter", "recursive_halving"), ("all_reduce", "rabenseifner"),
       ("all_reduce", "ring"), ("all_gather", "ring"), ("broadcast", "auto"),
       ("all_to_all", "auto"), ("reduce_scatter", "ring"), ("all_reduce", "auto")]


def job(spec_path: str) -> None:
    import numpy as np
    import ringlet as rl
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from hosts import _buffers, _call
    with open(spec_path) as f:
        spec = json.load(f)
    rl.init()
    r, p = rl.get_rank(), rl.get_world_size()
    for it in range(spec["iters"]):
        for nbytes in spec["sizes"]:
            for collective, algorithm in spec["mix"]:
                bufs = _buffers(np, collective, p, nbytes)
                rl.barrier()
                t = time.perf_counter()
                _call(rl, collective, bufs, algorithm)
                dt = np.array([time.perf_counter() - t])
                rl.all_reduce(dt, op=rl.ReduceOp.MAX)
                if r == 0:
                    print("CALL " + json.dumps([it, collective, algorithm, nbytes,
                                                float(dt[0])]), flush=True)
    rl.destroy()


COUNTERS = ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPWinProbe", "TCPToZeroWindowAdv",
            "TCPFromZeroWindowAdv", "TCPZeroWindowDrop", "TCPRcvQDrop", "PruneCalled",
            "RcvPruned", "OfoPruned", "TCPOFOQueue", "TCPBacklogDrop", "TCPSpuriousRTOs")


def tcp_counters(hosts, i) -> dict:
    """The kernel's TCP counters of host ``i``'s network namespace (/proc/net/{snmp,netstat})."""
    out = {}
    for name in ("snmp", "netstat"):
        text = hosts.run(i, ["cat", f"/proc/net/{name}"], capture_output=True, text=True).stdout
        lines = text.splitlines()
        for head, vals in zip(lines[::2], lines[1::2]):
            for k, v in zip(head.split()[1:], vals.split()[1:]):
                if k in COUNTERS:
                    out[k] = int(v)
    return out


def busy(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=15.0, help="RINGLET_TIMEOUT (s)")
    ap.add_argument("--load", type=int, default=4, help="busy loops beside the job")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--bucket", type=float, default=200e-6)
    ap.add_argument("--layout", default="2x2")
    ap.add_argument("--sizes", default="64M,16M,1M,64K")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the ranks")
    ap.add_argument("--pair", action="store_true", help="only the two calls that stalled")
    ap.add_argument("--verbose", action="store_true", help="print every call")
    a = ap.parse_args(argv)
    if a.job:
        job(a.job)
        return 0
    import ringlet.hosts
    from ringlet.cost.model import parse_size
    from ringlet.hosts import Hosts
    ringlet.hosts.PREFIX = os.environ.get("RINGLET_HOSTS_PREFIX", "th")
    h, m = (int(x) for x in a.layout.split("x"))
    spec_path = f"/tmp/ringlet-tcp-stall-{os.getpid()}.json"
    with open(spec_path, "w") as f:
        mix = MIX[:2] if a.pair else MIX
        json.dump({"iters": a.iters, "sizes": [parse_size(s) for s in a.sizes.split(",")],
                   "mix": mix}, f)
    env = {"PYTHONPATH": ROOT, "RINGLET_TIMEOUT": str(a.timeout)}
    env.update(kv.split("=", 1) for kv in a.env)
    loops = busy(a.load)
    stalls = calls = 0
    slowest = (0.0, None)
    try:
        for j in range(a.jobs):
            t0 = time.monotonic()
            with Hosts(h, rate=a.rate, bucket=a.bucket) as hosts:
                procs = hosts.ringlet_run(os.path.abspath(__file__), nproc=m,
                                          args=["--job", spec_path], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)
                results = hosts.wait(procs, 560)
                counters = [tcp_counters(hosts, i) for i in range(h)]
            n = 0
            for line in results[0][1].splitlines():
                if "CALL " in line:
                    it, coll, alg, nb, dt = json.loads(line.split("CALL ", 1)[1])
                    n += 1
                    if a.verbose:
                        print(f"  {it} {coll} {alg} {nb} {dt * 1e3:.0f} ms")
                    if dt > slowest[0]:
                        slowest = (dt, (coll, alg, nb))
            calls += n
            failed = [(i, code, e) for i, (code, _, e) in enumerate(results) if code]
            print(f"job {j}: {n} calls in {time.monotonic() - t0:.0f} s, "
                  f"{'FAILED' if failed else 'ok'}, load {os.getloadavg()[0]:.1f}", flush=True)
            for i, c in enumerate(counters):
                print(f"  host {i} kernel TCP: " + ", ".join(f"{k} {v}" for k, v in c.items() if v))
            if failed:
                stalls += 1
                for i, code, e in failed:   # the ranks' own errors, not their tracebacks
                    lines = [x for x in e.splitlines() if "Error" in x and "rank" in x]
                    print(f"--- host {i} exit {code}:\n" + "\n".join(lines), flush=True)
    finally:
        for p in loops:
            p.kill()
            p.wait()
        os.unlink(spec_path)
    print(f"SUMMARY jobs {a.jobs} stalled {stalls} calls {calls} slowest "
          f"{slowest[0]:.2f} s {slowest[1]}")
    return 1 if stalls else 0


if __name__ == "__main__":
    sys.exit(main())
