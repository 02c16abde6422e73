#!/usr/bin/python3
"""The `python_dist` section of `torchpar bench`: torch.distributed from /usr/bin/python3 on the
c10d backend "torchpar" (torchpar.distributed) beside the same calls on "gloo" (issue 40,
Benchmark).

One run measures one backend (--impl), so nothing of one backend's set-up (the torchpar
extension, its shared memory) is in the other's process; run_bench.py runs the backends
interleaved, each in its own process. Every case starts 2 fresh ranks (fork, after torch is
imported and set to 1 thread) that meet through a FileStore (init_method file://) in a private
temporary directory, so no port is raced for and nothing is left on disk; a case that fails
loses only itself.
  --impl torchpar   `import torchpar.distributed` (registers the backend), then
                    dist.init_process_group("torchpar"); rank 0 also prints which of torchpar's
                    backends the group runs on (shm on one host)
  --impl gloo       dist.init_process_group("gloo") (loopback TCP)
The ranks run where the kernel puts them, as torch.distributed users run them; --bind pins
rank r to the r-th core this process may use (as coll_bench pins its ranks).

Cases (--case, comma-separated; default all):
  all_reduce   dist.all_reduce(t) (SUM, in place) of float32 tensors of --sizes bytes
               (numel = max(1, bytes // 4)); also, at 4 B and 4 KiB, the same all_reduce called
               on the process group itself (pg.allreduce([t]).wait(), what dist.all_reduce does
               after its Python checks): the difference is distributed_c10d's Python wrapper
  broadcast    dist.broadcast(t, src=0), the same sizes
  all_gather   dist.all_gather(out, t) into a preallocated list, bytes = each rank's input
  ddp          DistributedDataParallel of the mnist_hogwild network (peers/mnist_hogwild.py's
               Net, loaders and training loop, as peers/mnist_ddp.py does it over gloo): 1
               epoch on the Fashion-MNIST training set (/usr/share/datasets/fashion-mnist; the
               first --samples samples), sharded rank::2, batch 64, SGD(lr 0.01, momentum 0.5),
               seed 1; samples/s of the timed epoch (between two barriers, rank 0), then rank 0
               evaluates on the 10k test set; then a quarter epoch more under model.no_sync()
               (no gradient all_reduce), timed the same way: the samples/s with communication
               free, which no backend can pass. Without the dataset: seeded synthetic images
               whose class is a fixed random pattern plus noise (the output says which)
Collectives: a dist.barrier(), warm-up calls, then timed calls, each one timed alone in rank 0
with time.perf_counter() around the plain call (which returns once the collective is done on
this rank: torch.distributed waits on its Work). Big sizes get fewer calls, as
torch_dist_collectives.py: timed = max(3, min(iters, iters * 1 MiB // max(bytes, 1 MiB))),
warm-up = max(1, min(warmup, timed)). One untimed call with known inputs checks the result.
Reported per size: the median of rank 0's calls (us), the nearest-rank p99 (us), busbw
(GB/s, nccl-tests' factors: all_reduce 2(n-1)/n, broadcast 1, all_gather (n-1)/n).

Every wait is bounded: the group timeout (--op-timeout) bounds each collective and the
rendezvous, a case's ranks are killed after --case-timeout, and SIGALRM ends the whole run
after --timeout (the ranks are killed on the way out). Prints one JSON object per line:
{"impl", "case", "name", "value", "unit"}, {"impl", "case", "note"}, or
{"impl", "case", "error"}.

usage: python_dist.py --impl torchpar|gloo [--case NAME[,NAME]] [--quick]
                      [--sizes BYTES[,BYTES]] [--iters N] [--warmup N] [--samples N]
                      [--bind] [--pythonpath DIR] [--op-timeout SECONDS] [--case-timeout SECONDS]
                      [--timeout SECONDS]
"""
import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback

sys.dont_write_bytecode = True  # no __pycache__ next to the peers
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from torch_dist_collectives import BUSBW_FACTOR, check, counts, make_op, p99, run_all  # noqa: E402

torch.set_num_threads(1)
CTX = mp.get_context("fork")
CASES = ("all_reduce", "broadcast", "all_gather", "ddp")
RANKS = 2
SIZES = (4, 4 << 10, 1 << 20, 16 << 20, 64 << 20)  # bytes
PG_SIZES = (4, 4 << 10)  # sizes whose all_reduce is also timed on the process group itself
DATA_DIR = "/usr/share/datasets/fashion-mnist"
IMPL = None  # set by main()


