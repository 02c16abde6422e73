"""DDP on the torch.distributed backend "torchpar": shared-memory all_reduce among the ranks of
this host (hierarchical across hosts), nothing else changed in the training script.

    python3 02_ddp_torchpar.py                       # starts 2 ranks itself
    torchpar run --nproc-per-node 3 /usr/bin/python3 02_ddp_torchpar.py  # or any launcher
                                                     # that sets RANK, WORLD_SIZE, MASTER_*
"""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchpar.distributed  # noqa: F401  registers the backend "torchpar"


def train(rank, world_size):
    dist.init_process_group("torchpar", rank=rank, world_size=world_size)  # env://
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)          # each rank its own batches
    for step in range(20):
        x = torch.randn(32, 10, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()                                 # gradients averaged over the ranks
        opt.step()
    weights = model.module.weight.detach().clone()
    every = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(every, weights)
    assert all(torch.equal(w, weights) for w in every)  # one model on every rank
    if rank == 0:
        print(f"{world_size} ranks on {torchpar.distributed.collective_backend()}, "
              f"loss {loss.item():.3f}; ddp example ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:                            # started by a launcher
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        with socket.socket() as s:                      # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        mp.spawn(train, args=(2,), nprocs=2)
