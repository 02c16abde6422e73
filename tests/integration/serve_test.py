#!/usr/bin/python3
"""`torchpar serve` end to end with real HTTP clients (http.client, urllib.request, curl) on a
small byte-level GPT checkpoint written by Python (tests/parallel/gpt_reference.py).

The checkpoint is gpt_reference's random model with its weights scaled so that its greedy
continuations are printable, differ from prompt to prompt and leave margins of > 0.005 between
the two likeliest logits (no ties that rounding could flip); a few bytes of two- and three-byte
UTF-8 characters stay in its vocabulary, so that some continuations hold an invalid sequence
(U+FFFD) and streaming must hold bytes back.

Cases (one server per block, each started with --port 0 in a session of its own, killed with
its process group whatever happens; after each: no process of the group, no worker and no
/dev/shm/torchpar_<pid>_* name of the server or a worker is left):
  1. temperature 0 == `torchpar infer --greedy`'s continuation, {seed, temperature 0.8,
     top_k 40} == `torchpar infer --seed --temperature 0.8 --top-k 40`'s, at --tp 1 and 2;
  2. stream: one event per token, pieces == the non-stream text, a last chunk with
     finish_reason, [DONE]; the same with `curl -N`;
  3. 32 concurrent clients (mixed stream / non-stream) each get their own greedy
     continuation; /metrics shows batches of more than one sequence and counts the 200s;
  4. a stop string ends the text before it, finish_reason "stop";
  5. 400s with a JSON error body (bad JSON, not an object, unknown field, wrong types, empty
     prompt, over n_positions, over --max-new-tokens), 404, and 401 / 200 with --api-key-file;
  6. --max-batch 1 --max-queue 1: a third request while one runs and one waits gets 503;
  7. a streaming client that goes away frees its slot (torchpar_serve_running back to 0 long
     before its max_tokens) and the next request is served;
  8. a worker SIGKILLed mid-request: 500 / an error event naming the rank, /health "broken",
     503 for new completions, SIGTERM still ends the server within the drain bound;
  9. SIGTERM while requests run and wait: they finish with 200, new ones get 503 (or the
     port is closed), exit 0.
Cases 6-9 freeze the workers with SIGSTOP at the moment the request under test is known to
run (its first event read, torchpar_serve_running observed) and SIGCONT them afterwards: a
tiny model generates thousands of tokens per second, so "mid-request" is made, not hoped for.
Exit 77 (skipped) when /usr/bin/python3 has no torch (Debian: python3-torch).
usage: serve_test.py BIN_DIR"""
import http.client
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

BIN = sys.argv[1]
TORCHPAR = os.path.join(BIN, "torchpar")
CURL = "/usr/bin/curl"
HOST = "127.0.0.1"
N_POSITIONS = 128
PROMPT = "Tensor parallel, byte by byte: "
BASES = ("Tensor parallel, byte by byte:", "hello", "The quick brown fox", "Zz")
PROMPTS = [f"{BASES[i % 4]} {i}" for i in range(32)]
failures = []
servers = []


def check(cond, what, detail=""):
    """Prints `what` with ok / FAIL (and `detail` when it fails); counts the failures."""
    print(("ok   " if cond else "FAIL ") + what + ("" if cond or not detail else "\n" + detail),
          flush=True)
    if not cond:
        failures.append(what)
    return cond


def short(x, n=300):
    s = x.strip() if isinstance(x, str) else repr(x)
    return s if len(s) <= n else s[:n] + "..."


def wait_until(pred, seconds, step=0.02):
    """Polls `pred` until it returns a true value or `seconds` pass; returns the last value."""
    deadline = time.monotonic() + seconds
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)


try:
    import torch
