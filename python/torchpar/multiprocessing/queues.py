"""Queue, SimpleQueue and JoinableQueue over torchpar's shared-memory ring.

The Python surface of multiprocessing's queues (put/get with block and timeout raising
queue.Full / queue.Empty, qsize, empty, full, close, join_thread, cancel_join_thread), over
torchpar's ring: put writes the message into shared memory before it returns (there is no
feeder thread, so nothing is lost when the putting process exits), tensors travel as
shared-memory handles (reductions.py). Thread- and process-safe; a process killed inside
put or get does not wedge the others. Every blocking call releases the GIL.
"""
from multiprocessing import reduction

from torchpar import _C
from torchpar.multiprocessing.reductions import dumps, loads

#: Bytes of each queue's shared ring; larger messages travel in a segment of their own.
CAPACITY_BYTES = 4 << 20


def _timeout(block, timeout):
    if not block:
        return 0.0
    if timeout is None:
        return None
    return max(0.0, float(timeout))


def _rebuild(fd, maxsize, cls, extra):
    q = cls.__new__(cls)
    q._q = _C.Queue.from_fd(fd.detach() if hasattr(fd, "detach") else fd)
    q._maxsize = maxsize
    q._setstate(extra)
    return q


class Queue:
    """multiprocessing.Queue on torchpar (torch.multiprocessing.Queue's tensor sharing).

    put(obj, block=True, timeout=None): queue.Full when there is no room in time (maxsize
    items, or a ring too full for the message); get(block=True, timeout=None): queue.Empty
    when nothing arrives in time. After close(), put and get raise ValueError (a
    torchpar.ClosedError), and a get waiting in another thread of this process wakes with it
    within 0.1 s. Timeouts are seconds (negative counts as 0).
    """

    def __init__(self, maxsize=0, *, ctx=None, capacity_bytes=CAPACITY_BYTES):
        self._maxsize = maxsize if maxsize > 0 else 0
        self._q = _C.Queue(self._maxsize, capacity_bytes)

    def __reduce__(self):
        return _rebuild, (reduction.DupFd(self._q.fileno()), self._maxsize, type(self),
                          self._getstate())

    def _getstate(self):
        return None

    def _setstate(self, state):
        pass

    def _check_closed(self):
        if self._q.closed:
            raise _C.ClosedError(f"Queue {self!r} is closed")

    def put(self, obj, block=True, timeout=None):
        self._check_closed()
        data, tensors = dumps(obj)
        self._q.put(data, tensors, _timeout(block, timeout))

    def get(self, block=True, timeout=None):
        self._check_closed()
        data, tensors = self._q.get(_timeout(block, timeout))
        return loads(data, tensors)

    def put_nowait(self, obj):
        return self.put(obj, False)

    def get_nowait(self):
        return self.get(False)

    def qsize(self):
        return self._q.qsize()

    def empty(self):
        return self._q.qsize() == 0

    def full(self):
        return self._maxsize > 0 and self._q.qsize() >= self._maxsize

    def close(self):
        """Closes the queue for this process (others go on using it)."""
        self._q.close()

    def join_thread(self):
        """Python joins its feeder thread here; put already wrote everything. Only after
        close(), as in Python."""
        assert self._q.closed, f"Queue {self!r} not closed"

    def cancel_join_thread(self):
        """Nothing to cancel: there is no feeder thread (put writes before it returns)."""

    def __repr__(self):
        return f"<torchpar.multiprocessing.Queue maxsize={self._maxsize} at {id(self):#x}>"


class SimpleQueue:
    """multiprocessing.SimpleQueue on torchpar: put, get, empty and close."""

    def __init__(self, *, ctx=None, capacity_bytes=CAPACITY_BYTES):
        self._maxsize = 0
        self._q = _C.Queue(0, capacity_bytes)

    __reduce__ = Queue.__reduce__
    _getstate = Queue._getstate
    _setstate = Queue._setstate

    def put(self, obj):
        data, tensors = dumps(obj)
        self._q.put(data, tensors, None)

    def get(self):
        data, tensors = self._q.get(None)
        return loads(data, tensors)

    def empty(self):
        return self._q.qsize() == 0

    def close(self):
        self._q.close()


class JoinableQueue(Queue):
    """multiprocessing.JoinableQueue on torchpar: Queue plus task_done() and join()."""

    def __init__(self, maxsize=0, *, ctx, capacity_bytes=CAPACITY_BYTES):
        super().__init__(maxsize, ctx=ctx, capacity_bytes=capacity_bytes)
        self._unfinished_tasks = ctx.Semaphore(0)
        self._cond = ctx.Condition()

    def _getstate(self):
        return (self._unfinished_tasks, self._cond)

    def _setstate(self, state):
        self._unfinished_tasks, self._cond = state

    def put(self, obj, block=True, timeout=None):
        self._check_closed()
        # Counted before it can be taken, so a fast consumer's task_done never runs ahead.
        with self._cond:
            self._unfinished_tasks.release()
        try:
            super().put(obj, block, timeout)
        except BaseException:
            with self._cond:
                self._unfinished_tasks.acquire(False)
                if self._unfinished_tasks.get_value() == 0:
                    self._cond.notify_all()
            raise

    def task_done(self):
        with self._cond:
            if not self._unfinished_tasks.acquire(False):
                raise ValueError("task_done() called too many times")
            if self._unfinished_tasks.get_value() == 0:
                self._cond.notify_all()

    def join(self):
        with self._cond:
            if not self._unfinished_tasks.get_value() == 0:
                self._cond.wait()
