"""DDP on the ringlet backend. The script is plain torch.distributed; it runs unchanged
under any of

    ringlet run -n 2 examples/torch_ddp.py
    torchrun --nproc-per-node 2 examples/torch_ddp.py
    mpirun -n 2 python examples/torch_ddp.py          (srun likewise)

Installing ringlet is enough: torch loads the backend through its entry point.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main(steps: int = 20):
    dist.init_process_group("ringlet")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                               # the same initial model everywhere
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + rank)        # each rank its own shard of data
    target = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        x = torch.randn(32, 64, generator=g)
        loss = nn.functional.mse_loss(model(x), torch.tanh(x @ target))
        opt.zero_grad()
        loss.backward()                                # gradients all-reduced by ringlet
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:2d}  loss {loss.item():.4f}", flush=True)
    # every rank holds the same parameters, to the bit
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    assert all(torch.equal(flat, c) for c in copies)
    if rank == 0:
        print(f"{world} ranks, {steps} steps on {dist.get_backend()}: parameters identical "
              f"on every rank", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
