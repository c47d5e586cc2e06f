"""The torch backend's own tensors - the result it gathers before spreading it into the
caller's list, the inputs it flattens or stacks (all_gather and reduce_scatter of a list,
the coalesced calls) - from torch's memory against lent from ringlet's shared memory (what
the backend does above 512 KiB), in one job, alternating blocks of calls, so the host's
spells fall on both alike.

    .venv/bin/python bench/torch_scratch.py [-n 2] [--size 8M] [--blocks 8 --calls 10]

``--size`` is the gathered (or reduced) whole, as ``ringlet bench`` counts it. Prints per
call the median over blocks of each block's median call (slowest rank), both kinds, and
torch / shared (> 1: lending is faster).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time


_COLLECTIVE = {"all_gather": "all_gather", "all_gather_coalesced": "all_gather",
               "reduce_scatter": "reduce_scatter", "all_reduce_coalesced": "all_reduce"}


def _calls(dist, torch, rank, p, n):
    """name -> the call, on tensors made once (inputs as a training step holds them)."""
    per = n // p
    x = torch.rand(per)
    outs = [torch.empty(per) for _ in range(p)]
    halves = [x[:per // 2].clone(), x[per // 2:].clone()]
    got = [[torch.empty_like(h) for h in halves] for _ in range(p)]
    parts = [torch.rand(per) for _ in range(p)]
    s = torch.empty(per)
    whole = [torch.rand(n // 2), torch.rand(n - n // 2)]
    return {
        "all_gather": lambda: dist.all_gather(outs, x),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced(got, halves),
        "reduce_scatter": lambda: dist.reduce_scatter(s, parts),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced(whole),
    }


def _job(rank, p, port, n, blocks, calls, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ringlet.torch as rt
    torch.set_num_threads(1)
    dist.init_process_group("ringlet", rank=rank, world_size=p)
    shared = rt._Scratch.__init__

    def kind(name):   # the backend's rule ("shared"), or torch's memory always
        rt._Scratch.__init__ = shared if name == "shared" else (
            lambda self, _: shared(self, False))
    from ringlet import runtime
    fns = _calls(dist, torch, rank, p, n)
    res = {}
    for name, fn in fns.items():
        times, picked = {"torch": [], "shared": []}, {}
        for k in times:
            kind(k)
            for _ in range(3):
                fn()
        for _ in range(blocks):
            for k in times:
                kind(k)
                ts = []
                for _ in range(calls):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                t = torch.tensor([statistics.median(ts)], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[k].append(t.item() * 1e6)
                ran = runtime.stats()["collectives"]   # (a reduce_scatter ordered as Gloo's
                picked[k] = ran.get(_COLLECTIVE[name], ran["all_reduce"])["algorithm"]  # is one)
        res[name] = {k: statistics.median(v) for k, v in times.items()}
        res[name]["algorithms"] = picked
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2, help="ranks")
    ap.add_argument("--size", default="8M")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args(argv)
    from ringlet.cost.model import parse_size
    from ringlet.launch import free_port
    n = parse_size(a.size) // 4
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_job, args=(r, a.n, port, n, a.blocks, a.calls, out))
                 for r in range(a.n)]
        for q in procs:
            q.start()
        for q in procs:
            q.join()
        if any(q.exitcode for q in procs):
            print("a rank failed", file=sys.stderr)
            return 1
        with open(out) as f:
            res = json.load(f)
    print(f"p = {a.n}, {a.size}, load {os.getloadavg()[0]:.1f}")
    print(f"{'call':<22}{'torch (us)':>12}{'shared (us)':>13}{'torch/shared':>14}   algorithm "
          f"(torch / shared)")
    for name, v in res.items():
        print(f"{name:<22}{v['torch']:>12.0f}{v['shared']:>13.0f}{v['torch'] / v['shared']:>13.2f}x"
              f"   {v['algorithms']['torch']} / {v['algorithms']['shared']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
