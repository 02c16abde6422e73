#!/usr/bin/python3
"""Peer of the IPC benchmarks: tensor messaging between processes in PyTorch (Debian's python3-torch).

With torch.multiprocessing (fork start method) and each sharing strategy, a fresh child
process per measurement group:
  {queue,pipe}_pingpong_4k   round trip of one 4 KiB float tensor, child echoes it (median us)
  {queue,pipe}_oneway_4k     parent sends N fresh 4 KiB tensors, child drops them (items/s)
  queue_handoff_64m_fresh    put a fresh (unshared) 64 MiB tensor, child acks (median ms)
  queue_handoff_64m_resend   re-put a 64 MiB tensor already in shared memory (median us)
Prints one JSON object per line: {"name", "strategy", "value", "unit"}.
"""
import contextlib
import json
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

torch.set_num_threads(1)
CTX = mp.get_context("fork")
STRATEGIES = ("file_descriptor", "file_system")
TIMEOUT = 60.0  # seconds; any receive waiting longer than this fails the run instead of hanging
WARMUP = 50


def emit(name, strategy, value, unit):
    print(json.dumps({"name": name, "strategy": strategy, "value": value, "unit": unit}),
          flush=True)


def channel(kind):
    """Return (parent_send, parent_recv, child_send, child_recv, close) over two queues or a duplex Pipe."""
    if kind == "queue":
        q1, q2 = CTX.Queue(), CTX.Queue()

        def close():
            for q in (q1, q2):
                q.close()
                q.cancel_join_thread()  # never block the parent's exit on an unread buffer

        return q1.put, lambda: q2.get(timeout=TIMEOUT), q2.put, lambda: q1.get(timeout=TIMEOUT), close

    a, b = CTX.Pipe(duplex=True)

    def recv_from(conn):
        if not conn.poll(TIMEOUT):
            raise TimeoutError(f"no message within {TIMEOUT} s")
        return conn.recv()

    def close():
        a.close()
        b.close()

    return a.send, lambda: recv_from(a), b.send, lambda: recv_from(b), close


def child_main(strategy, mode, send, recv):
    """Serve until None arrives. Tensors: 'echo' sends them back, 'ack' replies 1, 'sink' drops
    them. Anything else (an int marker) is sent back as is."""
    torch.set_num_threads(1)
    mp.set_sharing_strategy(strategy)
    while True:
        msg = recv()
        if msg is None:
            return
        if not isinstance(msg, torch.Tensor):
            send(msg)
        elif mode == "echo":
            send(msg)
        elif mode == "ack":
            send(1)
        del msg  # drop the tensor: releases its fd / shared segment


@contextlib.contextmanager
def child(kind, strategy, mode):
    """Start a fresh child serving `mode`; yield the parent's (send, recv); always reap the child."""
    psend, precv, csend, crecv, close = channel(kind)
    proc = CTX.Process(target=child_main, args=(strategy, mode, csend, crecv), daemon=True)
    proc.start()
    try:
        yield psend, precv
        psend(None)
        proc.join(TIMEOUT)
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join()
        close()
    if proc.exitcode != 0:
        raise RuntimeError(f"child exited with code {proc.exitcode}")


def pingpong_us(send, recv, trips):
    t = torch.ones(1024)
    times = []
    for i in range(WARMUP + trips):
        t0 = time.perf_counter()
        send(t)
        r = recv()
        dt = time.perf_counter() - t0
        if i >= WARMUP:
            times.append(dt * 1e6)
    assert r.shape == t.shape and r[0].item() == 1.0
    return statistics.median(times)


def oneway_items_per_s(send, recv, n):
    for count in (WARMUP, n):  # a warm-up batch, then the timed one
        t0 = time.perf_counter()
        for _ in range(count):
            send(torch.ones(1024))
        send(count)  # marker: the child echoes it after it has received everything before it
        got = recv()
        elapsed = time.perf_counter() - t0
        assert got == count, got
    return n / elapsed


def handoff_times(send, recv, reps, fresh):
    """Seconds from put to the child's ack, per rep (the first rep is a warm-up and dropped)."""
    t = None if fresh else torch.ones(16 << 20).share_memory_()
    times = []
    for _ in range(1 + reps):
        if fresh:
            t = None  # free the previous one first
            t = torch.ones(16 << 20)  # created outside the timed region, not yet shared
        t0 = time.perf_counter()
        send(t)
        got = recv()
        times.append(time.perf_counter() - t0)
        assert got == 1, got
    return times[1:]


def main():
    quick = "--quick" in sys.argv
    # Rates and medians settle long before this; at ~2,000 items/s a larger count only made
    # this peer the longest part of a full `torchpar bench` (57 s a round with 20,000, 25 s
    # with 5,000).
    trips, n, reps_fresh, reps_resend = (200, 1000, 2, 10) if quick else (1000, 2000, 5, 50)
    for strategy in STRATEGIES:
        mp.set_sharing_strategy(strategy)
        for kind in ("queue", "pipe"):
            with child(kind, strategy, "echo") as (send, recv):
                emit(f"{kind}_pingpong_4k", strategy, pingpong_us(send, recv, trips), "us")
            with child(kind, strategy, "sink") as (send, recv):
                emit(f"{kind}_oneway_4k", strategy, oneway_items_per_s(send, recv, n), "items/s")
        with child("queue", strategy, "ack") as (send, recv):
            ms = statistics.median(handoff_times(send, recv, reps_fresh, fresh=True)) * 1e3
            emit("queue_handoff_64m_fresh", strategy, ms, "ms")
        with child("queue", strategy, "ack") as (send, recv):
            us = statistics.median(handoff_times(send, recv, reps_resend, fresh=False)) * 1e6
            emit("queue_handoff_64m_resend", strategy, us, "us")
    mp.set_sharing_strategy("file_descriptor")


if __name__ == "__main__":
    main()
