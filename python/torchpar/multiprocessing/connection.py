"""Pipe and its Connection ends over torchpar (multiprocessing.Pipe's surface).

send(obj) / recv() carry any picklable object, tensors as shared-memory handles
(reductions.py); send_bytes / recv_bytes / recv_bytes_into carry raw bytes; poll(timeout)
waits. The ends are Unix sockets: multiprocessing.connection.wait() accepts them. Blocking
calls release the GIL. recv raises EOFError (a torchpar.ClosedError) once the peer is gone,
OSError on a closed or wrong-way end, as Python's.
"""
from multiprocessing import BufferTooShort, reduction

from torchpar import _C
from torchpar.multiprocessing.reductions import dumps, loads


def _rebuild(fd, readable, writable):
    return Connection(_C.Connection(fd.detach() if hasattr(fd, "detach") else fd,
                                    readable, writable))


class Connection:
    """One end of a Pipe (multiprocessing.connection.Connection)."""

    def __init__(self, c):
        self._c = c

    def __reduce__(self):
        return _rebuild, (reduction.DupFd(self._c.fileno()), self._c.readable,
                          self._c.writable)

    def _check(self, readable=False, writable=False):
        if self._c.closed:
            raise OSError("handle is closed")
        if readable and not self._c.readable:
            raise OSError("connection is write-only")
        if writable and not self._c.writable:
            raise OSError("connection is read-only")

    @property
    def closed(self):
        return self._c.closed

    @property
    def readable(self):
        return self._c.readable

    @property
    def writable(self):
        return self._c.writable

    def fileno(self):
        self._check()
        return self._c.fileno()

    def close(self):
        if not self._c.closed:
            self._c.close()

    def send(self, obj):
        self._check(writable=True)
        data, tensors = dumps(obj)
        self._c.send(data, tensors)

    def recv(self):
        self._check(readable=True)
        data, tensors = self._c.recv()
        return loads(data, tensors)

    def send_bytes(self, buf, offset=0, size=None):
        self._check(writable=True)
        m = memoryview(buf)
        if m.itemsize > 1:
            m = m.cast("B")
        n = m.nbytes
        if offset < 0:
            raise ValueError("offset is negative")
        if n < offset:
            raise ValueError("buffer length < offset")
        if size is None:
            size = n - offset
        elif size < 0:
            raise ValueError("size is negative")
        elif offset + size > n:
            raise ValueError("buffer length < offset + size")
        self._c.send_bytes(m[offset:offset + size])

    def recv_bytes(self, maxlength=None):
        self._check(readable=True)
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        return self._c.recv_bytes(maxlength)

    def recv_bytes_into(self, buf, offset=0):
        self._check(readable=True)
        with memoryview(buf) as m:
            itemsize = m.itemsize
            bytesize = itemsize * len(m)
            if offset < 0:
                raise ValueError("negative offset")
            elif offset > bytesize:
                raise ValueError("offset too large")
            data = self._c.recv_bytes(None)
            if bytesize < offset + len(data):
                raise BufferTooShort(data)
            m.cast("B")[offset:offset + len(data)] = data
            return len(data)  # bytes, whatever the buffer's item size (as Python)

    def poll(self, timeout=0.0):
        self._check(readable=True)
        return self._c.poll(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def Pipe(duplex=True):
    """A connected pair (conn1, conn2); duplex=False: conn1 only receives, conn2 only sends."""
    a, b = _C.Pipe(duplex)
    return Connection(a), Connection(b)
