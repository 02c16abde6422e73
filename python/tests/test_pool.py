"""torchpar.multiprocessing.Pool: multiprocessing.Pool's surface, and the dead-worker case.

Every method under fork and spawn (one pool per start method for the module: spawn workers
import torch once), errors with their type, message and remote traceback, callbacks,
AsyncResult's get/wait/ready/successful, maxtasksperchild, close/join and terminate leaving
no process behind, and the case CPython's pool hangs on: a worker killed with SIGKILL in
the middle of a task fails that task with torchpar.WorkerLostError within a second, and the
pool goes on serving. Task bodies are module-level functions: spawn children import them.
"""
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

import torchpar
import torchpar.multiprocessing as tmp

import tp_helpers

#: Seconds any single wait of a test may take before the test counts it as hung.
WAIT_S = 30.0

_started = None   # a worker's queue to announce the tasks it starts (initializer)


def square(x):
    return x * x


def add(a, b):
    return a + b


def kw(a, b=0, *, c=0):
    return (a, b, c)


def fail_on_3(x):
    if x == 3:
        raise KeyError(f"bad item {x}")
    return x


def getpid(_=None):
    return os.getpid()


def get_from(q):
    return q.get(timeout=WAIT_S)


def tensor_sum(t):
    return float(t.sum())


def unpicklable(_=None):
    return threading.Lock()


def exit_with(code):
    os._exit(code)


def init_announce(q):
    global _started
    _started = q


def announce_and_block(tag):
    """Tells the test which worker runs `tag` (its pid), then blocks until killed."""
    _started.put((tag, os.getpid()))
    threading.Event().wait(60)
    return tag


def announce_and_return(tag):
    _started.put((tag, os.getpid()))
    return tag


def init_set(value):
    global _started
    _started = value


def read_init(_=None):
    return _started


def track(p):
    """Records the pool's workers as children of the test run (test_zz_leaks.py checks that
    none is left and that no /dev/shm name of theirs outlives them); returns `p`."""
    tp_helpers.CHILD_PIDS.update(w.pid for w in p._pool)
    return p


@pytest.fixture(scope="module", params=["fork", "spawn"])
def pool(request):
    """A 2-worker pool of each start method, shared by the tests that do not break it."""
    p = tmp.get_context(request.param).Pool(2)
    p.apply(square, (1,))   # workers up (spawn imports torch)
    yield p
    p.close()
    p.join()
    track(p)   # after they exited: the per-test guard fails a test that leaves one running
    assert not any(w.is_alive() for w in p._pool)


@pytest.fixture(params=["fork", "spawn"])
def ctx(request):
    return tmp.get_context(request.param)


# ----------------------------------------------------------------------------- surface

def test_apply_and_apply_async(pool):
    assert pool.apply(add, (2, 3)) == 5
    assert pool.apply(kw, (1,), {"b": 2, "c": 3}) == (1, 2, 3)
    r = pool.apply_async(square, (7,))
    assert r.get(WAIT_S) == 49
    assert r.ready() and r.successful()
    results = [pool.apply_async(square, (i,)) for i in range(500)]
    assert [r.get(WAIT_S) for r in results] == [i * i for i in range(500)]


@pytest.mark.parametrize("chunksize", [None, 1, 7])
def test_map_starmap(pool, chunksize):
    assert pool.map(square, range(1000), chunksize) == [i * i for i in range(1000)]
    assert pool.map(square, (i for i in range(10)), chunksize) == [i * i for i in range(10)]
    assert pool.map(square, []) == []
    pairs = [(i, 2 * i) for i in range(300)]
    assert pool.starmap(add, pairs, chunksize) == [3 * i for i in range(300)]
    assert pool.map_async(square, range(50), chunksize).get(WAIT_S) == [
        i * i for i in range(50)]
    assert pool.starmap_async(add, pairs, chunksize).get(WAIT_S) == [3 * i for i in range(300)]


@pytest.mark.parametrize("chunksize", [1, 5])
def test_imap_imap_unordered(pool, chunksize):
    assert list(pool.imap(square, range(1000), chunksize)) == [i * i for i in range(1000)]
    assert list(pool.imap(square, iter(range(3)))) == [0, 1, 4]
    assert list(pool.imap(square, [])) == []
    assert sorted(pool.imap_unordered(square, iter(range(500)), chunksize)) == [
        i * i for i in range(500)]
    it = pool.imap(square, range(3))
    assert [it.next(WAIT_S), next(it), it.next(timeout=WAIT_S)] == [0, 1, 4]
    with pytest.raises(StopIteration):
        next(it)


