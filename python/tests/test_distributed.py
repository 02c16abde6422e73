"""The torch.distributed backend "torchpar" (torchpar.distributed) across real processes.

Each test forks 2 or 3 ranks that meet through a FileStore (file://) or a TCPStore on
loopback (tcp://127.0.0.1), run torch.distributed's own functions on backend "torchpar" and
check every result against the arithmetic they compute locally (float32 and int64). A rank
reports failure by its exit code (its traceback goes to stderr, which pytest shows). Also:
DDP of a small nn.Linear gives the same parameters on every rank and the same as on "gloo";
three ranks on two "hosts" (a private /dev/shm) run every op and DDP on the hierarchical
backend; an all_reduce nobody waits for still runs; a rank SIGKILLed before an all_reduce
makes the others raise naming it, a SIGSTOPped one makes the other raise TimeoutError, each
within the group timeout; nothing stays in /dev/shm.
"""
import datetime
import multiprocessing
import os
import re
import signal
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import torchpar
import torchpar.distributed as tpd

#: Seconds a whole job of ranks may take before the test kills it and fails.
JOB_S = 60.0


def _shm_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("torchpar_")}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(body, rank, world, init_method, timeout_s, args, prepare=None):
    """A rank's process: prepare(rank) when given, init "torchpar", run body, exit 0 (1 with
    the traceback on stderr)."""
    code = 1
    try:
        if prepare is not None:
            prepare(rank)
        dist.init_process_group("torchpar", init_method=init_method, rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        body(rank, world, *args)
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: B036 - any failure is the rank's exit code
        traceback.print_exc()
    finally:
        os._exit(code)


def run_job(body, world, *args, store="file", timeout_s=20.0, tmp_path=None, expect=None,
            prepare=None):
    """Runs body(rank, world, *args) as `world` forked ranks of a "torchpar" group (after
    prepare(rank) when given) and returns their exit codes; each must match `expect`
    (default: all 0). Ranks still alive after JOB_S seconds are killed (the test fails)."""
    if store == "file":
        path = tmp_path / "store"
        if path.exists():  # a FileStore file of a job that failed: never reuse it
            path.unlink()
        init_method = "file://" + str(path)
    else:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank_main,
                         args=(body, r, world, init_method, timeout_s, args, prepare))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOB_S
    hung = []
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            hung.append(p.pid)
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} did not finish within {JOB_S} s"
    codes = [p.exitcode for p in procs]
    assert codes == (expect or [0] * world), f"exit codes {codes}"
    return codes


@pytest.fixture(autouse=True)
def _shm_clean():
    before = _shm_names()
    yield
    assert _shm_names() <= before, f"left in /dev/shm: {sorted(_shm_names() - before)}"


# ---- every operation -------------------------------------------------------------------------

def _expect(cond, what):
    if not cond:
        raise AssertionError(what)


def _eq(a, b, what):
    _expect(torch.equal(a, b), f"{what}: got {a.tolist()}, want {b.tolist()}")


def _close(a, b, what):
    _expect(torch.allclose(a, b), f"{what}: got {a.tolist()}, want {b.tolist()}")


def _value(rank, dtype, n=4):
    """Rank r's tensor: r+1, r+2, ... (never 0, so PRODUCT and BAND mean something)."""
    return torch.arange(rank + 1, rank + 1 + n).to(dtype)


def _all_values(world, dtype, n=4):
    return torch.stack([_value(r, dtype, n) for r in range(world)])


