"""Contexts: multiprocessing's, with torchpar's queues and pipes.

get_context(method) returns a multiprocessing.context.BaseContext (DataLoader checks that
type for multiprocessing_context) whose Process is Python's own for that start method (fork,
spawn, forkserver; in the child, torch's new shared storages -- DataLoader's collated batches
-- are made in torchpar shared memory) and whose Queue, SimpleQueue, JoinableQueue and Pipe are torchpar's.
Its Lock, RLock, Semaphore, BoundedSemaphore, Condition, Event, Barrier
(synchronize.py), Value, Array, RawValue, RawArray (sharedctypes.py) and Pool (pool.py) are
torchpar's too. torchpar objects pass to children under every start method (fds travel as
multiprocessing passes them: inherited under fork, duplicated for the child under spawn and
forkserver). Manager() stays Python's own.
"""
import multiprocessing
import multiprocessing.context as _mpc

import torch

from torchpar.multiprocessing import connection as _connection
from torchpar.multiprocessing import queues as _queues
from torchpar.multiprocessing import sharedctypes as _sharedctypes
from torchpar.multiprocessing import synchronize as _sync


class TorchparContext(_mpc.BaseContext):
    """A start method's context with torchpar's queues, pipes, locks, shared values and
    Pool."""

    def __init__(self, method):
        self._base = multiprocessing.get_context(method)
        self._name = self._base.get_start_method()
        self.Process = _PROCESS_CLASSES[self._name]

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

    def Lock(self):
        """A torchpar Lock (multiprocessing.Lock: any process may release it)."""
        return _sync.Lock(ctx=self)

    def RLock(self):
        """A torchpar RLock (robust: a dead holder's lock is recovered)."""
        return _sync.RLock(ctx=self)

    def Condition(self, lock=None):
        """A torchpar Condition over `lock` (default a new RLock)."""
        return _sync.Condition(lock, ctx=self)

    def Semaphore(self, value=1):
        """A torchpar Semaphore."""
        return _sync.Semaphore(value, ctx=self)

    def BoundedSemaphore(self, value=1):
        """A torchpar BoundedSemaphore."""
        return _sync.BoundedSemaphore(value, ctx=self)

    def Event(self):
        """A torchpar Event."""
        return _sync.Event(ctx=self)

    def Barrier(self, parties, action=None, timeout=None):
        """A torchpar Barrier (threading.Barrier's surface across processes)."""
        return _sync.Barrier(parties, action, timeout, ctx=self)

    def RawValue(self, typecode_or_type, *args):
        """A ctypes object in torchpar shared memory (no lock)."""
        return _sharedctypes.RawValue(typecode_or_type, *args)

    def RawArray(self, typecode_or_type, size_or_initializer):
        """A ctypes array in torchpar shared memory (no lock)."""
        return _sharedctypes.RawArray(typecode_or_type, size_or_initializer)

    def Value(self, typecode_or_type, *args, lock=True):
        """multiprocessing.Value in torchpar shared memory, behind a torchpar RLock."""
        return _sharedctypes.Value(typecode_or_type, *args, lock=lock, ctx=self)

    def Array(self, typecode_or_type, size_or_initializer, *, lock=True):
        """multiprocessing.Array in torchpar shared memory, behind a torchpar RLock."""
        return _sharedctypes.Array(typecode_or_type, size_or_initializer, lock=lock, ctx=self)

    def Pool(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None):
        """A torchpar Pool whose workers this context starts (multiprocessing.Pool's
        surface; a worker that dies fails its tasks with torchpar.WorkerLostError)."""
        from torchpar.multiprocessing.pool import Pool
        return Pool(processes, initializer, initargs, maxtasksperchild, context=self)

    def __repr__(self):
        return f"<torchpar.multiprocessing context {self._name!r}>"


def _new_shared_in_torchpar(cls, size, *, device="cpu"):
    """torch.UntypedStorage._new_shared in a torchpar context's child: `size` bytes of
    torchpar shared memory (DataLoader's default collate stacks each batch into one of
    these, which then travels as a handle, without the copy a torch segment would need)."""
    if torch.device(device).type != "cpu":
        return _torch_new_shared.__func__(cls, size, device=device)
    from torchpar import _C
    return _C.empty_shared([size], torch.empty(0, dtype=torch.uint8)).storage().untyped()


_torch_new_shared = torch.UntypedStorage._new_shared


def _in_child():
    """What a torchpar context's process does first: torch's new shared storages (the
    batches DataLoader's default collate makes in its workers) come from torchpar."""
    torch.UntypedStorage._new_shared = classmethod(_new_shared_in_torchpar)


def _process_class(method):
    base = multiprocessing.get_context(method).Process

    def run(self):
        _in_child()
        return base.run(self)

    name = "Torchpar" + base.__name__
    cls = type(name, (base,), {"run": run, "__module__": __name__, "__qualname__": name,
                               "__doc__": f"{base.__name__} whose child makes torch's new "
                                          "shared storages in torchpar shared memory."})
    globals()[name] = cls  # spawn pickles the class by name
    return cls


#: The Process class of each start method: Python's own, plus _in_child() in the child.
_PROCESS_CLASSES = {m: _process_class(m) for m in multiprocessing.get_all_start_methods()}

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
