"""Pipe and its Connection ends of torchpar.multiprocessing against Python's.

The semantic tests run one body on torchpar's Pipe (per start method's context) and on
multiprocessing's own (the reference): send/recv, send_bytes with offset and size,
recv_bytes(maxlength), recv_bytes_into with BufferTooShort, poll(timeout), duplex=False
directions, EOFError once the peer is closed, OSError on a closed end, and
multiprocessing.connection.wait() over our ends. The cross-process tests run a child under
fork and spawn.
"""
import array
import multiprocessing
import multiprocessing.connection
import time

import pytest
import torch

import torchpar.multiprocessing as tmp

import tp_helpers
from tp_helpers import WAIT_S


@pytest.fixture(params=["torchpar-fork", "torchpar-spawn", "torchpar-forkserver", "python"])
def pctx(request):
    """A context whose Pipe is torchpar's (per start method) or Python's own."""
    if request.param == "python":
        return multiprocessing.get_context("fork")
    return tmp.get_context(request.param.split("-")[1])


def test_send_recv_objects(pctx):
    a, b = pctx.Pipe()
    for obj in [1, "s", None, {"a": (1, 2)}, [b"x"] * 3, 2.5]:
        a.send(obj)
        assert b.recv() == obj
        b.send(obj)
        assert a.recv() == obj
    a.close()
    b.close()


def test_send_bytes_offset_size(pctx):
    a, b = pctx.Pipe()
    msg = b"abcdefghij"
    a.send_bytes(msg)
    a.send_bytes(msg, 3)
    a.send_bytes(msg, 2, 5)
    a.send_bytes(b"")
    a.send_bytes(array.array("i", [1, 2, 3]), 4, 4)  # offset and size in bytes
    assert b.recv_bytes() == msg
    assert b.recv_bytes() == b"defghij"
    assert b.recv_bytes() == b"cdefg"
    assert b.recv_bytes() == b""
    assert b.recv_bytes() == array.array("i", [2]).tobytes()
    with pytest.raises(ValueError):
        a.send_bytes(msg, -1)
    with pytest.raises(ValueError):
        a.send_bytes(msg, 11)
    with pytest.raises(ValueError):
        a.send_bytes(msg, 2, -1)
    with pytest.raises(ValueError):
        a.send_bytes(msg, 5, 6)


def test_recv_bytes_maxlength(pctx):
    a, b = pctx.Pipe()
    a.send_bytes(b"12345")
    assert b.recv_bytes(5) == b"12345"
    with pytest.raises(ValueError):
        b.recv_bytes(-1)
    a.send_bytes(b"123456")
    with pytest.raises(OSError):  # Python: "bad message length"
        b.recv_bytes(5)


def test_recv_bytes_into(pctx):
    a, b = pctx.Pipe()
    buf = bytearray(10)
    a.send_bytes(b"hello")
    assert b.recv_bytes_into(buf) == 5
    assert buf[:5] == b"hello"
    a.send_bytes(b"xyz")
    assert b.recv_bytes_into(buf, 6) == 3
    assert buf == b"hello\0xyz\0"
    ints = array.array("i", [0] * 4)
    a.send_bytes(array.array("i", [7, 8]))
    assert b.recv_bytes_into(ints, 4) == 8  # offset and result in bytes, as Python
    assert ints.tolist() == [0, 7, 8, 0]
    a.send_bytes(b"0123456789AB")
    with pytest.raises(multiprocessing.BufferTooShort) as e:
        b.recv_bytes_into(buf)
    assert e.value.args[0] == b"0123456789AB"  # the message travels in the exception
    a.send_bytes(b"after")
    assert b.recv_bytes() == b"after"  # the pipe goes on


def test_poll_timeout(pctx):
    a, b = pctx.Pipe()
    assert not b.poll()
    t0 = time.monotonic()
    assert not b.poll(0.3)
    assert 0.25 <= time.monotonic() - t0 < 1.5
    a.send("x")
    assert b.poll(WAIT_S) and b.poll(0) and b.poll(None)
    assert b.recv() == "x"
    assert not b.poll(0)