def test_tensors_travel(pool):
    ts = [torch.full((100,), float(i)) for i in range(10)]
    assert pool.map(tensor_sum, ts) == [100.0 * i for i in range(10)]
    assert pool.apply(tensor_sum, (torch.ones(3, 4),)) == 12.0


def test_async_result_states(pool):
    q = tmp.Queue()
    r = pool.apply_async(get_from, (q,))   # runs until the test puts
    with pytest.raises(ValueError):
        r.successful()
    assert not r.ready()
    with pytest.raises(multiprocessing.TimeoutError):
        r.get(timeout=0.01)
    r.wait(0.01)
    assert not r.ready()
    q.put("go")
    r.wait(WAIT_S)
    assert r.ready() and r.successful() and r.get() == "go"


def test_callbacks(pool):
    got, errs = [], []
    done = threading.Event()
    r = pool.apply_async(square, (4,), callback=got.append, error_callback=errs.append)
    assert r.get(WAIT_S) == 16 and got == [16] and errs == []
    r = pool.apply_async(fail_on_3, (3,), callback=got.append, error_callback=errs.append)
    with pytest.raises(KeyError):
        r.get(WAIT_S)
    assert got == [16] and len(errs) == 1 and isinstance(errs[0], KeyError)
    m = pool.map_async(square, range(5), callback=lambda v: (got.append(v), done.set()))
    assert m.get(WAIT_S) == [0, 1, 4, 9, 16]
    assert done.wait(WAIT_S) and got[-1] == [0, 1, 4, 9, 16]
    m = pool.starmap_async(add, [(1, 2), (3, "x")], error_callback=errs.append)
    with pytest.raises(TypeError):
        m.get(WAIT_S)
    assert isinstance(errs[-1], TypeError)
    m = pool.map_async(square, [], callback=got.append)
    assert m.get(WAIT_S) == [] and got[-1] == []


def test_errors(pool):
    with pytest.raises(KeyError, match="bad item 3") as info:
        pool.apply(fail_on_3, (3,))
    cause = info.value.__cause__
    assert type(cause).__name__ == "RemoteTraceback" and "fail_on_3" in str(cause)
    with pytest.raises(KeyError, match="bad item 3"):
        pool.map(fail_on_3, range(10), chunksize=1)
    # imap raises at the failed position and goes on.
    it = pool.imap(fail_on_3, range(6))
    out = []
    for _ in range(6):
        try:
            out.append(next(it))
        except KeyError:
            out.append("KeyError")
    assert out == [0, 1, 2, "KeyError", 4, 5]
    with pytest.raises(multiprocessing.pool.MaybeEncodingError):
        pool.apply(unpicklable)
    with pytest.raises(Exception):   # the function itself does not pickle
        pool.apply(lambda: 1)
    assert pool.apply(square, (3,)) == 9   # the pool still serves


def test_arguments_checked(ctx):
    with pytest.raises(ValueError):
        ctx.Pool(0)
    with pytest.raises(ValueError):
        ctx.Pool(1, maxtasksperchild=0)
    with pytest.raises(TypeError):
        ctx.Pool(1, initializer=3)


def test_initializer(ctx):
    with track(ctx.Pool(2, initializer=init_set, initargs=("hello",))) as p:
        assert p.map(read_init, range(4)) == ["hello"] * 4


def test_module_level_pool():
    with track(tmp.Pool(1)) as p:
        assert p.apply(square, (5,)) == 25
    assert isinstance(p, tmp.pool.Pool)


# ----------------------------------------------------------------------------- lifetimes

def assert_gone(procs):
    for w in procs:
        w.join(WAIT_S)
        assert not w.is_alive()
    pids = {w.pid for w in procs}
    assert not pids & {c.pid for c in multiprocessing.active_children()}


def test_close_join(ctx):
    p = track(ctx.Pool(2))
    r = p.map_async(square, range(100))
    procs = p._pool
    p.close()
    with pytest.raises(ValueError):
        p.apply_async(square, (1,))
    p.join()
    assert r.get(0) == [i * i for i in range(100)]
    assert_gone(procs)