def emit(case, **fields):
    print(json.dumps(dict({"impl": IMPL, "case": case}, **fields)), flush=True)


def value(case, name, v, unit):
    emit(case, name=name, value=v, unit=unit)


def init(rank, init_method, op_timeout):
    """Joins the 2-rank group of --impl's backend."""
    if IMPL == "torchpar":
        import torchpar.distributed  # noqa: F401  registers the backend "torchpar"
    dist.init_process_group(IMPL, init_method=init_method, rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=op_timeout))
    if rank == 0 and IMPL == "torchpar":
        import torchpar.distributed as tpd
        emit("group", note=f"torchpar backend: {tpd.collective_backend()}")


# ----------------------------------------------------------------------------------------------
# Collectives


def time_calls(run, timed, warmup):
    """rank-local seconds of each of `timed` calls of run() after `warmup` untimed ones."""
    dist.barrier()
    for _ in range(warmup):
        run()
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def collective(rank, op, args):
    n = RANKS
    for size in args.sizes:
        numel = max(1, size // 4)
        nbytes = numel * 4
        t = torch.zeros(numel)
        out = [torch.empty(numel) for _ in range(n)] if op == "all_gather" else None
        timed, warmup = counts(nbytes, args.iters, args.warmup)
        times = time_calls(make_op(op, t, out), timed, warmup)
        check(op, t, out, rank, n)
        if rank == 0:
            med = statistics.median(times)
            data = nbytes * (n if op == "all_gather" else 1)
            value(op, f"{nbytes}/us", med * 1e6, "us")
            value(op, f"{nbytes}/p99", p99(times) * 1e6, "us")
            value(op, f"{nbytes}/busbw", data / med * BUSBW_FACTOR[op](n) / 1e9, "GB/s")
        if op == "all_reduce" and nbytes in PG_SIZES:
            pg = dist.distributed_c10d._get_default_group()
            t.zero_()  # check() filled it: keep the sums finite
            times = time_calls(lambda t=t: pg.allreduce([t]).wait(), timed, warmup)
            if rank == 0:
                value(op, f"{nbytes}/pg_us", statistics.median(times) * 1e6, "us")
        del t, out


# ----------------------------------------------------------------------------------------------
# DDP


def synthetic(n, seed):
    """(images n x 1 x 28 x 28, labels n): class k is a fixed random pattern plus noise, so the
    network can learn it and the accuracy means something."""
    g = torch.Generator().manual_seed(1234)
    patterns = torch.randn(10, 1, 28, 28, generator=g)
    g.manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    return patterns[y] + 1.5 * torch.randn(n, 1, 28, 28, generator=g), y


def ddp_data(samples):
    """(x, y, test x, test y, what the data is)."""
    try:
        from mnist_hogwild import load
        x, y = load("train", samples)
        tx, ty = load("t10k")
        return x, y, tx, ty, f"Fashion-MNIST ({DATA_DIR}), first {len(x):,} training samples"
    except OSError as e:
        x, y = synthetic(samples, 1)
        tx, ty = synthetic(10000, 2)
        return x, y, tx, ty, (f"synthetic ({DATA_DIR} not readable: {e.strerror}): "
                              f"{samples:,} samples")


def ddp(rank, args, data):
    import torch.optim as optim
    from mnist_hogwild import Net, evaluate, train_epoch
    from torch.nn.parallel import DistributedDataParallel as DDP
    x, y, tx, ty, what = data
    seed, n = 1, RANKS
    torch.manual_seed(seed)
    model = DDP(Net())
    torch.manual_seed(seed + rank)  # dropout masks
    per_rank = len(x) // n
    xs, ys = x[rank::n][:per_rank], y[rank::n][:per_rank]
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    perm = torch.randperm(per_rank, generator=torch.Generator().manual_seed(seed))
    dist.barrier()
    t0 = time.perf_counter()
    loss_sum = train_epoch(model, opt, xs, ys, perm, 64)
    dist.barrier()
    seconds = time.perf_counter() - t0
    total = torch.tensor([loss_sum], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        test_loss, test_acc = evaluate(model.module, tx, ty)
        emit("ddp", note=f"data: {what}")
        value("ddp", "samples_per_s", n * per_rank / seconds, "samples/s")
        value("ddp", "test_accuracy", test_acc, "%")
        value("ddp", "final_loss", total.item() / (n * per_rank), "nll")
        value("ddp", "test_loss", test_loss, "nll")
    # The ceiling no backend can pass: the same steps on a quarter of the epoch with DDP's
    # gradient all_reduce skipped (model.no_sync()), after the evaluation.
    steps = perm[:max(64, per_rank // 4)]
    dist.barrier()
    t0 = time.perf_counter()
    with model.no_sync():
        train_epoch(model, opt, xs, ys, steps, 64)
    dist.barrier()
    if rank == 0:
        value("ddp", "nosync_samples_per_s", n * len(steps) / (time.perf_counter() - t0),
              "samples/s")


# ----------------------------------------------------------------------------------------------


def rank_main(rank, case, init_method, args, data):
    """A rank's process: join the group, run the case, leave; exit 0, or 1 with the traceback
    on stderr."""
    code = 1
    try:
        torch.set_num_threads(1)
        if args.bind:
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[rank % len(cores)]})
        init(rank, init_method, args.op_timeout)
        if case == "ddp":
            ddp(rank, args, data)
        else:
            collective(rank, case, args)
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: B036 - any failure is the rank's exit code
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        sys.stdout.flush()
        os._exit(code)


def run_case(case, args, data, tmp):
    """Starts the case's 2 ranks and waits for them (at most --case-timeout); raises
    RuntimeError naming what failed. The ranks are always reaped."""
    store = os.path.join(tmp, f"store_{case}")
    procs = [CTX.Process(target=rank_main, args=(r, case, "file://" + store, args, data))
             for r in range(RANKS)]
    err = run_all(procs, args.case_timeout)
    if err:
        raise RuntimeError(err)


def on_alarm(signum, frame):
    # SystemExit: run_all's finally kills and reaps the ranks of the case under way.
    sys.exit("python_dist.py: the run outlived --timeout")


# Work (quick, full); each can be set on the command line.
ITERS = (100, 500)  # timed calls of the small sizes (fewer above 1 MiB)
WARMUP = (10, 20)
SAMPLES = (12000, 60000)  # DDP training samples (the epoch)


def main():
    global IMPL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", required=True, choices=("torchpar", "gloo"))
    ap.add_argument("--case", default="", help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--quick", action="store_true", help="fewer calls and samples (a smoke check)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per rank")
    ap.add_argument("--iters", type=int, help=f"timed calls; default {ITERS[1]}, --quick {ITERS[0]}")
    ap.add_argument("--warmup", type=int,
                    help=f"untimed calls; default {WARMUP[1]}, --quick {WARMUP[0]}")
    ap.add_argument("--samples", type=int,
                    help=f"DDP training samples; default {SAMPLES[1]:,}, --quick {SAMPLES[0]:,}")
    ap.add_argument("--bind", action="store_true",
                    help="bind rank r to the r-th core it may run on (as coll_bench does); "
                         "default: unbound, as torch.distributed users run")
    ap.add_argument("--pythonpath",
                    help="a directory to import torchpar from (put first on sys.path)")
    ap.add_argument("--op-timeout", type=float, default=60.0,
                    help="seconds: the group timeout (rendezvous and each collective)")
    ap.add_argument("--case-timeout", type=float, default=300.0,
                    help="seconds a case's ranks may run before they are killed")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    args = ap.parse_args()
    IMPL = args.impl
    if args.pythonpath:
        sys.path.insert(0, args.pythonpath)
    cases = [c for c in args.case.split(",") if c] or list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--case: unknown {','.join(unknown)} (choose from {','.join(CASES)})")
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    pick = lambda given, pair: given or (pair[0] if args.quick else pair[1])
    args.iters, args.warmup = pick(args.iters, ITERS), pick(args.warmup, WARMUP)
    args.samples = pick(args.samples, SAMPLES)
    if IMPL == "torchpar":
        import torchpar.distributed  # noqa: F401  fail here, once, when it is not importable
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.timeout))
    tmp = tempfile.mkdtemp(prefix="python_dist_")
    failed = 0
    try:
        for case in cases:
            try:
                data = ddp_data(args.samples) if case == "ddp" else None
                run_case(case, args, data, tmp)
            except Exception as e:  # one case failing must not lose the others
                traceback.print_exc()
                emit(case, error=f"{type(e).__name__}: {e}"[:300])
                failed += 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed == len(cases) else 0


if __name__ == "__main__":
    sys.exit(main())
