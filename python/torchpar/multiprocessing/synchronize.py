"""Lock, RLock, Semaphore, BoundedSemaphore, Condition, Event, Barrier on torchpar.

multiprocessing.synchronize's surface over torchpar's process-shared primitives (torchpar._C,
each a small sealed memfd): futex waits instead of POSIX named semaphores, nothing to unlink
and nothing left in /dev/shm when a process dies. Objects pass to children as Process
arguments under every start method (fork: inherited; spawn, forkserver: the fds are passed
as multiprocessing passes fds) and, unlike Python's, also through torchpar queues and pipes.

Semantics follow Python's:
- Lock is a binary semaphore: any process or thread may release it; releasing an unlocked
  Lock raises ValueError. Its holder's death leaves it locked (as in Python).
- RLock is a robust recursive mutex: only its holder releases it (RuntimeError otherwise,
  as in Python); when the holder dies, the next acquire gets it and `owner_died` is True.
- Condition(lock=None) wraps any of these (default a new RLock); notify(n) wakes exactly
  min(n, waiting) waiters, the longest waiting first, and never blocks (Python's notify
  waits for the woken waiters to run, and hangs when one of them is stopped). At most 1000
  waiters at once.
- Barrier(parties, action=None, timeout=None): threading.Barrier's surface; the action runs
  in whichever process completes a round. A timeout breaks it for every party
  (threading.BrokenBarrierError).
Timeouts are seconds (negative counts as 0; None: no limit). Blocking calls release the GIL
and run signal handlers every 0.1 s, except Barrier.wait. Thread- and process-safe.
"""
import os
import threading

from torchpar import _C
from torchpar.multiprocessing.queues import _timeout  # (block, timeout) -> seconds or None

__all__ = ["Lock", "RLock", "Semaphore", "BoundedSemaphore", "Condition", "Event", "Barrier"]


def _rebuild(cls, core_cls, data, fds, state):
    obj = cls.__new__(cls)
    obj._core = core_cls._load(data, [f.detach() if hasattr(f, "detach") else f for f in fds])
    obj._setstate(state)
    return obj


def _dup_fds(fds):
    from multiprocessing import reduction
    return [reduction.DupFd(fd) for fd in fds]


class _Shared:
    """Pickling of an object whose shared state is a torchpar._C core."""

    def __reduce__(self):
        data, fds = self._core._dump()
        return _rebuild, (type(self), type(self._core), data, _dup_fds(fds), self._getstate())

    def _getstate(self):
        return None

    def _setstate(self, state):
        pass


def _me():
    return (os.getpid(), threading.get_ident())


class Semaphore(_Shared):
    """multiprocessing.Semaphore(value=1): acquire takes a unit (waiting while 0), release
    returns one. ValueError for a negative value."""

    _bounded = False

    def __init__(self, value=1, *, ctx=None):
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        self._core = _C.Semaphore(value, self._bounded)
        self._maxvalue = value

    def acquire(self, block=True, timeout=None):
        """True once a unit is taken; False when `timeout` seconds passed (or, with
        block=False, none was free)."""
        return self._core.acquire(_timeout(block, timeout))

    def release(self):
        self._core.release()

    def get_value(self):
        return self._core.get_value()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *args):
        self.release()

    def _getstate(self):
        return self._maxvalue

    def _setstate(self, state):
        self._maxvalue = state

    def __repr__(self):
        return f"<{type(self).__name__}(value={self.get_value()})>"


class BoundedSemaphore(Semaphore):
    """multiprocessing.BoundedSemaphore(value=1): release past the initial value raises
    ValueError."""

    _bounded = True

    def __repr__(self):
        return f"<BoundedSemaphore(value={self.get_value()}, maxvalue={self._maxvalue})>"


class Lock(_Shared):
    """multiprocessing.Lock: a binary semaphore any process or thread may release."""

    def __init__(self, *, ctx=None):
        self._core = _C.Semaphore(1, True)
        self._owner = None

    def acquire(self, block=True, timeout=None):
        """True once held; False when `timeout` seconds passed (block=False: a try).
        Acquiring a Lock this thread holds waits (it is not recursive)."""
        if self._core.acquire(_timeout(block, timeout)):
            self._owner = _me()
            return True
        return False

    def release(self):
        """Releases it (from any thread or process). ValueError when it is not held."""
        self._core.release()
        self._owner = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *args):
        self.release()

    def _is_mine(self):
        return self._owner == _me() and self._core.get_value() == 0

    def _release_save(self):
        self.release()
        return None

    def _acquire_restore(self, state):
        self.acquire()

    def _setstate(self, state):
        self._owner = None

    def __repr__(self):
        if self._core.get_value() == 1:
            owner = "None"
        elif self._is_mine():
            owner = _process_name()
        else:
            owner = "SomeOtherThread" if self._owner and self._owner[0] == os.getpid() \
                else "SomeOtherProcess"
        return f"<Lock(owner={owner})>"


def _process_name():
    import multiprocessing
    name = multiprocessing.current_process().name
    if threading.current_thread().name != "MainThread":
        name += "|" + threading.current_thread().name
    return name


