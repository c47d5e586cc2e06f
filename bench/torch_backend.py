"""The ringlet torch.distributed backend beside Gloo, p = 2 (CPU).

    .venv/bin/python bench/torch_backend.py [--turns 3] [--steps 20]

Each turn runs one job on ringlet, then one on Gloo (the load average printed per turn),
so a shift in load hits both sides of a ratio alike. Each job measures:
  * dist.all_reduce of 25 MB (DDP's default bucket), median call: of a tensor ringlet sees
    once (staged through shared memory) and of one in shared memory (what a DDP bucket is
    from its second step on, or a tensor after ``share_memory_()``);
  * dist.all_reduce of 8 B, calls back to back; on ringlet also a direct rl.all_reduce of
    the same tensor, in alternating loops (medians of 10 each): the process-group layer is
    the difference;
  * a DDP training step of a ~4M-parameter MLP and an FSDP2 (fully_shard) step of it.
Then, on one rank alone, the layer's CPU cost without any peer: dist.all_reduce of 8 B on
a world of one minus rl.all_reduce, and how much of it is torch's own Python wrapper.
Prints one table: per turn, the ratio Gloo / ringlet (> 1: ringlet is faster) or the time,
against each target of issue #21.
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import ringlet as rl
import ringlet.torch  # noqa: F401  (registers the backend)
from ringlet.launch import free_port

P = 2
BIG = 25_000_000 // 4


def _median_us(fn, iters, group, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier(group)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _loop_us(fn, iters, group):
    """Small calls back to back (a barrier would add its own skew to each): time per call."""
    for _ in range(20):
        fn()
    dist.barrier(group)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e6


def _model():
    torch.manual_seed(0)   # 4 x (1024 x 1024 + 1024) = 4.2M parameters
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())])


def _trainers(group):
    """(DDP step, FSDP2 step) over ``group``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    x = torch.randn(32, 1024)

    def stepper(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return step
    ddp = DDP(_model(), process_group=group)
    fsdp, mesh = _model(), DeviceMesh.from_group(group, "cpu")   # (init_device_mesh's)
    for layer in fsdp:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    return stepper(ddp), stepper(fsdp)


def _rank(rank, port, backend, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(P))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=P)
    g = dist.group.WORLD
    big = torch.zeros(BIG)
    shared = torch.zeros(BIG).share_memory_()
    small = torch.zeros(2)
    r = {"load": os.getloadavg()[0]}
    r["all_reduce 25 MB"] = _median_us(lambda: dist.all_reduce(big), 10, g)
    r["all_reduce 25 MB, shared"] = _median_us(lambda: dist.all_reduce(shared), 10, g)
    via, direct = [], []
    for _ in range(10):   # short loops, alternating: a load shift hits both alike
        via.append(_loop_us(lambda: dist.all_reduce(small), 200, g))
        if backend == "ringlet":
            direct.append(_loop_us(lambda: rl.all_reduce(small), 200, g))
    r["all_reduce 8 B"] = statistics.median(via)
    if direct:
        r["rl.all_reduce 8 B"] = statistics.median(direct)
    ddp, fsdp = _trainers(g)
    r["DDP step"] = _median_us(ddp, steps, g, warmup=2)
    r["FSDP2 step"] = _median_us(fsdp, steps, g, warmup=2)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(r, f)
    dist.barrier()
    os._exit(0)   # (no destroy: rank 0's exit would take torch's store from under rank 1's)


