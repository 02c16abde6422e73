#!/usr/bin/python3
"""Peer of bench/pool/pool_bench.cpp: process pools in Python (Debian's python3 and python3-torch).

For multiprocessing.Pool and torch.multiprocessing.Pool, each with 2 worker processes started
with fork (as pool_bench), a fresh pool per measurement group:
  map_chunksize_1     pool.map(inc, range(N), chunksize=1): one untimed warm-up map of 1000
                      items, then one timed map of N items (tasks/s)
  map_chunksize_1000  the same with chunksize=1000; timed maps repeated until --min-time seconds
                      have passed, tasks/s = all tasks / all time (as Google Benchmark's rate)
  apply_async_rtt     pool.apply_async(inc, (x,)).get(): 100 warm-up calls, then the median
                      of ITERS timed calls (us; ITERS 2000, quick 500)
  map_tensors_1k      pool.map(tensor_sum, 2000 tensors torch.full((256,), 1.0)) with the default
                      chunksize, returning t.sum().item(); one warm-up map of the first 200
                      with chunksize 1, then the median of REPS timed maps (ms; REPS 3, quick 1)
Note: importing torch registers torch's tensor reductions with multiprocessing's ForkingPickler,
so the plain multiprocessing.Pool also passes tensors through shared memory here.

Starting a worker (system "multiprocessing.Process", as pool_bench's BM_ProcessStart), for the
start methods fork, forkserver and spawn: the time from Process.start() to the child running its
target. The parent reads CLOCK_MONOTONIC just before p.start(); the target's first action reads
it and stores it in a RawValue('q'); the parent joins the child, then takes child - parent. One
untimed start first (forkserver: it starts the server; spawn: the resource tracker), then
--starts timed starts, each joined before the next. Emits start_median/<method> and
start_p99/<method> (us; p99 by nearest rank, so the slowest start when --starts < 100).
This script imports torch at the top, as a torch.multiprocessing user's script does, so a spawn
child (which re-runs the main script) imports torch; so does every forkserver child on Python
< 3.13, whose forkserver does not preload __main__ (CPython gh-126631 / gh-137996). Hence
also forkserver_preload: the forkserver restarted with set_forkserver_preload(["torch"]), the
documented way to have torch imported once in the server (its children then re-run the
script with torch already imported).
Every result is waited for with a timeout, and the whole run is stopped by SIGALRM after
--timeout seconds, so the script fails instead of hanging.
Prints one JSON object per line: {"system", "name", "value", "unit"}.

usage: python_pool.py [--tasks 200000] [--starts 50] [--only pools|starts] [--quick]
                      [--min-time SECONDS] [--timeout SECONDS]
"""
import argparse
import json
import math
import multiprocessing
import multiprocessing.forkserver
import signal
import statistics
import sys
import time

import torch
import torch.multiprocessing as tmp

torch.set_num_threads(1)
SYSTEMS = {"multiprocessing.Pool": multiprocessing.get_context("fork"),
           "torch.multiprocessing.Pool": tmp.get_context("fork")}
PROCESSES = 2
GET_TIMEOUT = 300.0  # seconds; any single map/apply result waiting longer fails the run


def inc(x):
    return x + 1


def tensor_sum(t):
    return t.sum().item()


def emit(system, name, value, unit):
    print(json.dumps({"system": system, "name": name, "value": value, "unit": unit}), flush=True)


def map_checked(pool, fn, items, chunksize=None):
    r = pool.map_async(fn, items, chunksize=chunksize).get(GET_TIMEOUT)
    if len(r) != len(items):
        raise RuntimeError(f"map returned {len(r)} results for {len(items)} items")
    return r


def map_tasks_per_s(pool, tasks, chunksize, min_time):
    """Tasks/s of map(inc, range(tasks)); repeats the timed map until min_time has passed."""
    map_checked(pool, inc, range(1000), chunksize)  # warm-up
    items = range(tasks)
    done, elapsed = 0, 0.0
    while True:
        t0 = time.perf_counter()
        r = map_checked(pool, inc, items, chunksize)
        elapsed += time.perf_counter() - t0
        done += tasks
        if r[-1] != tasks:
            raise RuntimeError("wrong map results")
        if elapsed >= min_time:
            return done / elapsed


def apply_async_rtt_us(pool, iters):
    for i in range(100):  # warm-up
        pool.apply_async(inc, (i,)).get(GET_TIMEOUT)
    x, times = 0, []
    for _ in range(iters):
        t0 = time.perf_counter()
        x = pool.apply_async(inc, (x,)).get(GET_TIMEOUT)
        times.append(time.perf_counter() - t0)
    if x != iters:
        raise RuntimeError("wrong apply_async results")
    return statistics.median(times) * 1e6


