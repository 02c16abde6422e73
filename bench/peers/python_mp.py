#!/usr/bin/python3
"""The `python` section of `torchpar bench`: torchpar.multiprocessing beside torch.multiprocessing
and Python's multiprocessing, the same work from /usr/bin/python3 (issue 39, Benchmark).

One run measures one implementation (--impl), so the reducers one of them registers
(importing torch registers torch's tensor reducers with multiprocessing's ForkingPickler) never
leak into another's numbers; run_bench.py runs the implementations interleaved, each in its own
process. Every process here is started with fork; 2 processes per case (parent and one child,
or a pool of 2 workers) except the DataLoader's 4 workers.
  --impl torchpar   torchpar.multiprocessing.get_context("fork"): its Queue, Pool, DataLoader
                    context (tensors travel as torchpar shared-memory handles)
  --impl torch      torch.multiprocessing.get_context("fork") (sharing strategy file_descriptor,
                    the default); the DataLoader with its default context
  --impl mp         multiprocessing.get_context("fork") without importing torch: only the pool
                    cases (with torch imported, a multiprocessing.Queue carries tensors through
                    torch's reducers, so it would measure torch.multiprocessing again)

Cases (--case, comma-separated; default all the implementation runs):
  queue_rt_4k    one 4 KiB float32 tensor (torch.ones(1024)) parent -> child -> parent through
                 two Queues, the child putting back what it got (the same tensor every trip, as
                 torch_ipc.py's queue_pingpong_4k); 50 untimed trips, then the median of
                 --trips timed ones (us per round trip)
  queue_rate_4k  fresh 4 KiB float32 tensors parent -> child; the child adds each tensor's sum
                 into a counter and, at the end marker, puts back (count, sum); messages/s from
                 the first put to that reply (a batch of 50 untimed first; --messages
                 timed); the sum is checked
  dict16         a dict of 16 fresh float32 tensors of 64 elements (made before each timed
                 trip, not yet shared) parent -> child -> parent; 50 untimed trips, then the
                 median of --dict-trips timed ones (us)
  pool_map       Pool(2).map(f, range(--tasks), chunksize=1), f(x) = x + 1 at module level; one
                 untimed map of 1000 first; tasks/s of the timed map
  pool_apply_rt  Pool(2).apply_async(f, (i,)).get(): 100 untimed calls, then the median of
                 --trips timed calls (us)
  dataloader     DataLoader(batch_size=64, num_workers=4, shuffle=False) over a synthetic
                 dataset of --samples samples (torch.full((3, 32, 32), ...), label), default
                 collate (one 64x3x32x32 tensor and 64 labels a batch); torchpar:
                 multiprocessing_context=torchpar.multiprocessing.get_context("fork"), torch:
                 the default context. samples/s from the first batch received to the end (the
                 workers' start is outside); the main process's open fds after the last batch
                 (still holding it; the iterator finished: workers gone) and the most seen
                 between batches
  dataloader_list  the same with collate_fn returning the list of the batch's 64 tensors (64
                 tensors per message: torch.multiprocessing shares each through its own fd)

Every wait has a timeout and SIGALRM stops the whole run after --timeout seconds. A case that
fails (or cannot run: torchpar's Pool missing) prints an error line and the run goes on.
Prints one JSON object per line: {"impl", "case", "name", "value", "unit"}, or
{"impl", "case", "error"} / {"impl", "case", "skipped"}.

usage: python_mp.py --impl torchpar|torch|mp [--case NAME[,NAME]] [--quick]
                    [--trips N] [--messages N] [--dict-trips N] [--tasks N] [--samples N]
                    [--pythonpath DIR] [--timeout SECONDS]
"""
import argparse
import json
import os
import signal
import statistics
import sys
import time
import traceback

CASES = ("queue_rt_4k", "queue_rate_4k", "dict16", "pool_map", "pool_apply_rt", "dataloader",
         "dataloader_list")
TENSOR_CASES = ("queue_rt_4k", "queue_rate_4k", "dict16", "dataloader", "dataloader_list")
WAIT = 120.0  # seconds; any single get / result waiting longer fails the case
WARMUP = 50
IMPL = None  # set by main()


def emit(case, **fields):
    print(json.dumps(dict({"impl": IMPL, "case": case}, **fields)), flush=True)


def value(case, name, v, unit):
    emit(case, name=name, value=v, unit=unit)


def f(x):
    """The pool's task: trivial, so the pool's own costs are what is measured."""
    return x + 1


