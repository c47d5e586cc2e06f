"""Every algorithm of a collective beside Open MPI, in one mpirun job: alternating blocks
of calls (ringlet.bench.alternating_blocks), so each algorithm and Open MPI meet the same
placement on the cores and the same spells of the host, block by block.

    python bench/algorithms_vs_mpi.py --op reduce -p 4 --sizes 1M,8M
    python bench/algorithms_vs_mpi.py --op all_gather -p 2,4 --kinds plain --blocks 12

Inputs are written again before every call (as in_job_vs_mpi.py --fresh); plain buffers
start 64 bytes into a page (ringlet.bench.paged_empty). Printed per row: the median block
of each arm in us (the slowest rank's median call of each block) and which arm was
fastest. Use it to compare a schedule changed in the tree against the others and Open MPI
(bench/in_job_vs_mpi.py compares auto's pick only).

``--flag NAME``: instead of the algorithms, one of them (``--algorithms``, default auto)
with a transport rule of protocol.py set ("NAME=on") and cleared ("NAME=off"), block by
block, and on / off printed (above 1: the rule on was slower). The rules:

* CROWDED_BUSY_HELP (on: the old rule): where ranks outnumber cores, a sender with other
  copies in its round helps copy a message its receiver reads in place (split.py);
* CROWDED_EXCHANGE_CMA (on: the new rule): where ranks outnumber cores, an exchange's
  plain message larger than one EAGER packet is read whole by CMA (transport/limits.py,
  CMA_MIN);
* CMA_IN_C (on: the new rule, in transport/fast.py): a call whose exchange messages go by
  CMA runs in the C fast path, not in the Python engine;
* EMPTY_CMA_IN_C (on: the new rule, in transport/fast.py): ... and so does one whose
  sources lie in rl.empty buffers, sending them by CMA too (off: the engine has them read
  in place);

``--knob NAME=BYTES[,NAME=BYTES]``: instead of the algorithms, one of them with size limits
of every local peer (transport/shm.py's ShmPeer) set to BYTES and left as built ("built"),
block by block; BYTES / built printed is the ratio of their times. The
limits: ``cma_min`` (above it an exchange's plain message is read by CMA: limits.py,
CMA_MIN), ``zc_oneway_min`` (above it a one-way message is read in place from rl.empty or
offered by CMA from a plain buffer: ZERO_COPY_ONEWAY_MIN).

    python bench/algorithms_vs_mpi.py --knob cma_min=524288 --op all_to_all -p 2 \
        --sizes 1536K,2M,3M --kinds plain

Each flip clears the prepared calls (collectives._CALLS), so every block's call is prepared
under its own setting: C declines a call prepared under the other one (fast._cma_rule), which
had made flipping the CMA rules unfair to one arm before.

    python bench/algorithms_vs_mpi.py --flag CROWDED_BUSY_HELP --op scatter -p 3,4 \
        --sizes 8M,32M --kinds rl.empty
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def _child(a) -> None:
    from mpi4py import MPI

    import ringlet as rl
    from ringlet import algorithms, collectives
    from ringlet.bench import _make_call, alternating_blocks, mpi_arm, paged_empty, parse_sizes
    from ringlet.transport import fast, protocol
    comm = MPI.COMM_WORLD
    rl.init()
    p, rank = rl.get_world_size(), rl.get_rank()
    names = a.algorithms.split(",") if a.algorithms else [
        n for n in algorithms.CATALOG[a.op] if n != "hierarchical"]
    switch = None
    if a.knob:             # one algorithm, a peer limit set and as built
        from ringlet.runtime import engine
        from ringlet.transport.shm import ShmPeer
        knobs = {k: int(v) for k, v in (kv.split("=") for kv in a.knob.split(","))}
        peers = [q for q in engine().peers.values() if isinstance(q, ShmPeer)
                 and all(getattr(q, k) >= 0 for k in knobs)]
        built = {q: {k: getattr(q, k) for k in knobs} for q in peers}
        arms_of = {a.knob: a.algorithms or "auto", "built": a.algorithms or "auto"}

        def switch(name):
            for q in peers:
                for k, v in knobs.items():
                    setattr(q, k, built[q][k] if name == "built" else v)
            collectives._CALLS.clear()      # (C's by_cma reads cma_min when it prepares)
    elif a.flag:             # one algorithm, the rule on and off
        arms_of = {f"{a.flag}=on": a.algorithms or "auto", f"{a.flag}=off": a.algorithms or "auto"}

        def switch(name):
            setattr(fast if a.flag.endswith("CMA_IN_C") else protocol, a.flag,
                    name.endswith("=on"))
            # prepared again under the new setting (in the block's warm call): a call
            # prepared under the other one would be left by C to the engine (fast._cma_rule)
            collectives._CALLS.clear()
    else:
        arms_of = {n: n for n in names}
    rows = []
    for size in parse_sizes(a.sizes):
        for kind in a.kinds.split(","):
            made = {algo: _make_call(rl, a.op, size, p, rank, np.dtype(np.float32), algo,
                                     kind == "rl.empty", fresh=True, plain=paged_empty)
                    for algo in set(arms_of.values())}
            arms = {arm: made[algo] for arm, algo in arms_of.items()}
            arms["mpi"] = mpi_arm(comm, a.op, size)
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
    ap.add_argument("--op", default="reduce")
    ap.add_argument("--algorithms", default="", help="comma-separated (default: all but "
                    "hierarchical)")
    ap.add_argument("--flag", default="", choices=["", "CROWDED_BUSY_HELP",
                                                   "CROWDED_EXCHANGE_CMA", "CMA_IN_C",
                                                   "EMPTY_CMA_IN_C"],
                    help="A/B this rule of protocol.py (*CMA_IN_C: of transport/fast.py) on "
                         "one algorithm (module doc)")
    ap.add_argument("--knob", default="", help="NAME=BYTES: A/B a local peers' limit (cma_min, "
                    "zc_oneway_min) set so against as built (module doc)")
    ap.add_argument("-p", default="2,4", help="rank counts, comma-separated")
    ap.add_argument("--sizes", default="1M,8M")
    ap.add_argument("--kinds", default="plain,rl.empty")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a)
        return 0
    from ringlet.bench import mpi_job_rows
    everything = []
    for p in (int(x) for x in a.p.split(",")):
        try:
            rows = mpi_job_rows(__file__, p, ["--op", a.op, "--algorithms", a.algorithms,
                                              "--flag", a.flag,
                                              "--knob", a.knob,
                                              "--sizes", a.sizes, "--kinds", a.kinds,
                                              "--blocks", str(a.blocks), "--calls",
                                              str(a.calls)])
        except RuntimeError as exc:
            print(exc)
            return 1
        for r in rows:
            med = r["median_us"]
            best = min(med, key=med.get)
            if a.knob:
                tail = f"set/built {med[a.knob] / med['built']:.2f}"
            elif a.flag:
                tail = f"on/off {med[a.flag + '=on'] / med[a.flag + '=off']:.2f}"
            else:
                tail = f"fastest: {best}"
            print(f"{a.op} p={p} {r['bytes'] >> 10} KiB {r['kind']:8} "
                  + "  ".join(f"{k} {v:.0f}" for k, v in med.items()) + f"   {tail}",
                  flush=True)
        everything += rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
