"""Pool: multiprocessing.pool.Pool's surface on torchpar's queues, surviving dead workers.

    with torchpar.multiprocessing.Pool(4) as pool:
        squares = pool.map(f, range(100))

Surface: Pool(processes, initializer, initargs, maxtasksperchild, context); apply,
apply_async, map, map_async, imap, imap_unordered, starmap, starmap_async (chunksize, callback,
error_callback); AsyncResult (get, wait, ready, successful); close, join, terminate; a context
manager whose __exit__ terminates. Functions travel by reference as pickle sends them. A task's
exception is re-raised in the parent with its type and message, the worker's traceback text
attached as __cause__ (multiprocessing.pool.RemoteTraceback), as Python's pool does.

What differs from Python's pool: a worker that dies (SIGKILL, os._exit, a crash in C code)
fails exactly the tasks it held with torchpar.WorkerLostError, naming its pid and signal or
exit code, within about 0.1 s; tasks it had been sent but had not started go to the other
workers, a replacement worker starts and the pool goes on (CPython's pool hangs there).
Workers that exit after maxtasksperchild tasks are replaced the same way, silently. Outstanding
results of a terminated pool fail with torchpar.ClosedError instead of never becoming ready.

Design.
  - Workers are the context's Process (fork, spawn or forkserver), daemonic as Python's.
  - Each worker has its own task queue (a torchpar._C.Queue: a shared-memory ring, written
    before put returns); all workers put results on one shared result queue. The parent
    assigns every batch to one worker, so it knows, without any message from the worker,
    which batches each worker holds (at most two: the one running and one waiting, which keeps
    the worker busy while the parent refills it and bounds the imbalance at the tail).
  - Before each task a worker writes the task's number into its slot of a shared array
    (multiprocessing.sharedctypes.RawArray; a store, not a message). When a worker dies the
    parent first drains the result queue, then reads the slot: the task in it failed
    (WorkerLostError "while running task N"), tasks before it whose results had not come
    back ran but lost their results (WorkerLostError "after running task N"), tasks after it
    never started and are sent to other workers.
  - Batches: consecutive tasks of one map (or consecutive apply_async calls waiting for a
    worker) travel as one message of (function, [arguments]); the function is pickled once
    per batch. Batch sizes are guided: remaining tasks / (4 x workers), at least chunksize,
    at most 1024 (apply calls: at most 64), so a map of 200,000 trivial items costs a few
    hundred messages each way and the last batches are small. Results come back per batch
    (values plus a {position: exception} map, so errors stay per task), or in pieces every
    2 ms of running, so a long task does not hold back the results before it.
  - One handler thread in the parent reads the result queue (in 0.1 s slices), sets results,
    runs callbacks (as Python's result handler thread does), refills workers, and every 0.1 s
    checks the workers' sentinels (multiprocessing.connection.wait with a zero timeout) to
    replace dead workers. The result queue is not a file descriptor, so the handler polls the
    sentinels between slices instead of selecting on them; close() and terminate() wake it
    with a message on the result queue itself.
  - A get() or wait() on an AsyncResult reads the result queue itself while it waits (one
    reader at a time; the handler stands back while get() calls wait and for 5 ms after the
    last one), so apply().get() costs two process hops and no thread hop. What such a reader
    completes for other results runs their callbacks in the handler thread, as Python's.
  - Plain pickles (no tensor, storage or numpy array inside) skip reductions.dumps's
    persistent_id pass; anything with tensors goes through it (shared memory, as queues).

Thread safety: every method may be called from any thread of the process that made the pool;
the pool cannot be passed to another process (as Python's).
"""
import collections
import io
import itertools
import os
import multiprocessing
import pickle
import queue
import signal
import struct
import sys
import threading
import time
import traceback
import warnings
from multiprocessing import TimeoutError as _MpTimeoutError
from multiprocessing import connection as _mpconn
from multiprocessing import sharedctypes, util
from multiprocessing.pool import ExceptionWithTraceback, MaybeEncodingError

from torchpar import _C
from torchpar.multiprocessing import reductions

__all__ = ["Pool", "AsyncResult", "ApplyResult", "MapResult", "IMapIterator",
           "IMapUnorderedIterator"]

#: Bytes of the result ring shared by all workers, and of each worker's task ring; larger
#: messages travel in a segment of their own.
RESULT_CAPACITY_BYTES = 4 << 20
TASK_CAPACITY_BYTES = 1 << 20
#: Batches a worker holds at once (one running, one waiting).
_INFLIGHT = 2
_MAX_MAP_BATCH = 1024
_MAX_APPLY_BATCH = 64
#: Seconds between the handler's checks of the workers' sentinels.
_CHECK_SECONDS = 0.1
#: Seconds a waiting get() reads the result queue before it lets the handler look.
_WAITER_SLICE = 0.05
#: Seconds the handler leaves the result queue to get() calls after the last one returned.
_GRACE_SECONDS = 0.005
#: Seconds between an idle worker's checks that the pool's process is alive.
_PARENT_CHECK_SECONDS = 1.0
#: Seconds of running after which a worker sends the results it holds.
_FLUSH_SECONDS = 0.002