except ImportError:
    print("skip: /usr/bin/python3 has no torch (Debian: python3-torch)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "parallel"))
import gpt_reference  # noqa: E402

if not os.path.exists(CURL):
    print(f"skip: no {CURL}")
    sys.exit(77)


# ---------------------------------------------------------------- HTTP clients
def request(port, method, path, body=None, headers=None, timeout=60):
    """One request on a fresh http.client connection: (status, content type, body bytes);
    status None and the error's text when the connection fails."""
    hdrs = {}
    if body is not None:
        hdrs["Content-Type"] = "application/json"
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode()
    hdrs.update(headers or {})
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type", ""), r.read()
    except (OSError, http.client.HTTPException) as e:
        return None, "", f"{type(e).__name__}: {e}".encode()
    finally:
        conn.close()


def as_json(data):
    try:
        return json.loads(data)
    except (ValueError, TypeError):
        return None


def complete(port, fields, headers=None, timeout=60):
    """POST /v1/completions with urllib.request: (status, parsed body or raw bytes)."""
    req = urllib.request.Request(f"http://{HOST}:{port}/v1/completions",
                                 data=json.dumps(fields).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"
    j = as_json(data)
    return status, (j if j is not None else data)


def text_of(body):
    try:
        return body["choices"][0]["text"]
    except (TypeError, KeyError, IndexError):
        return None


def is_error(body, type_=None):
    """The spec's error body: {"error": {"message": non-empty str, "type": str, "code": null}}."""
    if isinstance(body, (bytes, str)):
        body = as_json(body)
    try:
        e = body["error"]
        return (isinstance(e["message"], str) and e["message"] != "" and "code" in e
                and e["code"] is None and (type_ is None or e["type"] == type_))
    except (TypeError, KeyError):
        return False


def message(body):
    if isinstance(body, (bytes, str)):
        body = as_json(body)
    try:
        return body["error"]["message"]
    except (TypeError, KeyError):
        return ""


def parse_sse(lines):
    """`data: ...` events from an iterable of text lines: dicts, or the string "[DONE]"."""
    events = []
    for line in lines:
        line = line.rstrip("\r\n")
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append("[DONE]" if payload == "[DONE]" else as_json(payload))
    return events


def stream(port, fields, first=None, timeout=60):
    """POST with stream: true on http.client, reading the events as they come; `first` (a
    threading.Event) is set when the first event has been read. Returns (status, content
    type, events or None, error body)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**fields, "stream": True}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        ctype = r.getheader("Content-Type", "")
        if r.status != 200:
            return r.status, ctype, None, r.read()
        events = []
        while True:
            line = r.readline()
            if not line:
                break
            ev = parse_sse([line.decode("utf-8", "replace")])
            events += ev
            if ev and first is not None:
                first.set()
        return r.status, ctype, events, b""
    except (OSError, http.client.HTTPException) as e:
        return None, "", None, f"{type(e).__name__}: {e}".encode()
    finally:
        conn.close()
        if first is not None:
            first.set()


def summary(events):
    """(text, token events (finish_reason null), finish_reason of the last chunk, [DONE] last,
    error events, every chunk well formed)."""
    chunks = [e for e in events if isinstance(e, dict) and "choices" in e]
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    formed = all(isinstance(c.get("id"), str) and c["id"].startswith("cmpl-")
                 and c.get("object") == "text_completion" and "usage" not in c
                 and isinstance(c["choices"][0].get("text"), str) for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if formed)
    tokens = [c for c in chunks if c["choices"][0].get("finish_reason") is None]
    finish = chunks[-1]["choices"][0].get("finish_reason") if chunks else None
    only_last = all(c["choices"][0].get("finish_reason") is None for c in chunks[:-1])
    return {"text": text, "tokens": len(tokens), "finish": finish,
            "done": bool(events) and events[-1] == "[DONE]" and events.count("[DONE]") == 1,
            "errors": errors, "formed": formed and only_last, "events": len(events)}


def in_thread(fn, *args, **kwargs):
    out = {}

    def run():
        try:
            out["result"] = fn(*args, **kwargs)
        except Exception as e:  # reported by the check that reads it
            out["result"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def joined(t, out, seconds=60):
    t.join(seconds)
    return None if t.is_alive() else out.get("result")


# ---------------------------------------------------------------- metrics
METRIC = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)')


def metrics(port, headers=None):
    """{(name, ((label, value), ...)): float} from GET /metrics, or None."""
    status, _, data = request(port, "GET", "/metrics", headers=headers, timeout=20)
    if status != 200:
        return None
    out = {}
    for line in data.decode("utf-8", "replace").splitlines():
        m = METRIC.match(line)
        if not m or line.startswith("#"):
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            pass
    return out


def metric(m, name, **labels):
    if m is None:
        return None
    return m.get((name, tuple(sorted(labels.items()))))


def over_one(m, name):
    """How many observations of histogram `name` are > 1 (its _count minus its le=1 bucket;
    without such a bucket, 1 when _sum > _count proves one, else 0)."""
    if m is None:
        return None
    count = metric(m, name + "_count") or 0
    for (n, labels), v in m.items():
        d = dict(labels)
        if n == name + "_bucket" and "le" in d and d["le"] not in ("+Inf", "inf") \
                and float(d["le"]) == 1.0:
            return count - v
    return 1 if (metric(m, name + "_sum") or 0) > count else 0


def running(port):
    return metric(metrics(port), "torchpar_serve_running")


def queued(port):
    return metric(metrics(port), "torchpar_serve_queue_depth")


def waits_or_runs(port):
    m = metrics(port)
    return (metric(m, "torchpar_serve_queue_depth") or 0) + (metric(m, "torchpar_serve_running")
                                                             or 0)


def stopped_while_running(srv, fields, tries=5):
    """Starts a streaming request with `fields`, waits for its first event and SIGSTOPs the
    workers; under load the tiny model can finish all its tokens between the first event and
    the SIGSTOP, so this retries (up to `tries`) until /metrics shows it running with the
    workers stopped. Returns the stream's (thread, out); the workers are left stopped (the
    caller SIGCONTs them), also when no try caught it (the caller's running() check fails)."""
    for _ in range(tries):
        first = threading.Event()
        ta = in_thread(stream, srv.port, fields, first=first, timeout=120)
        first.wait(60)
        srv.signal_workers(signal.SIGSTOP)
        if running(srv.port) == 1:
            return ta
        srv.signal_workers(signal.SIGCONT)
        joined(*ta, 120)
    srv.signal_workers(signal.SIGSTOP)
    return ta


# ---------------------------------------------------------------- processes
def stat(pid):
    """(ppid, state, start time, process group) of `pid`, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    return int(rest[1]), rest[0], int(rest[19]), int(rest[2])


def children(pid):
    kids = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.update(int(x) for x in f.read().split())
        return kids
    except OSError:
        pass
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = stat(int(d))
            if st and st[0] == pid:
                kids.add(int(d))
    return kids


def exe(pid):
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def rank_of(pid):
    """The worker's rank from its environment (RANK / TORCHPAR_RANK), else None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    for key in (b"RANK", b"TORCHPAR_RANK"):
        if env.get(key, b"").isdigit():
            return int(env[key])
    return None


def shm_names(pids):
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names if n.startswith("torchpar")
                  and len(n.split("_")) > 2 and n.split("_")[1].isdigit()
                  and int(n.split("_")[1]) in pids)


class Server:
    """`torchpar serve --port 0 ...` in a session of its own, stdout read by a thread."""

    def __init__(self, name, tp, *args):
        self.name, self.tp = name, tp
        self.err_path = os.path.join(TMP, f"{name}.stderr")
        self.stdout = []
        self.lines = queue.Queue()
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [TORCHPAR, "serve", "--checkpoint", CKPT, "--tp", str(tp), "--host", HOST,
                 "--port", "0", *args], stdout=subprocess.PIPE, stderr=err,
                start_new_session=True)
        servers.append(self)
        self.pid = self.proc.pid
        self.seen = {}  # worker pid -> start time
        threading.Thread(target=self._read, daemon=True).start()
        self.port = None
        deadline = time.monotonic() + 60
        while self.port is None and time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            m = re.search(r"torchpar serve: listening on http://([^:/]+):(\d+)", line)
            if m:
                self.port = int(m.group(2))
        check(self.port is not None and self.port > 0,
              f"{name}: 'listening on http://HOST:PORT' on stdout ({short(self.stdout)}; "
              f"stderr {short(self.stderr_tail())})")
        self.exe = exe(self.pid)

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace")
            self.stdout.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def stderr_tail(self, n=1500):
        try:
            with open(self.err_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-n:]
        except OSError:
            return ""

    def ready(self, seconds=120):
        """Polls /health until 200; every earlier answer must be 503 "loading"."""
        if self.port is None:
            return False
        other = []

        def healthy():
            status, _, data = request(self.port, "GET", "/health", timeout=10)
            if status == 200:
                return as_json(data) or {"status": None}
            j = as_json(data)
            if status is not None and not (status == 503 and j and j.get("status") == "loading"):
                other.append((status, data[:200]))
            return None
        h = wait_until(healthy, seconds, step=0.1)
        ok = check(bool(h) and h.get("status") == "ready",
                   f"{self.name}: /health 200 {{\"status\": \"ready\"}} within {seconds} s "
                   f"({short(h)}; stderr {short(self.stderr_tail())})")
        check(not other, f"{self.name}: /health answered only 503 \"loading\" before ready "
                         f"({short(other)})")
        line = wait_until(lambda: [s for s in self.stdout if "torchpar serve: ready" in s], 10)
        check(bool(line) and f"tensor parallel {self.tp}" in line[0],
              f"{self.name}: 'torchpar serve: ready (tensor parallel {self.tp}, ...)' on "
              f"stdout ({short(self.stdout)})")
        self.workers()
        check(len(self.seen) == self.tp, f"{self.name}: {self.tp} worker process(es) are "
                                         f"direct children ({sorted(self.seen)})")
        return ok

    def workers(self):
        """The serve process's children running the same program (not the shm cleaner)."""
        ws = sorted(p for p in children(self.pid) if exe(p) == self.exe)
        for p in ws:
            st = stat(p)
            if st:
                self.seen.setdefault(p, st[2])
        return ws

    def signal_workers(self, sig):
        """`sig` to the workers seen so far (no /proc scan: stopping them is timed)."""
        for p in list(self.seen):
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.seen:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self, bound):
        """SIGTERM; the exit code, or None when it did not exit within `bound` seconds."""
        self.workers()
        os.kill(self.pid, signal.SIGTERM)
        try:
            return self.proc.wait(bound)
        except subprocess.TimeoutExpired:
            return None

    def left_behind(self):
        """Processes of the group, live workers, /dev/shm names of the server or a worker."""
        left = []
        for d in os.listdir("/proc"):
            st = stat(int(d)) if d.isdigit() else None
            # A zombie (an exited shm cleaner reparented to init, not reaped yet) holds nothing.
            if st and st[3] == self.pid and st[1] != "Z":
                left.append(f"process {d} of group {self.pid}")
        for p, start in self.seen.items():
            st = stat(p)
            if st and st[2] == start and st[1] != "Z":
                left.append(f"worker {p}")
        left += shm_names({self.pid, *self.seen})
        return left

    def check_clean(self, what):
        left = wait_until(lambda: not self.left_behind(), 15, step=0.1) or self.left_behind()
        check(left is True, f"{self.name}: {what}: no process and no /dev/shm segment left "
                            f"({'' if left is True else left})")


