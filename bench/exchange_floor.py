"""The memory floor of a p = 2 exchange on this host, without any library: two processes
(one per core, as a p = 2 exchange runs) each hold an 8 MiB input in shared memory and make
the copies an 8 MiB all_to_all needs - its own block into its output (local) and the
peer's block from the peer's input (remote) - alone, at once, and both copies in either
order; then the remote copy made by the kernel (process_vm_readv, cross-memory attach),
as plain buffers move between ranks. Each input is written again before every round, as
`--fresh` benchmarks do.

    python bench/exchange_floor.py [--mib 8] [--rounds 40]

Printed per case: each process's median round in us. A collective that moves the same
bytes cannot beat the "local + remote, both" row; compare bench/in_job_vs_mpi.py's p = 2
8 MiB all_to_all and all_gather rows with it.
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time

import numpy as np

try:    # (the C fast path's process_vm_readv; without it the CMA cases are left out)
    from ringlet.transport._fastpath import cma
except ImportError:
    cma = None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=8, help="input per process (MiB)")
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args(argv)
    n = a.mib << 20
    half = n // 2
    regions = [mmap.mmap(-1, n + 4096) for _ in range(2)]   # inherited: shared after fork
    go = [os.pipe(), os.pipe()]
    out_dir = tempfile.mkdtemp()
    pid = os.fork()
    me = 1 if pid == 0 else 0
    inputs = [np.frombuffer(r, np.uint8, n, 64) for r in regions]
    mine, peers = inputs[me], inputs[1 - me]
    out = np.empty(n + 4096, np.uint8)[64:64 + n]     # (64 B into a page, as the inputs)
    out.fill(0)
    remote_block = peers[half:] if me == 0 else peers[:half]

    def barrier():
        (r0, w0), (r1, w1) = go
        if me == 0:
            os.write(w0, b"x")
            os.read(r1, 1)
        else:
            os.read(r0, 1)
            os.write(w1, b"x")

    def local():
        np.copyto(out[:half], mine[:half])

    def remote():
        np.copyto(out[half:], remote_block)

    peer_pid = pid if me == 0 else os.getppid()
    # A plain (private) input, as a NumPy array's: the kernel's copy reads the peer's from
    # its address (the addresses are swapped through the shared page after the inputs).
    private = np.empty(n + 4096, np.uint8)[64:64 + n]
    addresses = np.frombuffer(regions[0], np.int64, 2, 64 + n + 8)   # (past the input)
    addresses[me] = private.ctypes.data
    barrier()           # (each wrote its address before it entered)
    peer_private = int(addresses[1 - me]) + (half if me == 0 else 0)

    def remote_cma():   # the kernel's copy (process_vm_readv), as plain buffers move
        got = cma(False, peer_pid, out[half:].ctypes.data, peer_private, half)
        assert got == half, got

    cases = [("local, peer idle", local, None), ("local, both", local, local),
             ("remote, peer idle", remote, None), ("remote, both", remote, remote),
             ("local + remote, both", lambda: (local(), remote()), True),
             ("remote + local, both", lambda: (remote(), local()), True)]
    if cma is not None:
        cases += [("remote by CMA, idle", remote_cma, None),
                  ("remote by CMA, both", remote_cma, remote_cma),
                  ("CMA + local, both", lambda: (remote_cma(), local()), True)]
    lines = []
    for name, first, other in cases:
        work = first if me == 0 or other is True else other
        ts = []
        for i in range(a.rounds):
            mine.fill(i & 255)
            private.fill(i & 255)
            barrier()
            t0 = time.perf_counter()
            if work is not None:
                work()
            ts.append(time.perf_counter() - t0)
        barrier()
        lines.append(f"{name:<22} {np.median(ts[5:]) * 1e6:7.0f}" if work is not None
                     else f"{name:<22} {'idle':>7}")
    with open(os.path.join(out_dir, f"{me}.txt"), "w") as f:
        f.write("\n".join(lines))
    if pid:
        os.waitpid(pid, 0)
        rows = [open(os.path.join(out_dir, f"{r}.txt")).read().splitlines() for r in (0, 1)]
        print(f"{a.mib} MiB inputs, {a.rounds} rounds; median us per round")
        print(f"{'case':<22} {'process 0':>9} {'process 1':>9}")
        for r0, r1 in zip(*rows):
            print(f"{r0[:22]} {r0[22:]:>9} {r1[22:]:>9}")
    else:
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