_RUN, _CLOSE, _TERMINATE = "RUN", "CLOSE", "TERMINATE"
_APPLY, _MAP, _STARMAP = 0, 1, 2
_STOP = -1

# Task message: seq, kind | flag, first task number, count; then the pickle of (func, items).
_TASK = struct.Struct("<qiqi")
# Result message: worker index, seq, offset, count, flag; then that of (values, errors|None).
_RESULT = struct.Struct("<iqiii")


# ----------------------------------------------------------------------------- pickling

class _NeedsSharing(Exception):
    pass


class _PlainPickler(pickle.Pickler):
    """Pickles what holds no tensor, storage or numpy array; raises _NeedsSharing on one."""

    def reducer_override(self, obj):
        if type(obj).__module__.startswith(("torch", "numpy")):
            raise _NeedsSharing
        return NotImplemented


_PLAIN = 0x100   # flag in a message's kind: plain pickle, no tensors


def dumps(obj):
    """(flag, bytes, [tensors]) of `obj`: a plain pickle when it holds no tensor, storage or
    numpy array (the common case, and 4-10x cheaper than reductions.dumps, whose
    persistent_id runs for every object), reductions.dumps otherwise (tensors shared)."""
    f = io.BytesIO()
    p = _PlainPickler(f, 5)
    p.dispatch_table = reductions._dispatch_table()
    try:
        p.dump(obj)
    except _NeedsSharing:
        data, tensors = reductions.dumps(obj)
        return 0, data, tensors
    return _PLAIN, f.getvalue(), []


def loads(flag, data, offset, tensors):
    if flag & _PLAIN:
        return pickle.loads(memoryview(data)[offset:])
    return reductions.loads(data[offset:], tensors)


# ----------------------------------------------------------------------------- worker side

def _wrap(e):
    return ExceptionWithTraceback(e, e.__traceback__)


def _send_results(put, windex, seq, offset, values, errors):
    try:
        flag, data, tensors = dumps((values, errors))
    except Exception:
        # One value (or exception) does not pickle: send the others, wrap that one as
        # Python's pool does (MaybeEncodingError).
        values = list(values)
        errors = dict(errors or {})
        for i, v in enumerate(values):
            if i in errors:
                try:
                    dumps(errors[i])
                except Exception as e:
                    errors[i] = MaybeEncodingError(e, errors[i].exc)
                continue
            try:
                dumps(v)
            except Exception as e:
                values[i] = None
                errors[i] = MaybeEncodingError(e, v)
        flag, data, tensors = dumps((values, errors))
    put(_RESULT.pack(windex, seq, offset, len(values), flag) + data, tensors, None)


def _worker(tasks, results, slots, windex, initializer, initargs, maxtasks):
    """The loop of one pool worker: batches from its own queue, results to the shared one."""
    if initializer is not None:
        initializer(*initargs)
    get = tasks._q.get
    put = results._q.put
    monotonic = time.monotonic
    parent = multiprocessing.parent_process()
    done = 0
    while maxtasks is None or done < maxtasks:
        try:
            data, tensors = get(_PARENT_CHECK_SECONDS)
        except queue.Empty:
            # A pool whose process died (SIGKILL) sends no stop: go when it is gone.
            if parent is not None and not parent.is_alive():
                return
            continue
        seq, kind, first, n = _TASK.unpack_from(data)
        if seq == _STOP:
            break
        try:
            func, items = loads(kind, data, _TASK.size, tensors)
            kind &= ~_PLAIN
        except Exception as e:
            err = _wrap(e)
            _send_results(put, windex, seq, 0, [None] * n, {i: err for i in range(n)})
            done += n
            continue
        values = []
        errors = {}
        offset = 0
        flushed = monotonic()
        for i, item in enumerate(items):
            slots[windex] = first + i
            try:
                if kind == _MAP:
                    values.append(func(item))
                elif kind == _STARMAP:
                    values.append(func(*item))
                else:
                    f, args, kwds = item
                    values.append(f(*args, **kwds))
            except Exception as e:
                values.append(None)
                errors[i - offset] = _wrap(e)
            if i + 1 < n and monotonic() - flushed > _FLUSH_SECONDS:
                _send_results(put, windex, seq, offset, values, errors or None)
                offset = i + 1
                values = []
                errors = {}
                flushed = monotonic()
        _send_results(put, windex, seq, offset, values, errors or None)
        done += n
        func = items = item = values = errors = None


# ----------------------------------------------------------------------------- results