# ---------------------------------------------------------------- the checkpoint
TMP = tempfile.mkdtemp(prefix="torchpar_serve_")
CKPT = os.path.join(TMP, "tiny-gpt")
os.makedirs(CKPT)
MODEL = os.path.join(CKPT, "model.pt")


def write_checkpoint():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = gpt_reference.Gpt(layers=2, width=64, heads=4, vocab=256, context=N_POSITIONS)
    sd = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    # Printable ASCII and the bytes of "é" (C3 A9) and "€" (E2 82 AC) stay, the rest get zero
    # embeddings; large weights make the continuation depend on the whole prompt.
    keep = torch.zeros(256, 1)
    keep[list(range(32, 127)) + [0xC3, 0xA9, 0xE2, 0x82, 0xAC]] = 50
    sd["wte.weight"] *= keep
    sd["wpe.weight"] *= 10
    for k in sd:
        if k.endswith(".weight") and any(s in k for s in ("c_attn", "c_proj", "c_fc")):
            sd[k] *= 30
    torch.save(sd, MODEL)
    with open(os.path.join(CKPT, "model.json"), "w") as f:
        json.dump({"vocab_size": 256, "n_positions": N_POSITIONS, "n_embd": 64, "n_layer": 2,
                   "n_head": 4, "dtype": "float32", "tokenizer": "bytes",
                   "weight_layout": "conv1d"}, f)


