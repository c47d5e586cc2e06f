"""One-way EAGER messages of 128-512 KiB in pieces (limits.pieces) against whole packets,
A/B in one job.

    python bench/eager_pieces.py                       # p = 2 and 4, 256 KiB and 1 MiB
    python bench/eager_pieces.py --ops scatter,broadcast -p 2 --sizes 1M --blocks 16

A collective's message of more than 128 KiB, up to the EAGER limit, from a sender that
receives nothing in its round, goes to a local peer as up to 4 packets: its receiver
copies one out while the sender copies the next in. The arms take turns in blocks of calls (ringlet.bench.alternating_blocks; the order
rotating block by block); switching arms sets the piece size on every rank and drops the
prepared calls and lanes, so the next call compiles its plan again. Each block's time is
the slowest rank's median call, inputs written again before each call (``--fresh``'s
way); printed: each arm's median block and whole / pieces per block pair (> 1: pieces are
faster). Ranks pinned as mpirun pins Open MPI's.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

OPS = ("broadcast", "scatter", "gather", "reduce", "all_reduce", "all_gather",
       "reduce_scatter", "all_to_all")


def _job(rank, ops, sizes, blocks, calls, out):
    import ringlet as rl
    from ringlet import collectives, runtime
    from ringlet.bench import _make_call, ab_row, bind_like_mpirun, paged_empty, write_rows
    from ringlet.transport import limits
    p = rl.get_world_size()
    bind_like_mpirun(rank, p)
    piece = limits.SHM_PIECE_BYTES

    def switch(arm):
        limits.SHM_PIECE_BYTES = piece if arm == "pieces" else 0
        collectives._CALLS.clear()
        runtime.drop_lanes()

    rows = []
    for op in ops:
        for size in sizes:
            arms = {arm: _make_call(rl, op, size, p, rank, np.dtype(np.float32), "auto",
                                    fresh=True, plain=paged_empty)
                    for arm in ("whole", "pieces")}
            rows.append(ab_row(rl, op, size, arms, blocks, calls, switch))
    switch("pieces")
    write_rows(rank, rows, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("-p", "--procs", default="2,4")
    ap.add_argument("--sizes", default="256K,1M", help="nccl-tests' meaning, as ringlet bench")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args(argv)
    from ringlet.bench import auto_priced_by, parse_sizes, spawn_rows
    print(auto_priced_by())
    print(f"{'row':<26} {'ran':<20} {'whole':>7} {'pieces':>7}   whole/pieces (min-max)")
    bad = 0
    for p in [int(x) for x in a.procs.split(",")]:
        for r in spawn_rows(_job, p, a.ops.split(","), parse_sizes(a.sizes), a.blocks, a.calls):
            whole, split = np.array(r["res"]["whole"]), np.array(r["res"]["pieces"])
            ratio = whole / split
            size = r["size"]
            name = f"{r['op']} p={p} " + (f"{size >> 20} MiB" if size >= 1 << 20 else
                                          f"{size >> 10} KiB")
            print(f"{name:<26} {r['ran'] or '?':<20} {np.median(whole):7.0f} "
                  f"{np.median(split):7.0f}   {np.median(ratio):.2f} "
                  f"({ratio.min():.2f}-{ratio.max():.2f})"
                  + (f"  WRONG {r['wrong']}" if r["wrong"] else ""), flush=True)
            bad += r["wrong"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