class RLock(_Shared):
    """multiprocessing.RLock: its holder may acquire it again and releases it as often.
    Robust: when the holder dies, the next acquire gets it and `owner_died` is True."""

    def __init__(self, *, ctx=None):
        self._core = _C.Mutex()
        self._owner = None
        self._count = 0

    def acquire(self, block=True, timeout=None):
        """True once held (again, for the holder); False when `timeout` seconds passed."""
        if self._core.acquire(_timeout(block, timeout)):
            me = _me()
            if self._owner != me or self._core.owner_died:
                self._owner, self._count = me, 0
            self._count += 1
            return True
        return False

    def release(self):
        """Releases one level. RuntimeError when this thread does not hold it."""
        if not self._is_mine():
            raise RuntimeError("cannot release un-acquired lock")
        self._count -= 1
        if self._count == 0:
            self._owner = None
        self._core.release()

    @property
    def owner_died(self):
        """True when the last acquire recovered the lock from a holder that died."""
        return self._core.owner_died

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *args):
        self.release()

    def _is_mine(self):
        return self._owner == _me() and self._count > 0

    def _release_save(self):
        count = self._count
        for _ in range(count):
            self.release()
        return count

    def _acquire_restore(self, count):
        for _ in range(count):
            self.acquire()

    def _setstate(self, state):
        self._owner, self._count = None, 0

    def __repr__(self):
        if self._is_mine():
            return f"<RLock({_process_name()}, {self._count})>"
        if self._owner is not None:
            return "<RLock(SomeOtherThread, nonzero)>"
        return "<RLock(unknown, unknown)>"


class _Count:
    """A count read with get_value(), as the semaphores behind Python's Condition are."""

    def __init__(self, read):
        self._read = read

    def get_value(self):
        return self._read()


class Condition(_Shared):
    """multiprocessing.Condition(lock=None): a condition variable over `lock` (default a
    new RLock). wait, wait_for, notify, notify_all need the lock held (RuntimeError
    otherwise)."""

    def __init__(self, lock=None, *, ctx=None):
        self._lock = lock if lock is not None else RLock()
        self._core = _C.ConditionWord()
        self._bind()

    def _bind(self):
        self.acquire = self._lock.acquire
        self.release = self._lock.release
        # The counts CPython's own Condition exposes (its semaphores): with nobody waiting
        # all are 0 (CPython's test suite checks that invariant).
        self._sleeping_count = _Count(lambda: self._core.waiting)
        self._woken_count = _Count(lambda: 0)
        self._wait_semaphore = _Count(lambda: self._core.tickets)

    def __reduce__(self):
        data, fds = self._core._dump()
        return _rebuild_condition, (self._lock, data, _dup_fds(fds))

    def __enter__(self):
        return self._lock.__enter__()

    def __exit__(self, *args):
        return self._lock.__exit__(*args)

    def _check_owned(self, what):
        if not self._lock._is_mine():
            raise RuntimeError(f"cannot {what} on un-acquired lock")

    def wait(self, timeout=None):
        """Releases the lock (every level of an RLock), waits for a notify or `timeout`
        seconds, re-acquires. True when notified."""
        self._check_owned("wait")
        slot = self._core.enroll()
        state = self._lock._release_save()
        try:
            return self._core.wait(slot, None if timeout is None else max(0.0, float(timeout)))
        finally:
            self._lock._acquire_restore(state)

    def wait_for(self, predicate, timeout=None):
        """Waits until predicate() is true or `timeout` seconds passed; its last value."""
        import time
        result = predicate()
        if result:
            return result
        deadline = None if timeout is None else time.monotonic() + timeout
        while not result:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.wait(left)
            else:
                self.wait()
            result = predicate()
        return result

    def notify(self, n=1):
        """Wakes min(n, waiting) waiters (a notify with none waiting is not remembered)."""
        self._check_owned("notify")
        self._core.notify(n)

    def notify_all(self):
        self._check_owned("notify")
        self._core.notify(1 << 31)

    def __repr__(self):
        return f"<Condition({self._lock!r}, {self._core.waiting})>"


def _rebuild_condition(lock, data, fds):
    cond = Condition.__new__(Condition)
    cond._lock = lock
    cond._core = _C.ConditionWord._load(data, [f.detach() if hasattr(f, "detach") else f
                                               for f in fds])
    cond._bind()
    return cond


class Event(_Shared):
    """multiprocessing.Event: a flag processes wait for."""

    def __init__(self, *, ctx=None):
        self._core = _C.Event()

    def is_set(self):
        return self._core.is_set()

    def set(self):
        self._core.set()

    def clear(self):
        self._core.clear()

    def wait(self, timeout=None):
        """True once the flag is set; False when `timeout` seconds passed first."""
        return self._core.wait(None if timeout is None else max(0.0, float(timeout)))

    def __repr__(self):
        return f"<{type(self).__qualname__} at {id(self):#x} {'set' if self.is_set() else 'unset'}>"


class Barrier(_Shared):
    """multiprocessing.Barrier(parties, action=None, timeout=None): threading.Barrier's
    surface across processes. wait() returns this party's index in [0, parties);
    threading.BrokenBarrierError after abort(), reset() during a round, a timeout
    (`timeout` seconds; None: the barrier's default) or an action that raised."""

    def __init__(self, parties, action=None, timeout=None, *, ctx=None):
        if parties < 1:
            raise ValueError("parties must be > 0")
        self._core = _C.Barrier(parties, action, timeout)
        self._action = action
        self._timeout = timeout

    def wait(self, timeout=None):
        if timeout is None:
            timeout = self._timeout
        return self._core.wait(timeout)

    def reset(self):
        self._core.reset()

    def abort(self):
        self._core.abort()

    @property
    def parties(self):
        return self._core.parties

    @property
    def n_waiting(self):
        return self._core.n_waiting

    @property
    def broken(self):
        return self._core.broken

    def _getstate(self):
        return (self._action, self._timeout)

    def _setstate(self, state):
        self._action, self._timeout = state
        self._core.set_action(self._action)

    def __repr__(self):
        return (f"<{type(self).__qualname__} at {id(self):#x} waiters={self.n_waiting}/"
                f"{self.parties}{' broken' if self.broken else ''}>")