def _reductions(rank, world, dtype):
    every = _all_values(world, dtype)
    want = {
        dist.ReduceOp.SUM: every.sum(0),
        dist.ReduceOp.PRODUCT: every.prod(0),
        dist.ReduceOp.MIN: every.min(0).values,
        dist.ReduceOp.MAX: every.max(0).values,
    }
    for op, expected in want.items():
        t = _value(rank, dtype)
        dist.all_reduce(t, op=op)
        _eq(t, expected.to(dtype), f"all_reduce {op} {dtype}")
        # reduce: only the root's tensor changes.
        root = world - 1
        t = _value(rank, dtype)
        dist.reduce(t, root, op=op)
        _eq(t, expected.to(dtype) if rank == root else _value(rank, dtype),
            f"reduce {op} {dtype} on rank {rank}")
    if dtype.is_floating_point:
        t = _value(rank, dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        _close(t, every.mean(0), "all_reduce AVG")
    else:
        for op, fold in ((dist.ReduceOp.BAND, torch.bitwise_and),
                         (dist.ReduceOp.BOR, torch.bitwise_or),
                         (dist.ReduceOp.BXOR, torch.bitwise_xor)):
            expected = every[0].clone()
            for r in range(1, world):
                expected = fold(expected, every[r])
            t = _value(rank, dtype)
            dist.all_reduce(t, op=op)
            _eq(t, expected, f"all_reduce {op}")
            t = _value(rank, dtype)
            dist.reduce(t, 0, op=op)
            _eq(t, expected if rank == 0 else _value(rank, dtype), f"reduce {op}")
    # all_reduce_coalesced: several tensors, one collective.
    ts = [_value(rank, dtype, 3), _value(rank, dtype, 5).view(5, 1)]
    dist.all_reduce_coalesced(ts)
    _eq(ts[0], _all_values(world, dtype, 3).sum(0).to(dtype), "all_reduce_coalesced[0]")
    _eq(ts[1], _all_values(world, dtype, 5).sum(0).to(dtype).view(5, 1),
        "all_reduce_coalesced[1]")


def _gathers(rank, world, dtype):
    every = _all_values(world, dtype)
    for root in range(world):
        t = _value(rank, dtype) if rank == root else torch.zeros(4, dtype=dtype)
        dist.broadcast(t, root)
        _eq(t, _value(root, dtype), f"broadcast from {root}")
    out = [torch.zeros(4, dtype=dtype) for _ in range(world)]
    dist.all_gather(out, _value(rank, dtype))
    _eq(torch.stack(out), every, "all_gather")
    flat = torch.zeros(world * 4, dtype=dtype)
    dist.all_gather_into_tensor(flat, _value(rank, dtype))
    _eq(flat, every.reshape(-1), "all_gather_into_tensor")
    flat = torch.zeros(world * 4, dtype=dtype)
    dist._all_gather_base(flat, _value(rank, dtype))
    _eq(flat, every.reshape(-1), "_all_gather_base")
    ins = [_value(rank, dtype, 2), _value(rank, dtype, 6).view(2, 3)]
    outs = [[torch.zeros(2, dtype=dtype), torch.zeros(2, 3, dtype=dtype)] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    for r in range(world):
        _eq(outs[r][0], _value(r, dtype, 2), "all_gather_coalesced[0]")
        _eq(outs[r][1], _value(r, dtype, 6).view(2, 3), "all_gather_coalesced[1]")
    root = 1
    lst = [torch.zeros(4, dtype=dtype) for _ in range(world)] if rank == root else None
    dist.gather(_value(rank, dtype), lst, dst=root)
    if rank == root:
        _eq(torch.stack(lst), every, "gather")
    t = torch.zeros(4, dtype=dtype)
    dist.scatter(t, [_value(r, dtype) * 10 for r in range(world)] if rank == 0 else None, src=0)
    _eq(t, _value(rank, dtype) * 10, "scatter")


def _block(src, dst, dtype, n=3):
    """What rank src sends rank dst in the all-to-all and reduce-scatter checks."""
    return torch.full((n,), src * 100 + dst + 1).to(dtype)


def _exchanges(rank, world, dtype):
    out = torch.zeros(3, dtype=dtype)
    dist.reduce_scatter(out, [_block(rank, d, dtype) for d in range(world)])
    _eq(out, sum(_block(s, rank, dtype) for s in range(world)).to(dtype), "reduce_scatter")
    out = torch.zeros(3, dtype=dtype)
    dist.reduce_scatter_tensor(out, torch.cat([_block(rank, d, dtype) for d in range(world)]))
    _eq(out, sum(_block(s, rank, dtype) for s in range(world)).to(dtype),
        "reduce_scatter_tensor")
    outs = [torch.zeros(3, dtype=dtype) for _ in range(world)]
    dist.all_to_all(outs, [_block(rank, d, dtype) for d in range(world)])
    _eq(torch.stack(outs), torch.stack([_block(s, rank, dtype) for s in range(world)]),
        "all_to_all")
    # Uneven parts: rank s sends rank d (s + d + 1) elements.
    outs = [torch.zeros(s + rank + 1, dtype=dtype) for s in range(world)]
    dist.all_to_all(outs, [_block(rank, d, dtype, rank + d + 1) for d in range(world)])
    for s in range(world):
        _eq(outs[s], _block(s, rank, dtype, s + rank + 1), f"uneven all_to_all from {s}")
    out = torch.zeros(world * 3, dtype=dtype)
    dist.all_to_all_single(out, torch.cat([_block(rank, d, dtype) for d in range(world)]))
    _eq(out, torch.cat([_block(s, rank, dtype) for s in range(world)]), "all_to_all_single")
    in_splits = [rank + d + 1 for d in range(world)]
    out_splits = [s + rank + 1 for s in range(world)]
    out = torch.zeros(sum(out_splits), dtype=dtype)
    dist.all_to_all_single(out, torch.cat([_block(rank, d, dtype, rank + d + 1)
                                           for d in range(world)]),
                           output_split_sizes=out_splits, input_split_sizes=in_splits)
    _eq(out, torch.cat([_block(s, rank, dtype, s + rank + 1) for s in range(world)]),
        "all_to_all_single with splits")


def _point_to_point(rank, world, dtype):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(4, dtype=dtype)
    req = dist.irecv(got, prv)
    dist.send(_value(rank, dtype), nxt)
    req.wait()
    _eq(got, _value(prv, dtype), "irecv / send around the ring")
    if rank == 0:
        for _ in range(world - 1):
            t = torch.zeros(4, dtype=dtype)
            src = dist.recv(t)  # any source
            _eq(t, _value(src, dtype), f"recv from any rank (sender {src})")
    else:
        dist.isend(_value(rank, dtype), 0).wait()
    dist.barrier()


def _async_and_layout(rank, world):
    # async_op: several pending, waited in order with a timeout; is_completed after.
    ts = [torch.full((1000,), float(rank + i)) for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for i, w in enumerate(works):
        w.wait(datetime.timedelta(seconds=10))
        _expect(w.is_completed(), "is_completed after wait")
        _eq(ts[i], torch.full((1000,), float(sum(r + i for r in range(world)))), f"async {i}")
    # get_future: a List[Tensor] of the outputs (DDP's reducer reads it).
    t = torch.ones(3)
    value = dist.all_reduce(t, async_op=True).get_future().wait()
    _expect(isinstance(value, list) and value[0] is not None, f"future value {value!r}")
    _eq(value[0], torch.full((3,), float(world)), "future's tensor")
    # get_future first asked for once the call is done (synchronous calls make none
    # up front), of a plain all_reduce and of a bitwise one: completed, the same outputs.
    bor = 0
    for r in range(world):
        bor |= r + 1
    for op, dtype, want in ((dist.ReduceOp.MAX, torch.float32, world),
                            (dist.ReduceOp.BOR, torch.int32, bor)):
        t = torch.full((5,), rank + 1, dtype=dtype)
        w = dist.all_reduce(t, op=op, async_op=True)
        w.wait()
        _eq(t, torch.full((5,), want, dtype=dtype), f"{op}")
        fut = w.get_future()
        _expect(fut.done(), f"{op}: future of a finished call is done")
        _eq(fut.wait()[0], t, f"{op}: late future's tensor")
        _expect(w.get_future().done(), f"{op}: future asked for twice")
        _eq(w.result()[0], t, f"{op}: result()")
    # Non-contiguous tensors: a column slice and a transpose, written in place.
    base = torch.zeros(4, 6)
    base[:, ::2] = float(rank + 1)
    view = base[:, ::2]
    _expect(not view.is_contiguous(), "the slice is not contiguous")
    dist.all_reduce(view)
    _eq(base[:, ::2], torch.full((4, 3), float(world * (world + 1) // 2)), "strided all_reduce")
    _eq(base[:, 1::2], torch.zeros(4, 3), "strided all_reduce left the other columns")
    tt = (torch.arange(6.0).view(2, 3) + rank).t()
    dist.broadcast(tt, 0)
    _eq(tt, torch.arange(6.0).view(2, 3).t(), "transposed broadcast")
    # Sparse COO: SUM, as Gloo's (the result coalesced, nnz differing between ranks).
    i = torch.tensor([[rank, 3], [0, rank]])
    sp = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0]), (4, 4))
    dist.all_reduce(sp)
    dense = sum(torch.sparse_coo_tensor(torch.tensor([[r, 3], [0, r]]),
                                        torch.tensor([1.0, 2.0]), (4, 4)).to_dense()
                for r in range(world))
    _eq(sp.to_dense(), dense, "sparse all_reduce")
    # Argument errors raise at the call, on every rank alike.
    try:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
    except ValueError as e:
        _expect("integer or bool" in str(e), str(e))
    else:
        raise AssertionError("BAND on float32 did not raise")


def _subgroups(rank, world):
    # Every rank creates every group (torch.distributed's rule); members use theirs.
    pair = dist.new_group([0, world - 1], backend="torchpar")
    rest = dist.new_group(list(range(1, world)), backend="torchpar")
    t = torch.full((2,), float(rank + 1))
    if rank in (0, world - 1):
        dist.all_reduce(t, group=pair)
        _eq(t, torch.full((2,), float(1 + world)), "all_reduce in [0, last]")
        _expect(tpd.collective_backend(pair) == "shm", "pair on shm")
    t = torch.full((2,), float(rank + 1))
    if rank >= 1:
        dist.all_reduce(t, group=rest)
        _eq(t, torch.full((2,), float(sum(range(2, world + 1)))), "all_reduce in [1..]")
    dist.barrier()


def _other_dtypes(rank, world):
    # The rest of Gloo's CPU dtypes and more: all_reduce, broadcast, all_gather.
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
                  torch.int16, torch.int32):
        t = _value(rank, dtype)
        dist.all_reduce(t)
        _eq(t, _all_values(world, torch.int64).sum(0).to(dtype), f"all_reduce {dtype}")
        t = _value(rank, dtype)
        dist.broadcast(t, world - 1)
        _eq(t, _value(world - 1, dtype), f"broadcast {dtype}")
        out = [torch.zeros(4, dtype=dtype) for _ in range(world)]
        dist.all_gather(out, _value(rank, dtype))
        _eq(torch.stack(out), _all_values(world, dtype), f"all_gather {dtype}")
    flags = torch.tensor([rank == 0, False, True])
    dist.all_reduce(flags)  # bool SUM is OR
    _eq(flags, torch.tensor([True, False, True]), "all_reduce bool")
    flags = torch.tensor([rank == 0, True])
    dist.all_reduce(flags, op=dist.ReduceOp.BAND)
    _eq(flags, torch.tensor([False, True]), "all_reduce bool BAND")


def _every_op(rank, world):
    _expect(dist.get_backend() == "torchpar", dist.get_backend())
    _expect(tpd.collective_backend() == "shm", tpd.collective_backend())
    for dtype in (torch.float32, torch.int64):
        _reductions(rank, world, dtype)
        _gathers(rank, world, dtype)
        _exchanges(rank, world, dtype)
        _point_to_point(rank, world, dtype)
    _other_dtypes(rank, world)
    _async_and_layout(rank, world)
    _subgroups(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_every_operation(world, tmp_path):
    run_job(_every_op, world, tmp_path=tmp_path)


def _tcp_smoke(rank, world):
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    _eq(t, torch.full((3,), float(sum(range(world)))), "all_reduce over a TCPStore")


def test_tcp_store_rendezvous():
    run_job(_tcp_smoke, 2, store="tcp")


def _unwaited_progress(rank, world):
    # Rank 0 posts an all_reduce and then blocks on something else (the store, another
    # group) that the other ranks provide only once that all_reduce finished: the call must
    # start without Work.wait, as on Gloo.
    store = dist.distributed_c10d._get_default_store()
    other = dist.new_group(list(range(world)), backend="torchpar")
    t = torch.ones(8)
    if rank == 0:
        w = dist.all_reduce(t, async_op=True)
        store.get("all_reduce_done")  # set by rank 1 after its all_reduce
        u = torch.ones(2)
        dist.all_reduce(u, group=other)  # the others' second group call follows the first
        w.wait()
    else:
        dist.all_reduce(t)
        if rank == 1:
            store.set("all_reduce_done", "1")
        u = torch.ones(2)
        dist.all_reduce(u, group=other)
    _eq(t, torch.full((8,), float(world)), "all_reduce nobody waited for")
    _eq(u, torch.full((2,), float(world)), "the other group's all_reduce")


def test_unwaited_call_progresses(tmp_path):
    run_job(_unwaited_progress, 3, tmp_path=tmp_path)


def _monitored(rank, world, absent):
    # Through the process group (torch.distributed.monitored_barrier itself admits gloo only).
    # A failed monitored barrier leaves Gloo's pairs with the absent ranks closed, as Gloo's
    # own does: one failing round per job.
    pg = dist.distributed_c10d._get_default_group()
    store = dist.distributed_c10d._get_default_store()
    two_s = datetime.timedelta(seconds=2)
    pg.monitored_barrier(two_s)
    pg.monitored_barrier(two_s, wait_all_ranks=True)
    if rank == 0:
        want = (f"Rank {absent[0]} failed to pass monitoredBarrier" if len(absent) == 1 else
                "Ranks " + ", ".join(map(str, absent)) + " failed to pass monitoredBarrier")
        with pytest.raises(RuntimeError, match=want):
            pg.monitored_barrier(datetime.timedelta(seconds=1),
                                 wait_all_ranks=len(absent) > 1)
    elif rank not in absent:
        with pytest.raises(RuntimeError, match=f"Rank {rank} successfully reached "
                                               "monitoredBarrier, but received errors while "
                                               "waiting for send/recv from rank 0"):
            pg.monitored_barrier(datetime.timedelta(seconds=1))
    store.add("done", 1)  # a store barrier: the absent ranks stay until the others are done
    while store.add("done", 0) < world:
        time.sleep(0.01)


@pytest.mark.parametrize("absent", [[1], [1, 2]])
def test_monitored_barrier(absent, tmp_path):
    run_job(_monitored, 3, absent, tmp_path=tmp_path)


# ---- across "hosts": hierarchical ------------------------------------------------------------

def _become_another_host(rank):
    """Rank 2 becomes a host of its own for torchpar (whose host key includes /dev/shm's
    device): a private mount namespace with a fresh tmpfs on /dev/shm (needs CAP_SYS_ADMIN),
    as tests/dist/collective_test.cpp does."""
    if rank != 2:
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    ms_nosuid, ms_nodev, ms_rec, ms_private, clone_newns = 2, 4, 16384, 1 << 18, 0x20000
    if (libc.unshare(clone_newns) != 0
            or libc.mount(None, b"/", None, ms_rec | ms_private, None) != 0
            or libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", ms_nosuid | ms_nodev,
                          b"size=64m,mode=1777") != 0):
        raise OSError(ctypes.get_errno(), "cannot make a private /dev/shm")


def _can_become_another_host():
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_become_another_host, args=(2,))
    p.start()
    p.join(10)
    return p.exitcode == 0


def _hierarchical_ops(rank, world):
    _expect(tpd.collective_backend() == "hierarchical", tpd.collective_backend())
    for dtype in (torch.float32, torch.int64):
        _reductions(rank, world, dtype)
        _gathers(rank, world, dtype)
        _exchanges(rank, world, dtype)
        _point_to_point(rank, world, dtype)
    ours = _train(rank, "torchpar")
    every = [torch.zeros_like(ours) for _ in range(world)]
    dist.all_gather(every, ours)
    for r in range(world):
        _eq(every[r], ours, f"rank {r}'s parameters after DDP across hosts")


def test_across_hosts_hierarchical(tmp_path):
    """Hosts {0, 1} and {2}: every op and DDP on the hierarchical backend."""
    if not _can_become_another_host():
        pytest.skip("needs CAP_SYS_ADMIN for a private /dev/shm")
    run_job(_hierarchical_ops, 3, store="tcp", prepare=_become_another_host)


# ---- DDP -----------------------------------------------------------------------------------

def _train(rank, backend, steps=5):
    """A few DDP steps of nn.Linear(8, 4) on `backend` (an initialized default group);
    returns the flat parameters."""
    torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts rank 0's anyway)
    model = torch.nn.Linear(8, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ddp_vs_gloo(rank, world, gloo_init):
    ours = _train(rank, "torchpar")
    every = [torch.zeros_like(ours) for _ in range(world)]
    dist.all_gather(every, ours)
    for r in range(world):
        _eq(every[r], ours, f"rank {r}'s parameters after DDP on torchpar")
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=gloo_init, rank=rank, world_size=world)
    theirs = _train(rank, "gloo")
    _expect(torch.allclose(ours, theirs, atol=1e-6),
            f"torchpar and gloo differ by {(ours - theirs).abs().max().item()}")
    _expect(not torch.equal(ours, _train_untrained()), "the model trained")
    # _rank_main destroys the (gloo) default group.


def _train_untrained():
    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in torch.nn.Linear(8, 4).parameters()])


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_gloo(world, tmp_path):
    run_job(_ddp_vs_gloo, world, "file://" + str(tmp_path / "gloo_store"), tmp_path=tmp_path)


