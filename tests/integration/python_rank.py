#!/usr/bin/python3
"""A Python torch.distributed rank (gloo, env://) for the interop test: all_reduce of
rank + 1 and a broadcast of arange(5) from rank 0, checked; exits 0 when both match."""
import datetime
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
rank, n = dist.get_rank(), dist.get_world_size()
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
print(f"python rank {rank} of {n}: all_reduce sum = {t[0].item():g}", flush=True)
b = torch.arange(5, dtype=torch.float32) if rank == 0 else torch.zeros(5)
dist.broadcast(b, 0)
print(f"python rank {rank}: broadcast from rank 0 = {b[4].item():g}", flush=True)
ok = torch.equal(t, torch.full((4,), n * (n + 1) / 2)) and torch.equal(b, torch.arange(5.0))
dist.destroy_process_group()
sys.exit(0 if ok else 1)