class ApplyResult:
    """The result of apply_async (multiprocessing.pool.ApplyResult / AsyncResult).

    get(timeout=None): the value, or raises the task's exception (or WorkerLostError, or
    ClosedError after terminate()); multiprocessing.TimeoutError when not ready within
    `timeout` seconds. wait(timeout=None) waits up to `timeout` seconds. ready(): True once
    done. successful(): whether it returned without raising; ValueError when not ready.
    """

    def __init__(self, callback, error_callback, state=None):
        self._event = threading.Event()
        self._pool_state = state
        self._callback = callback
        self._error_callback = error_callback
        self._success = None
        self._value = None

    def ready(self):
        return self._event.is_set()

    def successful(self):
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._success

    def wait(self, timeout=None):
        s = self._pool_state
        if s is None or self._event.is_set() or threading.current_thread() is s.thread:
            self._event.wait(timeout)
        else:
            s.wait_for(self, timeout)

    def get(self, timeout=None):
        self.wait(timeout)
        if not self.ready():
            raise _MpTimeoutError
        if self._success:
            return self._value
        raise self._value

    # Called with the pool's lock held; True when this completed the result (the caller then
    # calls _complete() outside the lock).
    def _set(self, index, ok, value):
        if self._success is not None:
            return False
        self._success, self._value = ok, value
        return True

    def _complete(self):
        try:
            if self._success and self._callback is not None:
                self._callback(self._value)
            elif not self._success and self._error_callback is not None:
                self._error_callback(self._value)
        except Exception:
            _report_callback_error()
        self._event.set()


AsyncResult = ApplyResult


class MapResult(ApplyResult):
    """The result of map_async / starmap_async: the list of values in order; the first task
    exception fails it at once (as Python's MapResult)."""

    def __init__(self, length, callback, error_callback, state=None):
        super().__init__(callback, error_callback, state)
        self._value = [None] * length
        self._remaining = length

    def _set_range(self, start, values, errors):
        if self._success is not None:
            return False
        if errors:
            self._success = False
            self._value = errors[min(errors)]
            return True
        self._value[start:start + len(values)] = values
        self._remaining -= len(values)
        if self._remaining == 0:
            self._success = True
            return True
        return False

    def _set(self, index, ok, value):
        if ok:
            return self._set_range(index, [value], None)
        return self._set_range(index, [None], {0: value})

    def _set_length(self, length):
        return False


class IMapIterator:
    """The iterator imap returns: values in order; a task's exception is raised at its
    position (iteration can go on after it). next(timeout) raises multiprocessing.
    TimeoutError when the next value is not there within `timeout` seconds."""

    _ordered = True

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._ready = collections.deque()   # (ok, value)
        self._waiting = {}                  # start index -> [(ok, value)], out of order
        self._next = 0                      # ordered: index of the next item to append
        self._yielded = 0
        self._length = None

    def __iter__(self):
        return self

    def next(self, timeout=None):
        with self._cond:
            if not self._ready:
                if self._yielded == self._length:
                    raise StopIteration from None
                self._cond.wait_for(
                    lambda: self._ready or self._yielded == self._length, timeout)
                if not self._ready:
                    if self._yielded == self._length:
                        raise StopIteration from None
                    raise _MpTimeoutError from None
            ok, value = self._ready.popleft()
            self._yielded += 1
        if ok:
            return value
        raise value

    __next__ = next

    def _done(self):
        return self._length is not None and self._next >= self._length

    def _set_range(self, start, values, errors):
        items = [(True, v) for v in values]
        for i, e in (errors or {}).items():
            items[i] = (False, e)
        with self._cond:
            if not self._ordered:
                self._ready.extend(items)
                self._next += len(items)
            elif start != self._next:
                self._waiting[start] = items
                return False
            else:
                self._ready.extend(items)
                self._next += len(items)
                while self._next in self._waiting:
                    more = self._waiting.pop(self._next)
                    self._ready.extend(more)
                    self._next += len(more)
            self._cond.notify_all()
            return self._done()

    def _set(self, index, ok, value):
        return self._set_range(index, [value], None if ok else {0: value})

    def _set_length(self, length):
        with self._cond:
            self._length = length
            self._cond.notify_all()
            return self._done()

    def _complete(self):
        with self._cond:
            self._cond.notify_all()


class IMapUnorderedIterator(IMapIterator):
    """The iterator imap_unordered returns: values as they complete."""

    _ordered = False


def _report_callback_error():
    print("torchpar Pool: exception in a callback (ignored):", file=sys.stderr)
    traceback.print_exc()


# ----------------------------------------------------------------------------- sources

