"""The ringlet torch.distributed backend beside Gloo, in one run, p = 2 (CPU).

    .venv/bin/python bench/torch_backend.py [--turns 2] [--steps 20]

Measures, per backend, in alternating turns:
  * dist.all_reduce of 25 MB (DDP's default bucket; median call) and of 8 B (calls back
    to back, median of 5 loops);
  * for ringlet, the process-group layer's cost: 8 B dist.all_reduce minus a direct
    rl.all_reduce of the same tensor in the same job;
  * a DDP training step of a ~4M-parameter MLP and an FSDP2 (fully_shard) step of it.
Prints a table with each ratio (Gloo time / ringlet time: > 1 means ringlet is faster).
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


def _median_us(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _model():
    torch.manual_seed(0)   # 4 x (1024 x 1024 + 1024) = 4.2M parameters
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())])


def _loop_us(fn, iters, turns=5):
    """Small calls back to back (a barrier would add its own skew to each): the median
    over ``turns`` loops of the time per call."""
    for _ in range(50):
        fn()
    per = []
    for _ in range(turns):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        per.append((time.perf_counter() - t) / iters)
    return statistics.median(per) * 1e6


def _step_time(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 1024)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return _median_us(step, steps, warmup=2)


def _rank(rank, backend, port, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(P))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=P)
    res = {}
    big = torch.zeros(25_000_000 // 4)
    res["all_reduce 25 MB"] = _median_us(lambda: dist.all_reduce(big), 20)
    small = torch.zeros(2)
    if backend == "ringlet":   # turn by turn in one job, so load shifts hit both alike
        via_torch, direct = [], []
        for _ in range(5):
            via_torch.append(_loop_us(lambda: dist.all_reduce(small), 1000, turns=1))
            direct.append(_loop_us(lambda: rl.all_reduce(small), 1000, turns=1))
        res["all_reduce 8 B"] = statistics.median(via_torch)
        res["rl.all_reduce 8 B (direct)"] = statistics.median(direct)
    else:
        res["all_reduce 8 B"] = _loop_us(lambda: dist.all_reduce(small), 1000)
    from torch.nn.parallel import DistributedDataParallel as DDP
    res["DDP step, 4.2M params"] = _step_time(DDP(_model()), steps)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model, mesh = _model(), init_device_mesh("cpu", (P,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    res["FSDP2 step, 4.2M params"] = _step_time(model, steps)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()
    os._exit(0)


def run(backend, steps):
    port = free_port()
    out = tempfile.mktemp(suffix=".json")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, backend, port, steps, out)) for r in range(P)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            sys.exit(f"{backend} rank failed (exit {p.exitcode})")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    before = os.getloadavg()[0]
    turns = {"gloo": [], "ringlet": []}
    for _ in range(a.turns):
        for backend in turns:
            turns[backend].append(run(backend, a.steps))
    print(f"p = {P}, {os.cpu_count()} cores, load average {before:.1f} before and "
          f"{os.getloadavg()[0]:.1f} after; median per call, each turn (us)")
    print(f"{'':30} {'gloo':>22} {'ringlet':>22} {'gloo/ringlet':>14}")
    for key in turns["gloo"][0]:
        g = [t[key] for t in turns["gloo"]]
        r = [t[key] for t in turns["ringlet"]]
        ratios = [x / y for x, y in zip(g, r)]
        show = lambda v: " ".join(f"{x:10.1f}" for x in v)  # noqa: E731
        print(f"{key:30} {show(g):>22} {show(r):>22} "
              f"{min(ratios):6.2f}-{max(ratios):.2f}x")
    over = [t["all_reduce 8 B"] - t["rl.all_reduce 8 B (direct)"] for t in turns["ringlet"]]
    print(f"{'process-group layer, 8 B':30} {'':>22} {' '.join(f'{x:10.1f}' for x in over):>22}"
          f"  (dist.all_reduce - rl.all_reduce, us)")


if __name__ == "__main__":
    main()
