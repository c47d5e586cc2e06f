"""The training patterns side by side: ringlet.train against the same pattern over
torch.distributed's Gloo, on the same model, data and ranks, in turns within one run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/train_patterns.py [-n 4] [--turns 3]

* buckets: a model of many small tensors (300 of 100-3,000 floats); one step's gradient
  averaging alone. ringlet bucketed (25 MB) vs one all_reduce per parameter (seed 004:
  per-parameter launches waste the bandwidth); Gloo the same two ways.
* dp: a torch MLP's training step (forward, backward, SGD): GradBuckets.for_module (fed
  by the parameters' backward hooks, each bucket starts during backward) vs DDP on Gloo.
* moe: the dispatch exchange of top-1 routing, 1,024 tokens of 64 floats per rank, uneven
  splits: rl.train.dispatch vs Gloo's all_to_all_single (its splits sent first, as
  dispatch does).
* zero3: the same MLP's training step, parameters, gradients and SGD state sharded:
  rl.train.ZeroOptimizer(stage=3) (NumPy forward/backward, each layer gathered just
  before use with the next prefetched, gradients reduce-scattered in backward) vs torch
  FSDP2 (fully_shard per Linear and on the model, a CPU device mesh over Gloo).
* ps: a round of parameter server: broadcast 1 MiB of weights, gather 64 KiB of
  experience from each rank.

Medians of each turn's steps; the ratio is Gloo's time over ringlet's.
"""
import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

import numpy as np

import ringlet as rl
from ringlet.launch import free_port

SMALL = np.random.default_rng(0).integers(100, 3000, 300)


def _median_time(fn, iters, barrier):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


# -- ringlet side ------------------------------------------------------------------------------
def _rl_job(rank, case, iters, out):
    import torch
    torch.set_num_threads(1)
    from ringlet import train
    p = rl.get_world_size()
    res = {}
    if case == "buckets":
        params = [np.zeros(n, np.float32) for n in SMALL]
        grads = [np.ones(n, np.float32) for n in SMALL]
        for name, cap in (("bucketed", 25), ("per-parameter", 0)):
            gb = train.GradBuckets(params, bucket_cap_mb=cap)

            def step():
                for i in reversed(range(len(params))):
                    gb.ready(i, grads[i])
                gb.wait()
            res[name] = _median_time(step, iters, rl.barrier)
    elif case == "dp":
        model, x, y = _mlp(rank)
        gb = train.GradBuckets.for_module(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            gb.wait()
            opt.step()
        res["step"] = _median_time(step, iters, rl.barrier)
    elif case == "zero3":
        res["step"] = _median_time(_zero3_step(rank), iters, rl.barrier)
    elif case == "moe":
        x, idx = _tokens(rank, p)
        res["dispatch"] = _median_time(lambda: train.dispatch(x, idx, p, capacity_factor=2.0),
                                       iters, rl.barrier)
    elif case == "ps":
        w, exp = np.ones(1 << 18, np.float32), np.ones(1 << 14, np.float32)
        got = np.empty((p, 1 << 14), np.float32) if rank == 0 else None

        def rnd():
            rl.broadcast(w, 0)
            rl.gather(exp, got, dst=0)
        res["round"] = _median_time(rnd, iters, rl.barrier)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)


