"""Copies a few bytes past their source: glibc's memcpy against ringlet's copy
(transport/copies.py), alone and inside collectives.

    python bench/copy_distance.py                 # the copy table, then p = 2 and 4 jobs
    python bench/copy_distance.py --no-jobs       # the copy table only

glibc copies 2 KiB to ~1 MiB with ``rep movsb``; on some x86 cores (the AMD EPYC VM of
2026-12-02) it runs at a fifteenth of its speed when the destination lies 1-15 bytes past
the source within a page. Part 1 times one process's copy of each size at each distance
(best of 30): NumPy's copy (memcpy) against ``copies.copy`` (a vector loop at distances
1-63, memcpy elsewhere).

Part 2 runs collectives whose output starts ``--offset`` bytes into a page and whose input
starts at 0 - as a shard's view in a flat buffer can - in one job, three arms in
alternating blocks (ringlet.bench.alternating_blocks): the loop on (``near``), the loop off
so every copy is memcpy as before it (``near-memcpy``), and both buffers at distance 0
(``even``, the loop on; a reference). Each block's time is the slowest rank's median call;
printed: each arm's median block and near-memcpy / near per block pair (> 1: the loop is
faster). Ranks pinned as mpirun pins Open MPI's.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

OPS = ("all_gather", "all_to_all", "gather", "scatter", "broadcast")
ARMS = ("even", "near", "near-memcpy")


def _at(nbytes: int, offset: int) -> np.ndarray:
    raw = np.empty(nbytes + 8192, np.uint8)
    a = (-raw.ctypes.data) % 4096 + offset
    return raw[a:a + nbytes]


def copy_table(sizes, distances) -> None:
    from ringlet.transport import copies

    def best(fn, reps=30):
        b = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            b = min(b, time.perf_counter() - t)
        return b

    print("one process, best of 30 (us; GB/s): NumPy's copy (memcpy) | copies.copy")
    print(f"{'size':>8} {'distance':>9} {'memcpy':>16} {'copies.copy':>16}")
    for n in sizes:
        src = _at(n, 0)
        src[:] = 1
        for d in distances:
            dst = _at(n, d)
            t_np = best(lambda: np.copyto(dst, src))
            t_c = best(lambda: copies.copy(dst, src))
            print(f"{n >> 10:>6}Ki {d:>9} {t_np * 1e6:8.1f} {n / t_np / 1e9:6.1f} "
                  f"{t_c * 1e6:8.1f} {n / t_c / 1e9:6.1f}")


def _calls(rl, op, nbytes, p, rank, offset):
    """(call, reset, check) of ``op`` with its output ``offset`` bytes into a page."""
    f32 = np.dtype(np.float32)
    n = max(nbytes // 4 // p, 1)

    def view(count, off):
        return _at(count * 4, off).view(f32)

    if op == "all_gather":
        x, out = view(n, 0), view(n * p, offset)
        return (lambda: rl.all_gather(out, x)), (lambda: x.fill(rank)), \
            (lambda: int(np.count_nonzero(out != np.repeat(np.arange(p, dtype=f32), n))))
    if op == "all_to_all":
        x, out = view(n * p, 0), view(n * p, offset)
        return (lambda: rl.all_to_all(out, x)), (lambda: x.fill(rank)), \
            (lambda: int(np.count_nonzero(out != np.repeat(np.arange(p, dtype=f32), n))))
    if op == "gather":
        x, out = view(n, 0), view(n * p, offset)
        return (lambda: rl.gather(x, out if rank == 0 else None, 0)), (lambda: x.fill(rank)), \
            (lambda: int(np.count_nonzero(out != np.repeat(np.arange(p, dtype=f32), n)))
             if rank == 0 else 0)
    if op == "scatter":
        x, out = view(n * p, 0), view(n, offset)

        def reset():
            for r in range(p):
                x[r * n:(r + 1) * n] = r
        return (lambda: rl.scatter(out, x if rank == 0 else None, 0)), reset, \
            (lambda: int(np.count_nonzero(out != rank)))
    if op == "broadcast":
        x = view(n * p, offset)

        def reset():
            x.fill(7 if rank == 0 else rank)
        return (lambda: rl.broadcast(x, 0)), reset, (lambda: int(np.count_nonzero(x != 7)))
    raise ValueError(op)


def _job(rank, ops, sizes, offset, blocks, calls, out):
    import ringlet as rl
    from ringlet.bench import ab_row, bind_like_mpirun, write_rows
    from ringlet.transport import _fastpath
    p = rl.get_world_size()
    bind_like_mpirun(rank, p)

    def switch(arm):    # memcpy at every distance in the near-memcpy arm's blocks only
        _fastpath.copy_loop(arm != "near-memcpy")

    rows = []
    for op in ops:
        for size in sizes:
            arms = {arm: _calls(rl, op, size, p, rank, 0 if arm == "even" else offset)
                    for arm in ARMS}
            rows.append(ab_row(rl, op, size, arms, blocks, calls, switch))
            _fastpath.copy_loop(True)
    write_rows(rank, rows, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("-p", "--procs", default="2,4")
    ap.add_argument("--sizes", default="1M,8M", help="collective sizes (nccl-tests' meaning)")
    ap.add_argument("--offset", type=int, default=4, help="the outputs' bytes into a page")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--no-jobs", action="store_true", help="only the one-process copy table")
    a = ap.parse_args(argv)
    from ringlet.bench import parse_sizes, spawn_rows
    copy_table([64 << 10, 512 << 10, 1 << 20, 4 << 20], [0, 4, 8, 16, 32, 64])
    if a.no_jobs:
        return 0
    print(f"\ncollectives, output {a.offset} bytes into a page, input at 0 (us, median block "
          f"of {a.blocks}; ratio per block pair: > 1, the loop is faster)")
    print(f"{'row':<24} {'ran':<18} {'even':>7} {'near':>7} {'memcpy':>7}   memcpy/near (min-max)")
    bad = 0
    for p in [int(x) for x in a.procs.split(",")]:
        for r in spawn_rows(_job, p, a.ops.split(","), parse_sizes(a.sizes), a.offset,
                            a.blocks, a.calls):
            res = r["res"]
            ratio = np.array(res["near-memcpy"]) / np.array(res["near"])
            med = {k: np.median(v) for k, v in res.items()}
            name = f"{r['op']} p={p} {r['size'] >> 20} MiB"
            print(f"{name:<24} {r['ran'] or '?':<18} {med['even']:7.0f} {med['near']:7.0f} "
                  f"{med['near-memcpy']:7.0f}   {np.median(ratio):.2f} "
                  f"({ratio.min():.2f}-{ratio.max():.2f})"
                  + (f"  WRONG {r['wrong']}" if r["wrong"] else ""), flush=True)
            bad += r["wrong"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