def infer(tp, *args, prompt=PROMPT):
    """`torchpar infer`'s continuation (its stdout without the prompt and the final newline)."""
    p = subprocess.run([TORCHPAR, "infer", "--model", MODEL, "--prompt", prompt,
                        "--tensor-parallel", str(tp), *args], capture_output=True, timeout=180)
    out = p.stdout.decode("utf-8", "replace")
    ok = check(p.returncode == 0 and out.startswith(prompt),
               f"torchpar infer --tensor-parallel {tp} {' '.join(args)}: exit 0 "
               f"({p.returncode}: {short(p.stderr.decode('utf-8', 'replace')[-300:])})")
    out = out[len(prompt):]
    return (out[:-1] if out.endswith("\n") else out) if ok else None


GREEDY_N = 48
SAMPLED = {"seed": 5, "temperature": 0.8, "top_k": 40}
SAMPLED_N = 40


def equivalences(srv, want_greedy, want_sampled):
    """Case 1 on `srv`."""
    tp = srv.tp
    status, body = complete(srv.port, {"prompt": PROMPT, "max_tokens": GREEDY_N,
                                       "temperature": 0})
    check(status == 200 and text_of(body) == want_greedy,
          f"[1] TP={tp}: temperature 0 == torchpar infer --greedy's continuation",
          f"  got  {status} {short(text_of(body) if status == 200 else body)!s}\n"
          f"  want {want_greedy!r}")
    if status == 200:
        c = body["choices"][0]
        u = body.get("usage", {})
        check(isinstance(body.get("id"), str) and body["id"].startswith("cmpl-")
              and body.get("object") == "text_completion"
              and isinstance(body.get("created"), int)
              and abs(body["created"] - time.time()) < 600
              and body.get("model") == os.path.basename(CKPT)
              and c.get("index") == 0 and c.get("logprobs", 0) is None
              and c.get("finish_reason") == "length"
              and u.get("prompt_tokens") == len(PROMPT.encode())
              and u.get("completion_tokens") == GREEDY_N
              and u.get("total_tokens") == len(PROMPT.encode()) + GREEDY_N,
              f"[1] TP={tp}: the response's id, object, created, model (the directory's "
              f"name), finish_reason \"length\" and usage ({short(body, 500)})")
    status, body = complete(srv.port, {"prompt": PROMPT, "max_tokens": SAMPLED_N, **SAMPLED})
    check(status == 200 and text_of(body) == want_sampled,
          f"[1] TP={tp}: {SAMPLED} == torchpar infer --seed 5 --temperature 0.8 --top-k 40's "
          f"continuation", f"  got  {status} {short(text_of(body) if status == 200 else body)}\n"
          f"  want {want_sampled!r}")
    status, other = complete(srv.port, {"prompt": PROMPT, "max_tokens": SAMPLED_N,
                                        **SAMPLED, "seed": 6})
    check(status == 200 and text_of(other) not in (None, text_of(body)),
          f"[1] TP={tp}: seed 6 draws another text than seed 5 ({short(text_of(other))})")


def stream_matches(srv, prompt, n, want, label):
    """Case 2: the streamed pieces of a greedy request."""
    status, ctype, events, err = stream(srv.port, {"prompt": prompt, "max_tokens": n,
                                                   "temperature": 0})
    if not check(status == 200 and events is not None,
                 f"[2] {label}: stream 200 ({status}: {short(err)})"):
        return
    s = summary(events)
    check(ctype.startswith("text/event-stream"), f"[2] {label}: Content-Type {ctype!r}")
    check(s["formed"], f"[2] {label}: every chunk is a text_completion chunk without usage, "
                       f"finish_reason null but in the last")
    check(s["tokens"] == n, f"[2] {label}: one event per token ({s['tokens']} events with "
                            f"finish_reason null for max_tokens {n})")
    check(s["text"] == want, f"[2] {label}: the pieces concatenated == the non-stream text",
          f"  got  {s['text']!r}\n  want {want!r}")
    check(s["finish"] == "length" and s["done"] and not s["errors"],
          f"[2] {label}: a last chunk with finish_reason \"length\", then [DONE] "
          f"(finish {s['finish']!r}, done {s['done']}, errors {short(s['errors'])})")


def curl_stream(srv, prompt, n, want):
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True})
    p = subprocess.run([CURL, "-sS", "-N", "--max-time", "60", "-H",
                        "Content-Type: application/json", "-d", body,
                        f"http://{HOST}:{srv.port}/v1/completions"],
                       capture_output=True, timeout=90)
    s = summary(parse_sse(p.stdout.decode("utf-8", "replace").splitlines()))
    check(p.returncode == 0 and s["text"] == want and s["tokens"] == n and s["done"]
          and s["finish"] == "length",
          f"[2] curl -N: {s['tokens']} token events, the same text, finish \"length\", [DONE] "
          f"(exit {p.returncode} {short(p.stderr)}; got {s['text']!r})")


