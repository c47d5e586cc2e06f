"""16-bit floats reduced: dist.all_reduce of float32, float16 and bfloat16 tensors on the
ringlet backend beside a Gloo group of the same ranks, in one job, in alternating blocks.

    .venv/bin/ringlet run -n 2 bench/half_floats.py [--sizes 1M,8M] [--blocks 5]

Before the C kernels (2026-12-05) NumPy reduced float16 at 0.4 GB/s and ringlet's bfloat16
at 0.2: a 1 MiB float16 all_reduce took 4.5 ms against float32's 70 us. Prints, per dtype
and size, the median call of each backend (us, medians of the blocks) and Gloo / ringlet
(> 1: ringlet is faster), on rank 0.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ringlet.torch  # noqa: F401  (registers the backend)
from ringlet.cost.model import parse_size

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def block(t, group, calls=10) -> float:
    """Median microseconds of ``calls`` all_reduces of ``t``, each timed on this rank
    after a barrier (the slower rank's time is what both then wait for)."""
    times = []
    for _ in range(calls):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,8M", help="buffer bytes per rank, comma-separated")
    ap.add_argument("--blocks", type=int, default=5, help="alternating blocks per backend")
    a = ap.parse_args()
    dist.init_process_group("ringlet")
    gloo = dist.new_group(backend="gloo")
    rows = []
    for nbytes in (parse_size(s) for s in a.sizes.split(",")):
        for dtype in DTYPES:
            n = nbytes // torch.finfo(dtype).bits * 8
            t = (torch.rand(n) * 1e-3).to(dtype)    # (small: sums stay finite)
            for g in (None, gloo):                  # warm both
                block(t, g, 3)
            ours, theirs = [], []
            for _ in range(a.blocks):
                ours.append(block(t, None))
                theirs.append(block(t, gloo))
            rows.append((nbytes, str(dtype).split(".")[1], statistics.median(ours),
                         statistics.median(theirs)))
    if dist.get_rank() == 0:
        print(f"p = {dist.get_world_size()}; median call (us), medians of {a.blocks} blocks of 10")
        print(f"{'bytes':>9} {'dtype':>9} {'ringlet':>9} {'gloo':>9} {'gloo/ringlet':>13}")
        for nbytes, name, ours, theirs in rows:
            print(f"{nbytes:>9} {name:>9} {ours:>9.1f} {theirs:>9.1f} {theirs / ours:>13.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
