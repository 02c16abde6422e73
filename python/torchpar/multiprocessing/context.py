"""Contexts: multiprocessing's, with torchpar's queues and pipes.

get_context(method) returns a multiprocessing.context.BaseContext (DataLoader checks that
type for multiprocessing_context) whose Process is Python's own for that start method (fork,
spawn, forkserver) and whose Queue, SimpleQueue, JoinableQueue and Pipe are torchpar's.
torchpar objects pass to children under every start method (fds travel as multiprocessing
passes them: inherited under fork, duplicated for the child under spawn and forkserver).
Pool is torchpar's (pool.py). The other factories (Lock, Event, ...) are multiprocessing's
own for now.
"""
import multiprocessing
import multiprocessing.context as _mpc

from torchpar.multiprocessing import connection as _connection
from torchpar.multiprocessing import queues as _queues


class TorchparContext(_mpc.BaseContext):
    """A start method's context with torchpar's Queue, SimpleQueue, JoinableQueue, Pipe."""

    def __init__(self, method):
        self._base = multiprocessing.get_context(method)
        self._name = self._base.get_start_method()
        self.Process = self._base.Process

    def get_context(self, method=None):
        if method is None or method == self._name:
            return self
        return get_context(method)

    def get_start_method(self, allow_none=False):
        return self._name

    def set_start_method(self, method, force=False):
        raise ValueError("cannot set the start method of a concrete context")

    def Queue(self, maxsize=0):
        """A torchpar Queue (multiprocessing.Queue's surface; tensors shared)."""
        return _queues.Queue(maxsize, ctx=self)

    def SimpleQueue(self):
        """A torchpar SimpleQueue."""
        return _queues.SimpleQueue(ctx=self)

    def JoinableQueue(self, maxsize=0):
        """A torchpar JoinableQueue (task_done and join)."""
        return _queues.JoinableQueue(maxsize, ctx=self)

    def Pipe(self, duplex=True):
        """A pair of torchpar Connections (multiprocessing.Pipe)."""
        return _connection.Pipe(duplex)

    def Pool(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None):
        """A torchpar Pool whose workers this context starts (multiprocessing.Pool's
        surface; a worker that dies fails its tasks with torchpar.WorkerLostError)."""
        from torchpar.multiprocessing.pool import Pool
        return Pool(processes, initializer, initargs, maxtasksperchild, context=self)

    def __repr__(self):
        return f"<torchpar.multiprocessing context {self._name!r}>"


_contexts = {}


def get_context(method=None):
    """The torchpar context of `method` ('fork', 'spawn', 'forkserver'; None: the current
    start method, as multiprocessing.get_context). ValueError for an unknown method."""
    if method is None:
        method = multiprocessing.get_start_method()
    if method not in _contexts:
        if method not in multiprocessing.get_all_start_methods():
            raise ValueError(f"cannot find context for {method!r}")
        _contexts[method] = TorchparContext(method)
    return _contexts[method]