def concurrent(srv, refs):
    """Case 3: 32 clients at once, even ones urllib, odd ones streaming."""
    m0 = metrics(srv.port)
    start = threading.Barrier(len(PROMPTS), timeout=30)

    def client(i):
        start.wait()
        fields = {"prompt": PROMPTS[i], "max_tokens": 24, "temperature": 0}
        if i % 2 == 0:
            status, body = complete(srv.port, fields, timeout=120)
            return status, text_of(body) if status == 200 else body
        status, _, events, err = stream(srv.port, fields, timeout=120)
        if events is None:
            return status, err
        s = summary(events)
        return status, s["text"] if s["done"] and s["tokens"] == 24 else s
    threads = [in_thread(client, i) for i in range(len(PROMPTS))]
    results = [joined(t, out, 180) for t, out in threads]
    wrong = [(i, PROMPTS[i], r, refs[i]) for i, r in enumerate(results)
             if not (isinstance(r, tuple) and r == (200, refs[i]))]
    check(not wrong, f"[3] 32 concurrent clients (16 streaming) each get their own greedy "
                     f"continuation, equal to a sequential request's "
                     f"({len(wrong)} wrong: {short(wrong, 800)})")
    m1 = metrics(srv.port)
    if not check(m0 is not None and m1 is not None, "[3] GET /metrics 200"):
        return
    ok0 = metric(m0, "torchpar_serve_requests_total", code="200") or 0
    ok1 = metric(m1, "torchpar_serve_requests_total", code="200")
    check(ok1 is not None and ok1 - ok0 >= 32,
          f"[3] torchpar_serve_requests_total{{code=\"200\"}} counts the 32 ({ok0} -> {ok1})")
    b0, b1 = over_one(m0, "torchpar_serve_batch_size"), over_one(m1, "torchpar_serve_batch_size")
    check(b1 is not None and b1 - (b0 or 0) > 0,
          f"[3] torchpar_serve_batch_size has observations > 1: continuous batching ran "
          f"several sequences per step ({b0} -> {b1})")
    names = ("torchpar_serve_prompt_tokens_total", "torchpar_serve_generated_tokens_total",
             "torchpar_serve_steps_total", "torchpar_serve_queue_depth",
             "torchpar_serve_max_batch", "torchpar_serve_time_to_first_token_seconds_count",
             "torchpar_serve_time_per_token_seconds_count",
             "torchpar_serve_request_duration_seconds_count")
    missing = [n for n in names if metric(m1, n) is None]
    check(not missing, f"[3] /metrics has the spec's counters, gauges and histograms "
                       f"(missing {missing})")
    g0 = metric(m0, "torchpar_serve_generated_tokens_total") or 0
    g1 = metric(m1, "torchpar_serve_generated_tokens_total") or 0
    check(g1 - g0 >= 32 * 24, f"[3] generated_tokens_total grew by >= 32 x 24 ({g0} -> {g1})")
    gauges = [metric(m1, "torchpar_serve_" + n) for n in ("max_batch", "running", "queue_depth")]
    check(gauges == [8, 0, 0], f"[3] afterwards: max_batch 8, running 0, queue_depth 0 ({gauges})")


def stops(srv, ref):
    """Case 4: a stop string from the greedy continuation `ref` of PROMPT."""
    stop = next((ref[i:i + 2] for i in range(4, len(ref) - 2)
                 if ref[i:i + 2].isascii() and ref.find(ref[i:i + 2]) >= 4), None)
    if not check(stop is not None, f"[4] the greedy continuation has a stop candidate ({ref!r})"):
        return
    want = ref[:ref.find(stop)]
    for label, value in (("a string", stop), ("a list", ["\x01never", stop])):
        status, body = complete(srv.port, {"prompt": PROMPT, "max_tokens": GREEDY_N,
                                           "temperature": 0, "stop": value})
        fin = body["choices"][0].get("finish_reason") if status == 200 else None
        check(status == 200 and text_of(body) == want and fin == "stop",
              f"[4] stop {label} {value!r}: the text ends before it, finish_reason \"stop\"",
              f"  got  {status} {short(text_of(body) if status == 200 else body)} {fin!r}\n"
              f"  want {want!r}")
    status, _, events, err = stream(srv.port, {"prompt": PROMPT, "max_tokens": GREEDY_N,
                                               "temperature": 0, "stop": stop})
    s = summary(events or [])
    check(status == 200 and s["text"] == want and s["finish"] == "stop" and s["done"],
          f"[4] streamed with stop {stop!r}: the same text, finish_reason \"stop\", [DONE] "
          f"({status} {s['text']!r} {s['finish']!r} {short(err)})")


def bad_requests(srv):
    """Case 5: 400 and 404 (server started with --max-new-tokens 120)."""
    cases = [
        ("bad JSON", b'{"prompt": "a", "max_tokens": ', None),
        ("not an object", b'["a"]', None),
        ("a JSON string", b'"a"', None),
        ("unknown field", {"prompt": "a", "max_token": 4}, None),
        ("prompt a number", {"prompt": 5}, None),
        ("no prompt", {"max_tokens": 4}, None),
        ("max_tokens a string", {"prompt": "a", "max_tokens": "4"}, None),
        ("max_tokens 2.5", {"prompt": "a", "max_tokens": 2.5}, None),
        ("max_tokens -1", {"prompt": "a", "max_tokens": -1}, None),
        ("stream a string", {"prompt": "a", "stream": "yes"}, None),
        ("temperature a string", {"prompt": "a", "temperature": "hot"}, None),
        ("temperature -1", {"prompt": "a", "temperature": -1}, None),
        ("top_k -1", {"prompt": "a", "top_k": -1}, None),
        ("seed -1", {"prompt": "a", "seed": -1}, None),
        ("seed 2^64", {"prompt": "a", "seed": 2 ** 64}, None),
        ("stop a number", {"prompt": "a", "stop": 3}, None),
        ("stop an empty string", {"prompt": "a", "stop": ""}, None),
        ("stop a list of 5", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, None),
        ("empty prompt", {"prompt": ""}, None),
        ("prompt + max_tokens over n_positions", {"prompt": "x" * 40, "max_tokens": 100},
         "n_positions"),
        ("max_tokens over --max-new-tokens", {"prompt": "a", "max_tokens": 121}, None),
    ]
    for label, body, says in cases:
        status, ctype, data = request(srv.port, "POST", "/v1/completions", body=body)
        check(status == 400 and is_error(data, "invalid_request_error")
              and (says is None or says in message(data)),
              f"[5] {label}: 400 invalid_request_error"
              f"{f' naming {says}' if says else ''} ({status}: {short(data)})")
    status, _, data = request(srv.port, "POST", "/v1/completions",
                           body={"prompt": "x" * 40, "max_tokens": 88, "temperature": 0})
    check(status == 200, f"[5] prompt + max_tokens == n_positions is served ({status}: "
                         f"{short(data)})")
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v1/chat/completions")):
        status, _, data = request(srv.port, method, path, body={} if method == "POST" else None)
        check(status == 404 and is_error(data), f"[5] {method} {path}: 404 with a JSON error "
                                                f"body ({status}: {short(data)})")


