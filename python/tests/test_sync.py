"""torchpar's Lock, RLock, Semaphore, BoundedSemaphore, Condition, Event, Barrier, Value and
Array (synchronize.py, sharedctypes.py) across real processes, with the fault cases: a
holder killed (RLock recovered, owner_died), a holder stopped (timeouts still fire), a party
killed at a Barrier (BrokenBarrierError in time), and waits that leave the GIL to other
threads.
"""
import os
import signal
import threading
import time

import pytest

import torchpar.multiprocessing as tmp

import tp_helpers
from tp_helpers import WAIT_S

#: Seconds within which a wait that times out (after 0.2-0.5 s) must have returned: far from
#: a hang, loose enough for a loaded CI machine (load 13 seen).
SLACK_S = 5.0


# ---- children (module level: spawn imports them by name) --------------------------------

def _hold(lock, held, release):
    lock.acquire()
    held.set()
    release.wait(WAIT_S)
    lock.release()


def _hold_forever(lock, held):
    lock.acquire()
    held.set()
    time.sleep(WAIT_S * 4)


def _add(value, array, n):
    for _ in range(n):
        with value.get_lock():
            value.value += 1
        with array.get_lock():
            array[0] += 1.0


def _wait_cond(cond, ready, woken, timeout):
    with cond:
        ready.release()
        if cond.wait(timeout):
            woken.release()


def _at_barrier(barrier, out):
    out.put(barrier.wait(WAIT_S))


def _release_lock(lock):
    lock.release()


# ---- semantics ------------------------------------------------------------------------

def test_lock_any_process_may_release(ctx):
    """multiprocessing.Lock: held here, released by a child; releasing it again raises
    ValueError; acquire(False) on a held Lock is False (not recursive)."""
    lock = ctx.Lock()
    assert lock.acquire()
    assert lock.acquire(False) is False
    tp_helpers.finish(tp_helpers.start(ctx, _release_lock, lock))
    assert lock.acquire(timeout=WAIT_S)
    lock.release()
    with pytest.raises(ValueError):
        lock.release()


def test_rlock_recursion_and_owner():
    lock = tmp.RLock()
    assert lock.acquire() and lock.acquire()
    lock.release()
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()
    # held by another thread: this one cannot release it, and acquire(timeout) times out
    held, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_hold, args=(lock, held, release))
    t.start()
    try:
        assert held.wait(WAIT_S)
        with pytest.raises(RuntimeError):
            lock.release()
        t0 = time.monotonic()
        assert lock.acquire(timeout=0.3) is False
        assert 0.25 <= time.monotonic() - t0 < SLACK_S
    finally:
        release.set()
        t.join(WAIT_S)
    assert lock.acquire(timeout=WAIT_S)
    lock.release()


def test_semaphores():
    sem = tmp.Semaphore(2)
    assert sem.acquire() and sem.acquire() and sem.acquire(False) is False
    assert sem.get_value() == 0
    sem.release()
    assert sem.get_value() == 1
    bounded = tmp.BoundedSemaphore(1)
    with pytest.raises(ValueError):
        bounded.release()
    with pytest.raises(ValueError):
        tmp.Semaphore(-1)
    t0 = time.monotonic()
    assert tmp.Semaphore(0).acquire(timeout=0.3) is False
    assert 0.25 <= time.monotonic() - t0 < SLACK_S


def test_value_array_counted_by_children(ctx):
    """Two children add 200 each under get_lock(): no update is lost."""
    value, array = ctx.Value("i", 0), ctx.Array("d", [0.0, 7.0])
    ps = [tp_helpers.start(ctx, _add, value, array, 200) for _ in range(2)]
    for p in ps:
        tp_helpers.finish(p)
    assert value.value == 400 and array[:] == [400.0, 7.0]
    raw = ctx.RawArray("i", 3)
    assert list(raw) == [0, 0, 0]
    assert not hasattr(ctx.Value("i", 1, lock=False), "get_lock")


def test_condition_notify_wakes_exactly_n(ctx):
    """Three children wait; notify(2) wakes two, notify_all the last; a wait with a timeout
    and no notify returns False."""
    cond = ctx.Condition()
    ready, woken = ctx.Semaphore(0), ctx.Semaphore(0)
    ps = [tp_helpers.start(ctx, _wait_cond, cond, ready, woken, WAIT_S) for _ in range(3)]
    try:
        for _ in range(3):
            assert ready.acquire(timeout=WAIT_S)
        with cond:  # each child released `ready` holding the lock: all three wait now
            cond.notify(2)
        for _ in range(2):
            assert woken.acquire(timeout=WAIT_S)
        assert woken.acquire(timeout=0.3) is False
        with cond:
            cond.notify_all()
        assert woken.acquire(timeout=WAIT_S)
    finally:
        for p in ps:
            tp_helpers.finish(p)
    with cond:
        t0 = time.monotonic()
        assert cond.wait(0.2) is False
        assert time.monotonic() - t0 >= 0.15
    with pytest.raises(RuntimeError):
        cond.notify()


