"""Predicted flat vs hierarchical collectives on several hosts: the small case the
namespace hosts measure (2 hosts x 2 and x 4 ranks) and the what-if at 64 hosts x 8 ranks,
on the seeds' tiers (NVLink inside a host; Ethernet or InfiniBand between hosts), with one
NIC per host (its ranks share it) and with one NIC per rank.

    .venv/bin/python bench/hierarchical_prediction.py [--sizes 64K,16M,256M]

Every number is the simulator pricing the very schedule the runtime runs
(ringlet.cost.simulate); "best flat" is the fastest flat algorithm for that collective and
size, "ring" the flat ring (pipeline for broadcast).
"""
from __future__ import annotations

import argparse

from ringlet.cost import Topology, format_size, parse_size, simulate
from ringlet.cost.model import ALGORITHMS
from ringlet.cost.tune import build_schedule

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def best_flat(collective, p, nbytes, topo, hosts):
    times = {a: simulate(build_schedule(collective, a, p, nbytes, hosts=hosts), topo).time
             for a in ALGORITHMS[collective] if a not in ("hierarchical", "direct", "naive_ring")}
    alg = min(times, key=times.get)
    return alg, times[alg], times.get("ring", times.get("pipeline"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64K,16M,256M")
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    print(f"{'topology':<40}{'collective':<15}{'size':>8}  {'best flat':<19}{'ms':>9}"
          f"{'ring ms':>9}{'hier. ms':>9}{'flat/hier':>10}{'ring/hier':>10}")
    for h, m in ((2, 2), (2, 4), (64, 8)):
        for inter in ("ethernet", "infiniband"):
            for sharing in (True, False):
                topo = Topology(h, m, "nvlink", inter, nic_sharing=sharing)
                hosts = tuple(int(x) for x in topo.host_array)
                label = f"{h}x{m} nvlink/{inter}, NIC per {'host' if sharing else 'rank'}"
                for coll in COLLECTIVES:
                    for nb in sizes:
                        nb = nb // (h * m) * (h * m)
                        alg, flat, ring = best_flat(coll, h * m, nb, topo, hosts)
                        hier = simulate(build_schedule(coll, "hierarchical", h * m, nb,
                                                       hosts=hosts), topo).time
                        print(f"{label:<40}{coll:<15}{format_size(nb):>8}  {alg:<19}"
                              f"{flat * 1e3:>9.3f}{ring * 1e3:>9.3f}{hier * 1e3:>9.3f}"
                              f"{flat / hier:>10.2f}{ring / hier:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
