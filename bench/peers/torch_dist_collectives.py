#!/usr/bin/python3
"""Peer of the collective benchmarks: torch.distributed with the gloo backend (Debian's python3-torch).

--ranks processes (torch.multiprocessing, fork), rendezvous over tcp://127.0.0.1 on a free port.
For each op (all_reduce SUM in place, broadcast from rank 0, all_gather into a preallocated list)
and each size (bytes of a float32 tensor, numel = max(1, bytes // 4)): a dist.barrier(), warm-up
calls, then timed calls, each one timed alone with time.perf_counter() around the op only.
Big sizes get fewer calls: timed = max(3, min(iters, iters * 1 MiB // max(bytes, 1 MiB))),
warm-up = max(1, min(warmup, timed)). After the timed calls one untimed call checks the result.
Rank 0 prints one JSON object per line:
  {"system", "op", "bytes", "ranks", "iters", "median_us", "p99_us", "min_us", "busbw_GBps"}
over rank 0's per-call times: median_us is their median, p99_us the nearest-rank 99th percentile
(sorted[ceil(0.99 n) - 1]; with fewer than 100 timed calls that is the maximum), min_us the
fastest call. Bandwidth follows nccl-tests: algbw = data bytes / median time,
with data = bytes for all_reduce and broadcast and bytes * ranks (the gathered output; bytes is
the per-rank input) for all_gather; busbw = algbw * 2(n-1)/n (all_reduce), * 1 (broadcast),
* (n-1)/n (all_gather). GB = 1e9 bytes.

usage: torch_dist_collectives.py [--ops all_reduce,broadcast,all_gather]
           [--sizes 4,4096,1048576,16777216,67108864] [--iters 50] [--warmup 5] [--ranks 2]
"""
import argparse
import json
import socket
import statistics
import sys
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

torch.set_num_threads(1)
CTX = mp.get_context("fork")
OP_TIMEOUT = 120.0  # seconds; gloo's timeout for the rendezvous and for every collective
RUN_TIMEOUT = 1800.0  # seconds; the whole run, after which the parent kills the ranks
OPS = ("all_reduce", "broadcast", "all_gather")
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0,
                "all_gather": lambda n: (n - 1) / n}


def emit(op, nbytes, ranks, iters, median_us, p99_us, min_us, busbw):
    print(json.dumps({"system": "torch.distributed-gloo", "op": op, "bytes": nbytes, "ranks": ranks,
                      "iters": iters, "median_us": median_us, "p99_us": p99_us, "min_us": min_us,
                      "busbw_GBps": busbw}), flush=True)


def p99(times):
    """Nearest-rank 99th percentile: sorted[ceil(0.99 n) - 1] (the maximum below 100 values)."""
    s = sorted(times)
    return s[(len(s) * 99 + 99) // 100 - 1]


def counts(nbytes, iters, warmup):
    timed = max(3, min(iters, iters * (1 << 20) // max(nbytes, 1 << 20)))
    return timed, max(1, min(warmup, timed))


def make_op(op, t, out):
    """Return a no-argument callable running one collective on t (and out for all_gather)."""
    if op == "all_reduce":
        return lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM)
    if op == "broadcast":
        return lambda: dist.broadcast(t, src=0)
    return lambda: dist.all_gather(out, t)


def check(op, t, out, rank, n):
    """One untimed call with known inputs; raise if the result is wrong."""
    t.fill_(rank + 1)
    make_op(op, t, out)()
    if op == "all_reduce":
        ok = bool((t == n * (n + 1) / 2).all())
    elif op == "broadcast":
        ok = bool((t == 1).all())
    else:
        ok = all(bool((o == j + 1).all()) for j, o in enumerate(out))
    if not ok:
        raise RuntimeError(f"rank {rank}: wrong {op} result")


def rank_main(rank, n, port, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n, timeout=timedelta(seconds=OP_TIMEOUT))
    for op in args.ops:
        for size in args.sizes:
            numel = max(1, size // 4)
            t = torch.zeros(numel)
            out = [torch.empty(numel) for _ in range(n)] if op == "all_gather" else None
            run = make_op(op, t, out)
            timed, warmup = counts(numel * 4, args.iters, args.warmup)
            dist.barrier()
            for _ in range(warmup):
                run()
            times = []
            for _ in range(timed):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            check(op, t, out, rank, n)
            if rank == 0:
                med = statistics.median(times)
                data = numel * 4 * (n if op == "all_gather" else 1)
                busbw = data / med * BUSBW_FACTOR[op](n) / 1e9
                emit(op, numel * 4, n, timed, med * 1e6, p99(times) * 1e6, min(times) * 1e6, busbw)
            del t, out
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(procs, timeout):
    """Start procs and wait for all of them; on the first failure or at the deadline kill the
    rest. Returns an error message, or None if every process exited with code 0."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while True:
            alive = [p for p in procs if p.is_alive()]  # one snapshot: wait() on [] would sleep
            if not alive or any(p.exitcode not in (None, 0) for p in procs):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            wait([p.sentinel for p in alive], timeout=left)  # returns when any of them exits
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    if timed_out:
        return f"timed out after {timeout} s"
    bad = [f"rank {i} exited with code {p.exitcode}" for i, p in enumerate(procs) if p.exitcode]
    return "; ".join(bad) or None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sizes", default="4,4096,1048576,16777216,67108864")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    args.ops = args.ops.split(",")
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if any(op not in OPS for op in args.ops) or args.ranks < 1 or args.iters < 1:
        ap.error(f"ops must be among {','.join(OPS)}; ranks and iters must be >= 1")
    port = free_port()
    procs = [CTX.Process(target=rank_main, args=(r, args.ranks, port, args))
             for r in range(args.ranks)]
    err = run_all(procs, RUN_TIMEOUT)
    if err:
        sys.exit(f"torch_dist_collectives: {err}")


if __name__ == "__main__":
    main()
