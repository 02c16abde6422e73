#!/usr/bin/python3
"""Peer of bench/dist/rpc_bench.cpp: torch.distributed.rpc with the TensorPipe backend
(Debian's python3-torch).

Two workers, "worker0" (the caller) and "worker1" (the callee), are fork children of this
process; both call rpc.init_rpc (TensorPipe, env:// rendezvous: MASTER_ADDR 127.0.0.1 and a
free port, as torchrun sets them). worker0 runs the measures in turn, each on worker1:
  tiny_python_fn    rpc_sync(add, (i, 1)): a Python function adding two ints (pickled call)
  tiny_builtin      rpc_sync(torch.add, (a, b)) with two 2-element float32 tensors: the builtin
                    operator path (TorchScript call, no pickled function)
  tensor_1m_fresh   rpc_sync(first_element, (t,)) with t = torch.full((262144,), i), a fresh
                    1 MiB float32 tensor each call (its creation is timed too); the reply is
                    one float, so the measure is the 1 MiB transfer
  tensor_1m_reused  the same with one 1 MiB tensor made before the loop, t[0] = i before each
                    call (Python RPC has no shared-memory path: the tensor is sent every time)
  inflight_64       rpc_async(add, (i, 1)) keeping 64 calls outstanding (waits for the oldest
                    before issuing the 65th); calls/s
Each measure: a warm-up batch of 100 calls (20 for 1 MiB), then --batches timed batches of N
calls (--calls, or --tensor-calls for 1 MiB), each timed with time.perf_counter(). Round
trips: the median batch time / N (microseconds per call); inflight_64: all calls / all time.
Every reply is checked. Every RPC has a 60 s timeout, and the parent stops the run (killing
the workers) after --timeout seconds.
Prints one JSON object per line: {"name", "value", "unit"}.

usage: python_rpc.py [--quick] [--calls N] [--tensor-calls N] [--batches N] [--timeout SECONDS]
"""
import argparse
import collections
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed.rpc as rpc

torch.set_num_threads(1)
CTX = multiprocessing.get_context("fork")
TIMEOUT = 60.0  # seconds; any single RPC longer than this fails the run instead of hanging
WARMUP, WARMUP_TENSOR = 100, 20
NUMEL = 262144  # float32: 1 MiB
IN_FLIGHT = 64


def add(a, b):
    return a + b


def first_element(t):
    return t[0].item()


def emit(name, value, unit):
    print(json.dumps({"name": name, "value": value, "unit": unit}), flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(got, want, what):
    if got != want:
        raise RuntimeError(f"{what}: got {got!r}, want {want!r}")


def us_per_call(call, n, batches, warmup):
    """Median over `batches` timed batches of n calls of call(i), in microseconds per call."""
    for i in range(warmup):
        call(i)
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for i in range(n):
            call(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n * 1e6


def calls_per_s(n, batches):
    """rpc_async(add) with IN_FLIGHT outstanding: all calls / all time over `batches` batches."""
    def batch(k):
        pending = collections.deque()
        for i in range(k):
            if len(pending) == IN_FLIGHT:
                j, f = pending.popleft()
                check(f.wait(), j + 1, "in flight")
            pending.append((i, rpc.rpc_async("worker1", add, args=(i, 1), timeout=TIMEOUT)))
        while pending:
            j, f = pending.popleft()
            check(f.wait(), j + 1, "in flight")

    batch(WARMUP)
    elapsed = 0.0
    for _ in range(batches):
        t0 = time.perf_counter()
        batch(n)
        elapsed += time.perf_counter() - t0
    return n * batches / elapsed


def caller(calls, tensor_calls, batches):
    def tiny(i):
        check(rpc.rpc_sync("worker1", add, args=(i, 1), timeout=TIMEOUT), i + 1, "add")

    a, b = torch.ones(2), torch.ones(2)

    def builtin(i):
        r = rpc.rpc_sync("worker1", torch.add, args=(a, b), timeout=TIMEOUT)
        check(r[0].item(), 2.0, "torch.add")

    def fresh(i):
        t = torch.full((NUMEL,), float(i))
        check(rpc.rpc_sync("worker1", first_element, args=(t,), timeout=TIMEOUT), float(i),
              "first_element")

    reused = torch.zeros(NUMEL)

    def resent(i):
        reused[0] = float(i)
        check(rpc.rpc_sync("worker1", first_element, args=(reused,), timeout=TIMEOUT), float(i),
              "first_element")

    emit("tiny_python_fn", us_per_call(tiny, calls, batches, WARMUP), "us")
    emit("tiny_builtin", us_per_call(builtin, calls, batches, WARMUP), "us")
    emit("tensor_1m_fresh", us_per_call(fresh, tensor_calls, batches, WARMUP_TENSOR), "us")
    emit("tensor_1m_reused", us_per_call(resent, tensor_calls, batches, WARMUP_TENSOR), "us")
    emit("inflight_64", calls_per_s(calls, batches), "calls/s")


def worker(rank, args):
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=TIMEOUT)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    try:
        if rank == 0:
            caller(*args)
    finally:
        rpc.shutdown()  # graceful: worker1 waits here until worker0 is done


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 timed batches, smaller batches")
    ap.add_argument("--calls", type=int, help="calls per tiny / in-flight batch (2000, quick 500)")
    ap.add_argument("--tensor-calls", type=int, help="calls per 1 MiB batch (200, quick 50)")
    ap.add_argument("--batches", type=int, help="timed batches per measure (5, quick 3)")
    ap.add_argument("--timeout", type=int, default=600, help="stop the run after this many seconds")
    args = ap.parse_args()
    calls = args.calls or (500 if args.quick else 2000)
    tensor_calls = args.tensor_calls or (50 if args.quick else 200)
    batches = args.batches or (3 if args.quick else 5)

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    procs = [CTX.Process(target=worker, args=(r, (calls, tensor_calls, batches)), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    failed = [f"worker{r} " + ("timed out" if p.exitcode is None else f"exit code {p.exitcode}")
              for r, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    if failed:
        print(f"python_rpc.py: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
