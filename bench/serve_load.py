#!/usr/bin/python3
"""Load generator of the bench section serve: C concurrent streaming clients against an
OpenAI-style completions server (`torchpar serve`, bench/peers/python_serve.py); stdlib only.

Each client is a thread with its own keep-alive http.client connection that sends its requests
back to back: POST /v1/completions {"prompt": P, "max_tokens": M, "temperature": 0,
"stream": true}, P a distinct ASCII prompt of exactly --prompt-bytes bytes (equal lengths: a
static batcher needs no padding). Per request, time.perf_counter() at the send, at each token
event (an SSE `data:` chunk whose finish_reason is null: one per generated token) and at
`data: [DONE]`:
  time to first token (TTFT) = first token event - send (queueing included)
  time per output token (TPOT) = the gaps between consecutive token events (every gap of every
                                 request is one sample)
  tokens/s = token events of all requests / (last request's end - the level's start)
A request that does not answer 200, ends without [DONE], reports an error event or yields a
number of tokens other than M counts as an error (the run exits 1 after printing).

The levels run one after the other (--clients 1,8,32 with --requests 6,3,2: requests per client
at each level), after an untimed warm-up of --warmup requests sent at once. Prints one JSON
object per line, {"name", "value", "unit"}: c<C>/tokens_per_s, c<C>/ttft_p50_ms,
c<C>/ttft_p99_ms, c<C>/tpot_p50_ms, c<C>/tpot_p99_ms, c<C>/requests, c<C>/errors; with a server
command also startup_s (start to /health 200) and stop_s (SIGTERM to exit). Percentiles:
linear interpolation between the closest ranks.

Against a running server: --url http://HOST:PORT. Or give the server's command after `--`:
it is started in its own process group (--port 0 in the command: any free port), its stdout is
read for `listening on http://HOST:PORT`, /health is polled every 20 ms until 200; after the
levels it gets SIGTERM (a drain) and --stop-timeout seconds to exit, then its group is SIGKILLed
(a server that needed that, exited non-zero or left live processes in its group 0.1 s after
its exit is reported on
stderr and the run exits 1). --timeout bounds the whole run (the server's group is killed).

usage: serve_load.py (--url URL | [options] -- SERVER COMMAND ...) [--clients 1,8,32]
                     [--requests 6,3,2] [--max-tokens 32] [--prompt-bytes 32] [--warmup 2]
                     [--api-key-file F] [--timeout 600] [--ready-timeout 180] [--stop-timeout 30]
"""
import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

LISTENING = re.compile(r"listening on http://(\S+)")


def percentile(values, q):
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def emit(name, value, unit):
    print(json.dumps({"name": name, "value": value, "unit": unit}), flush=True)


