"""Under mpirun --bind-to core, p = 2: the engine as it was when each rank counted only
its own core (crowded: yield at once, the C fast path's budget a millisecond of yields,
one-way messages read whole) against now (the job's two cores), in alternating blocks of
one job. Both keep the job's profile, so this measures the engine's part, not the picks.

    mpirun --allow-run-as-root -np 2 --bind-to core .venv/bin/python bench/bound_ranks_ab.py \\
        all_reduce:8,all_reduce:1048576,broadcast:8388608 [BLOCKS]

OP:BYTES with OP one of all_reduce, all_gather, broadcast, all_to_all, send (a ping-pong).
Prints the median block of each and before/now per block pair (> 1: now is faster).
Not a unit test. (Sets the engine's private crowded, spin and fast_budget.)
"""
import sys

import numpy as np

import ringlet as rl
from ringlet.bench import alternating_blocks
from ringlet.runtime import engine
from ringlet.transport import engine as eng


def setting(e, crowded: bool) -> None:
    """The engine's settings as ``Engine.__init__`` derives them from ``crowded``."""
    e.crowded = crowded
    e.spin = eng.SPIN_CROWDED if crowded else eng.SPIN_FREE
    e.fast_budget = eng.YIELD_CROWDED if crowded else e.spin


def caller(op: str, size: int, rank: int, p: int):
    n = max(1, size // 4)
    x, out, inp = np.ones(n, np.float32), np.empty(n * p, np.float32), np.ones(n * p, np.float32)

    def call():
        if op == "all_reduce":
            rl.all_reduce(x)
        elif op == "all_gather":
            rl.all_gather(out, x)
        elif op == "broadcast":
            rl.broadcast(x, 0)
        elif op == "all_to_all":
            rl.all_to_all(out, inp)
        elif op == "send":             # a ping-pong between ranks 0 and 1
            if rank == 0:
                rl.send(x, 1)
                rl.recv(x, 1)
            elif rank == 1:
                rl.recv(x, 0)
                rl.send(x, 0)
        else:
            raise SystemExit(f"unknown op {op!r}")
    return x, call


def main(cases: list, blocks: int) -> None:
    rl.init()
    rank, p, e = rl.get_rank(), rl.get_world_size(), engine()
    now_crowded = e.crowded
    for op, size in cases:
        x, call = caller(op, size, rank, p)

        def reset():
            x[...] = 1

        calls = max(10, min(2000, int(0.02 / (1e-6 + size * 2e-10))))
        res = alternating_blocks(rl, {"before": (call, reset), "now": (call, reset)}, blocks,
                                 calls, lambda arm: setting(e, arm == "before" or now_crowded))
        setting(e, now_crowded)
        if rank == 0:
            before, now = np.array(res["before"]), np.array(res["now"])
            print(f"{op:10s} {size:>8d} B  before {np.median(before):8.1f} us  "
                  f"now {np.median(now):8.1f} us  before/now per block pair "
                  f"{np.round(before / now, 2).tolist()}", flush=True)
    rl.destroy()


if __name__ == "__main__":
    main([(c.split(":")[0], int(c.split(":")[1])) for c in sys.argv[1].split(",")],
         int(sys.argv[2]) if len(sys.argv) > 2 else 8)