class _MapSource:
    """The tasks of one map / imap / starmap not yet sent: an iterator over its items."""

    def __init__(self, job, func, kind, iterable, chunksize, start=0):
        self.job, self.func, self.kind = job, func, kind
        self.it = iter(iterable)
        try:
            self.remaining = len(iterable)
        except TypeError:
            self.remaining = None
        self.chunksize = chunksize
        self.index = self.first = start
        self.grow = 1
        self.done = False
        self.sets_length = True   # False for tasks sent back after a worker died

    def size(self, workers):
        if self.remaining is not None:
            guided = self.remaining // (4 * workers)
        else:
            guided = self.grow
            self.grow = min(self.grow * 2, 64)
        return max(self.chunksize, min(guided, _MAX_MAP_BATCH), 1)

    def take(self, limit):
        """(kind, func, items, targets) of up to `limit` tasks; targets is (job, start).
        An error of the iterable itself fails the task at its position and ends the job."""
        items = []
        start = self.index
        try:
            for item in itertools.islice(self.it, limit):
                items.append(item)
        except Exception as e:
            # As Python's pool: the chunk (of chunksize items) the error came in fails, at
            # its first position, and the job ends there.
            pos = start + len(items)
            pos -= (pos - self.first) % self.chunksize
            self.done = True
            self.index = max(pos, start) + 1
            return None, e, items[:max(0, pos - start)], (self.job, start)
        self.index = start + len(items)
        if self.remaining is not None:
            self.remaining -= len(items)
        if len(items) < limit or self.remaining == 0:
            self.done = True
        return self.kind, self.func, items, (self.job, start)


