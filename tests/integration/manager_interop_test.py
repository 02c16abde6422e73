#!/usr/bin/python3
"""`torchpar manager` driven by Python 3.11's own multiprocessing.managers client (the
legacy HMAC-MD5 handshake Debian's Python speaks), with the standard library only.

Cases (each server is started with --address 127.0.0.1:0 or a path and --authkey-file, in a
session of its own, and killed with its process group whatever happens):
  1. the right key: dict set/get and KeyError raised as KeyError; list append, slices and
     IndexError; Queue put/get with a timeout, queue.Empty / queue.Full raised as such after
     about the timeout; a Lock held by one connection (acquire with a timeout fails in another
     thread's connection, a blocking acquire succeeds once it is released); an Event set by
     one thread wakes another's wait; a value of a class outside the protocol's (fractions.
     Fraction) is refused with an error naming it, and the connection still works;
  2. a wrong key: multiprocessing.AuthenticationError, and the server keeps serving;
  3. two Python client processes share one dict through its token: one creates it and
     writes, the other builds a DictProxy from the token (typeid, address, id), reads, and
     writes back; the first sees the write;
  4. garbage: random bytes, a 2 GiB length header, a connection closed at once, and (past the
     handshake, with the key) a message that is not a pickle and a request naming a global
     outside the allow-list: the server still serves afterwards;
  5. AF_UNIX: a filesystem path as --address works the same (dict set/get);
  7. a C++ client (examples/04_python_shared_dict.cpp, PythonDictProxy) and a Python client
     share dicts both ways: C++ attaches to the dict Python made by its token's id, reads
     Python's items and writes its own; Python attaches to the dict C++ made by its ident and
     writes a reply C++ reads; the C++ dict is freed once both let go;
  6. SIGTERM: exit status 0 within 10 s, no process left in the server's session, and the
     AF_UNIX socket file removed (as Python's Listener does on close).
Exit 77 (skipped) when BIN_DIR/torchpar has no `manager` subcommand.
usage: manager_interop_test.py BIN_DIR"""
import faulthandler
import fractions
import multiprocessing
import multiprocessing.connection
import multiprocessing.managers
import os
import pickle
import queue
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

BIN = sys.argv[1]
TORCHPAR = os.path.join(BIN, "torchpar")
EXAMPLE = os.path.join(BIN, "example_python_shared_dict")
LISTENING = "torchpar manager: listening on "
CASE_S = 15  # bound on one case (SIGALRM); the whole test is bounded by ctest and below
failures = []

faulthandler.dump_traceback_later(120, exit=True)  # a hung call: stacks, then exit 1


def check(cond, what, detail=""):
    """Prints `what` with ok / FAIL (and `detail` when it fails); counts the failures."""
    print(("ok   " if cond else "FAIL ") + what + ("" if cond or not detail else "\n     " + detail),
          flush=True)
    if not cond:
        failures.append(what)
    return cond


def raises(exc_type, fn, *args, **kwargs):
    """The exception fn raised if it is an exc_type, else None (printing what happened)."""
    try:
        got = fn(*args, **kwargs)
    except exc_type as e:
        return e
    except Exception as e:  # noqa: BLE001  (the wrong type is the finding)
        print(f"     raised {type(e).__module__}.{type(e).__name__}: {e}")
        return None
    print(f"     returned {got!r}")
    return None


