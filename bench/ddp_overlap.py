"""torch DDP on the ringlet backend, on a shaped link: the share of gradient communication
its buckets hide behind backward, bucket_cap_mb swept, against communicating after backward.

    sudo .venv/bin/python bench/ddp_overlap.py [--rate 1gbit] [--caps 1,5,25,100]

Two emulated hosts (ringlet.hosts: network namespaces, own hostname and /dev/shm, one
tbf-shaped link), one rank on each, TCP between. The model: --layers Linear(d, d) layers
(float32), so its gradient is --layers x d^2 x 4 bytes; one torch thread per rank. Per step
(forward + backward of a --batch batch), medians of --reps taken in turns:

    comp      forward + backward under no_sync() (no communication)
    comm      one dist.all_reduce of every gradient, flattened (the communication alone)
    after     no_sync() forward + backward, then that all_reduce: nothing overlapped
    ddp <c>   DDP with bucket_cap_mb = c: buckets all-reduced (async) as backward fills them

hidden share = 1 - (ddp - comp) / comm: the part of the gradient communication the backward
pass hid (0: none, 1: all); speed-up = after / ddp.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
import on_hosts  # noqa: E402  (bench/on_hosts.py)


def rank_main(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("ringlet")
    rank = dist.get_rank()
    caps = [float(c) for c in a.caps.split(",")]

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(a.d, a.d) for _ in range(a.layers)])

    plain = model()
    ddps = {c: DDP(model(), bucket_cap_mb=c) for c in caps}
    x = torch.randn(a.batch, a.d, generator=torch.Generator().manual_seed(rank))

    def backward(m):
        m.zero_grad(set_to_none=False)
        m(x).square().mean().backward()

    def comp():
        with ddps[caps[0]].no_sync():
            backward(ddps[caps[0]])

    flat = torch.zeros(sum(p.numel() for p in plain.parameters()))

    def comm():
        dist.all_reduce(flat)

    def after():
        comp()
        comm()

    def ddp(c):
        return lambda: backward(ddps[c])

    runs = {"comp": comp, "comm": comm, "after": after,
            **{f"ddp {c:g}": ddp(c) for c in caps}}

    def timed(f):
        dist.barrier()
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    for f in runs.values():              # warm up: DDP builds its buckets on the first step
        f()
    times = {name: [] for name in runs}
    for _ in range(a.reps):              # in turns: load changes fall on all alike
        for name, f in runs.items():
            times[name].append(timed(f))
    med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
    if rank == 0:
        on_hosts.report({**med, "bytes": flat.numel() * 4})
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--caps", default="1,5,25,100", help="bucket_cap_mb values, comma-separated")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("-d", type=int, default=1024, help="width of each Linear layer")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        rank_main(a)
        return 0
    args = ["--rank", "--caps", a.caps, "--layers", str(a.layers), "-d", str(a.d),
            "--batch", str(a.batch), "--reps", str(a.reps)]
    r = on_hosts.run(HERE, args, a.rate, timeout=1800)
    print(f"2 emulated hosts x 1 rank, {a.rate} tbf link; DDP on ringlet, {a.layers} x "
          f"Linear({a.d}, {a.d}), gradient {r['bytes'] / 2**20:.0f} MiB, batch {a.batch}; "
          f"medians of {a.reps} steps (ms)")
    print(f"backward alone {r['comp'] * 1e3:.1f} | all_reduce of the gradient alone "
          f"{r['comm'] * 1e3:.1f} | backward then all_reduce {r['after'] * 1e3:.1f}")
    print(f"{'bucket_cap_mb':>14} {'step':>8} {'hidden':>7} {'vs after':>9}")
    for key in r:
        if key.startswith("ddp "):
            hidden = 1 - (r[key] - r["comp"]) / r["comm"]
            print(f"{key[4:]:>14} {r[key] * 1e3:8.1f} {hidden:7.2f} {r['after'] / r[key]:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
