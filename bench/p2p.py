"""Point-to-point latency (8 B, one way = half a ping-pong) and bandwidth (64 MiB, one
way) between 2 ranks: ringlet over shm and over TCP (two emulated hosts), and Open MPI
(mpi4py) measured in the same run.

    .venv/bin/python bench/p2p.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

SMALL, BIG = 8, 64 << 20
PINGS, BIGS = 5000, 8


def pingpong(send, recv, rank, nbytes, reps):
    """Median one-way time: half of each round trip (ack of 1 byte for big messages)."""
    buf = np.ones(nbytes, np.uint8)     # touched pages: zeros would all be one cached page
    ack = np.zeros(1, np.uint8)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        if rank == 0:
            send(buf, 1)
            recv(ack if nbytes > 8 else buf, 1)
        else:
            recv(buf, 0)
            send(ack if nbytes > 8 else buf, 0)
        times.append(time.perf_counter() - t)
    rt = float(np.median(times))
    return rt / 2 if nbytes <= 8 else rt   # a big message's time is one way plus a tiny ack


def _ringlet_rank(rank, path):
    import ringlet as rl
    lat = pingpong(rl.send, rl.recv, rank, SMALL, PINGS)
    bw_t = pingpong(rl.send, rl.recv, rank, BIG, BIGS)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"lat_us": lat * 1e6, "bw_GBps": BIG / bw_t / 1e9}, f)


def measure_ringlet(env=None) -> dict:
    import ringlet as rl
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r.json")
        rl.spawn(_ringlet_rank, 2, args=(path,), env=env)
        return json.load(open(path))


def _mpi_main(path):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    send = lambda b, peer: comm.Send(b, dest=peer)  # noqa: E731
    recv = lambda b, peer: comm.Recv(b, source=peer)  # noqa: E731
    lat = pingpong(send, recv, comm.rank, SMALL, PINGS)
    bw_t = pingpong(send, recv, comm.rank, BIG, BIGS)
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump({"lat_us": lat * 1e6, "bw_GBps": BIG / bw_t / 1e9}, f)


def measure_mpi() -> dict | str:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not installed"
    if not shutil.which("mpirun"):
        return "mpirun not found"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.json")
        subprocess.run(["mpirun", "--allow-run-as-root", "-np", "2", sys.executable,
                        os.path.abspath(__file__), "_mpi", path], check=True, capture_output=True)
        return json.load(open(path))


def main():
    rows = [("ringlet shm", measure_ringlet()),
            ("ringlet tcp (2 emulated hosts)", measure_ringlet({"RINGLET_HOST_ID_SPLIT": "1"})),
            ("Open MPI (mpi4py)", measure_mpi())]
    print(f"{'library':<32} {'8 B one-way (us)':>17} {'64 MiB (GB/s)':>14}")
    for name, r in rows:
        if isinstance(r, str):
            print(f"{name:<32} skipped: {r}")
        else:
            print(f"{name:<32} {r['lat_us']:>17.2f} {r['bw_GBps']:>14.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_mpi":
        _mpi_main(sys.argv[2])
    else:
        main()
