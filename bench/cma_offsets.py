"""Plain buffers whose receive side lies just past the send side within a page: where the
kernel's copy (process_vm_readv / _writev) is 4-5x slow (transport/cma.py), ringlet takes
the ring instead. This times both choices in one job, alternating blocks.

    python bench/cma_offsets.py                          # p = 2, 8 MiB, shift 16 and 0
    python bench/cma_offsets.py --ops all_to_all --shifts 16,48,0 -p 2 --size 8M

Each rank's arrays are carved from one allocation so the receive buffer starts ``shift``
bytes further into its page than the send buffer (NumPy's own large arrays all start 16
bytes in: shift 0). Arms: "probed" - CMA where the probe found the distance fast, the ring
where slow (the default); "always" - CMA at any distance (RINGLET_CMA_OFFSETS=0). The
receive side of one rank is the read's destination, the send side of its peer the source.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

OPS = ("all_gather", "all_to_all", "broadcast", "scatter", "gather")


def _carve(n_send: int, n_recv: int, shift: int):
    """float32 send and receive arrays, 64 and 64 + ``shift`` bytes into their pages."""
    from ringlet.bench import paged_empty
    return paged_empty(n_send, np.float32), paged_empty(n_recv, np.float32, 64 + shift)


def _job(rank, op, size, shift, blocks, calls, out):
    import ringlet as rl
    from ringlet.bench import alternating_blocks, bind_like_mpirun, counts
    from ringlet.transport import cma
    p = rl.get_world_size()
    bind_like_mpirun(rank, p)
    per, total = counts(op, size, p, 4)
    if op == "all_gather":
        x, y = _carve(per, total, shift)
        call = lambda: rl.all_gather(y.reshape(p, per), x)  # noqa: E731
    elif op == "all_to_all":
        x, y = _carve(total, total, shift)
        call = lambda: rl.all_to_all(y.reshape(p, per), x.reshape(p, per))  # noqa: E731
    elif op == "broadcast":   # the root's buffer is the source, each other's the destination
        x, y = _carve(total, total, shift)
        buf = x if rank == 0 else y
        call = lambda: rl.broadcast(buf, 0)  # noqa: E731
    elif op == "scatter":
        x, y = _carve(total, per, shift)
        call = lambda: rl.scatter(y, x.reshape(p, per) if rank == 0 else None, 0)  # noqa: E731
    else:
        x, y = _carve(per, total, shift)
        call = lambda: rl.gather(x, y.reshape(p, per) if rank == 0 else None, 0)  # noqa: E731
    x[:] = rank + 1
    call()
    probed = set(cma._slow or ())

    def switch(name):
        cma._slow = probed if name == "probed" else set()
    arms = {"probed": (call, lambda: None), "always": (call, lambda: None)}
    got = alternating_blocks(rl, arms, blocks, calls, switch)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"res": got, "slow": sorted(probed)}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("-p", type=int, default=2)
    ap.add_argument("--size", default="8M")
    ap.add_argument("--shifts", default="16,0")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args(argv)
    from ringlet.bench import parse_sizes
    from ringlet.launch import spawn
    size = parse_sizes(a.size)[0]
    print(f"{'row':34} {'probed us':>10} {'always us':>10} {'always/probed':>14}  load")
    slow = set()
    for op in a.ops.split(","):
        for shift in (int(s) for s in a.shifts.split(",")):
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "out.json")
                spawn(_job, a.p, args=(op, size, shift, a.blocks, a.calls, out), timeout=600)
                r = json.load(open(out))
            slow |= set(r["slow"])
            pr, al = np.median(r["res"]["probed"]), np.median(r["res"]["always"])
            print(f"{op} p={a.p} {a.size} shift {shift}".ljust(34),
                  f"{pr:10.0f} {al:10.0f} {al / pr:14.2f}  {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\nslow distances found here: {sorted(slow)} (of 128 probed)" if slow
          else "\nthe probe found no slow distance here (or no row read by CMA)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
