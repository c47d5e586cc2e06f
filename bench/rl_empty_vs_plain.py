"""rl.empty against plain NumPy buffers, call for call, on every >= 1 MiB row of
bench/targets.py (8 collectives, p = 2 and 4, 1 and 8 MiB), against the noise floor.

    python bench/rl_empty_vs_plain.py                 # in one job per row (about 4 min quiet)
    python bench/rl_empty_vs_plain.py --fresh 5       # fresh jobs, 5 turns (about 12 min)

In one job (the default; what the claim "rl.empty is never slower" rests on): each row's
job allocates three sets of buffers - plain, a second plain set, and rl.empty - and times
them in alternating blocks of calls (each call between barriers, slowest rank, a block's
median), so the job's placement on the cores, its memory and the host's load fall on all
three alike; the second plain set against the first is the noise floor (the same code on
the same kind of buffer). Fresh jobs (--fresh N): each kind in its own job, N turns taken
plain, rl.empty, plain again, ... - what bench/targets.py compares, where a job's
placement differs from the next one's; plain against the other plain jobs is the floor.
Prints per row: the algorithm each kind ran, medians, rl.empty / plain and plain' / plain
(> 1: slower than plain), and whether rl.empty is slower than plain by more than the floor.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

MiB = 1 << 20
OPS = ("broadcast", "all_gather", "reduce_scatter", "all_to_all", "all_reduce", "reduce",
       "gather", "scatter")
KINDS = ("plain", "plain'", "rl.empty")


def _job(rank, op, size, blocks, calls, kinds, out):
    import ringlet as rl
    from ringlet.bench import _make_call, slowest_median_us
    p = rl.get_world_size()
    fns = {k: _make_call(rl, op, size, p, rank, np.dtype(np.float32), "auto", k == "rl.empty")
           for k in kinds}
    ran = {}
    for k in kinds:
        call, reset, _ = fns[k]
        for _ in range(3):
            reset()
            call()
        ran[k] = rl.stats()["collectives"].get(op, {}).get("algorithm")
    res = {k: [] for k in kinds}
    for _ in range(blocks):
        for k in kinds:
            call, reset, _ = fns[k]
            res[k].append(slowest_median_us(rl, call, calls, reset))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"res": res, "ran": ran}, f)


def _run(op, p, size, blocks, calls, kinds):
    from ringlet.launch import spawn
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        spawn(_job, p, args=(op, size, blocks, calls, kinds, out))
        return json.load(open(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fresh", type=int, default=0, help="fresh jobs, this many turns")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sizes", default="1,8", help="MiB")
    a = ap.parse_args(argv)
    rows = [(op, p, int(s) * MiB) for op in a.ops.split(",") for p in (2, 4)
            for s in a.sizes.split(",")]
    print(f"{'row':28} {'ran (plain / rl.empty)':32} {'plain':>8} {'plain2':>8} {'rl.empty':>9} "
          f"{'rl.empty/plain':>15} {'floor':>6}  load", flush=True)
    worse = 0
    for op, p, size in rows:
        load = os.getloadavg()[0]
        if a.fresh:
            got = {k: [] for k in KINDS}
            ran = {}
            for _ in range(a.fresh):
                for k in KINDS:
                    r = _run(op, p, size, 1, a.calls * a.blocks, (k,))
                    got[k].append(r["res"][k][0])
                    ran[k] = r["ran"][k]
        else:
            r = _run(op, p, size, a.blocks, a.calls, KINDS)
            got, ran = r["res"], r["ran"]
        med = {k: float(np.median(got[k])) for k in KINDS}
        ratio, floor = med["rl.empty"] / med["plain"], med["plain'"] / med["plain"]
        # the floor: how far apart two runs of the same code on the same buffers land
        spread = max(abs(floor - 1.0), 0.01)
        slower = ratio > 1.0 + spread
        worse += slower
        print(f"{op} p={p} {size // MiB} MiB".ljust(28),
              f"{ran['plain']} / {ran['rl.empty']}".ljust(32),
              f"{med['plain']:8.0f} {med[KINDS[1]]:8.0f} {med['rl.empty']:9.0f} "
              f"{ratio:15.3f} {floor:6.3f}  {load:.1f}" + ("  SLOWER" if slower else ""),
              flush=True)
    print(f"\nrl.empty slower than plain beyond the noise floor in {worse} of {len(rows)} rows "
          f"({'fresh jobs, %d turns' % a.fresh if a.fresh else 'one job per row, alternating blocks'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