def prompt_text(client, request, size):
    base = f"client {client:03d} asks request {request:04d}: "
    return (base * (size // len(base) + 1))[:size]


class Client(threading.Thread):
    def __init__(self, a, index, n_requests, start):
        super().__init__(daemon=True)
        self.a, self.index, self.n, self.start_evt = a, index, n_requests, start
        self.results, self.errors = [], []  # (ttft s, [gaps s], tokens, end)

    def one(self, conn, j):
        body = json.dumps({"prompt": prompt_text(self.index, j, self.a.prompt_bytes),
                           "max_tokens": self.a.max_tokens, "temperature": 0, "stream": True})
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, self.a.headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        times, done = [], False
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            obj = json.loads(payload)
            if "error" in obj:
                raise RuntimeError(f"error event: {obj['error']}")
            if obj["choices"][0]["finish_reason"] is None:
                times.append(time.perf_counter())
        end = time.perf_counter()
        resp.read()  # the rest (the chunked terminator), so the connection can be reused
        if resp.will_close:
            conn.close()
        if not done:
            raise RuntimeError(f"the stream ended without [DONE] after {len(times)} tokens")
        if len(times) != self.a.max_tokens:
            raise RuntimeError(f"{len(times)} token events, {self.a.max_tokens} asked")
        gaps = [b - a for a, b in zip(times, times[1:])]
        return times[0] - t0, gaps, len(times), end

    def run(self):
        conn = http.client.HTTPConnection(self.a.host, self.a.port, timeout=self.a.timeout)
        self.start_evt.wait()
        for j in range(self.n):
            try:
                self.results.append(self.one(conn, j))
            except (OSError, http.client.HTTPException, RuntimeError, ValueError, KeyError) as e:
                self.errors.append(f"client {self.index} request {j}: {type(e).__name__}: {e}")
                conn.close()
        conn.close()


def level(a, clients, per_client):
    start = threading.Event()
    threads = [Client(a, i, per_client, start) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # the threads reach the start line
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    results = [r for t in threads for r in t.results]
    errors = [e for t in threads for e in t.errors]
    end = max((r[3] for r in results), default=time.perf_counter())
    return results, errors, end - t0


def run_levels(a):
    if a.warmup:
        _, errors, _ = level(a, a.warmup, 1)
        if errors:
            print("serve_load: warm-up: " + "; ".join(errors[:3]), file=sys.stderr, flush=True)
    failed = 0
    for c, n in zip(a.clients, a.requests):
        results, errors, wall = level(a, c, n)
        tokens = sum(r[2] for r in results)
        ttft = [r[0] * 1e3 for r in results]
        gaps = [g * 1e3 for r in results for g in r[1]]
        emit(f"c{c}/tokens_per_s", tokens / wall if wall > 0 else 0.0, "tokens/s")
        for name, vals in (("ttft", ttft), ("tpot", gaps)):
            for q in (50, 99):
                v = percentile(vals, q)
                if v is not None:
                    emit(f"c{c}/{name}_p{q}_ms", v, "ms")
        emit(f"c{c}/requests", len(results), "requests")
        emit(f"c{c}/errors", len(errors), "requests")
        for e in errors[:5]:
            print(f"serve_load: {c} clients: {e}", file=sys.stderr, flush=True)
        failed += len(errors)
    return failed


def group_members(pgid):
    """The live (not zombie) processes of process group pgid: 'pid name' each."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            found.append(f"{pid} {name}")
    return found


class Server:
    """The server command in its own process group."""

    def __init__(self, cmd):
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.address = None
        self.found = threading.Event()
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):  # echo the server's stdout to our stderr; find the address
        for line in self.proc.stdout:
            print(f"[server] {line.rstrip()}", file=sys.stderr, flush=True)
            m = LISTENING.search(line)
            if m and not self.address:
                self.address = m.group(1)
                self.found.set()
        self.found.set()

    def wait_ready(self, timeout, headers):
        deadline = time.monotonic() + timeout
        if not self.found.wait(timeout) or not self.address:
            raise RuntimeError(f"the server printed no 'listening on' line (exit code {self.proc.poll()})")
        host, _, port = self.address.rpartition(":")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before ready")
            try:
                conn = http.client.HTTPConnection(host, int(port), timeout=5)
                conn.request("GET", "/health", headers=headers)
                status = conn.getresponse().status
                conn.close()
                if status == 200:
                    return host, int(port), time.perf_counter() - self.t0
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"/health not 200 within {timeout:g} s")

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout):
        """SIGTERM, wait, then SIGKILL the group; returns (seconds, problems)."""
        problems = []
        t0 = time.perf_counter()
        if self.proc.poll() is not None:
            problems.append(f"the server had exited (code {self.proc.returncode}) before SIGTERM")
        else:
            self.proc.send_signal(signal.SIGTERM)
            try:
                if self.proc.wait(timeout) != 0:
                    problems.append(f"the server exited with code {self.proc.returncode} after SIGTERM")
            except subprocess.TimeoutExpired:
                problems.append(f"the server did not exit within {timeout:g} s of SIGTERM")
        took = time.perf_counter() - t0
        time.sleep(0.1)  # (helpers that exit with the server: not counted as left)
        left = group_members(self.proc.pid)
        if left:
            problems.append(f"{len(left)} process(es) of the server's group were left after it "
                            f"exited: {'; '.join(left[:3])}")
        self.kill()
        self.proc.wait()
        return took, problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server, http://HOST:PORT")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--requests", default="6,3,2", help="requests per client at each level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-bytes", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2, help="untimed requests sent at once first")
    ap.add_argument("--api-key-file")
    ap.add_argument("--timeout", type=float, default=600, help="the whole run (s)")
    ap.add_argument("--ready-timeout", type=float, default=180)
    ap.add_argument("--stop-timeout", type=float, default=30)
    ap.add_argument("server", nargs="*", help="the server command (after --)")
    a = ap.parse_args()
    a.clients = [int(c) for c in a.clients.split(",") if c]
    a.requests = [int(n) for n in a.requests.split(",") if n]
    if len(a.requests) == 1:
        a.requests *= len(a.clients)
    if len(a.requests) != len(a.clients) or min(a.clients + a.requests) < 1:
        ap.error("--requests needs one count >= 1 per --clients level (or one for all)")
    if bool(a.url) == bool(a.server):
        ap.error("give --url or a server command after --")
    a.headers = {"Content-Type": "application/json"}
    if a.api_key_file:
        with open(a.api_key_file) as f:
            a.headers["Authorization"] = f"Bearer {f.read().strip()}"

    try:
        server = Server(a.server) if a.server else None
    except OSError as e:
        print(f"serve_load: cannot run {a.server[0]}: {e.strerror}", file=sys.stderr, flush=True)
        return 1

    def on_alarm(*_):
        print(f"serve_load: timed out after {a.timeout:g} s", file=sys.stderr, flush=True)
        if server:
            server.kill()
        os._exit(1)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(a.timeout)))
    try:
        if server:
            a.host, a.port, startup = server.wait_ready(a.ready_timeout, a.headers)
            emit("startup_s", startup, "s")
        else:
            u = urlsplit(a.url)
            a.host, a.port = u.hostname, u.port or 80
        failed = run_levels(a)
        problems = []
        if server:
            took, problems = server.stop(a.stop_timeout)
            emit("stop_s", took, "s")
            for p in problems:
                print(f"serve_load: {p}", file=sys.stderr, flush=True)
    except RuntimeError as e:
        print(f"serve_load: {e}", file=sys.stderr, flush=True)
        if server:
            server.kill()
        return 1
    except BaseException:
        if server:
            server.kill()
        raise
    signal.alarm(0)
    if failed:
        print(f"serve_load: {failed} request(s) failed", file=sys.stderr, flush=True)
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