class _ApplySource:
    """apply_async calls waiting for a worker, sent together when several wait."""

    kind = _APPLY

    def __init__(self):
        self.calls = collections.deque()    # (job, func, args, kwds)
        self.done = False

    def size(self, workers):
        return max(1, min(len(self.calls) // (2 * workers), _MAX_APPLY_BATCH))

    def take(self, limit):
        calls = [self.calls.popleft() for _ in range(min(limit, len(self.calls)))]
        self.done = not self.calls
        return _APPLY, None, [(f, a, k) for _, f, a, k in calls], [c[0] for c in calls]


# ----------------------------------------------------------------------------- the pool

class _Batch:
    __slots__ = ("seq", "kind", "func", "items", "targets", "first", "n", "received")

    def __init__(self, seq, kind, func, items, targets, first):
        self.seq, self.kind, self.func, self.items = seq, kind, func, items
        self.targets, self.first, self.n, self.received = targets, first, len(items), 0


class _Worker:
    __slots__ = ("index", "process", "tasks", "put", "inflight", "allowance", "stopped")


def _describe_exit(process):
    code = process.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"signal {-code}, {name}"
    return f"exit code {code}"


class _State:
    """Everything the handler thread needs (the Pool object itself stays collectable)."""

    def __init__(self, ctx, processes, initializer, initargs, maxtasks):
        self.ctx = ctx
        self.processes = processes
        self.initializer, self.initargs, self.maxtasks = initializer, initargs, maxtasks
        self.lock = threading.RLock()
        self.state = _RUN
        self.results = ctx.Queue(capacity_bytes=RESULT_CAPACITY_BYTES)
        self.rget = self.results._q.get
        self.slots = sharedctypes.RawArray("q", processes)
        self.workers = []
        self.pending = collections.deque()  # sources with tasks not sent yet
        self.batches = {}                   # seq -> _Batch in flight
        self.jobs = set()                   # results not complete yet
        self.seq = 0
        self.task_number = 0
        self.completed = []                 # results to _complete() outside the lock
        # The reader role (see _acquire_reader), under rcond.
        self.rcond = threading.Condition(threading.Lock())
        self.reader = None                  # None, "handler" or "waiter"
        self.waiters = 0                    # get() calls waiting
        self.waiter_left = 0.0              # time.monotonic() when the last one left
        self.handler_wants = 0
        self.sleeping = 0                   # threads in rcond.wait that want a notify
        self.handler_done = False
        self.deferred = []                  # results whose callbacks the handler runs
        for i in range(processes):
            self.workers.append(self._start_worker(i))

    # -- workers

    def _start_worker(self, index):
        w = _Worker()
        w.index = index
        w.tasks = self.ctx.Queue(capacity_bytes=TASK_CAPACITY_BYTES)
        w.put = w.tasks._q.put
        w.inflight = collections.deque()
        w.allowance = self.maxtasks
        w.stopped = False
        self.slots[index] = -1
        w.process = self.ctx.Process(
            target=_worker, name=f"TorchparPoolWorker-{index}",
            args=(w.tasks, self.results, self.slots, index, self.initializer, self.initargs,
                  self.maxtasks))
        w.process.daemon = True
        w.process.start()
        return w

    # -- sending (lock held)

    def submit(self, source):
        with self.lock:
            if self.state != _RUN:
                raise ValueError("Pool not running")
            if isinstance(source, tuple):   # one apply_async call
                if not (self.pending and isinstance(self.pending[-1], _ApplySource)):
                    self.pending.append(_ApplySource())
                self.pending[-1].calls.append(source)
                self.jobs.add(source[0])
            else:
                self.pending.append(source)
                self.jobs.add(source.job)
            self._dispatch()
        self._run_completed()

    def _pick(self):
        best = None
        for w in self.workers:
            if w.stopped or len(w.inflight) >= _INFLIGHT or w.allowance == 0:
                continue
            if best is None or len(w.inflight) < len(best.inflight):
                best = w
                if not w.inflight:
                    break
        return best

    def _dispatch(self):
        while self.pending:
            w = self._pick()
            if w is None:
                return
            source = self.pending[0]
            limit = source.size(self.processes)
            if w.allowance is not None:
                limit = min(limit, w.allowance)
            kind, func, items, targets = source.take(limit)
            if source.done:
                self.pending.popleft()
                if isinstance(source, _MapSource) and source.sets_length:
                    self._job_length(source.job, source.index)
            if kind is None:   # the iterable raised: func is its exception
                job, start = targets
                if items:
                    self._send(w, source.kind, source.func, items, targets)
                self._fail_one(job, start + len(items), func)
                continue
            if items:
                self._send(w, kind, func, items, targets)

    def _send(self, w, kind, func, items, targets):
        try:
            flag, data, tensors = dumps((func, items))
        except Exception as e:
            # Something does not pickle: fail those tasks alone (as Python's task handler
            # does), send the rest one by one.
            if kind == _APPLY:
                for item, job in zip(items, targets):
                    self._send_or_fail(w, kind, None, [item], [job], e)
            else:
                job, start = targets
                for i, item in enumerate(items):
                    self._send_or_fail(w, kind, func, [item], (job, start + i), e)
            return
        self._put(w, kind, func, items, targets, flag, data, tensors)

    def _send_or_fail(self, w, kind, func, items, targets, error):
        try:
            flag, data, tensors = dumps((func, items))
        except Exception as e:
            self._fail_tasks(kind, targets, 0, 1, e)
            return
        self._put(w, kind, func, items, targets, flag, data, tensors)

    def _put(self, w, kind, func, items, targets, flag, data, tensors):
        self.seq += 1
        b = _Batch(self.seq, kind, func, items, targets, self.task_number)
        self.task_number += b.n
        w.put(_TASK.pack(b.seq, kind | flag, b.first, b.n) + data, tensors, None)
        w.inflight.append(b)
        if w.allowance is not None:
            w.allowance -= b.n
        self.batches[b.seq] = b

    # -- results (lock held)

    def _job_length(self, job, length):
        if job._set_length(length):
            self._finished(job)

    def _finished(self, job):
        self.jobs.discard(job)
        self.completed.append(job)

    def _fail_one(self, job, index, error):
        if job._set(index, False, error):
            self._finished(job)

    def _fail_tasks(self, kind, targets, offset, count, error):
        if kind == _APPLY:
            for job in targets[offset:offset + count]:
                self._fail_one(job, 0, error)
        else:
            job, start = targets
            if job._set_range(start + offset, [None] * count,
                              {i: error for i in range(count)}):
                self._finished(job)

    def _on_result(self, data, tensors):
        windex, seq, offset, count, flag = _RESULT.unpack_from(data)
        b = self.batches.get(seq)
        if b is None:
            return
        try:
            values, errors = loads(flag, data, _RESULT.size, tensors)
        except Exception as e:
            values, errors = [None] * count, {i: e for i in range(count)}
        if b.kind == _APPLY:
            for i in range(count):
                job = b.targets[offset + i]
                if errors and i in errors:
                    done = job._set(0, False, errors[i])
                else:
                    done = job._set(0, True, values[i])
                if done:
                    self._finished(job)
        else:
            job, start = b.targets
            if job._set_range(start + offset, values, errors):
                self._finished(job)
        b.received = offset + count
        if b.received >= b.n:
            del self.batches[seq]
            w = self.workers[windex]
            if w.inflight and w.inflight[0] is b:
                w.inflight.popleft()
            elif b in w.inflight:
                w.inflight.remove(b)

    def _run_completed(self, mine=None):
        """Completes the finished results: callbacks, then ready. In a waiting thread
        (mine: the result it waits for) other results' callbacks go to the handler thread,
        where Python's pool runs them."""
        handler = mine is None
        ran = False
        while True:
            with self.lock:
                if not self.completed:
                    break
                done, self.completed = self.completed, []
            deferred = []
            for job in done:
                if handler or job is mine or not (
                        getattr(job, "_callback", None) or getattr(job, "_error_callback", None)):
                    job._complete()
                else:
                    deferred.append(job)
            ran = True
            if deferred:
                with self.rcond:
                    if not self.handler_done:
                        self.deferred.extend(deferred)
                        deferred = []
                for job in deferred:   # no handler any more: here
                    job._complete()
        if ran:
            with self.rcond:
                if self.sleeping:
                    self.rcond.notify_all()

    # -- who reads the result queue: one thread at a time, the handler or a waiting get()

    def _acquire_reader(self, who, polite, timeout):
        """Takes the reader role within `timeout` seconds; False when it did not. The
        handler (polite) leaves it to waiting get() calls, and for _GRACE_SECONDS after the
        last one left (a loop of apply().get() reads its own results, without a thread hop);
        a forced take (a dead worker to handle) goes before waiters."""
        end = time.monotonic() + timeout
        with self.rcond:
            if not polite:
                self.handler_wants += 1
            try:
                while True:
                    now = time.monotonic()
                    if polite and self.deferred:
                        return False
                    wait = end - now
                    if self.reader is None:
                        if not polite:
                            self.reader = who
                            return True
                        if who == "handler" and not self.waiters:
                            grace = self.waiter_left + _GRACE_SECONDS - now
                            if grace <= 0:
                                self.reader = who
                                return True
                            wait = min(wait, grace)
                        elif who != "handler" and not self.handler_wants:
                            self.reader = who
                            return True
                    if wait <= 0:
                        return False
                    if polite and who == "handler":
                        # Polls (every release would otherwise wake it: a GIL hand-off
                        # per apply().get()).
                        self.rcond.wait(min(wait, _GRACE_SECONDS))
                    else:
                        self.sleeping += 1
                        try:
                            self.rcond.wait(wait)
                        finally:
                            self.sleeping -= 1
            finally:
                if not polite:
                    self.handler_wants -= 1

    def _release_reader(self):
        with self.rcond:
            self.reader = None
            if self.sleeping:
                self.rcond.notify_all()

    def _read_one(self, timeout):
        """Reads one message and handles it (reader role held): 'data', 'wake' or None."""
        try:
            data, tensors = self.rget(timeout)
        except queue.Empty:
            return None
        if len(data) < _RESULT.size:
            return "wake"
        with self.lock:
            self._on_result(data, tensors)
            self._dispatch()
        return "data"

    def wait_for(self, job, timeout):
        """AsyncResult.wait in a thread other than the handler: reads the result queue
        itself while no other thread does (see _acquire_reader)."""
        end = None if timeout is None else time.monotonic() + max(0.0, timeout)
        woke = False
        with self.rcond:
            self.waiters += 1
        try:
            while not job._event.is_set():
                left = _WAITER_SLICE if end is None else min(_WAITER_SLICE,
                                                             end - time.monotonic())
                if left <= 0:
                    return
                with self.rcond:
                    reader = self.reader
                if reader == "handler" and not woke:
                    woke = True
                    self.wake()   # the handler leaves its read, and then the role
                if not self._acquire_reader("waiter", True, left):
                    continue
                try:
                    if self.handler_done:
                        job._event.wait(left)
                        continue
                    self._read_one(left)
                finally:
                    self._release_reader()
                self._run_completed(mine=job)
        finally:
            with self.rcond:
                self.waiters -= 1
                if not self.waiters:
                    self.waiter_left = time.monotonic()

    # -- dead workers (lock held)

    def _on_exit(self, w):
        """Fails what `w` held, sends back what it had not started, replaces it."""
        running = self.slots[w.index]
        why = None
        requeue = []
        for b in w.inflight:
            del self.batches[b.seq]
            if b.first <= running < b.first + b.n and running - b.first >= b.received:
                ri = running - b.first
                why = why or _describe_exit(w.process)
                pid = w.process.pid
                for i in range(b.received, ri):
                    self._fail_tasks(b.kind, b.targets, i, 1, _C.WorkerLostError(
                        f"pool worker {pid} died ({why}) after running task {b.first + i}, "
                        f"before its result was sent"))
                self._fail_tasks(b.kind, b.targets, ri, 1, _C.WorkerLostError(
                    f"pool worker {pid} died ({why}) while running task {running}"))
                rest = ri + 1
            elif b.first + b.n <= running:
                # Ran to its end but its last results were lost.
                why = why or _describe_exit(w.process)
                self._fail_tasks(b.kind, b.targets, b.received, b.n - b.received,
                                 _C.WorkerLostError(
                                     f"pool worker {w.process.pid} died ({why}) after running "
                                     f"tasks {b.first + b.received}-{b.first + b.n - 1}, "
                                     f"before their results were sent"))
                continue
            else:
                rest = b.received
            if rest < b.n:
                requeue.append((b, rest))
        w.inflight.clear()
        for b, rest in reversed(requeue):
            if b.kind == _APPLY:
                src = _ApplySource()
                src.calls.extend((job, f, a, k) for (f, a, k), job in
                                 zip(b.items[rest:], b.targets[rest:]))
            else:
                job, start = b.targets
                src = _MapSource(job, b.func, b.kind, b.items[rest:], 1, start + rest)
                src.sets_length = False
            self.pending.appendleft(src)
        w.process.join()
        if self.state == _RUN or (self.state == _CLOSE and (self.pending or self.batches)):
            self.workers[w.index] = self._start_worker(w.index)
        else:
            w.stopped = True
        self._dispatch()

    # -- the handler thread

    def handle(self):
        try:
            last_check = time.monotonic()
            while True:
                got = None
                if self._acquire_reader("handler", True, _CHECK_SECONDS):
                    try:
                        got = self._read_one(_CHECK_SECONDS)
                    finally:
                        self._release_reader()
                with self.rcond:
                    deferred, self.deferred = self.deferred, []
                for job in deferred:
                    job._complete()
                self._run_completed()
                now = time.monotonic()
                if got != "data" or now - last_check >= _CHECK_SECONDS:
                    last_check = now
                    if self._check_workers():
                        return
        finally:
            with self.rcond:
                self.handler_done = True
                deferred, self.deferred = self.deferred, []
                self.rcond.notify_all()
            for job in deferred:
                job._complete()

    def _check_workers(self):
        """Replaces dead workers, stops idle ones after close(); True when the thread ends."""
        with self.lock:
            if self.state == _TERMINATE:
                return True
            sentinels = {w.process.sentinel: w for w in self.workers if not w.stopped}
        dead = _mpconn.wait(list(sentinels), 0) if sentinels else []
        if dead and self._reap(dead, sentinels):
            return True
        with self.lock:
            if self.state == _CLOSE and not self.pending and not self.batches:
                for w in self.workers:
                    if not w.stopped:
                        w.put(_TASK.pack(_STOP, 0, 0, 0), [], None)
                        w.stopped = True
                for w in self.workers:
                    w.process.join()
                return True
        return False

    def _reap(self, dead, sentinels):
        """Handles the exit of the workers whose sentinels are `dead`; True when the pool
        was terminated meanwhile."""
        # Their last results are on the queue already (put returns once written): read them
        # all first, holding the reader role so no waiter reads one meanwhile.
        while not self._acquire_reader("handler", False, _CHECK_SECONDS):
            pass
        try:
            while self._read_one(0) is not None:
                pass
            with self.lock:
                if self.state == _TERMINATE:
                    return True
                for s in dead:
                    if self.workers[sentinels[s].index] is sentinels[s]:
                        self._on_exit(sentinels[s])
        finally:
            self._release_reader()
        self._run_completed()
        return False

    def wake(self):
        self.results._q.put(b"", [], None)

    def repopulate(self):
        """Replaces the workers that have exited, now (Python's Pool._repopulate_pool)."""
        with self.lock:
            sentinels = {w.process.sentinel: w for w in self.workers if not w.stopped}
        dead = _mpconn.wait(list(sentinels), 0) if sentinels else []
        if dead:
            self._reap(dead, sentinels)

    def terminate_workers(self):
        with self.lock:
            self.state = _TERMINATE
            self.pending.clear()
            workers = list(self.workers)
            for w in workers:
                w.stopped = True
        for w in workers:
            if w.process.exitcode is None:
                w.process.terminate()
        for w in workers:
            w.process.join()
        with self.lock:
            error = _C.ClosedError("the pool was terminated before this task completed")
            for job in list(self.jobs):
                if isinstance(job, (IMapIterator,)):
                    job._set(job._next, False, error)
                    job._set_length(job._next)
                    self._finished(job)
                elif job._set(0, False, error):
                    self._finished(job)
            self.jobs.clear()
            self.batches.clear()
        self._run_completed()


class Pool:
    """multiprocessing.Pool on torchpar (see the module docstring).

    processes: workers (None: os.cpu_count()); ValueError when below 1. initializer(*initargs)
    runs in each worker first. maxtasksperchild: tasks after which a worker exits and is
    replaced (None: never); ValueError unless a positive int. context: the context whose
    Process starts workers (None: torchpar.multiprocessing's current one). TypeError when
    initializer is not callable.
    """

    def __init__(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None,
                 context=None):
        if processes is None:
            processes = os.cpu_count() or 1
        if processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if maxtasksperchild is not None and (
                not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if context is None:
            from torchpar.multiprocessing.context import get_context
            context = get_context()
        self._ctx = context
        self._processes = processes
        self._s = _State(_QueueContext(context), processes, initializer, initargs,
                         maxtasksperchild)
        self._handler = threading.Thread(target=self._s.handle, name="TorchparPoolHandler",
                                         daemon=True)
        self._s.thread = self._handler
        self._handler.start()
        # Terminates the pool when it is collected or at exit (as Python's pool does), before
        # the interpreter finalizes: a daemon thread still inside the C++ get then would
        # abort the process.
        self._terminate = util.Finalize(self, _shutdown, args=(self._s, self._handler),
                                        exitpriority=15)

    @property
    def _pool(self):
        """The worker processes (Python's Pool._pool)."""
        return [w.process for w in self._s.workers]

    @property
    def _state(self):
        return self._s.state

    @_state.setter
    def _state(self, value):
        self._s.state = value

    def _repopulate_pool(self):
        self._s.repopulate()

    def __reduce__(self):
        raise NotImplementedError(
            "pool objects cannot be passed between processes or pickled")

    def __repr__(self):
        return (f"<{type(self).__module__}.{type(self).__qualname__} "
                f"state={self._s.state} pool_size={self._processes}>")

    # -- submitting

    def apply(self, func, args=(), kwds={}):
        """func(*args, **kwds) in a worker; its value, or raises its exception."""
        return self.apply_async(func, args, kwds).get()

    def apply_async(self, func, args=(), kwds={}, callback=None, error_callback=None):
        """An AsyncResult of func(*args, **kwds). callback(value) or error_callback(exc)
        runs in the pool's handler thread before the result is ready. ValueError when the
        pool is not running."""
        job = ApplyResult(callback, error_callback, self._s)
        self._s.submit((job, func, tuple(args), dict(kwds)))
        return job

    def map(self, func, iterable, chunksize=None):
        """[func(x) for x in iterable] computed by the workers, in order; raises the first
        failed task's exception."""
        return self._map_async(func, iterable, _MAP, chunksize).get()

    def starmap(self, func, iterable, chunksize=None):
        """[func(*args) for args in iterable], in order."""
        return self._map_async(func, iterable, _STARMAP, chunksize).get()

    def map_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        """A MapResult of map(func, iterable); callback(list) or error_callback(exc)."""
        return self._map_async(func, iterable, _MAP, chunksize, callback, error_callback)

    def starmap_async(self, func, iterable, chunksize=None, callback=None,
                      error_callback=None):
        """A MapResult of starmap(func, iterable)."""
        return self._map_async(func, iterable, _STARMAP, chunksize, callback, error_callback)

    def _map_async(self, func, iterable, kind, chunksize, callback=None, error_callback=None):
        self._check_running()
        if not hasattr(iterable, "__len__"):
            iterable = list(iterable)
        chunksize = self._chunksize(chunksize)
        job = MapResult(len(iterable), callback, error_callback, self._s)
        if len(iterable) == 0:
            job._success = True
            job._value = []
            job._complete()
            return job
        self._s.submit(_MapSource(job, func, kind, iterable, chunksize))
        return job

    def imap(self, func, iterable, chunksize=1):
        """An iterator of func(x) for x in iterable, in order, consumed lazily."""
        return self._imap(IMapIterator(), func, iterable, chunksize)

    def imap_unordered(self, func, iterable, chunksize=1):
        """An iterator of func(x) for x in iterable, in completion order."""
        return self._imap(IMapUnorderedIterator(), func, iterable, chunksize)

    def _imap(self, job, func, iterable, chunksize):
        self._check_running()
        chunksize = self._chunksize(chunksize)
        self._s.submit(_MapSource(job, func, _MAP, iterable, chunksize))
        return job

    def _chunksize(self, chunksize):
        if chunksize is None:
            return 1
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        return chunksize

    def _check_running(self):
        if self._s.state != _RUN:
            raise ValueError("Pool not running")

    # -- ending

    def close(self):
        """No more tasks; workers exit once the submitted ones are done."""
        with self._s.lock:
            if self._s.state == _RUN:
                self._s.state = _CLOSE
        self._s.wake()

    def terminate(self):
        """Stops the workers now (SIGTERM, as Python's); outstanding results fail with
        torchpar.ClosedError."""
        self._terminate()

    def join(self):
        """Waits for the workers to exit after close() or terminate(); ValueError while the
        pool is running."""
        if self._s.state == _RUN:
            raise ValueError("Pool is still running")
        self._handler.join()
        for w in list(self._s.workers):
            w.process.join()

    def __enter__(self):
        self._check_running()
        return self

    def __exit__(self, *exc):
        self.terminate()

    def __del__(self, _warn=warnings.warn):
        s = getattr(self, "_s", None)
        if s is not None and s.state == _RUN:
            _warn(f"unclosed running multiprocessing pool {self!r}", ResourceWarning,
                  source=self)


def _shutdown(state, handler):
    state.terminate_workers()
    state.wake()
    if handler is not threading.current_thread():
        handler.join()


class _QueueContext:
    """The pool's context: Process from the given context, Queue from torchpar's."""

    def __init__(self, ctx):
        from torchpar.multiprocessing.queues import Queue
        self.Process = ctx.Process
        self._queue = Queue
        self._ctx = ctx

    def Queue(self, capacity_bytes):
        return self._queue(0, ctx=self._ctx, capacity_bytes=capacity_bytes)
