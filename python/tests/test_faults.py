"""The fault cases of issue 39: a queue peer stopped (SIGSTOP) or killed (SIGKILL) in the
middle of its puts and gets, close() from another thread waking a blocked get, a child that
exits before the parent loads its tensor (file_system and file_descriptor), and Ctrl-C
interrupting a blocked get. Each must end in bounded time with a clear Python exception,
never a hang or a crash.
"""
import os
import queue
import signal
import threading
import time

import pytest
import torch

import torchpar
import torchpar.multiprocessing as tmp

import tp_helpers
from tp_helpers import WAIT_S

#: Each round stops the peer at a different point of its loop.
STOP_ROUNDS = 4


def _timed_get(q, timeout):
    """(item or queue.Empty, seconds the get took)."""
    t0 = time.monotonic()
    try:
        item = q.get(timeout=timeout)
    except queue.Empty as e:
        item = e
    return item, time.monotonic() - t0


def test_sigstop_of_putter(ctx):
    """A child putting as fast as it can is SIGSTOPped wherever it is (inside put holding
    the ring, or waiting for room); the parent drains what is there and get(timeout=0.5)
    raises queue.Empty within 1.5 s. After SIGCONT the queue goes on."""
    q = ctx.Queue(maxsize=8)
    ready = ctx.Event()
    p = tp_helpers.start(ctx, tp_helpers.put_forever, q, ready, "file_descriptor")
    try:
        assert ready.wait(WAIT_S)
        last = -1
        for _ in range(STOP_ROUNDS):
            item, _ = _timed_get(q, WAIT_S)  # the child is putting now
            assert not isinstance(item, queue.Empty)
            tp_helpers.stop(p.pid)
            for _ in range(9):  # at most maxsize items, then Empty
                item, took = _timed_get(q, 0.5)
                assert took < 1.5, f"get(timeout=0.5) took {took:.2f} s with the peer stopped"
                if isinstance(item, queue.Empty):
                    assert took >= 0.45
                    break
                i, t = item
                assert i > last and torch.equal(t, torch.full((4,), float(i)))
                last = i
            else:
                raise AssertionError("the stopped child kept putting")
            os.kill(p.pid, signal.SIGCONT)
        item, _ = _timed_get(q, WAIT_S)
        assert not isinstance(item, queue.Empty) and item[0] > last
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.join(WAIT_S)


def test_sigstop_of_getter():
    """A child getting as fast as it can is SIGSTOPped; the parent's put(timeout=0.5) and
    get(timeout=0.5) each return within 1.5 s (done, queue.Full or queue.Empty). Fork only:
    the start method changes nothing here that test_sigstop_of_putter does not cover."""
    ctx = tmp.get_context("fork")
    q = ctx.Queue(maxsize=4)
    ready = ctx.Event()
    p = tp_helpers.start(ctx, tp_helpers.get_forever, q, ready)
    try:
        assert ready.wait(WAIT_S)
        for r in range(STOP_ROUNDS - 1):
            for i in range(20):
                q.put(torch.full((8,), float(i)), timeout=WAIT_S)
            tp_helpers.stop(p.pid)
            t0 = time.monotonic()
            try:
                for _ in range(5):
                    q.put(r, timeout=0.5)
            except queue.Full:
                pass
            assert time.monotonic() - t0 < 5 * 1.5
            for _ in range(6):
                item, took = _timed_get(q, 0.5)
                assert took < 1.5, f"get(timeout=0.5) took {took:.2f} s with the peer stopped"
                if isinstance(item, queue.Empty):
                    break
            os.kill(p.pid, signal.SIGCONT)
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.join(WAIT_S)


@pytest.mark.parametrize("method,strategy", [("fork", "file_system"),
                                             ("fork", "file_descriptor")])
