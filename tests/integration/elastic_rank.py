#!/usr/bin/python3
"""A rank for the elastic launcher's tests: torch.distributed (gloo, env://) as torchrun's and
`torchpar run`'s ranks see it. Writes its pid to DIR/pid.<RANK>.<TORCHELASTIC_RESTART_COUNT>
(so the test can kill or stop it), then runs STEPS all_reduces of ones, DELAY seconds apart,
checking each sum against WORLD_SIZE, and prints one line naming its rank, world size, restart
count and round. The collectives time out after ELASTIC_TEST_TIMEOUT seconds (default 10), so
a stopped peer fails this rank instead of hanging it.
usage: elastic_rank.py DIR STEPS DELAY"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

out_dir, steps, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
env = os.environ
rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
restart = env.get("TORCHELASTIC_RESTART_COUNT", "?")
with open(os.path.join(out_dir, f"pid.{rank}.{restart}"), "w") as f:
    f.write(str(os.getpid()))
timeout = datetime.timedelta(seconds=float(env.get("ELASTIC_TEST_TIMEOUT", "10")))
dist.init_process_group("gloo", init_method="env://", timeout=timeout)
for _ in range(steps):
    t = torch.ones(1)
    dist.all_reduce(t)
    if t.item() != world:
        print(f"rank {rank}: all_reduce gave {t.item()}, want {world}", flush=True)
        sys.exit(3)
    time.sleep(delay)
dist.destroy_process_group()
print(f"rank {rank} of {world} done: restart {restart}, round {env.get('TORCHPAR_RDZV_ROUND')}, "
      f"group rank {env.get('GROUP_RANK')}", flush=True)
