"""ringlet against Open MPI in the same processes: one mpirun job runs both libraries, in
alternating blocks of calls, so both meet the same placement on the cores and the same
state of the host, block by block.

    python bench/in_job_vs_mpi.py          # 8 collectives, p = 2 and 4, 1 and 8 MiB
    python bench/in_job_vs_mpi.py --ops all_gather,all_to_all -p 2 --sizes 1M,8M --fresh

Why: on this VM the two cores' distance changes by the second (bench/core_distance.py: a
cache line's one-way trip takes 60-90 ns in some spells and 250-500 ns in others), and
with it the cost of every byte one core writes and the other reads. A job that starts in
a far spell runs ringlet's 1 MiB all_gather p = 2 at ~250 us instead of ~110 (fresh jobs
in turns: bimodal, both kinds of buffer alike). Open MPI in separate jobs does not show
it on the usual measurement, which never writes its input again: a peer's input read once
(by process_vm_readv) stays in the reader's cache, and from the second call on nothing
crosses between the cores. ``--fresh`` writes every input again before each timed call
(outside the timer, as a training step writes new gradients): then both libraries move
the bytes every call, and Open MPI meets the far spells too.

Plain buffers on both sides start 64 bytes into a page (ringlet.bench.paged_empty): arrays
from the heap, as a job's later allocations are, can meet at a distance where the kernel's
copy is 4-5x slow (Open MPI's all_gather p = 2 1 MiB: 400 us instead of 100).

Each block: a warm call, then ``--calls`` timed calls (each after a barrier, the slowest
rank's median), the arms rotated block by block (ringlet.bench.alternating_blocks).
Reported per row: the median block of each arm, and Open MPI's time over ringlet's taken
block pair by block pair (the median pair and the spread: > 1, ringlet is faster).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

OPS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
       "gather", "scatter")
ARMS = ("plain", "rl.empty", "mpi")
PLAIN_TARGET, RL_EMPTY_TARGET = 1.0, 1.2     # issue 27: times Open MPI's speed


def _child(a) -> None:
    from mpi4py import MPI

    import ringlet as rl
    from ringlet.bench import (_make_call, algorithm_ran, alternating_blocks, mpi_arm,
                               paged_empty, parse_sizes)
    comm = MPI.COMM_WORLD
    rl.init()
    p, rank = rl.get_world_size(), rl.get_rank()
    rows = []
    for op in a.ops.split(","):
        for size in parse_sizes(a.sizes):
            arms = {}
            for kind in [k for k in a.arms.split(",") if k != "mpi"]:
                arms[kind] = _make_call(rl, op, size, p, rank, np.dtype(np.float32), "auto",
                                        kind == "rl.empty", fresh=a.fresh, plain=paged_empty)
            if "mpi" in a.arms.split(","):
                arms["mpi"] = mpi_arm(comm, op, size, a.fresh)
            # what auto picked for each kind of buffer (they may differ: rl.empty's messages
            # are read in place, and priced so)
            picks = [algorithm_ran(rl, op, call) for kind, (call, *_) in arms.items()
                     if kind != "mpi"]
            ran = "/".join(dict.fromkeys(str(x) for x in picks))
            got = alternating_blocks(rl, arms, a.blocks, a.calls)
            rows.append({"op": op, "p": p, "bytes": size, "ran": ran, "blocks": got,
                         "load": os.getloadavg()[0]})
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(rows, f)


def _ratio(mpi: list, ours: list) -> tuple[float, float, float]:
    """Open MPI over ringlet, block pair by block pair: the median and its 90% interval."""
    from ringlet.bench import median_interval
    return median_interval(np.array(mpi) / np.array(ours))


def _mark(v: str) -> str:
    return {"met": " ", "missed": "x", "unsure": "?"}[v]


def _count(rows: list, key: str) -> str:
    n = {v: sum(r[key] == v for r in rows) for v in ("met", "unsure", "missed")}
    return f"{n['met']} met, {n['unsure']} unsure, {n['missed']} missed"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("-p", default="2,4", help="rank counts, comma-separated")
    ap.add_argument("--sizes", default="1M,8M")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--arms", default=",".join(ARMS), help="a subset of " + ",".join(ARMS))
    ap.add_argument("--fresh", action="store_true", help="write every input again before each call")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a)
        return 0
    from ringlet.bench import auto_priced_by, mpi_job_rows, verdict
    print(auto_priced_by())
    print(f"{'row':26} {'ran (plain/rl.empty)':26} {'plain':>7} {'rl.empty':>9} {'mpi':>7}   "
          f"{'mpi/plain (90% interval)':>24} {'mpi/rl.empty (90% interval)':>28}  load",
          flush=True)
    everything = []
    for p in (int(x) for x in a.p.split(",")):
        try:
            rows = mpi_job_rows(__file__, p, ["--ops", a.ops, "--sizes", a.sizes, "--arms",
                                              a.arms, "--blocks", str(a.blocks), "--calls",
                                              str(a.calls)] + (["--fresh"] if a.fresh else []))
        except RuntimeError as exc:
            print(exc)
            return 1
        for r in rows:
            b = r["blocks"]
            med = {k: float(np.median(b[k])) if k in b else float("nan") for k in ARMS}
            if set(ARMS) - set(b):
                print(f"{r['op']} p={r['p']} {r['bytes'] >> 20} MiB: " + "  ".join(
                    f"{k} {v:.0f}" for k, v in med.items()), flush=True)
                continue
            mp, lo, hi = _ratio(b["mpi"], b["plain"])
            me, lo2, hi2 = _ratio(b["mpi"], b["rl.empty"])
            r.update(ratio_plain=mp, ratio_rl_empty=me, fresh=a.fresh)
            name = f"{r['op']} p={r['p']} {r['bytes'] >> 20} MiB"
            r.update(interval_plain=(lo, hi), interval_rl_empty=(lo2, hi2),
                     verdict_plain=verdict((mp, lo, hi), PLAIN_TARGET),
                     verdict_rl_empty=verdict((me, lo2, hi2), RL_EMPTY_TARGET))
            print(f"{name:26} {str(r['ran']):26} {med['plain']:7.0f} {med['rl.empty']:9.0f} "
                  f"{med['mpi']:7.0f}   {mp:6.2f} ({lo:.2f}-{hi:.2f}) {_mark(r['verdict_plain'])}"
                  f"         {me:6.2f} ({lo2:.2f}-{hi2:.2f}) {_mark(r['verdict_rl_empty'])}"
                  f"         {r['load']:.1f}", flush=True)
            everything.append(r)
    held = [(r["ratio_plain"] >= PLAIN_TARGET, r["ratio_rl_empty"] >= RL_EMPTY_TARGET)
            for r in everything]
    print(f"\nplain >= {PLAIN_TARGET}x Open MPI: {sum(h[0] for h in held)} of {len(held)} rows "
          f"on the median ({_count(everything, 'verdict_plain')}); rl.empty >= "
          f"{RL_EMPTY_TARGET}x: {sum(h[1] for h in held)} of {len(held)} "
          f"({_count(everything, 'verdict_rl_empty')}); "
          f"{'inputs written again before every call' if a.fresh else 'inputs written once'}")
    print("(met / missed: the median's 90% bootstrap interval over the block pairs lies wholly "
          "above / below the target; unsure: the target lies inside it)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
