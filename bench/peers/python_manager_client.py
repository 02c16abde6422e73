#!/usr/bin/python3
"""CPython's own SyncManager client against a manager server in another process: `torchpar
manager` (--server torchpar) or Python's SyncManager server (--server python), the same client
code for both (issue 44: what the server saves a Python program).

For each transport, "tcp" (127.0.0.1, port 0) and "unix" (a socket file in a temporary
directory), the server is started as its own process (`torchpar manager --address A
--authkey-file F`, or this script with --serve: `SyncManager(A, key).get_server()
.serve_forever()`), and this process connects `SyncManager(address, authkey).connect()` and
measures, from its main thread:
  dict_setget   d["key"] = i; d.get("key") == i   (pairs/s: one pair is two round trips)
  list_append   l.append(i)                        (appends/s: one round trip)
and, for each, this process's CPU time per operation (<measure>_client_cpu, us/op): the
client's own share of a round trip, which no server can save (wall time per operation over
it bounds the speed-up any server can give this client), and the server process's CPU time per
operation (<measure>_server_cpu, us/op; /proc/PID/stat, clock-tick resolution).
Each measure: a warm-up batch of 100, then --batches timed batches of --ops; value = all items /
all time (as Google Benchmark's items_per_second). The server is stopped with SIGTERM after
the transport (killed after 10 s; its process group too).
Every wait has a bound and the whole run is stopped by SIGALRM after --timeout seconds.
Prints one JSON object per line: {"name", "transport", "server", "value", "unit"}.

usage: python_manager_client.py --server torchpar|python [--torchpar PATH] [--ops N]
                                [--batches N] [--transports tcp,unix] [--timeout SECONDS]
"""
import argparse
import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.managers import SyncManager

WARMUP = 100
LISTENING = ": listening on "  # `torchpar manager: listening on <address>`
START_S = 30.0
STOP_S = 10.0


def parse_address(text):
    if "/" in text:
        return text
    host, _, port = text.rpartition(":")
    return (host, int(port))


def serve(address, authkey_file):
    """--serve: Python's SyncManager server in the foreground, printing the line torchpar
    manager prints; SIGTERM ends it with status 0."""
    import multiprocessing

    with open(authkey_file, "rb") as f:
        authkey = f.read().rstrip(b"\n")
    multiprocessing.current_process().authkey = authkey  # as in the process start() makes
    server = SyncManager(address=parse_address(address), authkey=authkey).get_server()
    real = server.address
    shown = f"{real[0]}:{real[1]}" if isinstance(real, tuple) else real
    print(f"python manager{LISTENING}{shown}", flush=True)

    def on_term(signum, frame):
        raise SystemExit(0)  # serve_forever() exits 0 on SystemExit

    signal.signal(signal.SIGTERM, on_term)
    server.serve_forever()
    return 0


class Server:
    def __init__(self, kind, torchpar, address, workdir):
        # Random bytes, but never a trailing CR or LF: `torchpar manager --authkey-file` drops
        # those (a key file written by echo), so 1 key in 128 would differ.
        self.authkey = secrets.token_bytes(31) + b"."
        key_path = os.path.join(workdir, "authkey")
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.authkey)
        if kind == "torchpar":
            cmd = [torchpar, "manager", "--address", address, "--authkey-file", key_path]
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--address", address,
                   "--authkey-file", key_path]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        try:
            line = self._first_line()
            if LISTENING not in line:
                raise RuntimeError(f"{' '.join(cmd)}: first line {line!r}, exit status "
                                   f"{self.proc.poll()}")
        except BaseException:
            self.stop()
            raise
        self.address = parse_address(line.split(LISTENING, 1)[1].strip())

    def _first_line(self):
        deadline = time.monotonic() + START_S
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

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc.stdout.close()
        return self.proc.returncode


def process_cpu_s(pid):
    """CPU seconds (user + system, all threads) a process has used: /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rate(batch, n, batches, server_pid):
    """(items/s, this process's CPU microseconds per item, the server's) of `batches` timed
    calls of batch(n), after one warm-up batch. The client's CPU time is its own cost per round
    trip: the part no server can save; the server's is what it spends per operation."""
    batch(WARMUP)
    done, elapsed, cpu, server_cpu = 0, 0.0, 0.0, 0.0
    for _ in range(batches):
        s0, c0, t0 = process_cpu_s(server_pid), time.process_time(), time.perf_counter()
        batch(n)
        elapsed += time.perf_counter() - t0
        cpu += time.process_time() - c0
        server_cpu += process_cpu_s(server_pid) - s0
        done += n
    return done / elapsed, cpu / done * 1e6, server_cpu / done * 1e6


def bench_transport(kind, torchpar, transport, ops, batches):
    with tempfile.TemporaryDirectory(prefix="pyclient_manager_") as workdir:
        address = "127.0.0.1:0" if transport == "tcp" else os.path.join(workdir, "manager.sock")
        server = Server(kind, torchpar, address, workdir)
        try:
            manager = SyncManager(address=server.address, authkey=server.authkey)
            manager.connect()
            d, l = manager.dict(), manager.list()

            def dict_batch(k):
                ok = 0
                for i in range(k):
                    d["key"] = i
                    ok += d.get("key") == i
                if ok != k:
                    raise RuntimeError(f"dict: {ok} of {k} pairs read back their value")

            def list_batch(k):
                before = len(l)
                for i in range(k):
                    l.append(i)
                if len(l) - before != k:
                    raise RuntimeError(f"list: {len(l) - before} of {k} appends arrived")

            pid = server.proc.pid
            res = {"dict_setget": rate(dict_batch, ops, batches, pid),
                   "list_append": rate(list_batch, ops, batches, pid)}
            del d, l, manager
        finally:
            status = server.stop()
        if status != 0:
            raise RuntimeError(f"the {kind} server exited with status {status} after SIGTERM")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", choices=("torchpar", "python"))
    ap.add_argument("--torchpar", default="torchpar", help="the torchpar program")
    ap.add_argument("--ops", type=int, default=2000, help="pairs / appends per batch (2000)")
    ap.add_argument("--batches", type=int, default=3, help="timed batches per measure (3)")
    ap.add_argument("--transports", default="tcp,unix", help="tcp,unix (default both)")
    ap.add_argument("--timeout", type=int, default=300, help="stop the run after this many s")
    # Internal: be Python's server (--server python starts this script so).
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--authkey-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.address, args.authkey_file)
    if not args.server:
        ap.error("--server is required")

    def on_alarm(signum, frame):
        raise TimeoutError(f"python_manager_client.py: run took longer than {args.timeout} s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    for transport in args.transports.split(","):
        for name, (value, cpu_us, server_us) in bench_transport(
                args.server, args.torchpar, transport, args.ops, args.batches).items():
            for key, v, unit in ((name, value, "ops/s"), (f"{name}_client_cpu", cpu_us, "us/op"),
                                 (f"{name}_server_cpu", server_us, "us/op")):
                print(json.dumps({"name": key, "transport": transport, "server": args.server,
                                  "value": v, "unit": unit}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