def api_keys():
    """Case 5b: --api-key-file."""
    key = "s3cret-key-43"
    key_file = os.path.join(TMP, "key")
    with open(key_file, "w") as f:
        f.write(f"  {key}\n")
    srv = Server("api-key", 1, "--api-key-file", key_file, "--max-new-tokens", "32")
    if srv.port is None:
        return
    # /health answers 401 without the key, so readiness is polled with it.
    right = {"Authorization": f"Bearer {key}"}
    h = wait_until(lambda: request(srv.port, "GET", "/health", headers=right)[0] == 200, 120, 0.1)
    check(h, f"[5] api key: /health 200 with the key within 120 s ({short(srv.stderr_tail())})")
    srv.workers()
    for label, hdrs in (("no Authorization", {}), ("a wrong key", {"Authorization": "Bearer x"}),
                        ("the key without Bearer", {"Authorization": key})):
        for method, path, body in (("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2}),
                                   ("GET", "/health", None), ("GET", "/metrics", None)):
            status, _, data = request(srv.port, method, path, body=body, headers=hdrs)
            check(status == 401 and is_error(data, "authentication_error"),
                  f"[5] api key: {method} {path} with {label}: 401 authentication_error "
                  f"({status}: {short(data)})")
    for method, path, body in (("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2}),
                               ("GET", "/health", None), ("GET", "/metrics", None)):
        status, _, data = request(srv.port, method, path, body=body, headers=right)
        check(status == 200, f"[5] api key: {method} {path} with the right key: 200 "
                             f"({status}: {short(data)})")
    code = srv.terminate(30)
    check(code == 0, f"[5] api key: SIGTERM -> exit 0 ({code})")
    srv.check_clean("after SIGTERM")


def overload():
    """Case 6: --max-batch 1 --max-queue 1: one running, one waiting, the third gets 503."""
    srv = Server("overload", 1, "--max-batch", "1", "--max-queue", "1", "--max-new-tokens", "120")
    if not srv.ready():
        return
    ta = stopped_while_running(srv, {"prompt": "abc", "max_tokens": 120, "temperature": 0})
    try:
        check(running(srv.port) == 1, "[6] the first request runs (running 1, workers stopped)")
        tb = in_thread(complete, srv.port, {"prompt": "hello", "max_tokens": 100,
                                            "temperature": 0})
        check(wait_until(lambda: queued(srv.port) == 1, 20), "[6] the second waits (queue 1)")
        status, body = complete(srv.port, {"prompt": "Zz", "max_tokens": 100}, timeout=30)
        check(status == 503 and is_error(body, "overloaded_error"),
              f"[6] a third request with 1 running and 1 waiting: 503 overloaded_error "
              f"({status}: {short(body)})")
    finally:
        srv.signal_workers(signal.SIGCONT)
    a = joined(*ta, 120)
    b = joined(*tb, 120)
    sa = summary(a[2]) if isinstance(a, tuple) and a[2] is not None else None
    check(sa is not None and a[0] == 200 and sa["done"] and sa["tokens"] == 120,
          f"[6] the running request completes: 120 tokens, [DONE] ({short(a)})")
    check(isinstance(b, tuple) and b[0] == 200 and len(text_of(b[1]) or "") > 0,
          f"[6] the waiting request completes with 200 ({short(b)})")
    # Three at once without the workers stopped: at least one 503 or all 200s when they
    # happened not to overlap; every answer is 200 or 503 with an error body.
    start = threading.Barrier(3, timeout=30)

    def client(p):
        start.wait()
        return complete(srv.port, {"prompt": p, "max_tokens": 120, "temperature": 0})
    threads = [in_thread(client, p) for p in ("ab", "cd", "ef")]
    rs = [joined(t, out, 120) for t, out in threads]
    check(all(isinstance(r, tuple) and (r[0] == 200 or (r[0] == 503 and is_error(r[1])))
              for r in rs), f"[6] three at once: each 200 or 503 with an error body "
                            f"({[r[0] if isinstance(r, tuple) else r for r in rs]})")
    code = srv.terminate(30)
    check(code == 0, f"[6] SIGTERM -> exit 0 ({code})")
    srv.check_clean("after SIGTERM")


def client_goes_away(srv, ref_hello):
    """Case 7: a raw socket reads the first event of a 120-token stream and is closed."""
    body = json.dumps({"prompt": "abc", "max_tokens": 120, "temperature": 0,
                       "stream": True}).encode()
    # Under load the tiny model can finish its 120 tokens between the first event and the
    # SIGSTOP (as in case 9): retry until the request is caught running.
    for attempt in range(5):
        wait_until(lambda: running(srv.port) == 0, 10)
        m0 = metrics(srv.port)
        sock = socket.create_connection((HOST, srv.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + HOST.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: " +
                     str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: " not in got:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
        srv.signal_workers(signal.SIGSTOP)
        try:
            r = running(srv.port)
            sock.close()
        finally:
            srv.signal_workers(signal.SIGCONT)
        if r == 1:
            break
    check(b" 200 " in got.split(b"\r\n", 1)[0] and b"data: " in got,
          f"[7] the raw client reads 200 and a first event ({short(got[:200])})")
    check(r == 1, f"[7] while it streams: torchpar_serve_running 1 ({r}; attempt {attempt + 1})")
    t0 = time.monotonic()
    r = wait_until(lambda: running(srv.port) == 0, 10)
    check(r, f"[7] the client gone: torchpar_serve_running back to 0 within "
             f"{time.monotonic() - t0:.1f} s (limit 10)")
    m1 = metrics(srv.port)
    s0 = metric(m0, "torchpar_serve_steps_total") or 0
    s1 = metric(m1, "torchpar_serve_steps_total")
    check(s1 is not None and s1 - s0 < 120,
          f"[7] the slot was freed before its 120 tokens: {None if s1 is None else s1 - s0} "
          f"decoding steps ran")
    status, body = complete(srv.port, {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0})
    check(status == 200 and text_of(body) == ref_hello,
          f"[7] the next request is served with its greedy continuation ({status}: "
          f"{short(body)})")


def worker_killed(srv):
    """Case 8 on the TP=2 server: SIGKILL one worker while two requests run."""
    for attempt in range(5):
        first = threading.Event()
        ta = in_thread(stream, srv.port, {"prompt": "abc", "max_tokens": 120,
                                          "temperature": 0}, first=first, timeout=120)
        first.wait(60)
        tb = in_thread(complete, srv.port, {"prompt": "hello", "max_tokens": 100,
                                            "temperature": 0}, timeout=120)
        wait_until(lambda: running(srv.port) == 2, 10, step=0.002)
        srv.signal_workers(signal.SIGSTOP)
        if running(srv.port) == 2:
            break
        srv.signal_workers(signal.SIGCONT)
        joined(*ta, 120)
        joined(*tb, 120)
    else:
        check(False, "[8] two requests running at once with the workers stopped (5 tries)")
        return
    ws = srv.workers()
    ranks = {p: rank_of(p) for p in ws}
    victim = next((p for p, r in ranks.items() if r == 1), ws[-1])
    os.kill(victim, signal.SIGKILL)
    srv.signal_workers(signal.SIGCONT)
    rank = ranks.get(victim)
    named = "rank" if rank is None else f"rank {rank}"

    def names_victim(msg):
        """`msg` names a rank ("rank <r>", <r> the victim's when known) and, when it names a
        pid, the victim's."""
        pids = re.findall(r"pid (\d+)", msg)
        return (re.search(r"rank \d+", msg) is not None and named in msg
                and all(int(p) == victim for p in pids))
    b = joined(*tb, 60)
    check(isinstance(b, tuple) and b[0] == 500 and is_error(b[1], "server_error")
          and names_victim(message(b[1])),
          f"[8] worker {victim} (rank {rank}) SIGKILLed: the running non-stream request gets "
          f"500 server_error naming {named!r} ({short(b)})")
    a = joined(*ta, 60)
    sa = summary(a[2]) if isinstance(a, tuple) and a[2] is not None else None
    check(sa is not None and sa["errors"] and names_victim(message(sa["errors"][-1]))
          and not sa["done"],
          f"[8] the running stream ends with an error event naming {named!r}, no [DONE] "
          f"({short(sa or a)})")
    status, _, data = request(srv.port, "GET", "/health")
    h = as_json(data) or {}
    check(status == 503 and h.get("status") == "broken" and names_victim(str(h.get("reason"))),
          f"[8] /health: 503 \"broken\" with a reason naming {named!r} ({status}: "
          f"{short(data)})")
    status, body = complete(srv.port, {"prompt": "a", "max_tokens": 4})
    check(status == 503 and is_error(body), f"[8] a new completion: 503 with an error body "
                                            f"({status}: {short(body)})")
    t0 = time.monotonic()
    code = srv.terminate(5 + 15)
    check(code is not None, f"[8] broken server: SIGTERM -> exit within the drain bound "
                            f"(--drain-timeout 5 + 15 s): exit {code} after "
                            f"{time.monotonic() - t0:.1f} s")
    srv.check_clean("broken, after SIGTERM")


def drain(srv):
    """Case 9: SIGTERM with one request running and one waiting."""
    fa = {"prompt": "Zz 3", "max_tokens": 110, "temperature": 0}
    fb = {"prompt": "Zz 4", "max_tokens": 110, "temperature": 0}
    refs = [text_of(complete(srv.port, f)[1]) for f in (fa, fb)]
    ta = stopped_while_running(srv, fa)
    try:
        check(running(srv.port) == 1, "[9] a streaming request runs (workers stopped)")
        # --max-batch 8: the second joins at the next step; with the workers stopped it waits.
        tb = in_thread(complete, srv.port, fb, timeout=120)
        check(wait_until(lambda: waits_or_runs(srv.port) == 2, 20),
              "[9] a second request waits (queue_depth + running 2)")
        t0 = time.monotonic()
        srv.workers()
        os.kill(srv.pid, signal.SIGTERM)

        def draining():
            status, _, data = request(srv.port, "GET", "/health", timeout=5)
            return status is None or (status == 503 and (as_json(data) or {}).get("status")
                                      == "draining")
        check(wait_until(draining, 10), "[9] after SIGTERM /health says 503 \"draining\"")
        status, body = complete(srv.port, {"prompt": "a", "max_tokens": 4}, timeout=30)
        check(status is None or (status == 503 and is_error(body)),
              f"[9] a new request while draining: 503 with an error body or refused "
              f"({status}: {short(body)})")
    finally:
        srv.signal_workers(signal.SIGCONT)
    a = joined(*ta, 60)
    b = joined(*tb, 60)
    sa = summary(a[2]) if isinstance(a, tuple) and a[2] is not None else None
    check(sa is not None and a[0] == 200 and sa["done"] and sa["text"] == refs[0],
          f"[9] the running stream completes with its continuation and [DONE] ({short(a)})")
    check(isinstance(b, tuple) and b[0] == 200 and text_of(b[1]) == refs[1],
          f"[9] the waiting request completes with 200 and its continuation ({short(b)})")
    try:
        code = srv.proc.wait(20 + 15)
    except subprocess.TimeoutExpired:
        code = None
    check(code == 0, f"[9] the drained server exits 0 ({code}, "
                     f"{time.monotonic() - t0:.1f} s after SIGTERM)")
    srv.check_clean("drained")


def idle_worker_dies():
    """Case 8b: a worker SIGKILLed while no request runs: /health turns broken by itself."""
    srv = Server("idle", 2, "--drain-timeout", "5")
    if not srv.ready():
        return
    victim = srv.workers()[-1]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()

    def broken():
        status, _, data = request(srv.port, "GET", "/health", timeout=5)
        h = as_json(data) or {}
        return h if status == 503 and h.get("status") == "broken" else None
    h = wait_until(broken, 10, step=0.1)
    check(bool(h) and f"pid {victim}" in str(h.get("reason")),
          f"[8b] a worker killed while idle: /health 503 \"broken\" naming pid {victim} within "
          f"{time.monotonic() - t0:.1f} s, before any request ({short(h)})")
    status, body = complete(srv.port, {"prompt": "a", "max_tokens": 4})
    check(status == 503 and is_error(body, "unavailable"),
          f"[8b] then a completion: 503 unavailable ({status}: {short(body)})")
    code = srv.terminate(20)
    check(code == 0, f"[8b] SIGTERM: exit 0 ({code})")
    srv.check_clean("idle death, after SIGTERM")


def no_queue():
    """Case 6b: --max-queue 0 takes a request when a batch slot is free, and only then."""
    srv = Server("noqueue", 1, "--max-batch", "1", "--max-queue", "0", "--max-new-tokens", "120")
    if not srv.ready():
        return
    status, body = complete(srv.port, {"prompt": "a", "max_tokens": 4, "temperature": 0})
    check(status == 200, f"[6b] --max-queue 0, empty batch: served ({status}: {short(body)})")
    ta = stopped_while_running(srv, {"prompt": "abc", "max_tokens": 120, "temperature": 0})
    try:
        check(running(srv.port) == 1, "[6b] a request runs (running 1, workers stopped)")
        status, body = complete(srv.port, {"prompt": "b", "max_tokens": 4}, timeout=30)
        check(status == 503 and is_error(body, "overloaded_error"),
              f"[6b] --max-queue 0, the one slot taken: 503 overloaded_error ({status}: "
              f"{short(body)})")
    finally:
        srv.signal_workers(signal.SIGCONT)
    a = joined(*ta, 60)
    check(isinstance(a, tuple) and a[0] == 200, f"[6b] the running request completes ({short(a)})")
    code = srv.terminate(20)
    check(code == 0, f"[6b] SIGTERM: exit 0 ({code})")
    srv.check_clean("no queue, after SIGTERM")


def main():
    write_checkpoint()
    want_greedy = {tp: infer(tp, "--greedy", "--max-new-tokens", str(GREEDY_N)) for tp in (1, 2)}
    sampled_args = ("--seed", "5", "--temperature", "0.8", "--top-k", "40",
                    "--max-new-tokens", str(SAMPLED_N))
    want_sampled = {tp: infer(tp, *sampled_args) for tp in (1, 2)}
    ref_zz = infer(1, "--greedy", "--max-new-tokens", "64", prompt="Zz 7")

    srv = Server("tp1", 1, "--max-new-tokens", "120", "--drain-timeout", "20")
    if srv.ready():
        equivalences(srv, want_greedy[1], want_sampled[1])
        status, body = complete(srv.port, {"prompt": "Zz 7", "max_tokens": 64, "temperature": 0})
        check(status == 200 and text_of(body) == ref_zz,
              f"[1] TP=1: a continuation with U+FFFD equals infer's ({short(body)})")
        stream_matches(srv, PROMPT, GREEDY_N, want_greedy[1], "TP=1")
        stream_matches(srv, "Zz 7", 64, ref_zz, "TP=1, a continuation with U+FFFD")
        curl_stream(srv, PROMPT, GREEDY_N, want_greedy[1])
        stops(srv, want_greedy[1] or "")
        refs = []
        for p in PROMPTS:
            status, body = complete(srv.port, {"prompt": p, "max_tokens": 24, "temperature": 0})
            refs.append(text_of(body) if status == 200 else None)
        check(all(refs) and len(set(refs)) > 16,
              f"[3] sequential greedy references ({len(set(filter(None, refs)))} distinct)")
        concurrent(srv, refs)
        bad_requests(srv)
        client_goes_away(srv, refs[1])
        drain(srv)
    api_keys()
    overload()
    no_queue()
    idle_worker_dies()
    srv = Server("tp2", 2, "--max-new-tokens", "120", "--drain-timeout", "5")
    if srv.ready():
        equivalences(srv, want_greedy[2], want_sampled[2])
        stream_matches(srv, PROMPT, GREEDY_N, want_greedy[2], "TP=2")
        worker_killed(srv)


try:
    main()
finally:
    for s in servers:
        if s.proc.poll() is None:
            s.kill()
        if failures:
            print(f"--- {s.name} (pid {s.pid}) stderr, tail:\n{s.stderr_tail()}")
    shutil.rmtree(TMP, ignore_errors=True)

for what in failures:  # again at the end: CI shows a log's head and tail
    print("FAIL " + what)
print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
