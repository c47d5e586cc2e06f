"""A round's order, A/B in one job: receives posted before the local copy and looked at
between its pieces against the old order (the whole local copy, then the receives), in
alternating blocks of calls, so the job's placement, its memory and the host's load fall
on both alike. ``--round exchange`` (work.EARLY_RECV): a round that sends and receives
large messages (all_gather, all_to_all). ``--round root`` (work.EARLY_ROOT): a root's
round that receives large one-way messages (a gather's), each then written whole by its
sender while the root copies its own block.

    python bench/exchange_order.py                       # all_gather, all_to_all; p = 2; 8 MiB
    python bench/exchange_order.py -p 4 --sizes 1,8 --blocks 16
    python bench/exchange_order.py --round root -p 4 --sizes 4,8,32 --fresh

Prints per row each order's median (and best) block - a block's time is the slowest rank's
median call (ringlet.bench.slowest_median_us) - and old / new per pair of blocks (> 1:
the new order is faster), for plain NumPy and rl.empty buffers. Ranks are pinned as mpirun
pins Open MPI's (ringlet.bench.bind_like_mpirun).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

MiB = 1 << 20


FLAGS = {"exchange": "EARLY_RECV", "root": "EARLY_ROOT"}


def _job(rank, op, size, zero_copy, blocks, calls, out, flag="EARLY_RECV", fresh=False):
    import ringlet as rl
    from ringlet import work
    from ringlet.bench import _make_call, alternating_blocks, bind_like_mpirun, paged_empty
    p = rl.get_world_size()
    bind_like_mpirun(rank, p)
    call, reset, check = _make_call(rl, op, size, p, rank, np.dtype(np.float32), "auto",
                                    zero_copy, fresh=fresh, plain=paged_empty)

    def switch(order):
        setattr(work, flag, order == "new")

    res = alternating_blocks(rl, {"old": (call, reset), "new": (call, reset)}, blocks, calls,
                             switch)
    setattr(work, flag, True)
    reset()
    call()
    wrong = np.array([check()], np.int64)
    rl.all_reduce(wrong)
    if rank == 0:
        ran = rl.stats()["collectives"].get(op, {}).get("algorithm")
        with open(out, "w") as f:
            json.dump({"res": res, "ran": ran, "wrong": int(wrong[0])}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--round", choices=sorted(FLAGS), default="exchange")
    ap.add_argument("--ops", help="default: all_gather,all_to_all (exchange), gather (root)")
    ap.add_argument("-p", type=int, default=2)
    ap.add_argument("--sizes", default="8", help="MiB")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--fresh", action="store_true", help="write every input again before each call")
    a = ap.parse_args(argv)
    ops = a.ops or ("gather" if a.round == "root" else "all_gather,all_to_all")
    from ringlet.launch import spawn
    print(f"{'row':32s} {'ran':10s} {'old (med/best us)':>20s} {'new (med/best us)':>20s} "
          f"{'old/new med [min-max]':>24s}  load")
    for op in ops.split(","):
        for mib in a.sizes.split(","):
            size = int(float(mib) * MiB)
            for zc in (False, True):
                with tempfile.TemporaryDirectory() as d:
                    out = os.path.join(d, "out.json")
                    spawn(_job, a.p, args=(op, size, zc, a.blocks, a.calls, out, FLAGS[a.round],
                                            a.fresh))
                    with open(out) as f:
                        got = json.load(f)
                old, new = np.array(got["res"]["old"]), np.array(got["res"]["new"])
                r = old / new
                kind = "rl.empty" if zc else "plain"
                with open("/proc/loadavg") as f:
                    load = f.read().split()[0]
                print(f"{op} p={a.p} {mib} MiB {kind:9s} {got['ran'] or '':10s} "
                      f"{np.median(old):11.0f} {old.min():8.0f} {np.median(new):11.0f} "
                      f"{new.min():8.0f} {np.median(r):10.2f} [{r.min():.2f}-{r.max():.2f}]  {load}"
                      + ("" if got["wrong"] == 0 else f"  WRONG: {got['wrong']} elements"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
