"""Where ranks outnumber cores: a transport rule of protocol.py on and off in one mpirun
job - alternating blocks of the same call with the flag set ("on") and cleared ("off"),
Open MPI's call beside them, every input written again before each call.

* ``--flag CROWDED_BUSY_HELP`` (on: the old rule): a sender with other copies in its round
  helps copy a message its receiver reads in place (transport/split.py).
* ``--flag CROWDED_EXCHANGE_CMA`` (on: the new rule): an exchange's plain message larger
  than one EAGER packet is read whole by CMA (transport/limits.py, CMA_MIN).

    python bench/crowded_ab.py --op scatter -p 3,4 --sizes 8M,32M
    python bench/crowded_ab.py --flag CROWDED_EXCHANGE_CMA --op all_to_all --kinds plain \
        --sizes 3M,4M

Printed per row: the median block of each arm in us (the slowest rank's median call of
each block) and on / off (above 1: the flag on was slower).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def _child(a) -> None:
    from mpi4py import MPI

    import ringlet as rl
    from ringlet.bench import _make_call, alternating_blocks, mpi_arm, paged_empty, parse_sizes
    from ringlet.transport import protocol
    comm = MPI.COMM_WORLD
    rl.init()
    p, rank = rl.get_world_size(), rl.get_rank()

    def switch(name):
        setattr(protocol, a.flag, name == "on")

    rows = []
    for size in parse_sizes(a.sizes):
        for kind in a.kinds.split(","):
            call = _make_call(rl, a.op, size, p, rank, np.dtype(np.float32), a.algorithm,
                              kind == "rl.empty", fresh=True, plain=paged_empty)
            arms = {"on": call, "off": call, "mpi": mpi_arm(comm, a.op, size)}
            got = alternating_blocks(rl, arms, a.blocks, a.calls, switch=switch)
            rows.append({"op": a.op, "p": p, "bytes": size, "kind": kind,
                         "median_us": {k: float(np.median(v)) for k, v in got.items()},
                         "blocks": got})
    rl.destroy()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(rows, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flag", default="CROWDED_BUSY_HELP",
                    choices=["CROWDED_BUSY_HELP", "CROWDED_EXCHANGE_CMA"])
    ap.add_argument("--op", default="scatter")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("-p", default="4", help="rank counts, comma-separated")
    ap.add_argument("--sizes", default="8M")
    ap.add_argument("--kinds", default="rl.empty", help="rl.empty and/or plain")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a)
        return 0
    from ringlet.bench import mpi_job_rows
    rows = []
    for p in (int(x) for x in a.p.split(",")):
        for r in mpi_job_rows(__file__, p, ["--flag", a.flag, "--op", a.op,
                                            "--algorithm", a.algorithm,
                                            "--sizes", a.sizes, "--kinds", a.kinds,
                                            "--blocks", str(a.blocks), "--calls", str(a.calls)]):
            m = r["median_us"]
            print(f"{a.flag} {r['op']} p={r['p']} {r['bytes'] >> 10} KiB {r['kind']:<9} "
                  f"on {m['on']:.0f}  off {m['off']:.0f}  mpi {m['mpi']:.0f}   "
                  f"on/off {m['on'] / m['off']:.2f}", flush=True)
            rows.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
