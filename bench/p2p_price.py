"""A blocking send and its receive between 2 local ranks, beside a two-rank direct
broadcast of the same bytes, and what the cost model prices each at: ``predict_p2p`` (a
send's limits, whole) and ``predict_host("broadcast", ..., "direct")`` (a collective's).

    .venv/bin/python bench/p2p_price.py [--sizes 256K,640K,768K,960K,1M,2M] [--calls 60]

Each row: the slowest rank's median over ``--calls`` calls (rank 0 writes its buffer,
barrier, time one call), plain NumPy buffers and ``rl.empty`` ones; then the prices and
each one's error against the send's time. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _job(rank, sizes, calls):
    import numpy as np

    import ringlet as rl
    from ringlet.bench import bind_like_mpirun, slowest_median_us
    from ringlet.cost import predict_host, predict_p2p
    bind_like_mpirun(rank, 2)
    rows = []
    for nb in sizes:
        for kind in ("plain", "rl.empty"):
            x = np.zeros(nb, np.uint8) if kind == "plain" else rl.empty(nb, np.uint8)

            def send():
                if rank == 0:
                    rl.send(x, 1)
                else:
                    rl.recv(x, 0)

            def broadcast():
                rl.broadcast(x, 0, algorithm="direct")

            def write():
                if rank == 0:
                    x[...] = 1

            got = {}
            for name, call in (("send", send), ("broadcast", broadcast)):
                for _ in range(5):
                    call()
                got[name] = slowest_median_us(rl, call, calls, write) * 1e-6
            shared = kind == "rl.empty"
            rows.append((nb, kind, got["send"], got["broadcast"],
                         predict_p2p(nb, shared=shared),
                         predict_host("broadcast", nb, 2, "direct", itemsize=1,
                                      shared=("buf",) if shared else ())))
    if rank == 0:
        from ringlet.cost import format_size
        print(f"{'size':>9} {'buffer':<9}{'send':>8}{'bcast':>8}{'p2p price':>11}{'err':>6}"
              f"{'bcast price':>13}{'err':>6}   (us; err against the send)")
        for nb, kind, s, b, ps, pb in rows:
            print(f"{format_size(nb):>9} {kind:<9}{s * 1e6:8.1f}{b * 1e6:8.1f}{ps * 1e6:11.1f}"
                  f"{(ps / s - 1) * 100:+5.0f}%{pb * 1e6:13.1f}{(pb / s - 1) * 100:+5.0f}%")


def main(argv=None) -> int:
    from ringlet.cost import parse_size
    from ringlet.launch import spawn
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256K,640K,768K,960K,1M,2M")
    ap.add_argument("--calls", type=int, default=60)
    a = ap.parse_args(argv)
    sizes = [int(parse_size(s)) for s in a.sizes.split(",")]
    spawn(_job, 2, args=(sizes, a.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
