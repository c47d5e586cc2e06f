"""The same blocking collective (or send and receive) on the world and on a subgroup of
the same ranks, in alternating blocks inside one job: what a call costs for being a subgroup's (a training
job's tensor-, data- or pipeline-parallel groups are all subgroups).

    .venv/bin/ringlet run -n 2 bench/group_calls.py [--sizes 8,64K,1M] [--ops all_reduce,all_gather]

Per row: the median block of each arm (ringlet.bench.alternating_blocks: the slowest rank's
median over each block's calls, a barrier before each), in us.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

import ringlet as rl
from ringlet.bench import alternating_blocks, bind_like_mpirun
from ringlet.cost import format_size, parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,64K,1M")
    ap.add_argument("--ops", default="all_reduce,all_gather,barrier,send")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    rl.init()
    r, p = rl.get_rank(), rl.get_world_size()
    bind_like_mpirun(r, p)
    groups = {"world": None, "subgroup": rl.new_group(list(range(p)))}
    for op in a.ops.split(","):
        for size in ([0] if op == "barrier" else [int(parse_size(s)) for s in a.sizes.split(",")]):
            n = max(size // 4 // p, 1)
            x, y = np.ones(n * p, np.float32), np.empty((p, n), np.float32)
            call = {"all_reduce": lambda g: rl.all_reduce(x, group=g),
                    "all_gather": lambda g: rl.all_gather(y, x[:n], group=g),
                    "barrier": lambda g: rl.barrier(group=g),
                    # rank 0 to rank 1, the others idle
                    "send": lambda g: (rl.send(x, 1, group=g) if r == 0 else
                                       rl.recv(x, 0, group=g) if r == 1 else None)}[op]
            arms = {name: (lambda g=g, c=call: c(g), lambda: None)
                    for name, g in groups.items()}
            got = alternating_blocks(rl, arms, a.blocks, a.calls)
            if r == 0:
                med = {k: statistics.median(v) for k, v in got.items()}
                print(f"{op:<11} p={p} {format_size(size) if size else '-':>8}  world "
                      f"{med['world']:8.1f}  subgroup {med['subgroup']:8.1f}  "
                      f"subgroup/world {med['subgroup'] / med['world']:.2f}", flush=True)
    rl.destroy()


if __name__ == "__main__":
    main()
