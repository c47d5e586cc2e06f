"""Gradient communication hidden behind backward: GradBuckets on a shaped link.

    sudo .venv/bin/python bench/train_overlap.py [--rate 1gbit] [--layers 8] [--mib 2]

Two emulated hosts (ringlet.hosts), one rank on each, one tbf-shaped link. A backward
pass of --layers layers, each a GIL-releasing NumPy compute (float32 matmuls, one BLAS
thread) about as long as its gradient's share of the all_reduce, producing a gradient of
--mib MiB (float32). Buckets of one layer each. Per step, medians of --reps:

    comm      the buckets alone: every gradient handed over, then wait()
    comp      the backward alone
    after     backward, then every gradient handed over, then wait() (no overlap)
    bucketed  each gradient handed over as its layer finishes, wait() at the end

hidden share = 1 - (bucketed - comp) / comm: the part of the gradient communication the
backward pass hid (0: none, 1: all).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
import on_hosts  # noqa: E402  (bench/on_hosts.py)


def rank_main(layers: int, mib: float, reps: int) -> None:
    import numpy as np
    import ringlet as rl
    from ringlet import train

    rl.init()
    n = int(mib * (1 << 18))
    grads = [np.full(n, 1.0 + i, np.float32) for i in range(layers)]
    gb = train.GradBuckets([np.zeros(n, np.float32) for _ in range(layers)],
                           bucket_cap_mb=mib)
    a = np.random.default_rng(rl.get_rank()).random((384, 384), dtype=np.float32)
    out = np.empty_like(a)

    def compute(k):
        for _ in range(k):
            np.matmul(a, a, out=out)

    def timed(f):
        rl.barrier()
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    def hand_over():
        for i in reversed(range(layers)):
            gb.ready(i, grads[i])
        gb.wait()

    hand_over()
    compute(10)
    unit = sorted(timed(lambda: compute(20)) for _ in range(3))[1] / 20
    t_comm = sorted(timed(hand_over) for _ in range(3))[1]
    k = np.array([max(1, round(t_comm / layers / unit))])
    rl.broadcast(k, 0)                       # the same backward on both ranks
    k = int(k[0])

    def comm():
        hand_over()

    def comp():
        for _ in range(layers):
            compute(k)

    def after():
        comp()
        hand_over()

    def bucketed():
        for i in reversed(range(layers)):
            compute(k)
            gb.ready(i, grads[i])
        gb.wait()

    runs = {f.__name__: [] for f in (comm, comp, after, bucketed)}
    for _ in range(reps):                    # in turns: load changes fall on all alike
        for f in (comm, comp, after, bucketed):
            runs[f.__name__].append(timed(f))
    med = {name: sorted(v)[len(v) // 2] for name, v in runs.items()}
    priced = gb.price(rl.cost.Link(alpha=50e-6, bandwidth=_RATE[0] * 1448 / 1538,
                                   name="shaped")).comm_seconds
    if rl.get_rank() == 0:
        on_hosts.report({**med, "priced": priced, "k": k})
    rl.destroy()


_RATE = [0.0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mib", type=float, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    _RATE[0] = on_hosts.rate_bytes(a.rate)
    if a.rank:
        rank_main(a.layers, a.mib, a.reps)
        return 0
    args = ["--rank", "--rate", a.rate, "--layers", str(a.layers), "--mib", str(a.mib),
            "--reps", str(a.reps)]
    r = on_hosts.run(HERE, args, a.rate)
    ms = {key: v * 1e3 for key, v in r.items() if key != "k"}
    hidden = 1 - (r["bucketed"] - r["comp"]) / r["comm"]
    print(f"2 emulated hosts x 1 rank, {a.rate} tbf link; backward of {a.layers} layers, "
          f"{a.mib} MiB float32 gradient each, one bucket per layer; medians of {a.reps} (ms)")
    print(f"comm alone {ms['comm']:.1f} (priced {ms['priced']:.1f}) | backward alone "
          f"{ms['comp']:.1f} | backward then comm {ms['after']:.1f} | bucketed "
          f"{ms['bucketed']:.1f}")
    print(f"hidden share of gradient communication: {hidden:.2f} "
          f"(step {r['after'] / r['bucketed']:.2f}x faster than communicating after backward)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
