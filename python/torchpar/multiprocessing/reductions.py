"""How objects travel through torchpar's queues and pipes.

An object becomes (bytes, [tensors]):
  - a bare CPU tensor: one marker byte and the tensor (no pickling at all);
  - anything else: a pickle (protocol 5) whose tensors are persistent ids indexing the tensor
    list, and whose large out-of-band buffers (numpy arrays and other PickleBuffers of at
    least OUT_OF_BAND_BYTES) are uint8 tensors at the head of the list.
The C++ side moves every tensor to torchpar shared memory (in place, as share_memory_) and
sends a handle: the receiver's tensor aliases the sender's memory, as with
torch.multiprocessing, but without a file descriptor per tensor or a resource-sharer thread.
Buffers are copied once, into shared memory; the receiver's array views that memory.

Other objects use the reducers multiprocessing registers (Connection, socket, ...), but not
the ones torch.multiprocessing registers for tensors and storages: those are ours here.
"""
import copyreg
import io
import pickle
import struct
from multiprocessing.reduction import ForkingPickler

import torch

from torchpar import _C

#: PickleBuffers of at least this many bytes travel out of band, through shared memory.
OUT_OF_BAND_BYTES = 64 * 1024

_BARE = b"T"        # a bare tensor, requires_grad False
_BARE_GRAD = b"G"   # a bare tensor, requires_grad True (a leaf)
_PICKLE = b"P"      # struct "<I" (out-of-band buffer count), then the pickle
_HEADER = struct.Struct("<I")

_NON_LEAF = (
    "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd does "
    "not support crossing process boundaries.  If you just want to transfer the data, call "
    "detach() on the tensor before serializing (e.g., putting it on the queue).")

_dispatch = {"size": -1, "table": None}


def _dispatch_table():
    """copyreg's table plus multiprocessing's extra reducers, without torch's tensor ones."""
    extra = ForkingPickler._extra_reducers
    if _dispatch["size"] != len(extra):
        def ours(cls):
            return isinstance(cls, type) and (
                issubclass(cls, torch.Tensor)
                or issubclass(cls, (torch.UntypedStorage, torch.storage.TypedStorage))
                or getattr(cls, "__module__", "").startswith("torch.")
                and cls.__name__.endswith("Storage"))
        table = dict(copyreg.dispatch_table)
        table.update({cls: fn for cls, fn in extra.items() if not ours(cls)})
        _dispatch.update(size=len(extra), table=table)
    return _dispatch["table"]


def _shareable(obj):
    return type(obj) in (torch.Tensor, torch.nn.Parameter)


class _Pickler(pickle.Pickler):
    def __init__(self, file):
        super().__init__(file, protocol=5, buffer_callback=self._buffer)
        self.dispatch_table = _dispatch_table()
        self.tensors = []
        self.buffers = []

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor) or not _shareable(obj):
            return None
        if obj.requires_grad and not obj.is_leaf:
            raise RuntimeError(_NON_LEAF)
        self.tensors.append(obj.detach() if obj.requires_grad else obj)
        return (len(self.tensors) - 1, obj.requires_grad, type(obj) is torch.nn.Parameter)

    def _buffer(self, buf):
        view = buf.raw()
        if view.nbytes < OUT_OF_BAND_BYTES:
            return True  # in band
        shared = torch.empty(view.nbytes, dtype=torch.uint8)
        _C.share_memory_(shared)  # empty: nothing to copy yet
        shared.numpy()[:] = view
        self.buffers.append(shared)
        return False


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors, buffers):
        super().__init__(file, buffers=buffers)
        self._tensors = tensors

    def persistent_load(self, pid):
        index, requires_grad, parameter = pid
        t = self._tensors[index]
        if parameter:
            return torch.nn.Parameter(t, requires_grad=requires_grad)
        return t.requires_grad_() if requires_grad else t


def dumps(obj):
    """(bytes, [tensors]) for `obj`; the tensors are shared (moved to shared memory) when
    the C++ side sends them."""
    if type(obj) is torch.Tensor:
        if not obj.requires_grad:
            return _BARE, [obj]
        if obj.is_leaf:
            return _BARE_GRAD, [obj.detach()]
        raise RuntimeError(_NON_LEAF)
    file = io.BytesIO()
    file.write(_PICKLE + _HEADER.pack(0))
    pickler = _Pickler(file)
    pickler.dump(obj)
    data = file.getbuffer()
    _HEADER.pack_into(data, 1, len(pickler.buffers))
    return bytes(data), pickler.buffers + pickler.tensors


def loads(data, tensors):
    """The object `dumps` made (bytes, [tensors]) from."""
    kind = data[:1]
    if kind == _BARE:
        return tensors[0]
    if kind == _BARE_GRAD:
        return tensors[0].requires_grad_()
    if kind != _PICKLE:
        raise _C.SerializationError(f"not a torchpar message (first byte {kind!r})")
    (n_buffers,) = _HEADER.unpack_from(data, 1)
    buffers = [memoryview(t.numpy()) for t in tensors[:n_buffers]]
    file = io.BytesIO(data)
    file.seek(1 + _HEADER.size)
    return _Unpickler(file, tensors[n_buffers:], buffers).load()
