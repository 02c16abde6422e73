"""Queue, SimpleQueue and JoinableQueue of torchpar.multiprocessing against Python's.

The semantic tests run the same body on torchpar's context of each start method and on
multiprocessing's own context (the reference): block/timeout raising queue.Full and
queue.Empty, maxsize, qsize/empty/full, the _nowait forms, close() then ValueError,
join_thread's assertion, JoinableQueue's task_done/join. The cross-process tests run a
child under fork and spawn. The GIL test shows a waiting get lets other threads run.
"""
import multiprocessing
import queue
import threading
import time

import pytest
import torch

import torchpar
import torchpar.multiprocessing as tmp

import tp_helpers
from tp_helpers import WAIT_S


@pytest.fixture(params=["torchpar-fork", "torchpar-spawn", "torchpar-forkserver", "python"])
def qctx(request):
    """A context whose queues are torchpar's (per start method) or Python's own."""
    if request.param == "python":
        return multiprocessing.get_context("fork")
    return tmp.get_context(request.param.split("-")[1])


def is_torchpar(c):
    return isinstance(c, tmp.TorchparContext)


def test_context_types(any_ctx):
    import multiprocessing.context as mpc
    assert isinstance(any_ctx, mpc.BaseContext)
    assert any_ctx.get_start_method() in ("fork", "spawn", "forkserver")
    assert type(any_ctx.Queue()).__module__ == "torchpar.multiprocessing.queues"
    assert type(any_ctx.Pipe()[0]).__module__ == "torchpar.multiprocessing.connection"


def test_put_get_fifo(qctx):
    q = qctx.Queue()
    items = [1, "two", (3.0, None), {"k": [4]}, b"5" * 100]
    for x in items:
        q.put(x)
    assert [q.get(timeout=WAIT_S) for _ in items] == items


def test_get_timeout_raises_empty(qctx):
    q = qctx.Queue()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.3)
    waited = time.monotonic() - t0
    assert 0.25 <= waited < 1.5, waited
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(block=False)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(True, -1)  # a negative timeout counts as 0
    assert time.monotonic() - t0 < 0.5


def test_maxsize_full(qctx):
    q = qctx.Queue(maxsize=2)
    assert q.empty() and not q.full()
    q.put(1)
    q.put_nowait(2)
    # Python's qsize and full count at put; its empty() waits for the feeder thread.
    # torchpar's put writes before it returns, so empty() is exact at once.
    assert q.qsize() == 2 and q.full()
    if is_torchpar(qctx):
        assert not q.empty()
    t0 = time.monotonic()
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.3)
    assert 0.25 <= time.monotonic() - t0 < 1.5
    with pytest.raises(queue.Full):
        q.put(3, block=False)
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    assert q.get(timeout=WAIT_S) == 1
    q.put(3, timeout=WAIT_S)
    assert [q.get(timeout=WAIT_S), q.get(timeout=WAIT_S)] == [2, 3]
    with pytest.raises(queue.Empty):
        q.get_nowait()
    assert q.qsize() == 0


def test_unbounded_takes_many(qctx):
    q = qctx.Queue()
    for i in range(2000):
        q.put_nowait(i)
    assert q.qsize() == 2000 and not q.full()
    assert sum(q.get(timeout=WAIT_S) for _ in range(2000)) == sum(range(2000))


def test_close_then_put_get_raise_value_error(qctx):
    q = qctx.Queue()
    q.put(1)
    q.get(timeout=WAIT_S)
    with pytest.raises(AssertionError):
        q.join_thread()  # only after close(), as Python asserts
    q.close()
    with pytest.raises(ValueError):
        q.put(2)
    with pytest.raises(ValueError):
        q.get(timeout=0.1)
    q.join_thread()
    q.cancel_join_thread()
    if is_torchpar(qctx):
        with pytest.raises(torchpar.ClosedError):
            q.get_nowait()


def test_simple_queue(qctx):
    q = qctx.SimpleQueue()
    assert q.empty()
    q.put([1, 2])
    q.put(torch.arange(3))
    assert q.get() == [1, 2]
    assert torch.equal(q.get(), torch.arange(3))
    assert q.empty()
    q.close()


def test_joinable_task_done(qctx):
    q = qctx.JoinableQueue()
    with pytest.raises(ValueError, match="task_done\\(\\) called too many times"):
        q.task_done()
    q.put(1)
    q.put(2)
    q.get(timeout=WAIT_S)
    q.task_done()
    joined = threading.Event()
    t = threading.Thread(target=lambda: (q.join(), joined.set()), daemon=True)
    t.start()
    assert not joined.wait(0.2), "join returned with a task unfinished"
    q.get(timeout=WAIT_S)
    q.task_done()
    assert joined.wait(WAIT_S)
    t.join(WAIT_S)
    q.join()  # nothing unfinished: returns at once
    with pytest.raises(ValueError, match="too many times"):
        q.task_done()


def test_joinable_across_processes(ctx):
    q = ctx.JoinableQueue()
    for i in range(5):
        q.put(torch.full((3,), float(i)))
    p = tp_helpers.start(ctx, tp_helpers.joinable_worker, q, 5)
    done = threading.Event()
    t = threading.Thread(target=lambda: (q.join(), done.set()), daemon=True)
    t.start()
    assert done.wait(WAIT_S), "join did not return after the child's task_done calls"
    t.join(WAIT_S)
    assert tp_helpers.finish(p) == 0


def test_cross_process_round_trip(ctx):
    """Objects of every kind go to a child and come back equal, in order, both ways."""
    q_in, q_out = ctx.Queue(), ctx.Queue(maxsize=4)
    p = tp_helpers.start(ctx, tp_helpers.echo, q_in, q_out, "file_system")
    items = [0, "text", {"nested": [1, (2, 3)]}, torch.arange(6).view(2, 3),
             torch.tensor(3.5), torch.empty(0), torch.ones(5, dtype=torch.bool),
             torch.randn(64, 64), b"x" * 100_000]
    got = []
    for x in items:  # maxsize 4 on the way back: the child blocks in put until we get
        q_in.put(x)
        got.append(tp_helpers.get_from(q_out, p))
    q_in.put(None)
    assert tp_helpers.finish(p) == 0
    for x, y in zip(items, got):
        if isinstance(x, torch.Tensor):
            assert type(y) is torch.Tensor and y.dtype == x.dtype and torch.equal(x, y)
        else:
            assert x == y


def test_get_releases_the_gil():
    """Another Python thread counts on while Queue.get(timeout=2) waits in this one."""
    q = tmp.get_context("fork").Queue()
    stop, counter = threading.Event(), [0]
    t = threading.Thread(target=tp_helpers.busy_count, args=(stop, counter), daemon=True)
    t.start()
    try:
        # Baseline: the rate while this thread waits on an Event (which releases the GIL).
        c0 = counter[0]
        stop.wait(0.5)
        base_rate = (counter[0] - c0) / 0.5
        c0, t0 = counter[0], time.monotonic()
        with pytest.raises(queue.Empty):
            q.get(timeout=2)
        waited = time.monotonic() - t0
        rate = (counter[0] - c0) / waited
    finally:
        stop.set()
        t.join(WAIT_S)
    assert 1.9 <= waited < 3.0, waited
    assert base_rate > 0
    # Holding the GIL for the whole wait would leave the counter nearly still; the wait
    # takes the GIL only briefly every 100 ms (to run signal handlers).
    assert rate > 0.3 * base_rate, (rate, base_rate)