def _alone(out):
    """On a world of one: the CPU time of each call, no peer to wait for."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")
    torch.set_num_threads(1)
    dist.init_process_group("ringlet")
    from torch._C import _distributed_c10d as c10d
    small, pg, opts = torch.zeros(2), dist.group.WORLD, c10d.AllreduceOptions()
    opts.asyncOp = False
    cases = {"dist.all_reduce": lambda: dist.all_reduce(small),
             "ProcessGroup.allreduce": lambda: pg.allreduce([small], opts),
             "rl.all_reduce": lambda: rl.all_reduce(small)}
    res = {k: [] for k in cases}
    for _ in range(5):
        for k, fn in cases.items():
            for _ in range(500):
                fn()
            t = time.thread_time()
            for _ in range(20000):
                fn()
            res[k].append((time.thread_time() - t) / 20000 * 1e6)
    with open(out, "w") as f:
        json.dump({k: min(v) for k, v in res.items()}, f)
    dist.destroy_process_group()
    os._exit(0)


def _spawn(target, n, *args):
    out = tempfile.mktemp(suffix=".json")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=target, args=(*((r,) if n > 1 else ()), *args, out))
             for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1800)
        if p.exitcode != 0:
            sys.exit(f"a benchmark rank failed (exit {p.exitcode})")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def _row(name, values, target, unit, met):
    """One line: the value of each turn, the target, and whether every turn met it (mixed:
    some did - under load, a turn's time is mostly the scheduler's)."""
    shown = " ".join(f"{v:8.2f}" for v in values)
    hits = sum(map(met, values))
    verdict = "met" if hits == len(values) else "NOT met" if not hits else f"mixed {hits}/{len(values)}"
    print(f"{name:40} {shown:>28}  {unit:2} {target:>7}  {verdict}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    turns = []
    for _ in range(a.turns):
        turns.append({b: _spawn(_rank, P, free_port(), b, a.steps) for b in ("ringlet", "gloo")})
    alone = _spawn(_alone, 1)
    loads = " ".join(f"{t['ringlet']['load']:.1f}/{t['gloo']['load']:.1f}" for t in turns)
    print(f"p = {P}, {os.cpu_count()} cores; {a.turns} turns (each: a ringlet job, then a Gloo "
          f"job), load average at each job's start: {loads}")
    print(f"{'':40} {'each turn':>28}  {'':2} {'target':>7}")

    def ratio(key):
        return [t["gloo"][key] / t["ringlet"][key] for t in turns]
    for key in ("all_reduce 25 MB", "all_reduce 25 MB, shared"):
        _row(f"{key}: Gloo / ringlet", ratio(key), ">= 4", "x", lambda v: v >= 4)
    _row("all_reduce 8 B, ringlet", [t["ringlet"]["all_reduce 8 B"] for t in turns],
         "<= 15", "us", lambda v: v <= 15)
    gloo_8b = " ".join(f"{t['gloo']['all_reduce 8 B']:8.2f}" for t in turns)
    print(f"{'  (Gloo)':40} {gloo_8b:>28}  us")
    _row("layer: dist - rl.all_reduce, 8 B",   # (< 0: the load moved between the loops)
         [t["ringlet"]["all_reduce 8 B"] - t["ringlet"]["rl.all_reduce 8 B"] for t in turns],
         "<= 5", "us", lambda v: 0 <= v <= 5)
    _row("DDP step: Gloo / ringlet", ratio("DDP step"), ">= 1.5", "x", lambda v: v >= 1.5)
    _row("FSDP2 step: Gloo / ringlet", ratio("FSDP2 step"), ">= 2", "x", lambda v: v >= 2)
    layer = alone["dist.all_reduce"] - alone["rl.all_reduce"]
    wrapper = alone["dist.all_reduce"] - alone["ProcessGroup.allreduce"]
    _row("layer alone (1 rank, CPU time)", [layer], "<= 5", "us", lambda v: v <= 5)
    print(f"  of which torch's dist.all_reduce wrapper {wrapper:.2f} us, ringlet's "
          f"ProcessGroup.allreduce {layer - wrapper:.2f} us (rl.all_reduce itself "
          f"{alone['rl.all_reduce']:.2f} us)")
    print("absolute times (us, per turn):")
    for key in list(turns[0]["ringlet"])[1:]:
        for name in ("ringlet", "gloo"):
            if key in turns[0][name]:
                print(f"  {key:30} {name:8} " +
                      " ".join(f"{t[name][key]:10.1f}" for t in turns))


if __name__ == "__main__":
    main()