def context():
    """The implementation's context (fork)."""
    if IMPL == "torchpar":
        import torchpar.multiprocessing as tmp
        return tmp.get_context("fork")
    if IMPL == "torch":
        import torch.multiprocessing as tmp
        return tmp.get_context("fork")
    import multiprocessing
    return multiprocessing.get_context("fork")


# ----------------------------------------------------------------------------------------------
# Queues


def echo_child(inq, outq):
    """Puts back everything it gets until None."""
    import torch
    torch.set_num_threads(1)
    while True:
        msg = inq.get(timeout=WAIT)
        if msg is None:
            return
        outq.put(msg)
        del msg


def sum_child(inq, outq):
    """Adds up the tensors it gets; at an int marker puts back (tensors counted, their sum)."""
    import torch
    torch.set_num_threads(1)
    count, total = 0, 0.0
    while True:
        msg = inq.get(timeout=WAIT)
        if msg is None:
            return
        if isinstance(msg, int):
            outq.put((count, total))
            count, total = 0, 0.0
            continue
        count += 1
        total += msg.sum().item()
        del msg


class Child:
    """A child process running target(q_to_child, q_from_child); always reaped."""

    def __init__(self, ctx, target):
        self.to_child, self.from_child = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=target, args=(self.to_child, self.from_child), daemon=True)

    def __enter__(self):
        self.proc.start()
        return self

    def __exit__(self, *exc):
        try:
            self.to_child.put(None)
            self.proc.join(WAIT)
        finally:
            if self.proc.is_alive():
                self.proc.terminate()
            self.proc.join()
            for q in (self.to_child, self.from_child):
                q.close()
                q.cancel_join_thread()  # never block the exit on an unread buffer
        if exc[0] is None and self.proc.exitcode != 0:
            raise RuntimeError(f"child exited with code {self.proc.exitcode}")

    def get(self):
        return self.from_child.get(timeout=WAIT)


def round_trip_us(child, make, trips):
    """Median us of put(make()) + get(); make() runs outside the timed region."""
    times = []
    for i in range(WARMUP + trips):
        msg = make()
        t0 = time.perf_counter()
        child.to_child.put(msg)
        back = child.get()
        dt = time.perf_counter() - t0
        if i >= WARMUP:
            times.append(dt * 1e6)
        del msg
    return statistics.median(times), back


def case_queue_rt_4k(ctx, sizes):
    import torch
    t = torch.ones(1024)
    with Child(ctx, echo_child) as child:
        us, back = round_trip_us(child, lambda: t, sizes["trips"])
    if back.shape != (1024,) or back[0].item() != 1.0:
        raise RuntimeError("the tensor came back changed")
    value("queue_rt_4k", "rtt", us, "us")


def case_queue_rate_4k(ctx, sizes):
    import torch
    with Child(ctx, sum_child) as child:
        for n in (WARMUP, sizes["messages"]):
            t0 = time.perf_counter()
            for i in range(n):
                child.to_child.put(torch.full((1024,), float(i % 4)))
            child.to_child.put(n)  # the end marker
            count, total = child.get()
            elapsed = time.perf_counter() - t0
            expect = 1024.0 * sum(i % 4 for i in range(n))
            if count != n or total != expect:
                raise RuntimeError(f"the child got {count} tensors summing to {total}; "
                                   f"sent {n} summing to {expect}")
    value("queue_rate_4k", "rate", n / elapsed, "messages/s")


def case_dict16(ctx, sizes):
    import torch

    def make():
        return {f"t{k}": torch.full((64,), float(k)) for k in range(16)}

    with Child(ctx, echo_child) as child:
        us, back = round_trip_us(child, make, sizes["dict_trips"])
    if sorted(back) != sorted(make()) or back["t15"][0].item() != 15.0:
        raise RuntimeError("the dict came back changed")
    value("dict16", "rtt", us, "us")


# ----------------------------------------------------------------------------------------------
# Pools


def pool(ctx):
    return ctx.Pool(2)


def case_pool_map(ctx, sizes):
    n = sizes["tasks"]
    with pool(ctx) as p:
        p.map_async(f, range(1000), chunksize=1).get(WAIT)
        t0 = time.perf_counter()
        r = p.map_async(f, range(n), chunksize=1).get(WAIT * 5)
        elapsed = time.perf_counter() - t0
    if len(r) != n or r[-1] != n:
        raise RuntimeError(f"map returned {len(r)} results for {n} tasks")
    value("pool_map", "rate", n / elapsed, "tasks/s")


