"""What a float16 or bfloat16 reduction costs over float32's, in the calls: ring all_reduce
and reduce_scatter of the same bytes in each dtype, blocks taken in turn in one job, inputs
written again before every call; the extra seconds per byte a rank reduces, over float32's,
beside what the cost model prices (``cost.reduce_gamma``: the profile's gamma plus
``cost.profile.HALF_GAMMA``).

    python bench/half_gamma.py [-p 2] [--sizes 1M,4M,8M] [--blocks 8 --calls 8]

Printed per row: the median block (slowest rank's median call, us) of each dtype, the
measured extra ps per byte reduced, and the model's time for each dtype and its ratio to
float32's beside the measured ratio. Sets HALF_GAMMA (profile.py): the median of the rows'
extras.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

DTYPES = ("float32", "float16", "bfloat16")
COLLECTIVES = ("all_reduce", "reduce_scatter")


def _worker(rank, sizes, blocks, calls, out):
    import ringlet as rl
    from ringlet import ops
    from ringlet.bench import alternating_blocks
    p = rl.get_world_size()
    res = {}
    for nb in sizes:
        for coll in COLLECTIVES:
            arms = {}
            for name in DTYPES:
                d = ops.dtype_named(name)
                a = np.zeros(nb // d.itemsize, d)
                part = np.zeros(nb // d.itemsize // p, d)
                reset = (lambda a=a: ops.fill(a, 0.5))
                call = ((lambda a=a: rl.all_reduce(a, algorithm="ring")) if coll == "all_reduce"
                        else (lambda a=a, q=part: rl.reduce_scatter(q, a, algorithm="ring")))
                arms[name] = (call, reset)
            res[f"{coll} {nb}"] = alternating_blocks(rl, arms, blocks, calls)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-p", type=int, default=2)
    ap.add_argument("--sizes", default="1M,4M,8M")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=8)
    a = ap.parse_args(argv)
    from ringlet import cost
    from ringlet.cost.profile import HALF_GAMMA
    from ringlet.launch import spawn
    sizes = [cost.parse_size(s) for s in a.sizes.split(",")]
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        spawn(_worker, a.p, args=(sizes, a.blocks, a.calls, out))
        got = json.load(open(out))
    print(f"p = {a.p}, ring, {a.blocks} blocks of {a.calls} calls per dtype, load {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}; HALF_GAMMA (ps/B): "
          + ", ".join(f"{k} {v * 1e12:.0f}" for k, v in HALF_GAMMA.items()))
    print(f"{'row':22} {'dtype':9} {'us':>7} {'extra ps/B':>10} {'model us':>9} "
          f"{'model ratio':>11} {'measured ratio':>14}")
    extras = {k: [] for k in DTYPES[1:]}
    for key, times in got.items():
        coll, nb = key.split()
        nb = int(nb)
        reduced = nb * (a.p - 1) / a.p         # bytes each rank reduces in a ring
        f32 = float(np.median(times["float32"]))
        model32 = cost.predict_host(coll, nb, a.p, "ring", dtype="float32")
        for name in DTYPES:
            med = float(np.median(times[name]))
            extra = (med - f32) * 1e-6 / reduced
            model = cost.predict_host(coll, nb, a.p, "ring", dtype=name)
            if name != "float32":
                extras[name].append(extra)
            print(f"{coll + ' ' + cost.format_size(nb):22} {name:9} {med:7.0f} "
                  f"{extra * 1e12:10.1f} {model * 1e6:9.0f} {model / model32:11.2f} "
                  f"{med / f32:14.2f}")
    print("median extra (ps/B): " + ", ".join(f"{k} {np.median(v) * 1e12:.1f}"
                                              for k, v in extras.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
