"""How far apart this host's two cores are right now, as the caches see it - and how that
changes from one second to the next on a VM, whose virtual cores the hypervisor moves
between physical ones.

    python bench/core_distance.py               # 20 rounds, 200 ms apart
    python bench/core_distance.py --rounds 50 --bytes 1M

Each round forks a pair of processes pinned to two cores (bench/core_distance.c, built
here with gcc): they pass one cache line back and forth 20000 times (the one-way trip), then
one writes a buffer and the other copies it out, 100 times (bytes that cross between the
cores every time, as in a collective whose inputs are new each call). Printed per round:
the trip in ns and the copy in us, and at the end how the rounds split.

Why it matters: on this machine the trip was 60-90 ns in some spells and 250-500 ns in
others, and a copy of 512 KiB written by the other core 35-40 us against 55-68. ringlet's
1 MiB all_gather p = 2, measured in fresh jobs, took ~110 us in a near spell and ~250 us in
a far one: a bimodal cost by job that followed the probe run just before and after it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

from ringlet.bench import parse_sizes

HERE = os.path.dirname(os.path.abspath(__file__))


def build(directory: str) -> str:
    exe = os.path.join(directory, "core_distance")
    subprocess.run(["gcc", "-O2", "-o", exe, os.path.join(HERE, "core_distance.c")], check=True)
    return exe


def probe(exe: str, rounds: int, nbytes: int, cpus=(0, 1)) -> list[tuple[float, float]]:
    """[(one-way trip ns, copy us)] per round."""
    out = subprocess.run([exe, str(rounds), str(nbytes), str(cpus[0]), str(cpus[1])],
                         capture_output=True, text=True, check=True).stdout
    return [(float(t), float(c)) for _, t, c in (line.split() for line in out.splitlines())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--bytes", default="512K", help="the copied buffer")
    ap.add_argument("--cpus", default="0,1")
    ap.add_argument("--far-ns", type=float, default=150,
                    help="a trip longer than this counts as a far spell "
                         "(seen here: 30-90 near, 250-500 far)")
    a = ap.parse_args(argv)
    cpus = tuple(int(c) for c in a.cpus.split(","))
    if len(os.sched_getaffinity(0)) < 2:
        print("needs two cores")
        return 1
    with tempfile.TemporaryDirectory() as d:
        rows = probe(build(d), a.rounds, parse_sizes(a.bytes)[0], cpus)
    for i, (trip, copy) in enumerate(rows):
        print(f"round {i:3}: one-way trip {trip:5.0f} ns   copy of {a.bytes} written by the "
              f"other core {copy:6.1f} us")
    trips = np.array([t for t, _ in rows])
    copies = np.array([c for _, c in rows])
    near = trips <= a.far_ns
    if near.any():
        print(f"\nnear spells (trip <= {a.far_ns:g} ns): {near.sum()} of {len(rows)} rounds, "
              f"trip median {np.median(trips[near]):.0f} ns, copy median "
              f"{np.median(copies[near]):.1f} us")
    if (~near).any():
        print(f"far spells: {(~near).sum()} rounds, trip median {np.median(trips[~near]):.0f} ns, "
              f"copy median {np.median(copies[~near]):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