def test_condition_over_a_plain_lock():
    cond = tmp.Condition(tmp.Lock())
    box = []

    def waiter():
        with cond:
            box.append(cond.wait_for(lambda: len(box) == 1, WAIT_S))

    t = threading.Thread(target=waiter)
    with cond:
        t.start()
    tp_helpers.wait_until_blocked_in(t.ident, "wait")
    with cond:
        box.append("go")
        cond.notify()
    t.join(WAIT_S)
    assert box == ["go", True]


def test_barrier_action_and_index(ctx):
    out = ctx.Queue()
    barrier = ctx.Barrier(3, action=None, timeout=WAIT_S)
    ps = [tp_helpers.start(ctx, _at_barrier, barrier, out) for _ in range(2)]
    mine = barrier.wait()
    got = sorted([mine] + [out.get(timeout=WAIT_S) for _ in ps])
    for p in ps:
        tp_helpers.finish(p)
    assert got == [0, 1, 2] and not barrier.broken


def test_sync_objects_travel_through_a_queue():
    """Unlike Python's, torchpar's locks and events may be sent through a torchpar queue."""
    q = tmp.Queue()
    ev, lock = tmp.Event(), tmp.Lock()
    q.put((ev, lock))
    ev2, lock2 = q.get(timeout=WAIT_S)
    ev2.set()
    assert ev.is_set()
    assert lock2.acquire() and lock.acquire(False) is False
    lock.release()


# ---- faults ----------------------------------------------------------------------------

def test_rlock_of_killed_holder_is_recovered(ctx):
    """SIGKILL of the process holding an RLock: the next acquire gets it within its timeout
    and says so (owner_died)."""
    lock, held = ctx.RLock(), ctx.Event()
    p = tp_helpers.start(ctx, _hold_forever, lock, held)
    assert held.wait(WAIT_S)
    assert lock.acquire(timeout=0.2) is False
    p.kill()
    p.join(WAIT_S)
    assert lock.acquire(timeout=WAIT_S)
    assert lock.owner_died
    lock.release()
    assert lock.acquire(timeout=WAIT_S) and not lock.owner_died
    lock.release()


def test_timeouts_fire_while_holder_is_stopped(ctx):
    """A child holds a Lock (and so the Condition over it) and is SIGSTOPped:
    Lock.acquire(timeout=0.5) and Condition.acquire(timeout=0.5) each return False in time,
    """
    lock, held = ctx.Lock(), ctx.Event()
    cond = ctx.Condition(lock)
    p = tp_helpers.start(ctx, _hold_forever, lock, held)
    try:
        assert held.wait(WAIT_S)
        tp_helpers.stop(p.pid)
        for call in (lambda: lock.acquire(timeout=0.5), lambda: cond.acquire(True, 0.5)):
            t0 = time.monotonic()
            assert call() is False
            assert 0.45 <= time.monotonic() - t0 < SLACK_S
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.join(WAIT_S)


def test_barrier_with_a_killed_party_breaks_in_time(ctx):
    """A party is killed before it arrives: the others get BrokenBarrierError when the
    barrier's timeout passes, not a hang."""
    barrier, held = ctx.Barrier(2, timeout=0.5), ctx.Event()
    lock = ctx.Lock()
    p = tp_helpers.start(ctx, _hold_forever, lock, held)
    assert held.wait(WAIT_S)
    p.kill()
    p.join(WAIT_S)
    t0 = time.monotonic()
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait()
    assert time.monotonic() - t0 < SLACK_S
    assert barrier.broken


@pytest.mark.parametrize("kind", ["Lock.acquire", "Event.wait", "Condition.wait"])
def test_waits_release_the_gil(kind):
    """While one thread waits, another Python thread keeps counting."""
    lock, ev, cond = tmp.Lock(), tmp.Event(), tmp.Condition()
    lock.acquire()

    def wait():
        if kind == "Lock.acquire":
            lock.acquire(timeout=1.0)
        elif kind == "Event.wait":
            ev.wait(1.0)
        else:
            with cond:
                cond.wait(1.0)

    stop, counter = threading.Event(), [0]
    t = threading.Thread(target=wait)
    c = threading.Thread(target=tp_helpers.busy_count, args=(stop, counter))
    t.start()
    c.start()
    time.sleep(0.5)
    seen = counter[0]
    stop.set()
    c.join(WAIT_S)
    t.join(WAIT_S)
    assert seen > 1000, f"the counting thread ran {seen} times in 0.5 s"