def has_manager_command():
    """`torchpar manager --help` prints the subcommand's usage (a torchpar without it prints
    the top-level help, also with status 0)."""
    try:
        r = subprocess.run([TORCHPAR, "manager", "--help"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and re.search(r"^Usage: \S+ manager\b", r.stdout, re.M) is not None


class Server:
    """`torchpar manager` in its own session; .address is what it printed, parsed."""

    def __init__(self, workdir, address="127.0.0.1:0"):
        # Random bytes, but never a trailing CR or LF: `torchpar manager --authkey-file` drops
        # those (a key file written by echo), so 1 key in 128 would differ.
        self.authkey = secrets.token_bytes(31) + b"."
        key_path = os.path.join(workdir, f"key.{secrets.token_hex(4)}")
        self.key_path = key_path
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.authkey + b"\n")  # the trailing newline is stripped
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([TORCHPAR, "manager", "--address", address,
                                      "--authkey-file", key_path],
                                     stdout=subprocess.PIPE, stderr=self.stderr,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        line = self._first_line(30)
        if not line.startswith(LISTENING):
            self.kill()
            raise RuntimeError(f"unexpected first line {line!r}; stderr: {self.err_text()}")
        text = line[len(LISTENING):].strip()
        if "/" in text:
            self.address = text
        else:
            host, _, port = text.rpartition(":")
            self.address = (host, int(port))

    def _first_line(self, seconds):
        import selectors
        deadline = time.monotonic() + seconds
        data = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in data:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    break
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                data += chunk
        return data.decode(errors="replace")

    def err_text(self):
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace").strip()[-600:]

    def alive(self):
        return self.proc.poll() is None

    def manager(self, authkey=None):
        m = multiprocessing.managers.SyncManager(address=self.address,
                                                 authkey=authkey or self.authkey)
        m.connect()
        return m

    def group_gone(self, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.05)
        return False

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc.stdout.close()


class CaseTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise CaseTimeout(f"case ran past {CASE_S} s")


def run_case(name, fn, *args):
    print(f"-- {name}", flush=True)
    signal.alarm(CASE_S)
    try:
        fn(*args)
    except (Exception, CaseTimeout) as e:  # noqa: BLE001
        check(False, f"{name}: completes", f"{type(e).__name__}: {e}")
    finally:
        signal.alarm(0)


# ---------------------------------------------------------------- cases
def case_right_key(server):
    m = server.manager()
    d = m.dict()
    d["a"] = 1
    d[(1, "b")] = [1, 2.5, None, b"x"]
    check(d["a"] == 1 and d.get((1, "b")) == [1, 2.5, None, b"x"] and len(d) == 2,
          "dict set/get (str and tuple keys; list value)", repr(d.copy()))
    e = raises(KeyError, lambda: d["missing"])
    check(e is not None and e.args == ("missing",), "d['missing'] raises KeyError('missing')")
    check(d.get("missing", 7) == 7, "d.get with a default")

    l = m.list([1, 2])
    for i in range(3, 6):
        l.append(i)
    check(l[:] == [1, 2, 3, 4, 5] and l[-1] == 5 and len(l) == 5, "list append, slice, index",
          repr(l[:]))
    check(raises(IndexError, lambda: l[10]) is not None, "l[10] raises IndexError")

    q = m.Queue(1)
    q.put("x", timeout=1)
    t0 = time.monotonic()
    full = raises(queue.Full, q.put, "y", True, 0.3)
    check(full is not None and time.monotonic() - t0 >= 0.25, "put on a full Queue(1) with "
          "timeout 0.3 raises queue.Full after ~0.3 s")
    check(q.get(timeout=1) == "x", "Queue get with a timeout")
    t0 = time.monotonic()
    empty = raises(queue.Empty, q.get, True, 0.3)
    elapsed = time.monotonic() - t0
    check(empty is not None and 0.25 <= elapsed < 5, f"get on an empty Queue with timeout 0.3 "
          f"raises queue.Empty after ~0.3 s ({elapsed:.2f} s)")
    check(raises(queue.Empty, q.get_nowait) is not None, "get_nowait raises queue.Empty")

    lock = m.Lock()
    check(lock.acquire(), "Lock acquire")
    got = {}

    def other(timeout_result_key, **kw):
        got[timeout_result_key] = lock.acquire(**kw)

    t = threading.Thread(target=other, args=("timed",), kwargs={"timeout": 0.3})
    t.start()
    t.join(5)
    check(got.get("timed") is False, "another connection's acquire(timeout=0.3) on a held "
          "Lock returns False", repr(got))
    t = threading.Thread(target=other, args=("blocking",))
    t.start()
    time.sleep(0.2)  # not a barrier: the acquire is checked to wait, whatever the timing
    check(t.is_alive(), "a blocking acquire waits while the Lock is held")
    lock.release()
    t.join(5)
    check(got.get("blocking") is True, "... and returns True once released", repr(got))
    lock_release_err = raises(Exception, lambda: (lock.release(), lock.release()))
    check(lock_release_err is not None, "releasing an unlocked Lock raises")

    ev = m.Event()
    woke = {}
    t = threading.Thread(target=lambda: woke.setdefault("r", ev.wait(10)))
    t.start()
    check(not ev.is_set(), "Event starts unset")
    ev.set()
    t.join(5)
    check(woke.get("r") is True and ev.is_set(), "Event.set wakes a wait in another connection")
    check(ev.wait(0.05) is True, "wait on a set Event returns True at once")

    e = raises(Exception, d.__setitem__, "f", fractions.Fraction(1, 3))
    check(e is not None and "Fraction" in str(e), "a fractions.Fraction value is refused with "
          "an error naming it", "" if e is None else f"{type(e).__name__}: {e}")
    check(d["a"] == 1, "the connection still works after the refusal")


def case_wrong_key(server):
    e = raises(multiprocessing.AuthenticationError, server.manager, b"not the key")
    check(e is not None, "a wrong key: connect() raises multiprocessing.AuthenticationError")
    check(server.alive(), "the server still runs")
    m = server.manager()
    d = m.dict()
    d["k"] = "v"
    check(d["k"] == "v", "the right key still works after the refused one")


WRITER = r"""
import multiprocessing.managers as mm, sys
addr = eval(sys.argv[1]); key = bytes.fromhex(sys.argv[2])
m = mm.SyncManager(address=addr, authkey=key); m.connect()
d = m.dict()
d["from_writer"] = [1, "two", 3.0]
t = d._token
print(repr((t.typeid, t.address, t.id)), flush=True)
sys.stdin.readline()  # the reader has written
print(repr(d.get("from_reader")), flush=True)
"""

READER = r"""
import multiprocessing.managers as mm, sys
addr = eval(sys.argv[1]); key = bytes.fromhex(sys.argv[2])
typeid, address, ident = eval(sys.argv[3])
token = mm.Token(typeid, address, ident)
d = mm.DictProxy(token, "pickle", authkey=key)
print(repr(d["from_writer"]), flush=True)
d["from_reader"] = ("reader", 42)
"""


def case_two_processes(server):
    addr, key = repr(server.address), server.authkey.hex()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, addr, key], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        token = writer.stdout.readline().strip()
        check(token.startswith("('dict',"), "writer: created a dict, token " + token,
              writer.stderr.read() if not token else "")
        reader = subprocess.run([sys.executable, "-c", READER, addr, key, token],
                                capture_output=True, text=True, timeout=10)
        check(reader.returncode == 0 and reader.stdout.strip() == "[1, 'two', 3.0]",
              "reader: a DictProxy from the token reads the writer's value",
              f"rc {reader.returncode}: {reader.stdout.strip()} {reader.stderr.strip()[-400:]}")
        out, err = writer.communicate("go\n", timeout=10)
        check(writer.returncode == 0 and out.strip() == "('reader', 42)",
              "writer: sees the reader's write", f"rc {writer.returncode}: {out} {err[-400:]}")
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


def case_cpp_client(server):
    """A Python client and a C++ client (examples/04_python_shared_dict.cpp) share dicts."""
    m = server.manager()
    d = m.dict()
    d["from_python"] = "h\u00e9llo"
    d[1] = 1.5
    d["counter"] = 41
    before = m._number_of_objects()  # d and what earlier cases left
    addr = server.address if isinstance(server.address, str) else "%s:%d" % server.address
    cpp = subprocess.Popen([EXAMPLE, addr, server.key_path, d._token.id], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or not lines[-1].startswith("ident:"):
            line = cpp.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
        check(lines[:3] == ["python wrote: 'from_python' = 'h\u00e9llo'", "python wrote: 1 = 1.5",
                            "python wrote: 'counter' = 41"],
              "C++ reads the items a Python client wrote (str, int and float keys)", repr(lines))
        check(d["from_cpp"] == "hello from C++" and d[("step", 1)] == 0.5 and
              d["counts"] == [1, 2, 3] and d["counter"] == 42 and d[1.0] == 1.5,
              "Python reads what C++ wrote (str, tuple key, list value, read-modify-write)",
              repr(d.copy()))
        ident = lines[-1].split()[-1] if lines and lines[-1].startswith("ident:") else None
        check(ident is not None, "C++ made a dict of its own and printed its ident", repr(lines))
        if ident is None:
            return
        theirs = multiprocessing.managers.DictProxy(
            multiprocessing.managers.Token("dict", server.address, ident), "pickle",
            authkey=server.authkey)
        check(theirs.copy() == {"answer": 42}, "Python reads the C++ client's dict by its ident",
              repr(theirs.copy()))
        theirs["reply"] = ("ok", 2)
        out, err = cpp.communicate("go\n", timeout=10)
        check(cpp.returncode == 0 and out.strip() == "reply: ('ok', 2)",
              "C++ sees Python's write in its dict", f"rc {cpp.returncode}: {out} {err[-400:]}")
        del theirs
        deadline = time.monotonic() + 5  # the server sees the C++ client's close soon after
        while m._number_of_objects() != before and time.monotonic() < deadline:
            time.sleep(0.05)
        check(m._number_of_objects() == before,
              "the C++ client's dict is freed with the last proxy (its exit, Python's del)",
              f"{m._number_of_objects()} objects, {before} before")
    finally:
        if cpp.poll() is None:
            cpp.kill()
            cpp.wait()


def raw_connect(address):
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(address)
    return s


def drain(s):
    """Reads until the server closes or 1 s passes; returns what came."""
    s.settimeout(1)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data


def case_garbage(server):
    for what, payload in (("64 random bytes", secrets.token_bytes(64)),
                          ("a 2 GiB length header", struct.pack("!i", 0x7FFFFFFF) + b"xx"),
                          ("a negative length header", struct.pack("!i", -1)),
                          ("nothing (closed at once)", b"")):
        s = raw_connect(server.address)
        if payload:
            try:
                s.sendall(payload)
            except OSError:
                pass
            drain(s)
        s.close()
        check(server.alive(), f"raw garbage ({what}): the server still runs", server.err_text())

    # Past the handshake: a message that is not a pickle, then a pickle naming a global
    # outside the allow-list (os.system, which a pickle-trusting server would call).
    for what, message in (("a message that is not a pickle", b"\x80\x04not a pickle at all"),
                          ("a pickle naming os.system",
                           pickle.dumps((None, "create", ("dict",), {"x": _Evil()}), 4))):
        conn = multiprocessing.connection.Client(server.address, authkey=server.authkey)
        conn.send_bytes(message)
        reply = None
        if conn.poll(5):
            try:
                reply = conn.recv()
            except (EOFError, OSError):
                reply = "closed"
        conn.close()
        kind = reply[0] if isinstance(reply, tuple) and reply else reply
        check(kind in ("#ERROR", "#TRACEBACK", "closed"), f"{what}: an error reply or a close",
              repr(reply)[:300])
        check(server.alive(), f"{what}: the server still runs", server.err_text())
    check(not os.path.exists(MARKER), "os.system in a request was not called")
    m = server.manager()
    d = m.dict({"after": "garbage"})
    check(d["after"] == "garbage", "a client works after the garbage")


MARKER = os.path.join(tempfile.gettempdir(), f"manager_interop_pwned.{os.getpid()}")


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def case_unix(workdir):
    path = os.path.join(workdir, "manager.sock")
    server = Server(workdir, path)
    try:
        check(server.address == path, f"listening on the path ({server.address!r})")
        d = server.manager().dict()
        d[1] = "one"
        check(d[1] == "one", "AF_UNIX: dict set/get")
        case_sigterm(server, path)
    finally:
        server.kill()


def case_sigterm(server, path=None):
    os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        rc = server.proc.wait(10)
    except subprocess.TimeoutExpired:
        rc = "still running 10 s after SIGTERM"
    check(rc == 0, f"SIGTERM: exit status 0 (got {rc})", server.err_text())
    check(server.group_gone(5), "SIGTERM: no process left in the server's session")
    if path:
        check(not os.path.exists(path), "SIGTERM: the socket file is removed")


def main():
    if not has_manager_command():
        print(f"skip: {TORCHPAR} has no `manager` subcommand")
        return 77
    signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="manager_interop_") as workdir:
        server = Server(workdir)
        try:
            print(f"server at {server.address}", flush=True)
            run_case("right key", case_right_key, server)
            run_case("wrong key", case_wrong_key, server)
            run_case("two client processes, one dict", case_two_processes, server)
            run_case("a Python and a C++ client, shared dicts", case_cpp_client, server)
            run_case("garbage", case_garbage, server)
            run_case("SIGTERM (TCP)", case_sigterm, server)
        finally:
            server.kill()
        run_case("AF_UNIX path, SIGTERM", case_unix, workdir)
    if os.path.exists(MARKER):
        os.unlink(MARKER)
    print(f"{len(failures)} failure(s) in {time.monotonic() - started:.1f} s")
    for f in failures:
        print("  FAILED: " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