# -- Gloo side ----------------------------------------------------------------------------------
def _gloo_job(rank, case, iters, out, p, port):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p)
    res = {}
    if case == "buckets":
        grads = [torch.ones(int(n)) for n in SMALL]

        def bucketed():
            flat = torch.cat(grads[::-1])
            dist.all_reduce(flat)
            flat /= p

        def per_param():
            works = [dist.all_reduce(g, async_op=True) for g in reversed(grads)]
            for w in works:
                w.wait()
            for g in grads:
                g /= p
        res["bucketed"] = _median_time(bucketed, iters, dist.barrier)
        res["per-parameter"] = _median_time(per_param, iters, dist.barrier)
    elif case == "dp":
        model, x, y = _mlp(rank)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step():
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        res["step"] = _median_time(step, iters, dist.barrier)
    elif case == "zero3":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        model, x, y = _mlp(rank)
        mesh = init_device_mesh("cpu", (p,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        res["step"] = _median_time(step, iters, dist.barrier)
    elif case == "moe":
        xn, idxn = _tokens(rank, p)
        x = torch.from_numpy(xn)

        def dispatch():
            order = np.argsort(idxn, kind="stable")
            send = torch.from_numpy(np.bincount(idxn, minlength=p).astype(np.int64))
            recv = torch.empty(p, dtype=torch.int64)
            dist.all_to_all_single(recv, send)
            out = torch.empty((int(recv.sum()), x.shape[1]))
            dist.all_to_all_single(out, x[torch.from_numpy(order)], recv.tolist(), send.tolist())
        res["dispatch"] = _median_time(dispatch, iters, dist.barrier)
    elif case == "ps":
        w, exp = torch.ones(1 << 18), torch.ones(1 << 14)
        got = [torch.empty(1 << 14) for _ in range(p)] if rank == 0 else None

        def rnd():
            dist.broadcast(w, 0)
            dist.gather(exp, got, dst=0)
        res["round"] = _median_time(rnd, iters, dist.barrier)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _mlp(rank):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    g = torch.Generator().manual_seed(rank)
    return model, torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)


def _zero3_step(rank):
    """One training step of _mlp's model in NumPy on ZeroOptimizer(stage=3)."""
    from ringlet import train
    model, x, y = _mlp(rank)
    units = [[m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy()]
             for m in model if hasattr(m, "weight")]
    x, y = x.numpy(), y.numpy()
    z = train.ZeroOptimizer(units, stage=3, optimizer="sgd", lr=0.01)
    L = len(units)

    def step():
        acts = [x]
        for u in range(L):
            W, b = z.gather(u, prefetch=u + 1 if u + 1 < L else None)
            h = acts[-1] @ W + b
            acts.append(h if u == L - 1 else np.maximum(h, 0))
            z.free(u)
        e = np.exp(acts[-1] - acts[-1].max(1, keepdims=True))
        d = e / e.sum(1, keepdims=True)
        d[np.arange(len(y)), y] -= 1
        d /= len(y)
        for u in reversed(range(L)):
            W, _ = z.gather(u, prefetch=u - 1 if u > 0 else None)
            if u < L - 1:
                d = d * (acts[u + 1] > 0)
            z.reduce_grad(u, [acts[u].T @ d, d.sum(0)])
            d = d @ W.T
            z.free(u)
        z.step()
    return step


def _tokens(rank, p):
    rng = np.random.default_rng(rank)
    return rng.standard_normal((1024, 64)).astype(np.float32), rng.integers(0, p, 1024)


def run_side(side, case, n, iters):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        if side == "ringlet":
            rl.spawn(_rl_job, n, args=(case, iters, out))
        else:
            import torch.multiprocessing as mp
            mp.spawn(_gloo_job, args=(case, iters, out, n, free_port()), nprocs=n)
        with open(out) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cases", default="buckets,dp,zero3,moe,ps")
    args = ap.parse_args()
    if importlib.util.find_spec("torch") is None:     # Gloo and the dp model
        sys.exit("bench/train_patterns.py needs torch (for Gloo and the dp model): "
                 "pip install torch==2.13.0")
    print(f"ringlet.train vs torch.distributed Gloo, {args.n} ranks, {args.turns} turns "
          f"(median of {args.iters} steps each)")
    for case in args.cases.split(","):
        rows, loads = {}, []
        for _ in range(args.turns):
            for side in ("ringlet", "gloo"):
                loads.append(os.getloadavg()[0])
                for k, v in run_side(side, case, args.n, args.iters).items():
                    rows.setdefault((k, side), []).append(v)
        print(f"{case:8s} load average (1 min) at each turn's start: "
              + " ".join(f"{x:.1f}" for x in loads))
        for k in sorted({k for k, _ in rows}):
            r, g = rows[(k, "ringlet")], rows[(k, "gloo")]
            turns = " ".join(f"{b / a:.2f}" for a, b in zip(r, g))
            print(f"{case:8s} {k:14s} ringlet {_us(r)}  gloo {_us(g)}  gloo/ringlet "
                  f"{min(g) / min(r):.2f}x best, {np.median(g) / np.median(r):.2f}x median "
                  f"(turn by turn: {turns})")
        if case == "buckets":
            b, pp = rows[("bucketed", "ringlet")], rows[("per-parameter", "ringlet")]
            print(f"{case:8s} ringlet per-parameter / bucketed: {min(pp) / min(b):.2f}x best, "
                  f"{np.median(pp) / np.median(b):.2f}x median")


def _us(ts):
    return "/".join(f"{t * 1e6:.0f}" for t in ts) + " us"


if __name__ == "__main__":
    main()
