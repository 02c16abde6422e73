"""Value, Array, RawValue, RawArray: ctypes objects in torchpar shared memory.

multiprocessing.sharedctypes' surface: the objects are ctypes objects over a torchpar
SharedBuffer (a zero-filled sealed memfd per object, instead of Python's mmap arena), and
Value / Array wrap them in multiprocessing's own Synchronized wrappers (.value, .get_lock(),
.get_obj(), slicing) with a torchpar RLock by default. They pass to children as Process
arguments under every start method; like Python's, pickling them elsewhere raises
RuntimeError ("... should only be shared between processes through inheritance").
typecode_or_type: a typecode of the array module ('i', 'd', ...) or a ctypes type.
"""
import ctypes
from multiprocessing import reduction
from multiprocessing import sharedctypes as _sc

from torchpar import _C

__all__ = ["RawValue", "RawArray", "Value", "Array"]


class _Buffer:
    """`nbytes` of torchpar shared memory; what sharedctypes.rebuild_ctype maps a ctypes
    object onto (its create_memoryview) and pickles with the object."""

    def __init__(self, nbytes, shared=None):
        self._nbytes = nbytes
        self._shared = shared if shared is not None else _C.SharedBuffer(nbytes)

    def create_memoryview(self):
        return memoryview(self._shared)

    def __reduce__(self):
        return _rebuild_buffer, (reduction.DupFd(self._shared.fileno()), self._nbytes)


def _rebuild_buffer(fd, nbytes):
    fd = fd.detach() if hasattr(fd, "detach") else fd
    try:
        return _Buffer(nbytes, _C.SharedBuffer.from_fd(fd, nbytes))
    finally:
        import os
        os.close(fd)


def _new_value(type_):
    return _sc.rebuild_ctype(type_, _Buffer(ctypes.sizeof(type_)), None)


def RawValue(typecode_or_type, *args):
    """An unsynchronized ctypes object in shared memory, initialised with `args`."""
    type_ = _sc.typecode_to_type.get(typecode_or_type, typecode_or_type)
    obj = _new_value(type_)
    obj.__init__(*args)
    return obj


def RawArray(typecode_or_type, size_or_initializer):
    """An unsynchronized ctypes array in shared memory: zeros of a size, or a copy of a
    sequence."""
    type_ = _sc.typecode_to_type.get(typecode_or_type, typecode_or_type)
    if isinstance(size_or_initializer, int):
        return _new_value(type_ * size_or_initializer)
    values = list(size_or_initializer)
    obj = _new_value(type_ * len(values))
    obj.__init__(*values)
    return obj


def _synchronized(obj, lock, ctx):
    if lock is False:
        return obj
    if lock in (True, None):
        from torchpar.multiprocessing.context import get_context
        ctx = ctx or get_context()
        lock = ctx.RLock()
    if not hasattr(lock, "acquire"):
        raise AttributeError(f"{lock!r} has no method 'acquire'")
    return _sc.synchronized(obj, lock, ctx=ctx)


def Value(typecode_or_type, *args, lock=True, ctx=None):
    """multiprocessing.Value: a shared ctypes object behind a lock (lock=True or None: a
    new torchpar RLock; a lock object: that one; False: the raw object)."""
    return _synchronized(RawValue(typecode_or_type, *args), lock, ctx)


def Array(typecode_or_type, size_or_initializer, *, lock=True, ctx=None):
    """multiprocessing.Array: a shared ctypes array behind a lock (as Value)."""
    return _synchronized(RawArray(typecode_or_type, size_or_initializer), lock, ctx)