def test_one_way_pipe(pctx):
    r, w = pctx.Pipe(duplex=False)
    assert r.readable and not r.writable
    assert w.writable and not w.readable
    w.send([1, 2])
    w.send_bytes(b"raw")
    assert r.recv() == [1, 2]
    assert r.recv_bytes() == b"raw"
    with pytest.raises(OSError):
        r.send(1)
    with pytest.raises(OSError):
        r.send_bytes(b"x")
    with pytest.raises(OSError):
        w.recv()
    with pytest.raises(OSError):
        w.recv_bytes()
    with pytest.raises(OSError):
        w.poll()


def test_eof_after_peer_closes(pctx):
    a, b = pctx.Pipe()
    a.send("last")
    a.close()
    assert a.closed
    assert b.recv() == "last"  # what was sent before the close still arrives
    assert b.poll(WAIT_S)      # EOF counts as readable
    with pytest.raises(EOFError):
        b.recv()
    with pytest.raises(EOFError):
        b.recv_bytes()
    for call in (lambda: a.send(1), lambda: a.recv(), a.fileno, lambda: a.poll()):
        with pytest.raises(OSError):  # the closed end itself
            call()
    a.close()  # closing twice is fine


def test_connection_wait(pctx):
    a1, b1 = pctx.Pipe()
    a2, b2 = pctx.Pipe()
    wait = multiprocessing.connection.wait
    t0 = time.monotonic()
    assert wait([b1, b2], timeout=0.2) == []
    assert time.monotonic() - t0 >= 0.15
    a2.send("two")
    assert wait([b1, b2], timeout=WAIT_S) == [b2]
    a1.send_bytes(b"one")
    assert set(wait([b1, b2], timeout=WAIT_S)) == {b1, b2}
    assert b1.recv_bytes() == b"one" and b2.recv() == "two"
    a1.close()
    assert wait([b1], timeout=WAIT_S) == [b1]  # EOF wakes wait too


def test_tensor_through_pipe_locally():
    a, b = tmp.Pipe()
    t = torch.arange(10.0)
    a.send({"t": t, "view": t[2:4]})
    d = b.recv()
    assert torch.equal(d["t"], t)
    d["view"].fill_(-1)  # the received tensors share one storage, and the sender's
    assert d["t"][2:4].tolist() == [-1, -1] and t[2:4].tolist() == [-1, -1]


def test_pipe_child_echo(ctx):
    a, b = ctx.Pipe()
    p = tp_helpers.start(ctx, tp_helpers.pipe_echo, b)
    b.close()
    a.send(("obj", {"x": [1, 2, 3]}))
    assert a.recv() == {"x": [1, 2, 3]}
    a.send(("bytes", None))
    a.send_bytes(b"\x00\x01" * 5000)
    assert a.recv_bytes() == b"\x00\x01" * 5000
    t = torch.arange(8.0)
    a.send(("write", t))
    assert a.recv() == "written"
    assert t.tolist() == [2.0 * i for i in range(8)]  # the child's write, seen here
    a.send(("obj", torch.ones(3, 3)))
    assert torch.equal(a.recv(), torch.ones(3, 3))
    a.send((None, None))
    with pytest.raises(EOFError):  # the child closed its end and exited
        a.recv()
    assert tp_helpers.finish(p) == 0


def test_pipe_one_way_child_and_wait(ctx):
    """wait() times out while the child waits for its cue, wakes when it sends, and the
    one-way end reads EOF once the child exits."""
    cue_r, cue_w = ctx.Pipe(duplex=False)
    r, w = ctx.Pipe(duplex=False)
    other_r, other_w = ctx.Pipe(duplex=False)
    p = tp_helpers.start(ctx, tp_helpers.pipe_write_only, cue_r, w)
    w.close()
    assert multiprocessing.connection.wait([r, other_r], timeout=0.2) == []
    cue_w.send("go")
    got = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < 3 and time.monotonic() < deadline:
        ready = multiprocessing.connection.wait([r, other_r], timeout=WAIT_S)
        assert ready == [r]
        got.append(r.recv_bytes())
    assert got == [b"\x00", b"\x01\x01", b"\x02\x02\x02"]
    assert tp_helpers.finish(p) == 0
    with pytest.raises(EOFError):
        r.recv_bytes()
