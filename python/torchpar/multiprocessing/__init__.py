"""torchpar.multiprocessing: a drop-in for torch.multiprocessing on torchpar's runtime.

    import torchpar.multiprocessing as mp

Everything torch.multiprocessing offers is here (Process, current_process, cpu_count, the
start methods, spawn, start_processes, ProcessContext, ProcessRaisedException,
ProcessExitedException, the sharing strategies), and these are torchpar's: Queue,
SimpleQueue, JoinableQueue and Pipe (tensors travel as torchpar shared-memory handles: no fd
per tensor, no resource-sharer thread), Pool, Lock, RLock, Semaphore, BoundedSemaphore,
Condition, Event, Barrier, Value, Array, RawValue, RawArray, get_context(method) (a
BaseContext whose factories are these), share_memory_ / empty_shared / is_shared, get_sharing_strategy /
set_sharing_strategy / get_all_sharing_strategies (torchpar's strategies, same names).
"""
import multiprocessing
from multiprocessing import *  # noqa: F401,F403  (torch.multiprocessing re-exports it all)

import torch
from torch.multiprocessing import (  # noqa: F401
    ProcessContext,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
    start_processes,
)

from torchpar import _C
from torchpar.multiprocessing.connection import Connection  # noqa: F401
from torchpar.multiprocessing.context import TorchparContext, get_context  # noqa: F401

__all__ = list(multiprocessing.__all__) + [
    "ProcessContext", "ProcessExitedException", "ProcessRaisedException", "spawn",
    "start_processes", "get_sharing_strategy", "set_sharing_strategy",
    "get_all_sharing_strategies", "share_memory_", "empty_shared", "is_shared",
    "TorchparContext",
]


def _current():
    return get_context(None)


def Queue(maxsize=0):
    """A torchpar Queue of the current start method's context."""
    return _current().Queue(maxsize)


def Pool(processes=None, initializer=None, initargs=(), maxtasksperchild=None):
    """A torchpar Pool of the current start method's context (pool.py)."""
    return _current().Pool(processes, initializer, initargs, maxtasksperchild)


def SimpleQueue():
    """A torchpar SimpleQueue."""
    return _current().SimpleQueue()


def JoinableQueue(maxsize=0):
    """A torchpar JoinableQueue."""
    return _current().JoinableQueue(maxsize)


def Pipe(duplex=True):
    """A pair of torchpar Connections."""
    return _current().Pipe(duplex)


def Lock():
    """A torchpar Lock (synchronize.py)."""
    return _current().Lock()


def RLock():
    """A torchpar RLock (robust: a dead holder's lock is recovered)."""
    return _current().RLock()


def Condition(lock=None):
    """A torchpar Condition over `lock` (default a new RLock)."""
    return _current().Condition(lock)


def Semaphore(value=1):
    """A torchpar Semaphore."""
    return _current().Semaphore(value)


def BoundedSemaphore(value=1):
    """A torchpar BoundedSemaphore."""
    return _current().BoundedSemaphore(value)


def Event():
    """A torchpar Event."""
    return _current().Event()


def Barrier(parties, action=None, timeout=None):
    """A torchpar Barrier."""
    return _current().Barrier(parties, action, timeout)


def RawValue(typecode_or_type, *args):
    """A ctypes object in torchpar shared memory (no lock)."""
    return _current().RawValue(typecode_or_type, *args)


def RawArray(typecode_or_type, size_or_initializer):
    """A ctypes array in torchpar shared memory (no lock)."""
    return _current().RawArray(typecode_or_type, size_or_initializer)


def Value(typecode_or_type, *args, lock=True):
    """multiprocessing.Value in torchpar shared memory, behind a torchpar RLock."""
    return _current().Value(typecode_or_type, *args, lock=lock)


def Array(typecode_or_type, size_or_initializer, *, lock=True):
    """multiprocessing.Array in torchpar shared memory, behind a torchpar RLock."""
    return _current().Array(typecode_or_type, size_or_initializer, lock=lock)


def get_sharing_strategy():
    """This process's sharing strategy ('file_descriptor', the default, or 'file_system')."""
    return _C.get_sharing_strategy()


def set_sharing_strategy(new_strategy):
    """Sets this process's sharing strategy (torch.multiprocessing.set_sharing_strategy);
    ValueError names the valid ones."""
    _C.set_sharing_strategy(new_strategy)


def get_all_sharing_strategies():
    """The sharing strategies torchpar offers: {'file_descriptor', 'file_system'}."""
    return set(_C.get_all_sharing_strategies())


def share_memory_(tensor):
    """Moves a CPU tensor's storage into torchpar shared memory in place (every view sees
    it), releasing the GIL while it copies; returns the tensor. A no-op when already there.
    ValueError for a tensor that cannot be shared (not on the CPU, sparse)."""
    _C.share_memory_(tensor)
    return tensor


def empty_shared(*size, dtype=None):
    """An uninitialised CPU tensor of `size` (ints, or one sequence of them) in torchpar
    shared memory, of `dtype` (None: torch's default dtype)."""
    if len(size) == 1 and not isinstance(size[0], int):
        size = tuple(size[0])
    return _C.empty_shared(list(size), torch.empty(0, dtype=dtype))


def is_shared(tensor):
    """True when the tensor's storage is in torchpar shared memory."""
    return _C.is_shared(tensor)
