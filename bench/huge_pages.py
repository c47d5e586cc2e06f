"""rl.empty buffers on huge pages (buffers.HUGE_MIN and up, the default) against 4 KiB
pages (RINGLET_HUGE=0), with plain NumPy buffers beside them, A/B in one job: each arm's
buffers are allocated once, and the arms take turns in blocks of calls (the order rotating
block by block), so the job's placement and the host's load fall on all alike.

    python bench/huge_pages.py                      # all_gather, all_to_all; p = 2; 8 MiB
    python bench/huge_pages.py -p 4 --blocks 16

Prints per row each arm's median (and best) block - a block's time is the slowest rank's
median call (ringlet.bench.slowest_median_us) - and 4k / huge and plain / huge per block
(> 1: huge pages are faster). Ranks are pinned as mpirun pins Open MPI's
(ringlet.bench.bind_like_mpirun).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

MiB = 1 << 20
ARMS = ("plain", "4k", "huge")


def _job(rank, op, size, blocks, calls, out):
    import ringlet as rl
    from ringlet.bench import _make_call, alternating_blocks, bind_like_mpirun
    p = rl.get_world_size()
    bind_like_mpirun(rank, p)
    f32 = np.dtype(np.float32)
    arms = {}
    for arm in ARMS:
        os.environ["RINGLET_HUGE"] = "0" if arm == "4k" else "1"
        arms[arm] = _make_call(rl, op, size, p, rank, f32, "auto", arm != "plain")
    os.environ.pop("RINGLET_HUGE")
    res = alternating_blocks(rl, arms, blocks, calls)
    wrong = np.array([sum(check() for _, _, check in arms.values())], np.int64)
    rl.all_reduce(wrong)
    if rank == 0:
        ran = rl.stats()["collectives"].get(op, {}).get("algorithm")
        with open(out, "w") as f:
            json.dump({"res": res, "ran": ran, "wrong": int(wrong[0])}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="all_gather,all_to_all")
    ap.add_argument("-p", type=int, default=2)
    ap.add_argument("--sizes", default="8", help="MiB")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args(argv)
    from ringlet.launch import spawn
    print(f"{'row':26s} {'ran':10s} " + " ".join(f"{x + ' med/best':>17s}" for x in ARMS)
          + f" {'4k/huge med [min-max]':>23s} {'plain/huge med [min-max]':>25s}  load")
    for op in a.ops.split(","):
        for mib in a.sizes.split(","):
            size = int(float(mib) * MiB)
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "out.json")
                spawn(_job, a.p, args=(op, size, a.blocks, a.calls, out))
                with open(out) as f:
                    got = json.load(f)
            t = {arm: np.array(got["res"][arm]) for arm in ARMS}
            r4, rp = t["4k"] / t["huge"], t["plain"] / t["huge"]
            with open("/proc/loadavg") as f:
                load = f.read().split()[0]
            print(f"{op} p={a.p} {mib} MiB {got['ran'] or '':10s} "
                  + " ".join(f"{np.median(t[x]):9.0f}/{t[x].min():7.0f}" for x in ARMS)
                  + f" {np.median(r4):9.2f} [{r4.min():.2f}-{r4.max():.2f}]"
                  f" {np.median(rp):10.2f} [{rp.min():.2f}-{rp.max():.2f}]  {load}"
                  + ("" if got["wrong"] == 0 else f"  WRONG: {got['wrong']} elements"),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