def case_pool_apply_rt(ctx, sizes):
    times = []
    with pool(ctx) as p:
        for i in range(100 + sizes["trips"]):
            t0 = time.perf_counter()
            r = p.apply_async(f, (i,)).get(WAIT)
            dt = time.perf_counter() - t0
            if r != i + 1:
                raise RuntimeError(f"apply_async(f, ({i},)) returned {r!r}")
            if i >= 100:
                times.append(dt * 1e6)
    value("pool_apply_rt", "rtt", statistics.median(times), "us")


# ----------------------------------------------------------------------------------------------
# DataLoader


def _dataset(n):
    import torch

    class Images(torch.utils.data.Dataset):
        """Sample i: a fresh 3x32x32 float32 tensor (filled, not random: cheap to make) and
        its label."""

        def __len__(self):
            return n

        def __getitem__(self, i):
            return torch.full((3, 32, 32), float(i % 251)), i % 10

    return Images()


def list_collate(batch):
    """The batch's image tensors as a list (one message of 64 tensors)."""
    return [x for x, _ in batch]


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def run_dataloader(case, collate, sizes):
    import warnings

    from torch.utils.data import DataLoader
    n = sizes["samples"]
    kwargs = {}
    if IMPL == "torchpar":
        import torchpar.multiprocessing as tmp
        kwargs["multiprocessing_context"] = tmp.get_context("fork")
    if collate is not None:
        kwargs["collate_fn"] = collate
    with warnings.catch_warnings():  # 4 workers on a 2-core machine: the case asks for that
        warnings.simplefilter("ignore")
        loader = DataLoader(_dataset(n), batch_size=64, num_workers=4, shuffle=False,
                            timeout=WAIT, **kwargs)
        it = iter(loader)
        first = next(it)
        got = len(first) if collate is not None else len(first[0])
        most = open_fds()
        t0 = time.perf_counter()
        count = 0
        batch = None
        for batch in it:
            count += len(batch) if collate is not None else len(batch[0])
            most = max(most, open_fds())
        elapsed = time.perf_counter() - t0
    if got + count != n:
        raise RuntimeError(f"the loader yielded {got + count} samples of {n}")
    fds_end = open_fds()  # still holding the last batch
    del batch, first, it, loader
    value(case, "rate", count / elapsed, "samples/s")
    value(case, "fds_end", fds_end, "fds")
    value(case, "fds_max", most, "fds")


def case_dataloader(ctx, sizes):
    run_dataloader("dataloader", None, sizes)


def case_dataloader_list(ctx, sizes):
    run_dataloader("dataloader_list", list_collate, sizes)


# ----------------------------------------------------------------------------------------------


# Work per case (quick, full); each can be set on the command line (run_bench.py sets them all).
SIZES = {"trips": (500, 2000),  # timed round trips of queue_rt_4k and pool_apply_rt
         "messages": (1000, 5000),  # tensors one way in queue_rate_4k
         "dict_trips": (100, 500),  # timed round trips of dict16
         "tasks": (20000, 200000),  # tasks of pool_map
         "samples": (3200, 12800)}  # samples of each DataLoader case


def on_alarm(signum, frame):
    # SystemExit, not an Exception: the case handlers do not catch it, the with blocks still
    # reap the children and pools on the way out, and the exit status says it failed.
    sys.exit("python_mp.py: the run outlived --timeout")


def main():
    global IMPL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", required=True, choices=("torchpar", "torch", "mp"))
    ap.add_argument("--case", default="", help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke check)")
    for key, (quick, full) in SIZES.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int,
                        help=f"default {full:,}, --quick {quick:,}")
    ap.add_argument("--pythonpath",
                    help="a directory to import torchpar from (put first on sys.path)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    args = ap.parse_args()
    IMPL = args.impl
    if args.pythonpath:
        sys.path.insert(0, args.pythonpath)
    cases = [c for c in args.case.split(",") if c] or [
        c for c in CASES if IMPL != "mp" or c not in TENSOR_CASES]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--case: unknown {','.join(unknown)} (choose from {','.join(CASES)})")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.timeout))
    if IMPL != "mp":
        import torch
        torch.set_num_threads(1)
    ctx = context()
    sizes = {key: getattr(args, key) or (quick if args.quick else full)
             for key, (quick, full) in SIZES.items()}
    for case in cases:
        if IMPL == "mp" and case in TENSOR_CASES:
            emit(case, skipped="tensor case: with torch imported, multiprocessing carries tensors "
                               "through torch's reducers (torch.multiprocessing's numbers)")
            continue
        try:
            globals()[f"case_{case}"](ctx, sizes)
        except Exception as e:  # one case failing (or missing) must not lose the others
            traceback.print_exc()
            emit(case, error=f"{type(e).__name__}: {e}"[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