def test_join_while_running_is_value_error(ctx):
    p = track(ctx.Pool(1))
    with pytest.raises(ValueError):
        p.join()
    p.terminate()
    p.join()


def test_terminate_with_tasks_in_flight(ctx):
    q = ctx.SimpleQueue()
    p = track(ctx.Pool(2, initializer=init_announce, initargs=(q,)))
    procs = p._pool
    r = p.map_async(announce_and_block, range(10), chunksize=1)
    q.get()   # a task is running
    t0 = time.monotonic()
    p.terminate()
    assert time.monotonic() - t0 < 5
    with pytest.raises(torchpar.ClosedError):
        r.get(WAIT_S)
    p.join()
    assert_gone(procs)


def test_context_manager_terminates(ctx):
    with track(ctx.Pool(2)) as p:
        procs = p._pool
        assert p.apply(square, (2,)) == 4
    assert_gone(procs)
    with pytest.raises(ValueError):
        p.apply(square, (2,))


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_maxtasksperchild(method):
    # forkserver rather than spawn: a spawned replacement imports torch (seconds each on a
    # loaded machine); forkserver's children come from a server that preloaded it.
    ctx = tmp.get_context(method)
    p = track(ctx.Pool(2, maxtasksperchild=2))
    first = {w.pid for w in p._pool}
    pids = [p.apply(getpid) for _ in range(5)]
    assert all(pids.count(x) <= 2 for x in pids)
    assert len(set(pids) - first) >= 1      # 5 tasks, 2 a worker: a replacement ran some
    assert p.map(square, range(3), chunksize=1) == [0, 1, 4]
    p.close()
    p.join()
    assert_gone(p._pool)


# ----------------------------------------------------------------------------- dead workers

def test_sigkill_fails_the_task_and_pool_goes_on(ctx):
    q = ctx.SimpleQueue()
    p = track(ctx.Pool(2, initializer=init_announce, initargs=(q,)))
    try:
        assert p.apply(square, (3,)) == 9
        before = {w.pid for w in p._pool}
        r = p.apply_async(announce_and_block, ("victim",))
        tag, pid = q.get()
        assert tag == "victim" and pid in before
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(torchpar.WorkerLostError) as info:
            r.get(WAIT_S)
        assert time.monotonic() - t0 < 1.0
        msg = str(info.value)
        assert str(pid) in msg and "SIGKILL" in msg and "signal 9" in msg
        assert isinstance(info.value, torchpar.PeerLostError)
        # The pool goes on: a replacement worker, and every task of a map served.
        assert p.map(square, range(200), chunksize=1) == [i * i for i in range(200)]
        after = {w.pid for w in p._pool}
        assert pid not in after and len(after) == 2
    finally:
        p.terminate()
        p.join()


def test_sigkill_in_a_map_fails_only_that_task(ctx):
    q = ctx.SimpleQueue()
    p = track(ctx.Pool(2, initializer=init_announce, initargs=(q,)))
    try:
        # Each task announces itself; task 5 blocks until killed. imap shows per-task
        # outcomes: only item 5 fails, the others (before, with or after it) complete.
        it = p.imap(announce_and_block_on_5, range(40), chunksize=1)
        while True:
            tag, pid = q.get()
            if tag == 5:
                break
        os.kill(pid, signal.SIGKILL)
        out = []
        for _ in range(40):
            try:
                out.append(it.next(WAIT_S))
            except torchpar.WorkerLostError as e:
                out.append(str(e))
        assert out[:5] == list(range(5)) and out[6:] == list(range(6, 40))
        assert f"pool worker {pid} died (signal 9, SIGKILL)" in out[5]
        assert p.apply(square, (4,)) == 16
    finally:
        p.terminate()
        p.join()


def announce_and_block_on_5(x):
    _started.put((x, os.getpid()))
    if x == 5:
        threading.Event().wait(60)
    return x


def test_worker_exit_fails_with_exit_code(ctx):
    with track(ctx.Pool(1)) as p:
        with pytest.raises(torchpar.WorkerLostError, match="exit code 7"):
            p.apply(exit_with, (7,))
        assert p.apply(square, (6,)) == 36
