#!/usr/bin/python3
"""Peer of bench/manager/manager_bench.cpp: Python's multiprocessing.Manager (Debian's python3
and python3-torch).

For each transport, "unix" (AF_UNIX, the Manager's default on Linux) and "tcp" (127.0.0.1), one
SyncManager (fork start method, as manager_bench) serves the three measures in turn:
  dict_setget      a child process does d["key"] = i; d.get("key") == i (pairs/s: one pair is
                   two round trips)
  list_append      the same child does l.append(i) (appends/s)
  queue_tensor_4k  a producer child puts fresh torch.full((1024,), i) float32 tensors (4 KiB)
                   into manager.Queue(64), the parent gets them and checks them (items/s)
Each measure: a warm-up batch of 100, then --batches timed batches of N (--ops for dict and
list, --items for the queue), each timed in the parent from its request to the child's reply
(or to the last item got); value = all items / all time, as Google Benchmark's
items_per_second.
Note: importing torch registers torch's tensor reductions with multiprocessing's
ForkingPickler, so the queue's tensors travel to and from the server as shared-memory handles
(file_descriptor strategy: one fd per tensor, passed through multiprocessing's
resource_sharer); that is what a Python user of a Manager gets.
Every wait has a timeout, and the whole run is stopped by SIGALRM after --timeout seconds.
Prints one JSON object per line: {"name", "transport", "value", "unit"}.

usage: python_manager.py [--quick] [--ops N] [--items N] [--batches N] [--timeout SECONDS]
"""
import argparse
import contextlib
import json
import multiprocessing
import signal
import sys
import time
from multiprocessing.managers import SyncManager

import torch

torch.set_num_threads(1)
CTX = multiprocessing.get_context("fork")
TIMEOUT = 60.0  # seconds; any single wait longer than this fails the run instead of hanging
WARMUP = 100
QUEUE_MAX = 64
NUMEL = 1024  # float32: 4 KiB
TRANSPORTS = {"unix": None, "tcp": ("127.0.0.1", 0)}  # None: the default family, AF_UNIX


def emit(name, transport, value, unit):
    print(json.dumps({"name": name, "transport": transport, "value": value, "unit": unit}),
          flush=True)


def recv(conn):
    if not conn.poll(TIMEOUT):
        raise TimeoutError(f"no message within {TIMEOUT} s")
    return conn.recv()


def client_child(conn, d, l):
    """Runs the batches the parent asks for: ("dict", n), ("list", n); replies with the count
    of checked operations. ("stop", 0) ends it."""
    while True:
        op, n = recv(conn)
        if op == "dict":
            ok = 0
            for i in range(n):
                d["key"] = i
                ok += d.get("key") == i
        elif op == "list":
            before = len(l)
            for i in range(n):
                l.append(i)
            ok = len(l) - before
        else:
            return
        conn.send(ok)


def producer_child(conn, q):
    """Puts n fresh tensors (item i filled with i) for every n the parent sends; -1 ends it."""
    while True:
        n = recv(conn)
        if n < 0:
            return
        for i in range(n):
            q.put(torch.full((NUMEL,), float(i)), True, TIMEOUT)


@contextlib.contextmanager
def manager(transport):
    m = SyncManager(address=TRANSPORTS[transport], ctx=CTX)
    m.start()
    try:
        yield m
    finally:
        m.shutdown()


@contextlib.contextmanager
def child(target, args, stop):
    """Starts target(conn, *args) in a fork child; yields the parent's end; always reaps it."""
    mine, theirs = CTX.Pipe()
    proc = CTX.Process(target=target, args=(theirs,) + args, daemon=True)
    proc.start()
    try:
        yield mine
        mine.send(stop)
        proc.join(TIMEOUT)
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join()
        mine.close()
    if proc.exitcode != 0:
        raise RuntimeError(f"child exited with code {proc.exitcode}")


def rate(batch, n, batches):
    """Items/s of `batches` timed calls of batch(n), after one warm-up batch."""
    batch(WARMUP)
    done, elapsed = 0, 0.0
    for _ in range(batches):
        t0 = time.perf_counter()
        batch(n)
        elapsed += time.perf_counter() - t0
        done += n
    return done / elapsed


def bench_transport(transport, ops, items, batches):
    """{measure: items/s} on one manager: dict and list from one client child, then the queue
    with a producer child."""
    res = {}
    with manager(transport) as m:
        d, l = m.dict(), m.list()
        with child(client_child, (d, l), ("stop", 0)) as conn:
            for op, name in (("dict", "dict_setget"), ("list", "list_append")):
                def batch(k):
                    conn.send((op, k))
                    got = recv(conn)
                    if got != k:
                        raise RuntimeError(f"{op}: {got} of {k} operations checked")
                res[name] = rate(batch, ops, batches)
        q = m.Queue(QUEUE_MAX)
        with child(producer_child, (q,), -1) as conn:
            def batch(k):
                conn.send(k)
                for i in range(k):
                    t = q.get(True, TIMEOUT)
                    if t.numel() != NUMEL or t[-1].item() != float(i):
                        raise RuntimeError(f"queue item {i} has the wrong contents")
            res["queue_tensor_4k"] = rate(batch, items, batches)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 timed batch, smaller batches")
    ap.add_argument("--ops", type=int, help="dict pairs / list appends per batch (2000, quick 1000)")
    ap.add_argument("--items", type=int, help="tensors per queue batch (1000, quick 200)")
    ap.add_argument("--batches", type=int, help="timed batches per measure (3, quick 1)")
    ap.add_argument("--timeout", type=int, default=600, help="stop the run after this many seconds")
    args = ap.parse_args()
    ops = args.ops or (1000 if args.quick else 2000)
    items = args.items or (200 if args.quick else 1000)
    batches = args.batches or (1 if args.quick else 3)

    def on_alarm(signum, frame):
        raise TimeoutError(f"python_manager.py: run took longer than {args.timeout} s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    for transport in TRANSPORTS:
        for name, value in bench_transport(transport, ops, items, batches).items():
            emit(name, transport, value, "items/s" if name.startswith("queue") else "ops/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