def map_tensors_ms(pool, reps):
    items = [torch.full((256,), 1.0) for _ in range(2000)]  # 1 KiB each
    map_checked(pool, tensor_sum, items[:200], 1)  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = map_checked(pool, tensor_sum, items)
        times.append(time.perf_counter() - t0)
        if r[0] != 256.0:
            raise RuntimeError("wrong tensor_sum results")
    return statistics.median(times) * 1e3


def record_start(started_ns):
    """The child's target: reading the clock is its first action."""
    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    started_ns.value = now


def start_latency_us(ctx, started_ns):
    """Microseconds from just before p.start() to the target's first action."""
    started_ns.value = 0
    p = ctx.Process(target=record_start, args=(started_ns,))
    t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    p.start()
    p.join(GET_TIMEOUT)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise RuntimeError(f"a {ctx.get_start_method()} child did not exit within {GET_TIMEOUT:g} s")
    if p.exitcode != 0 or started_ns.value == 0:
        raise RuntimeError(f"a {ctx.get_start_method()} child failed (exit code {p.exitcode})")
    return (started_ns.value - t0) / 1e3


def start_latencies(method, starts):
    """(median, p99) of `starts` timed starts with `method`, after one untimed start."""
    ctx = multiprocessing.get_context(method)
    started_ns = ctx.RawValue("q", 0)
    start_latency_us(ctx, started_ns)  # warm-up
    us = sorted(start_latency_us(ctx, started_ns) for _ in range(starts))
    return statistics.median(us), us[max(1, math.ceil(0.99 * len(us))) - 1]


def restart_forkserver(preload):
    """Stops Python's forkserver (if running; the next forkserver start launches a new one)
    and sets the modules the new one preloads."""
    multiprocessing.forkserver._forkserver._stop()  # private; Python's own tests use it
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)


def measure_starts(starts):
    for method in ("fork", "forkserver", "spawn"):
        median, p99 = start_latencies(method, starts)
        emit("multiprocessing.Process", f"start_median/{method}", median, "us")
        emit("multiprocessing.Process", f"start_p99/{method}", p99, "us")
    restart_forkserver(["torch"])
    try:
        median, p99 = start_latencies("forkserver", starts)
    finally:
        restart_forkserver(["__main__"])  # Python's default
    emit("multiprocessing.Process", "start_median/forkserver_preload", median, "us")
    emit("multiprocessing.Process", "start_p99/forkserver_preload", p99, "us")


def with_pool(ctx, fn, *args):
    """Run fn(pool, *args) on a fresh pool of PROCESSES workers; always tear the pool down."""
    pool = ctx.Pool(PROCESSES)
    try:
        return fn(pool, *args)
    finally:
        pool.terminate()
        pool.join()


def on_alarm(signum, frame):
    raise TimeoutError("python_pool: run timed out")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=None, help="N for the maps (default 200000, quick 20000)")
    ap.add_argument("--starts", type=int, default=None,
                    help="timed starts per start method (default 50, quick 10)")
    ap.add_argument("--only", choices=("pools", "starts"), help="run only the pools or the starts")
    ap.add_argument("--quick", action="store_true", help="fewer tasks, iterations and starts")
    ap.add_argument("--min-time", type=float, default=None,
                    help="seconds of timed maps at chunksize 1000 (default 0.5, quick 0.1)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    args = ap.parse_args()
    tasks = args.tasks or (20000 if args.quick else 200000)
    min_time = args.min_time if args.min_time is not None else (0.1 if args.quick else 0.5)
    iters, reps = (500, 1) if args.quick else (2000, 3)
    starts = args.starts or (10 if args.quick else 50)
    if tasks < 1:
        ap.error("--tasks must be >= 1")
    if starts < 1:
        ap.error("--starts must be >= 1")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(args.timeout)))
    for system, ctx in SYSTEMS.items():
        if args.only == "starts":
            break
        emit(system, "map_chunksize_1", with_pool(ctx, map_tasks_per_s, tasks, 1, 0.0), "tasks/s")
        emit(system, "map_chunksize_1000", with_pool(ctx, map_tasks_per_s, tasks, 1000, min_time),
             "tasks/s")
        emit(system, "apply_async_rtt", with_pool(ctx, apply_async_rtt_us, iters), "us")
        emit(system, "map_tensors_1k", with_pool(ctx, map_tensors_ms, reps), "ms")
    if args.only != "pools":
        measure_starts(starts)
    signal.alarm(0)


if __name__ == "__main__":
    sys.exit(main())