def test_sigkill_of_putter_leaves_queue_usable(method, strategy):
    """A child killed (SIGKILL) while it puts does not wedge the queue: what it finished
    arrives whole, then queue.Empty in time, and the parent's own put/get work.

    Known (xfail under file_system, measured): the killed child's slab segment keeps its
    /dev/shm name after everything it finished was received: it counts as in flight (held
    up to an hour by torchpar-shm-cleaner). The test unlinks it so the run leaves no name.
    """
    ctx = tmp.get_context(method)
    q = ctx.Queue(maxsize=8)
    ready = ctx.Event()
    p = tp_helpers.start(ctx, tp_helpers.put_forever, q, ready, strategy)
    assert ready.wait(WAIT_S)
    for _ in range(3):
        q.get(timeout=WAIT_S)
    p.kill()
    p.join(WAIT_S)
    assert p.exitcode == -signal.SIGKILL
    for _ in range(9):
        item, took = _timed_get(q, 0.5)
        assert took < 1.5
        if isinstance(item, queue.Empty):
            break
        assert torch.equal(item[1], torch.full((4,), float(item[0])))
    else:
        raise AssertionError("more items than maxsize after the kill")
    q.put("mine", timeout=WAIT_S)
    assert q.get(timeout=WAIT_S) == "mine"
    left = tp_helpers.names_left_after_exit([p.pid])
    tp_helpers.unlink_shm(left)
    if left:
        pytest.xfail(f"known: names of the SIGKILLed putter left in /dev/shm: {left}")


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue", "JoinableQueue"])
def test_close_wakes_blocked_get(kind):
    """close() from another thread wakes a get blocked without a timeout: ValueError (a
    torchpar.ClosedError) within 1 s."""
    q = getattr(tmp.get_context("fork"), kind)()
    main = threading.get_ident()
    closed_at = []

    def closer():
        tp_helpers.wait_until_blocked_in(main, "get")
        closed_at.append(time.monotonic())
        q.close()

    t = threading.Thread(target=closer, daemon=True)
    t.start()
    with pytest.raises(ValueError) as e:
        q.get()
    woke = time.monotonic() - closed_at[0]
    t.join(WAIT_S)
    assert isinstance(e.value, torchpar.ClosedError)
    assert woke < 1.0, f"get woke {woke:.2f} s after close()"


def test_peer_close_wakes_blocked_recv():
    """The peer end closed from another thread wakes a blocked recv with EOFError in 1 s."""
    a, b = tmp.Pipe()
    main = threading.get_ident()
    closed_at = []

    def closer():
        tp_helpers.wait_until_blocked_in(main, "recv")
        closed_at.append(time.monotonic())
        a.close()

    t = threading.Thread(target=closer, daemon=True)
    t.start()
    with pytest.raises(EOFError):
        b.recv()
    t.join(WAIT_S)
    assert time.monotonic() - closed_at[0] < 1.0


def test_child_exits_before_parent_loads(ctx, strategy):
    """A child puts a tensor and a dict of tensors and exits before the parent gets them.

    What happens (measured, and asserted here):
      - file_system: the segment's name stays for its receiver (the cleaner leaves names
        whose handles are in flight): get returns the tensors, equal to what was sent.
      - file_descriptor: the segment was an fd of the dead child; the receiver cannot reach
        it: get raises torchpar.SerializationError, whose message names the cause ("has the
        sending process exited?"). No hang, no crash, and the queue goes on.
    """
    q = ctx.Queue()
    p = tp_helpers.start(ctx, tp_helpers.put_and_exit, q, strategy)
    assert tp_helpers.finish(p) == 0  # exited: nothing of it is left to serve a handle
    expected = torch.arange(1000, dtype=torch.float32)
    if strategy == "file_system":
        t = q.get(timeout=WAIT_S)
        assert torch.equal(t, expected)
        d = q.get(timeout=WAIT_S)
        assert torch.equal(d["t"], expected) and torch.equal(d["more"][0], torch.ones(3))
    else:
        for _ in range(2):
            t0 = time.monotonic()
            with pytest.raises(torchpar.SerializationError, match="sending process exited"):
                q.get(timeout=WAIT_S)
            assert time.monotonic() - t0 < 2.0
    q.put(torch.ones(2))
    assert torch.equal(q.get(timeout=WAIT_S), torch.ones(2))


@pytest.mark.parametrize("call", ["Queue.get", "SimpleQueue.get", "Connection.recv",
                                  "Connection.poll"])
def test_ctrl_c_interrupts_blocked_call(call):
    """SIGINT (Ctrl-C) to this process while it blocks raises KeyboardInterrupt within 1 s."""
    ctx = tmp.get_context("fork")
    if call == "Queue.get":
        obj, name, fn = ctx.Queue(), "get", lambda o: o.get()
    elif call == "SimpleQueue.get":
        obj, name, fn = ctx.SimpleQueue(), "get", lambda o: o.get()
    else:
        a, b = ctx.Pipe()
        obj, name = b, call.split(".")[1]
        fn = (lambda o: o.recv()) if name == "recv" else (lambda o: o.poll(None))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    main = threading.get_ident()
    sent_at = []

    def interrupter():
        tp_helpers.wait_until_blocked_in(main, name)
        sent_at.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=interrupter, daemon=True)
    t.start()
    with pytest.raises(KeyboardInterrupt):
        fn(obj)
    took = time.monotonic() - sent_at[0]
    t.join(WAIT_S)
    assert took < 1.0, f"KeyboardInterrupt came {took:.2f} s after SIGINT"
