"""bfloat16 against float16 and float32: an all_reduce of the same bytes, in blocks taken
in turn inside one job, and the time its reduction kernel takes inside the call.

    .venv/bin/ringlet run -n 2 bench/bfloat16_reduce.py [--sizes 1M,8M] [--algorithm auto]

Why: a bfloat16 all_reduce took 1.6-1.8x float32's time at p = 2 where its kernel, warm,
reduces at half float32's rate (docs/results.md, "The targets table on an Intel VM"); the
kernel inside the call, whose sources lie in a ring another core has just written, ran
far slower than warm. Each block: ``--calls`` calls, inputs written again before each (as
a training step writes new gradients), then the slowest rank's median. Reported per size
and dtype: the median block and the spread (us), and - where the Python engine reduced
with a C kernel (``transport.fast.CReduce``: float16, bfloat16) - that kernel's time per
call on rank 0. Where the C fast path ran a call whole, its reductions are inside C and
not counted here (the column reads "-").
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import ringlet as rl
from ringlet import ops
from ringlet.bench import parse_sizes, slowest_median_us
from ringlet.transport import fast

DTYPES = ("float32", "float16", "bfloat16")


def _timing_kernel():
    """Wrap CReduce so the engine's kernel calls are timed: [seconds, calls]."""
    spent = [0.0, 0]
    inner = fast.CReduce.__call__

    def timed(self, acc, src, out):
        t = time.perf_counter()
        inner(self, acc, src, out)
        spent[0] += time.perf_counter() - t
        spent[1] += 1
    fast.CReduce.__call__ = timed
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,8M", help="bytes per rank, e.g. 1M,8M")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--calls", type=int, default=15)
    a = ap.parse_args()
    spent = _timing_kernel()
    rl.init()
    rank = rl.get_rank()
    for nbytes in parse_sizes(a.sizes):
        bufs = {name: np.zeros(nbytes // ops.dtype_named(name).itemsize, ops.dtype_named(name))
                for name in DTYPES}
        blocks = {name: [] for name in DTYPES}
        kernel = {name: [] for name in DTYPES}
        for block in range(a.blocks + 1):           # (the first block only warms up)
            for name in DTYPES[block % 3:] + DTYPES[:block % 3]:    # (turns rotated)
                x = bufs[name]
                spent[:] = [0.0, 0]
                us = slowest_median_us(rl, lambda: rl.all_reduce(x, algorithm=a.algorithm),
                                       a.calls, reset=lambda: ops.fill(x, rank + 1))
                if block:
                    blocks[name].append(us)
                    kernel[name].append(spent[0] / a.calls if spent[1] else None)
        if rank == 0:
            for name in DTYPES:
                b = np.array(blocks[name])
                k = [x for x in kernel[name] if x is not None]
                ktext = f"{np.median(k) * 1e6:8.0f}" if k else f"{'-':>8}"
                print(f"{nbytes:>10} B {name:>9}: {np.median(b):8.0f} us "
                      f"({b.min():.0f}-{b.max():.0f}), kernel {ktext} us a call", flush=True)
    rl.destroy()


if __name__ == "__main__":
    main()
