"""What the always-on mismatch check costs: an 8 B all_reduce at p = 2 with the check,
and with it switched off (RINGLET_UNSAFE_NO_MISMATCH_CHECK=1, a switch that exists only
for this measurement), alternated in one run.

    .venv/bin/python bench/mismatch_overhead.py
"""
import json
import os
import tempfile
import time

import numpy as np

import ringlet as rl


def _rank(rank, path):
    x = np.ones(2, np.float32)
    for _ in range(2000):
        rl.all_reduce(x, algorithm="recursive_doubling")
    best = 1e9
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(3000):
            x[...] = 1
            rl.all_reduce(x, algorithm="recursive_doubling")
        best = min(best, (time.perf_counter() - t) / 3000)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(best, f)


def measure(check: bool) -> float:
    env = {} if check else {"RINGLET_UNSAFE_NO_MISMATCH_CHECK": "1"}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        rl.spawn(_rank, 2, args=(path,), env=env)
        return json.load(open(path))


def main():
    on, off = [], []
    for _ in range(3):          # alternate, so drift in machine load hits both alike
        on.append(measure(True))
        off.append(measure(False))
    a, b = min(on), min(off)
    print(f"8 B all_reduce, p=2: with check {a * 1e6:.2f} us, without {b * 1e6:.2f} us, "
          f"overhead {100 * (a - b) / b:+.1f}%")


if __name__ == "__main__":
    main()
