"""What a round costs when ranks outnumber cores: all_to_all pairwise (p - 1 rounds) against
direct (one round, the same messages and bytes) - or two algorithms of another collective -
on emulated hosts (ringlet.hosts), turn by turn in one job; per call the slowest rank's time and, summed over all ranks, the CPU
(user + system) and the context switches. Needs root.

    .venv/bin/python bench/round_cpu.py [--ranks 4] [--rate 10gbit] [--sizes 1M,16M]
        [--turns 15] [--collective all_to_all] [--algorithms pairwise,direct]

A waiting rank polls (yields) for up to RINGLET_YIELD_US (engine.YIELD_CROWDED) before it
sleeps, runnable meanwhile: each round it waits in costs CPU that the working ranks lack
(ringlet.cost.simulate prices it: Machine.poll). 2 hosts x 4 ranks, 10 Gbit/s, 1 MiB,
15 turns, load 3.2 (medians): pairwise 17.2 ms, 30.0 ms CPU, 7 voluntary and 101
involuntary switches per call; direct 11.6 ms, 18.0 ms CPU, 0 and 25. 2 x 2 (load 2.9):
pairwise 11.2 ms, 7.0 ms CPU; direct 8.1 ms, 5.3 ms CPU. Again under the bench lock, load
8.2-8.4: 2 x 4, 1 MiB pairwise 65.5 ms, 44.5 ms CPU against direct 30.6 ms, 21.3 ms CPU;
16 MiB 122 / 103 against 97 / 74; 2 x 2, 1 MiB 7.6 / 8.4 against 6.2 / 5.5; 16 MiB
54.8 / 40.5 against 43.4 / 33.8.

``--collective reduce_scatter --algorithms ring,direct`` (or all_gather): the other miss
on 2 x 4, where ring is priced below direct and measured above it. Under the bench lock,
load 8.8-9.0, 2 x 4, 7 turns: reduce_scatter 16 MiB ring 172 ms / 127 ms CPU / 219
involuntary switches against direct 99 / 85 / 36; 64 MiB 597 / 439 / 780 against
359 / 302 / 123; all_gather (same pattern, no reduction) 16 MiB ring 99 / 79 / 93 against
direct 100 / 80 / 32; 64 MiB 264 / 212 / 135 against 297 / 248 / 93. Ring reduce_scatter's
extra CPU grows with the bytes (42, then 137 ms), not with the rounds: not the polling
that Machine.poll prices. Not priced yet: its intra-host messages reduce, so no CMA
(all_gather's ring reads them whole) - they stream through the 1 MiB shm ring, sender and
receiver taking turns on crowded cores (the switches).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job(spec: dict) -> None:
    import numpy as np
    import ringlet as rl
    rl.init()
    r, p = rl.get_rank(), rl.get_world_size()
    out = {}
    coll = spec["collective"]
    call = {"all_to_all": rl.all_to_all, "reduce_scatter": rl.reduce_scatter,
            "all_gather": rl.all_gather}[coll]
    for nbytes in spec["sizes"]:
        block = max(1, nbytes // 4 // p)     # the size convention of ringlet.cost.model
        a, b = np.ones((p, block), np.float32), np.ones((p, block), np.float32)
        if coll == "all_gather":                 # (output, input), as bench/hosts.py
            b = np.ones(block, np.float32)
        elif coll == "reduce_scatter":
            a = np.ones(block, np.float32)
        for alg in spec["algorithms"]:          # a warm-up call of each
            call(a, b, algorithm=alg)
        rows = {alg: [] for alg in spec["algorithms"]}
        for _ in range(spec["turns"]):
            for alg in spec["algorithms"]:
                rl.barrier()
                u0 = resource.getrusage(resource.RUSAGE_SELF)
                t = time.perf_counter()
                call(a, b, algorithm=alg)
                dt = time.perf_counter() - t
                u1 = resource.getrusage(resource.RUSAGE_SELF)
                wall = np.array([dt])
                rl.all_reduce(wall, op=rl.ReduceOp.MAX)
                used = np.array([u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime,
                                 u1.ru_nvcsw - u0.ru_nvcsw, u1.ru_nivcsw - u0.ru_nivcsw])
                rl.all_reduce(used)
                rows[alg].append([float(wall[0]), *map(float, used)])
        out[nbytes] = rows
    if r == 0:
        print("ROUNDCPU " + json.dumps(out), flush=True)
    rl.destroy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=4, help="ranks per host (2 hosts)")
    ap.add_argument("--rate", default="10gbit")
    ap.add_argument("--sizes", default="1M,16M")
    ap.add_argument("--turns", type=int, default=15)
    ap.add_argument("--collective", default="all_to_all",
                    choices=("all_to_all", "reduce_scatter", "all_gather"))
    ap.add_argument("--algorithms", default="pairwise,direct")
    a = ap.parse_args(argv)
    if a.job:
        with open(a.job) as f:
            job(json.load(f))
        return 0
    import ringlet.hosts
    from ringlet.cost import format_size, parse_size
    from ringlet.hosts import Hosts
    if os.environ.get("RINGLET_HOSTS_PREFIX"):
        ringlet.hosts.PREFIX = os.environ["RINGLET_HOSTS_PREFIX"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hosts import tagged_job
    spec = {"sizes": [parse_size(s) for s in a.sizes.split(",")], "turns": a.turns,
            "algorithms": a.algorithms.split(","), "collective": a.collective}
    path = f"/tmp/ringlet-bench-roundcpu-{os.getpid()}.json"
    with open(path, "w") as f:
        json.dump(spec, f)
    try:
        with Hosts(2, rate=a.rate) as hosts:
            env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
            out = tagged_job(hosts, os.path.abspath(__file__), a.ranks, ["--job", path], env,
                             600, "ROUNDCPU")
    finally:
        os.unlink(path)
    print(f"{a.collective}: 2 hosts x {a.ranks} ranks, link {a.rate}, {os.cpu_count()} cores; {a.turns} turns; "
          f"load {os.getloadavg()[0]:.1f}; medians per call (CPU and switches: all ranks)")
    print(f"{'size':>8}  {'algorithm':<10}{'ms':>9}{'CPU ms':>9}{'vol. cs':>9}{'invol. cs':>11}")
    for nb, rows in out.items():
        for alg, v in rows.items():
            med = [statistics.median(x[i] for x in v) for i in range(4)]
            print(f"{format_size(int(nb)):>8}  {alg:<10}{med[0] * 1e3:>9.2f}{med[1] * 1e3:>9.2f}"
                  f"{med[2]:>9.1f}{med[3]:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
