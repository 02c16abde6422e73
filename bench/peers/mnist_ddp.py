#!/usr/bin/python3
"""Peer of the training benchmarks: the mnist_hogwild.py model, data and flags trained with
DistributedDataParallel over gloo instead (Debian's python3-torch).

--workers ranks (torch.multiprocessing, fork; rendezvous over tcp://127.0.0.1 on a free port),
each with torch.set_num_threads(--threads-per-worker). Every rank builds the model from seed
--seed (DDP also broadcasts rank 0's parameters), wraps it in DDP with the default bucket
settings, and trains with its own SGD(lr, momentum) on shard rank::N of the training set,
truncated to len // N samples so every rank runs the same number of steps, reshuffled every
epoch by a generator seeded seed+epoch. Gradients are averaged over the ranks each step, so one
step covers N * batch-size samples at the same lr. Dropout is seeded seed+rank.
Timed on rank 0: a barrier, the training epochs, a barrier. Then rank 0 evaluates on the 10k
test set and prints one JSON object with the keys of mnist_hogwild.py and "system":
"pytorch-ddp-gloo"; samples = N * (len // N) * epochs, final_loss = the mean training loss over
the last epoch (all ranks; dropout on).

usage: mnist_ddp.py [--workers 2] [--epochs 1] [--batch-size 64] [--lr 0.01] [--momentum 0.5]
           [--seed 1] [--limit SAMPLES] [--threads-per-worker 1]
"""
import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

sys.dont_write_bytecode = True  # no __pycache__ next to the peers
from mnist_hogwild import Net, add_flags, emit, evaluate, load, train_epoch
from torch_dist_collectives import free_port, run_all

torch.set_num_threads(1)
CTX = mp.get_context("fork")
OP_TIMEOUT = 120.0  # seconds; gloo's timeout for the rendezvous and for every collective
TIMEOUT = 3600.0  # seconds; the whole run, after which the parent kills the ranks


def rank_main(rank, n, port, args, x, y, tx, ty):
    torch.set_num_threads(args.threads_per_worker)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n, timeout=timedelta(seconds=OP_TIMEOUT))
    torch.manual_seed(args.seed)
    model = DDP(Net())
    torch.manual_seed(args.seed + rank)  # dropout masks
    per_rank = len(x) // n
    xs, ys = x[rank::n][:per_rank], y[rank::n][:per_rank]
    opt = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    dist.barrier()
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        gen = torch.Generator().manual_seed(args.seed + epoch)
        loss_sum = train_epoch(model, opt, xs, ys, torch.randperm(per_rank, generator=gen),
                               args.batch_size)
    dist.barrier()
    seconds = time.perf_counter() - t0

    total = torch.tensor([loss_sum], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        test_loss, test_acc = evaluate(model.module, tx, ty)
        emit("pytorch-ddp-gloo", args, n * per_rank * args.epochs, seconds, test_loss, test_acc,
             total.item() / (n * per_rank))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(ap)
    args = ap.parse_args()
    x, y = load("train", args.limit)
    tx, ty = load("t10k")
    if args.workers < 1 or len(x) < args.workers:
        ap.error("--workers must be >= 1 and at most the number of training samples")
    port = free_port()
    procs = [CTX.Process(target=rank_main, args=(r, args.workers, port, args, x, y, tx, ty))
             for r in range(args.workers)]
    err = run_all(procs, TIMEOUT)
    if err:
        sys.exit(f"mnist_ddp: {err}")


if __name__ == "__main__":
    main()
