"""FSDP2 (fully_shard on a CPU DeviceMesh) on the ringlet backend: parameters are sharded,
all-gathered before each layer's forward and backward, gradients reduce-scattered.

    ringlet run -n 2 examples/torch_fsdp.py     (or torchrun / mpirun / srun)
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main(steps: int = 20):
    dist.init_process_group("ringlet")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)             # each layer its own all-gather unit
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    target = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        x = torch.randn(32, 64, generator=g)
        loss = nn.functional.mse_loss(model(x), torch.tanh(x @ target))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:2d}  loss {loss.item():.4f}", flush=True)
    shard = model[0].weight.to_local()
    if rank == 0:
        print(f"{world} ranks, {steps} steps: each holds {shard.numel()} of "
              f"{model[0].weight.numel()} elements of layer 0's weight", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
