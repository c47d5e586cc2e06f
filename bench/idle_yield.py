"""A waiting rank with a core of its own on a busy host: yield until the peer's answer
comes (engine.IDLE_YIELD, the default) against sleeping after SPIN_FREE (the old way), A/B
in one job in alternating blocks of calls, so the job's placement, its memory and the
host's load fall on both alike.

    python bench/idle_yield.py                     # all_gather, all_to_all; p = 2; 8 MiB
    python bench/idle_yield.py --ops all_to_all --blocks 20

Prints per row each way's median (and best) block - a block's time is the slowest rank's
median call (ringlet.bench.slowest_median_us) - sleep / yield per pair of blocks (> 1:
yielding is faster), and each way's sleeps (voluntary context switches) per call and rank,
calls and barriers between them, for plain NumPy and rl.empty buffers. Ranks are pinned as
mpirun pins Open MPI's (ringlet.bench.bind_like_mpirun). Only a busy host (more runnable
processes than cores) tells the two apart: on an idle one both spin (engine.IDLE_SPIN).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile

import numpy as np

MiB = 1 << 20


def _job(rank, op, size, zero_copy, blocks, calls, out):
    import ringlet as rl
    from ringlet.bench import _make_call, alternating_blocks, bind_like_mpirun
    from ringlet.transport import engine
    p = rl.get_world_size()
    bind_like_mpirun(rank, p)
    call, reset, check = _make_call(rl, op, size, p, rank, np.dtype(np.float32), "auto",
                                    zero_copy)
    sleeps = {"sleep": 0, "yield": 0}

    def switch(way):
        engine.IDLE_YIELD = way == "yield"
        v = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw

        def count(_):
            sleeps[way] += resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - v
        return count

    res = alternating_blocks(rl, {"sleep": (call, reset), "yield": (call, reset)}, blocks,
                             calls, switch)
    engine.IDLE_YIELD = True
    reset()
    call()
    wrong = np.array([check()], np.int64)
    rl.all_reduce(wrong)
    got = np.array([sleeps["sleep"], sleeps["yield"]], np.float64) / (blocks * calls * p)
    rl.all_reduce(got)
    if rank == 0:
        ran = rl.stats()["collectives"].get(op, {}).get("algorithm")
        with open(out, "w") as f:
            json.dump({"res": res, "ran": ran, "wrong": int(wrong[0]),
                       "sleeps": got.tolist()}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="all_gather,all_to_all")
    ap.add_argument("-p", type=int, default=2)
    ap.add_argument("--sizes", default="8", help="MiB")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--kinds", default="plain,rl.empty")
    a = ap.parse_args(argv)
    from ringlet.launch import spawn
    print(f"{'row':32s} {'ran':10s} {'sleep (med/best us)':>20s} {'yield (med/best us)':>20s} "
          f"{'sleep/yield med [min-max]':>26s}  sleeps/call sleep yield  load")
    for op in a.ops.split(","):
        for mib in a.sizes.split(","):
            size = int(float(mib) * MiB)
            for kind in a.kinds.split(","):
                with tempfile.TemporaryDirectory() as d:
                    out = os.path.join(d, "out.json")
                    spawn(_job, a.p, args=(op, size, kind == "rl.empty", a.blocks, a.calls, out))
                    with open(out) as f:
                        got = json.load(f)
                old, new = np.array(got["res"]["sleep"]), np.array(got["res"]["yield"])
                r = old / new
                with open("/proc/loadavg") as f:
                    load = f.read().split()[0]
                print(f"{op} p={a.p} {mib} MiB {kind:9s} {got['ran'] or '':10s} "
                      f"{np.median(old):11.0f} {old.min():8.0f} {np.median(new):11.0f} "
                      f"{new.min():8.0f} {np.median(r):12.2f} [{r.min():.2f}-{r.max():.2f}]"
                      f"  {got['sleeps'][0]:10.2f} {got['sleeps'][1]:5.2f}  {load}"
                      + ("" if got["wrong"] == 0 else f"  WRONG: {got['wrong']} elements"),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