# ---- faults --------------------------------------------------------------------------------

def _killed_mid_all_reduce(rank, world, report):
    t = torch.ones(1 << 16)
    dist.all_reduce(t)  # every rank is in
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    w = dist.all_reduce(t, async_op=True)
    try:
        w.wait()
    except RuntimeError as e:
        with open(report / f"rank{rank}", "w") as f:
            f.write(f"{time.monotonic() - start:.3f}\n{type(e).__name__}\n{e}")
        # A Future first asked for after the call failed carries its error.
        try:
            w.get_future().wait()
            late = "the late future completed without an error"
        except RuntimeError as f:
            late = str(f)
        (report / f"rank{rank}.future").write_text(late)
        return
    raise AssertionError("all_reduce with a killed rank returned")


@pytest.mark.parametrize("world", [2, 3])
def test_killed_rank_raises_naming_it(world, tmp_path):
    report = tmp_path / "reports"
    report.mkdir()
    codes = run_job(_killed_mid_all_reduce, world, report, tmp_path=tmp_path, timeout_s=10.0,
                    expect=[0] * (world - 1) + [-signal.SIGKILL])
    assert codes[-1] == -signal.SIGKILL
    for r in range(world - 1):
        took, kind, msg = (report / f"rank{r}").read_text().split("\n", 2)
        assert float(took) < 10.0, f"rank {r} took {took} s"
        assert kind == "PeerLostError" and issubclass(torchpar.PeerLostError, RuntimeError)
        assert f"rank {world - 1}" in msg, msg
        late = (report / f"rank{r}.future").read_text()
        assert f"rank {world - 1}" in late, late


def _stopped_rank(rank, world, report):
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent SIGCONTs and kills it
        return
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except torchpar.TimeoutError as e:
        with open(report / "rank0", "w") as f:
            f.write(f"{time.monotonic() - start:.3f}\n{e}")
        os._exit(0)  # destroy_process_group would wait for the stopped rank's store
    raise AssertionError("all_reduce with a stopped rank returned")


def test_stopped_rank_times_out(tmp_path):
    report = tmp_path / "reports"
    report.mkdir()
    ctx = multiprocessing.get_context("fork")
    init = "file://" + str(tmp_path / "store")
    procs = [ctx.Process(target=_rank_main, args=(_stopped_rank, r, 2, init, 3.0, (report,)))
             for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(JOB_S)
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.join(5)
    assert procs[0].exitcode == 0
    took, msg = (report / "rank0").read_text().split("\n", 1)
    assert 2.0 < float(took) < 10.0, f"took {took} s: {msg}"
    assert re.search(" (Timed out|closed|timeout) ", msg), msg  # c10d's words, as Gloo's
    assert isinstance(torchpar.TimeoutError("x"), RuntimeError)
