"""Measure the peer libraries — Open MPI via mpi4py, Gloo via torch.distributed — with
exactly the method ``ringlet bench`` uses (barrier, time one call, median per rank, max
over ranks), so their rows sit beside ringlet's in one table.

    mpirun -np 2 python -m ringlet.peers mpi --op all_reduce --sizes 8,1048576 --json F
    python -m ringlet.peers gloo -n 2 --op all_reduce --sizes 8,1048576 --json F
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from .bench import counts, iters_for


def _measure(call, barrier, max_across, nbytes, iters, warmup=3, before=None):
    for _ in range(warmup):
        call()
    n = iters_for(nbytes, iters)
    times = np.empty(n)
    for i in range(n):
        if before is not None:
            before()
        barrier()
        t0 = time.perf_counter()
        call()
        times[i] = time.perf_counter() - t0
    return max_across(float(np.median(times)))


def _emit(args, lib, p, nbytes, t):
    with open(args.json, "a") as f:
        f.write(json.dumps({"lib": lib, "op": args.op, "p": p, "bytes": nbytes,
                            "dtype": "float32", "algorithm": lib, "time_us": t * 1e6}) + "\n")


def mpi_call(comm, op: str, nbytes: int, empty=np.empty):
    """(call, input): one Open MPI collective through mpi4py on buffers sized as ringlet's
    benchmarks size them (bench.counts), and the array it sends (None where this rank sends
    nothing: a broadcast's or scatter's non-root), which a fresh measurement writes again.
    ``empty(n, dtype)`` allocates them (bench.paged_empty: placed as ringlet's)."""
    from mpi4py import MPI
    p = comm.size
    per, total = counts(op, nbytes, p, 4)

    def ones(n):
        a = empty(n, np.float32)
        a[...] = 1
        return a

    def out(n):
        return empty(n, np.float32)

    if op == "all_reduce":
        x, y = ones(per), out(per)
        return (lambda: comm.Allreduce(x, y, MPI.SUM)), x
    if op == "broadcast":
        x = ones(per)
        return (lambda: comm.Bcast(x, root=0)), (x if comm.rank == 0 else None)
    if op == "reduce":
        x, y = ones(per), out(per)
        return (lambda: comm.Reduce(x, y, MPI.SUM, root=0)), x
    if op == "all_gather":
        x, y = ones(per), out(total)
        return (lambda: comm.Allgather(x, y)), x
    if op == "reduce_scatter":
        x, y = ones(total), out(per)
        return (lambda: comm.Reduce_scatter_block(x, y, MPI.SUM)), x
    if op == "all_to_all":
        x, y = ones(total), out(total)
        return (lambda: comm.Alltoall(x, y)), x
    if op == "gather":
        x, y = ones(per), out(total)
        return (lambda: comm.Gather(x, y, root=0)), x
    x, y = ones(total), out(per)
    return (lambda: comm.Scatter(x, y, root=0)), (x if comm.rank == 0 else None)


def mpi_main(args):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    for nbytes in args.size_list:
        call, x = mpi_call(comm, args.op, nbytes)
        before = (lambda: x.fill(1.0)) if args.fresh and x is not None else None
        t = _measure(call, comm.Barrier, lambda v: comm.allreduce(v, MPI.MAX), nbytes, args.iters,
                     before=before)
        if comm.rank == 0:
            _emit(args, "mpi", comm.size, nbytes, t)


def _gloo_rank(rank, args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.n)
    p = args.n
    for nbytes in args.size_list:
        per, total = counts(args.op, nbytes, p, 4)
        op = args.op
        if op == "all_reduce":
            x = torch.ones(per); call = lambda: dist.all_reduce(x)  # noqa: E731
        elif op == "broadcast":
            x = torch.ones(per); call = lambda: dist.broadcast(x, 0)  # noqa: E731
        elif op == "reduce":
            x = torch.ones(per); call = lambda: dist.reduce(x, 0)  # noqa: E731
        elif op == "all_gather":
            x, y = torch.ones(per), torch.empty(total)
            call = lambda: dist.all_gather_into_tensor(y, x)  # noqa: E731
        elif op == "reduce_scatter":
            x, y = torch.ones(total), torch.empty(per)
            call = lambda: dist.reduce_scatter_tensor(y, x)  # noqa: E731
        elif op == "all_to_all":
            x, y = torch.ones(total), torch.empty(total)
            call = lambda: dist.all_to_all_single(y, x)  # noqa: E731
        elif op == "gather":
            x = torch.ones(per)
            ys = [torch.empty(per) for _ in range(p)] if rank == 0 else None
            call = lambda: dist.gather(x, ys, dst=0)  # noqa: E731
        else:
            y = torch.empty(per)
            xs = [torch.ones(per) for _ in range(p)] if rank == 0 else None
            call = lambda: dist.scatter(y, xs, src=0)  # noqa: E731

        def max_across(v):
            tv = torch.tensor([v], dtype=torch.float64)
            dist.all_reduce(tv, op=dist.ReduceOp.MAX)
            return tv.item()
        t = _measure(call, dist.barrier, max_across, nbytes, args.iters)
        if rank == 0:
            _emit(args, "gloo", p, nbytes, t)
    dist.destroy_process_group()


def gloo_main(args):
    import torch.multiprocessing as mp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from .launch import free_port
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(_gloo_rank, args=(args,), nprocs=args.n)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("lib", choices=["mpi", "gloo"])
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--op", default="all_reduce")
    ap.add_argument("--sizes", required=True, help="comma-separated byte counts")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--json", required=True)
    ap.add_argument("--fresh", action="store_true",
                    help="write the input again before every timed call (Open MPI only)")
    args = ap.parse_args()
    args.size_list = [int(s) for s in args.sizes.split(",")]
    (mpi_main if args.lib == "mpi" else gloo_main)(args)


if __name__ == "__main__":
    main()
