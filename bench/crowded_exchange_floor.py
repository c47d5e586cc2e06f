"""What a crowded all_to_all's copies cost without any library: p ranks (more than the
cores) exchange plain blocks two ways, beside Open MPI's and ringlet's all_to_all, in
alternating blocks of one mpirun job.

    python bench/crowded_exchange_floor.py [-p 4] [--block 256K,64K] [--blocks 12]

* ``cma``: each rank says its input is ready (a flag in shared memory) and reads its block
  of every peer's input by process_vm_readv, as Open MPI does; it returns once every peer
  said it has read its own block from it - the rendezvous at its cheapest (flags, no
  packets, no engine);
* ``two copies``: each rank copies each peer's block into a slot of shared memory and
  raises a flag; the peer copies it out (and each copies its own block) - what ringlet's
  C fast path does with EAGER packets, without the packets;
* ``mpi``: Open MPI's Alltoall; ``ringlet ALGO``: rl.all_to_all (``--algorithms``, default
  auto).

Waiting ranks yield (os.sched_yield), as ringlet's and Open MPI's do where ranks
outnumber cores. Each timed call follows a barrier, Open MPI's or ringlet's
(``--barrier``): which one changes the times of every arm. Inputs are written again
before every call (outside the timer). Printed per block size: each arm's median block (a
block's time is the slowest rank's median call, ringlet.bench.alternating_blocks).

Why: whether a single copy by the kernel, moved into the C fast path, would beat the
ring's two copies for 64-512 KiB blocks where ranks share cores (issue 27). It did not:
docs/results.md, "A single copy in C, tested first".
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

CALLS = 8


def _child(a) -> None:
    from mpi4py import MPI

    import ringlet as rl
    from ringlet.bench import alternating_blocks, parse_sizes, write_rows
    from ringlet.transport._fastpath import cma, copy
    comm = MPI.COMM_WORLD
    rl.init()
    r, p = comm.rank, comm.size
    rows = []
    for block in parse_sizes(a.block):
        # flags, a cache line each, and slots: [src, dst] blocks
        name = f"/dev/shm/ringlet_floor_{os.getppid()}_{block}"
        if r == 0:
            np.zeros(4 * p * p * 8 + p * p * block // 8, np.int64).tofile(name)
        comm.Barrier()
        shared = np.memmap(name, np.int64, "r+")
        flags = shared[:4 * p * p * 8].reshape(4, p, p, 8)[..., 0]
        slots = shared[4 * p * p * 8:].view(np.uint8).reshape(p, p, block)
        inp = np.empty(p * block + 8192, np.uint8)[64:64 + p * block]
        out = np.empty(p * block + 8192, np.uint8)[64:64 + p * block]
        pids, addrs = comm.allgather(os.getpid()), comm.allgather(inp.ctypes.data)
        turn = {"cma": 0, "two copies": 0}
        READY, READ, FULL, EMPTIED = 0, 1, 2, 3   # flags: [kind, src, dst] = the turn

        def wait(kind, a, b, v):
            while flags[kind, a, b] < v:
                os.sched_yield()

        def by_cma():
            turn["cma"] += 1
            v = turn["cma"]
            flags[READY, r, r] = v
            for k in range(1, p):
                j = (r + k) % p
                wait(READY, j, j, v)
                got = cma(False, pids[j], out.ctypes.data + j * block, addrs[j] + r * block,
                          block)
                assert got == block, got
                flags[READ, j, r] = v
            copy(out[r * block:(r + 1) * block], inp[r * block:(r + 1) * block])
            for k in range(1, p):
                wait(READ, r, (r + k) % p, v)

        def two_copies():
            turn["two copies"] += 1
            v = turn["two copies"]
            for k in range(1, p):
                j = (r + k) % p
                copy(slots[r, j], inp[j * block:(j + 1) * block])
                flags[FULL, r, j] = v
            for k in range(1, p):
                j = (r + k) % p
                wait(FULL, j, r, v)
                copy(out[j * block:(j + 1) * block], slots[j, r])
            copy(out[r * block:(r + 1) * block], inp[r * block:(r + 1) * block])
            peers = [(r + k) % p for k in range(1, p)]
            for j in peers:                        # (slots reused next turn: all emptied)
                flags[EMPTIED, j, r] = v
            for j in peers:
                wait(EMPTIED, r, j, v)

        rin, rout = (np.empty(p * block // 4, np.float32) for _ in range(2))
        calls = {"cma": by_cma, "two copies": two_copies,
                 "mpi": lambda: comm.Alltoall(inp, out)}
        for algo in a.algorithms.split(","):
            calls[f"ringlet {algo}"] = lambda algo=algo: rl.all_to_all(rout, rin, algorithm=algo)
        filled = [0]

        def fill():            # every input written again before each call
            filled[0] += 1
            inp.fill(filled[0] & 255)
            rin.fill(filled[0])

        def check(arm):        # after a bare arm's block: every block from its rank, intact
            if arm not in ("cma", "two copies"):
                return None

            def after(_us):
                if not (out == filled[0] & 255).all():
                    raise AssertionError(f"{arm}: a block arrived wrong")
                out.fill(0)                    # (the next arm's check starts clean)
            return after

        keep = a.arms.split(",")
        arms = {k: (call, fill) for k, call in calls.items() if k.split()[0] in keep}
        res = alternating_blocks(rl, arms, a.blocks, CALLS, switch=check,
                                 barrier=rl.barrier if a.barrier == "ringlet" else comm.Barrier)
        rows.append({"p": p, "block": block, "res": res})
        comm.Barrier()
        if r == 0:
            os.unlink(name)
    rl.destroy()
    write_rows(r, rows, a.out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-p", type=int, default=4)
    ap.add_argument("--block", default="256K,64K", help="bytes per block (per pair)")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--algorithms", default="auto", help="ringlet's arms, comma-separated")
    ap.add_argument("--arms", default="cma,two,mpi,ringlet",
                    help="a subset of cma, two (copies), mpi, ringlet")
    ap.add_argument("--barrier", default="mpi", choices=["mpi", "ringlet"],
                    help="whose barrier precedes each timed call")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a)
        return 0
    from ringlet.bench import mpi_job_rows
    try:
        rows = mpi_job_rows(__file__, a.p, ["--block", a.block, "--blocks", str(a.blocks),
                                               "--algorithms", a.algorithms,
                                               "--barrier", a.barrier, "--arms", a.arms])
    except RuntimeError as exc:
        print(exc)
        return 1
    print(f"all_to_all of plain blocks, p = {a.p} on {os.cpu_count()} cores; median block, "
          f"us (a block: the slowest rank's median of {CALLS} calls)")
    for row in rows:
        print(f"block {row['block'] >> 10:4d} KiB: " + "  ".join(
            f"{k} {np.median(v):.0f}" for k, v in row["res"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
