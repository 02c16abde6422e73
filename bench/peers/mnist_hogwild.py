#!/usr/bin/python3
"""Peer of the training benchmarks: pytorch/examples' mnist_hogwild recipe (Debian's python3-torch)
on Fashion-MNIST, read from the idx .gz files in /usr/share/datasets/fashion-mnist (no torchvision).

Model and optimiser as in the example: conv1 1->10 k5, conv2 10->20 k5 + Dropout2d, fc1 320->50,
dropout, fc2 50->10, log_softmax; SGD(lr, momentum) on nll_loss. Pixels: (x/255 - 0.2860) / 0.3530.
Hogwild: the parent builds the model (seed --seed) and calls model.share_memory(); --workers
processes (torch.multiprocessing, fork) each run torch.set_num_threads(--threads-per-worker) and
train it lock-free with their own SGD (private gradients and momentum) on shard i::N of the
training set, reshuffled every epoch by a generator seeded seed+i. --single instead trains in the
parent process on the whole set (needs --workers 1). --limit keeps only the first SAMPLES
training samples.
Timed: wall time of the training phase only, from before the workers are started to after they
are all joined (fork + exit included); then the parent evaluates on the 10k test set.
Prints one JSON object: {"system", "workers", "threads", "epochs", "samples", "seconds",
"samples_per_s", "test_accuracy" (percent), "final_loss", "test_loss"}, where samples counts all
training samples processed and final_loss is the mean training loss over the last epoch
(all workers; dropout on).

usage: mnist_hogwild.py [--workers 2] [--single] [--epochs 1] [--batch-size 64] [--lr 0.01]
           [--momentum 0.5] [--seed 1] [--limit SAMPLES] [--threads-per-worker 1]
"""
import argparse
import gzip
import json
import struct
import sys
import time

import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

sys.dont_write_bytecode = True  # no __pycache__ next to the peers
from torch_dist_collectives import run_all

torch.set_num_threads(1)
CTX = mp.get_context("fork")
DATA_DIR = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530
TIMEOUT = 3600.0  # seconds; training that takes longer is killed and the run fails


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def read_idx(path):
    """An idx file of unsigned bytes (magic 0x0000 08 <ndim>) as a uint8 tensor."""
    with gzip.open(path) as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    if magic >> 8 != 0x08:
        raise ValueError(f"{path}: not an idx file of unsigned bytes (magic {magic:#x})")
    ndim = magic & 0xFF
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return torch.from_numpy(np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims).copy())


def load(split, limit=None):
    """(images N x 1 x 28 x 28 float normalised, labels N int64) of 'train' or 't10k'."""
    x = read_idx(f"{DATA_DIR}/{split}-images-idx3-ubyte.gz")[:limit]
    y = read_idx(f"{DATA_DIR}/{split}-labels-idx1-ubyte.gz")[:limit].long()
    return ((x.float() / 255 - MEAN) / STD).unsqueeze(1), y


def train_epoch(model, opt, x, y, perm, batch_size):
    """One pass over x[perm] in batches; returns the sum of the per-sample training losses."""
    model.train()
    total = 0.0
    for i in range(0, len(perm), batch_size):
        idx = perm[i:i + batch_size]
        opt.zero_grad()
        loss = F.nll_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        total += loss.item() * len(idx)
    return total


@torch.no_grad()
def evaluate(model, x, y):
    """(mean test loss, accuracy in percent)."""
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(x), 1000):
        out = model(x[i:i + 1000])
        loss += F.nll_loss(out, y[i:i + 1000], reduction="sum").item()
        correct += (out.argmax(1) == y[i:i + 1000]).sum().item()
    return loss / len(x), 100.0 * correct / len(x)


def add_flags(ap):
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="use only the first SAMPLES training samples")
    ap.add_argument("--threads-per-worker", type=int, default=1)


def emit(system, args, samples, seconds, test_loss, test_acc, final_loss):
    print(json.dumps({"system": system, "workers": args.workers, "threads": args.threads_per_worker,
                      "epochs": args.epochs, "samples": samples, "seconds": seconds,
                      "samples_per_s": samples / seconds, "test_accuracy": test_acc,
                      "final_loss": final_loss, "test_loss": test_loss}), flush=True)


def worker(i, n, model, x, y, args, losses):
    torch.set_num_threads(args.threads_per_worker)
    torch.manual_seed(args.seed + i)  # dropout masks
    xs, ys = x[i::n], y[i::n]
    gen = torch.Generator().manual_seed(args.seed + i)
    opt = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    for _ in range(args.epochs):
        losses[i] = train_epoch(model, opt, xs, ys, torch.randperm(len(xs), generator=gen),
                                args.batch_size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(ap)
    ap.add_argument("--single", action="store_true", help="plain training in this process")
    args = ap.parse_args()
    if args.workers < 1 or (args.single and args.workers != 1):
        ap.error("--workers must be >= 1, and 1 with --single")
    x, y = load("train", args.limit)
    tx, ty = load("t10k")
    torch.manual_seed(args.seed)
    model = Net()
    samples = len(x) * args.epochs
    if args.single:
        torch.set_num_threads(args.threads_per_worker)
        gen = torch.Generator().manual_seed(args.seed)
        opt = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        t0 = time.perf_counter()
        for _ in range(args.epochs):
            loss_sum = train_epoch(model, opt, x, y, torch.randperm(len(x), generator=gen),
                                   args.batch_size)
        seconds = time.perf_counter() - t0
        torch.set_num_threads(1)
    else:
        model.share_memory()  # parameters only: gradients are allocated lazily in each worker
        losses = torch.zeros(args.workers, dtype=torch.float64).share_memory_()
        procs = [CTX.Process(target=worker, args=(i, args.workers, model, x, y, args, losses))
                 for i in range(args.workers)]
        t0 = time.perf_counter()
        err = run_all(procs, TIMEOUT)
        seconds = time.perf_counter() - t0
        if err:
            sys.exit(f"mnist_hogwild: {err}")
        loss_sum = losses.sum().item()
    test_loss, test_acc = evaluate(model, tx, ty)
    emit("pytorch-single" if args.single else "pytorch-hogwild", args, samples, seconds,
         test_loss, test_acc, loss_sum / len(x))


if __name__ == "__main__":
    main()
