#!/usr/bin/python3
"""Peer of `torchpar serve` (bench section serve): the tensor-parallel GPT-2 of python_tp_infer.py
(imported, not copied: Megatron-style, plain PyTorch + torch.distributed gloo) behind Python's
http.server.ThreadingHTTPServer, serving the subset of `torchpar serve`'s HTTP interface the
benchmark uses, as a Python user would write it with reasonable effort (Debian's python3-torch).

Processes: rank 0 is this process (HTTP server threads, one scheduler thread that runs the model);
ranks 1 .. --tp - 1 are fork children (PR_SET_PDEATHSIG: they die with rank 0) that follow rank 0
through torch.distributed broadcasts. Every rank loads the whole checkpoint (DIR/model.pt +
DIR/model.json, GPT-2 names, Conv1D layout, "bytes" tokenizer: what `torchpar serve` loads) and
keeps its Megatron shard (python_tp_infer.Gpt's slicing); torch.set_num_threads(cores / tp).

Batching policy (static batching): rank 0's scheduler takes the oldest waiting request and up to
--max-batch - 1 more waiting requests with the same prompt length (no padding needed), broadcasts
the batch's prompt ids and one generate of max(max_tokens) new tokens, and runs it: one forward
over the prompts, then one per token; each step rank 0 picks every row's token (greedy at
temperature 0, else a draw from softmax(logits / temperature) over the top_k likeliest) and
broadcasts them; the handler threads stream each request's tokens as they come. Requests that
arrive during a generate wait for the next one; a request whose max_tokens is reached stops
streaming (its row keeps being computed until the batch ends); a client that disconnects is
dropped from delivery only.

HTTP (HTTP/1.1, keep-alive; streamed responses use chunked transfer encoding):
  POST /v1/completions  {"prompt": str (required, non-empty), "max_tokens": int >= 0 (16),
                         "temperature": number >= 0 (1.0; 0 = greedy), "top_k": int >= 0 (0),
                         "seed": int, "stream": bool (false), "model": str (ignored)}; any other
                         field, bad JSON or prompt bytes + max_tokens > n_positions -> 400;
                         more than --max-queue waiting, loading or draining -> 503.
                         stream: one SSE event `data: <chunk>\\n\\n` per token, then a chunk with
                         finish_reason "length", then `data: [DONE]\\n\\n` (torchpar serve's form)
  GET /health           200 {"status": "ready"}; 503 {"status": "loading" | "draining"}
stdout: `python_serve: listening on http://HOST:PORT` once bound, `python_serve: ready (...)` once
the ranks hold the model. SIGTERM / SIGINT: drain (new requests 503, the queued and running ones
finish, at most --drain-timeout s), stop the ranks, exit 0.

--save-checkpoint DIR: instead of serving, write DIR/model.pt (torch.save of a plain dict of GPT-2
names -> float32 tensors, Conv1D [in, out] projections, no lm_head: tied to wte) and
DIR/model.json ("tokenizer": "bytes"), the unsliced model of python_tp_infer.full_model (from its
fixed seed) at --layers/--width/--heads/--vocab/--positions/--inner, and exit.

usage: python_serve.py --checkpoint DIR [--tp 1] [--host 127.0.0.1] [--port 8000 (0: any)]
                       [--max-batch 8] [--max-queue 64] [--threads 0 (cores / tp)]
                       [--drain-timeout 30] [--timeout 600]
       python_serve.py --save-checkpoint DIR [--layers 4 --width 768 --heads 12 --vocab 256
                       --positions 256 --inner 0]
"""
import argparse
import codecs
import ctypes
import http.server
import itertools
import json
import multiprocessing
import os
import queue
import signal
import socket
import sys
import threading
import time
import types
from datetime import timedelta

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import python_tp_infer as tpi  # noqa: E402  (beside this file: the model and its slicing)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STOP, RUN = 0, 1  # rank 0's commands to the other ranks


# ----------------------------------------------------------------------------------------------
# Checkpoint: python_tp_infer's "full" parameter dict <-> GPT-2 state dict (Conv1D layout)

LINEARS = (("attn_w", "attn_b", "attn.c_attn"), ("proj_w", "proj_b", "attn.c_proj"),
           ("fc_w", "fc_b", "mlp.c_fc"), ("out_w", "out_b", "mlp.c_proj"))


def to_state_dict(full):
    sd = {"wte.weight": full["wte"], "wpe.weight": full["wpe"],
          "ln_f.weight": full["ln_f"][0], "ln_f.bias": full["ln_f"][1]}
    for i, b in enumerate(full["blocks"]):
        p = f"h.{i}."
        sd[p + "ln_1.weight"], sd[p + "ln_1.bias"] = b["ln1"]
        sd[p + "ln_2.weight"], sd[p + "ln_2.bias"] = b["ln2"]
        for w, bias, name in LINEARS:  # nn.Linear [out, in] -> Conv1D [in, out]
            sd[p + name + ".weight"], sd[p + name + ".bias"] = b[w].t(), b[bias]
    return {k: v.contiguous().clone() for k, v in sd.items()}


def from_state_dict(sd, layers):
    full = {"wte": sd["wte.weight"], "wpe": sd["wpe.weight"],
            "ln_f": (sd["ln_f.weight"], sd["ln_f.bias"]), "blocks": []}
    for i in range(layers):
        p = f"h.{i}."
        b = {"ln1": (sd[p + "ln_1.weight"], sd[p + "ln_1.bias"]),
             "ln2": (sd[p + "ln_2.weight"], sd[p + "ln_2.bias"])}
        for w, bias, name in LINEARS:
            b[w], b[bias] = sd[p + name + ".weight"].t().contiguous(), sd[p + name + ".bias"]
        full["blocks"].append(b)
    return full


def save_checkpoint(a):
    shape = types.SimpleNamespace(layers=a.layers, width=a.width, heads=a.heads, vocab=a.vocab,
                                  positions=a.positions, inner=a.inner)
    os.makedirs(a.save_checkpoint, exist_ok=True)
    sd = to_state_dict(tpi.full_model(shape))
    torch.save(sd, os.path.join(a.save_checkpoint, "model.pt"))
    with open(os.path.join(a.save_checkpoint, "model.json"), "w") as f:
        json.dump({"vocab_size": a.vocab, "n_positions": a.positions, "n_embd": a.width,
                   "n_layer": a.layers, "n_head": a.heads, "n_inner": a.inner,
                   "layer_norm_epsilon": 1e-5, "dtype": "float32", "tokenizer": "bytes",
                   "weight_layout": "conv1d"}, f)
    print(f"python_serve: wrote {a.save_checkpoint}/model.pt and model.json "
          f"({sum(v.numel() for v in sd.values()) / 1e6:.1f}M parameters)", flush=True)


def load_model(a, comm):
    with open(os.path.join(a.checkpoint, "model.json")) as f:
        cfg = json.load(f)
    if cfg.get("weight_layout", "conv1d") != "conv1d" or cfg.get("tokenizer", "bytes") != "bytes":
        raise ValueError("model.json: only weight_layout conv1d and tokenizer bytes are served")
    shape = types.SimpleNamespace(layers=cfg["n_layer"], width=cfg["n_embd"], heads=cfg["n_head"],
                                  vocab=cfg["vocab_size"], positions=cfg["n_positions"],
                                  inner=cfg.get("n_inner", 0))
    inner = shape.inner or 4 * shape.width
    if shape.heads % comm.world or inner % comm.world:
        raise ValueError(f"--tp {comm.world} must divide n_head {shape.heads} and the MLP width {inner}")
    sd = {k: v.float() for k, v in torch.load(os.path.join(a.checkpoint, "model.pt")).items()}
    return tpi.Gpt(shape, comm, from_state_dict(sd, shape.layers)), shape


# ----------------------------------------------------------------------------------------------
# The model loop: every rank runs run_batch; rank 0 picks the tokens


def run_batch(model, comm, ids, new_tokens, pick=None, deliver=None):
    """One static batch: a forward over the [B, T] prompts, then one per new token. Rank 0
    (pick given) picks each step's [B, 1] tokens and hands them to deliver(step, tokens)."""
    caches = [[] for _ in model.blocks]
    logits = model.forward(ids, caches)
    for i in range(new_tokens):
        nxt = pick(logits[:, -1]) if pick else torch.empty(ids.size(0), 1, dtype=torch.int64)
        if comm.world > 1:
            dist.broadcast(nxt, 0)
        if deliver:
            deliver(i, nxt)
        if i + 1 == new_tokens:
            break
        logits = model.forward(nxt, caches)


def follower(model, comm):
    """Ranks 1..: run what rank 0 broadcasts until it says STOP."""
    while True:
        head = torch.zeros(4, dtype=torch.int64)
        dist.broadcast(head, 0)
        cmd, b, t, n = head.tolist()
        if cmd == STOP:
            return
        ids = torch.empty(b, t, dtype=torch.int64)
        dist.broadcast(ids, 0)
        run_batch(model, comm, ids, n)


class Request:
    _ids = itertools.count(1)

    def __init__(self, prompt, max_tokens, temperature, top_k, seed):
        self.id = f"cmpl-{next(Request._ids)}"
        self.prompt, self.max_tokens = prompt, max_tokens
        self.temperature, self.top_k = temperature, top_k
        self.gen = None
        if temperature > 0:
            self.gen = torch.Generator()
            self.gen.manual_seed(seed if seed is not None else torch.seed())
        self.tokens = queue.SimpleQueue()  # ints, then None (done) or an str (error)
        self.gone = False  # the client disconnected


class Engine:
    """Rank 0's side: the waiting list, the scheduler loop, the state /health shows."""

    def __init__(self, a):
        self.a = a
        self.state, self.reason = "loading", ""
        self.cv = threading.Condition()
        self.waiting = []
        self.model = self.shape = self.comm = None

    def submit(self, req):
        with self.cv:
            if self.state != "ready":
                return self.state
            if len(self.waiting) >= self.a.max_queue:
                return "queue full"
            self.waiting.append(req)
            self.cv.notify()
        return None

    def take(self):
        """The next batch (oldest request + up to max_batch - 1 of the same prompt length), or
        None when drained."""
        with self.cv:
            while not self.waiting:
                if self.state != "ready":
                    return None
                self.cv.wait(0.1)
            first = self.waiting[0]
            batch = [r for r in self.waiting if len(r.prompt) == len(first.prompt)][:self.a.max_batch]
            chosen = set(map(id, batch))
            self.waiting = [r for r in self.waiting if id(r) not in chosen]
            return batch

    def drain(self):
        with self.cv:
            if self.state in ("loading", "ready"):
                self.state, self.reason = "draining", "SIGTERM"
            self.cv.notify_all()

    def pick(self, batch):
        def pick(last):  # [B, vocab] -> [B, 1]
            out = last.argmax(-1, keepdim=True)
            for i, r in enumerate(batch):
                if r.temperature > 0:
                    row = last[i].double() / r.temperature
                    if 0 < r.top_k < row.numel():
                        kth = row.topk(r.top_k).values[-1]
                        row = row.masked_fill(row < kth, float("-inf"))
                    out[i, 0] = torch.multinomial(row.softmax(-1), 1, generator=r.gen)
            return out
        return pick

    def loop(self):
        drain_deadline = None
        while True:
            batch = self.take()
            if batch is None:
                break
            if self.state == "draining":
                drain_deadline = drain_deadline or time.monotonic() + self.a.drain_timeout
                if time.monotonic() > drain_deadline:
                    for r in batch + self.waiting:
                        r.tokens.put("draining: --drain-timeout passed")
                    self.waiting = []
                    break
            n = max(r.max_tokens for r in batch)
            ids = torch.tensor([list(r.prompt) for r in batch], dtype=torch.int64)
            if self.comm.world > 1:
                dist.broadcast(torch.tensor([RUN, ids.size(0), ids.size(1), n]), 0)
                dist.broadcast(ids, 0)

            def deliver(step, nxt):
                for r, tok in zip(batch, nxt[:, 0].tolist()):
                    if step < r.max_tokens and not r.gone:
                        r.tokens.put(tok)
                    if step + 1 == r.max_tokens:
                        r.tokens.put(None)
            run_batch(self.model, self.comm, ids, n, self.pick(batch), deliver)
        if self.comm.world > 1:
            dist.broadcast(torch.tensor([STOP, 0, 0, 0]), 0)


# ----------------------------------------------------------------------------------------------
# HTTP


class BadRequest(Exception):
    pass


def parse_body(raw, n_positions):
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body is not a JSON object")
    unknown = set(body) - {"prompt", "max_tokens", "temperature", "top_k", "seed", "stream", "model"}
    if unknown:
        raise BadRequest(f"unknown field {sorted(unknown)[0]!r}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string")
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    max_tokens, temperature = body.get("max_tokens", 16), body.get("temperature", 1.0)
    top_k, seed, stream = body.get("top_k", 0), body.get("seed"), body.get("stream", False)
    if not is_int(max_tokens) or max_tokens < 0:
        raise BadRequest("max_tokens must be an integer >= 0")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0:
        raise BadRequest("temperature must be a number >= 0")
    if not is_int(top_k) or top_k < 0:
        raise BadRequest("top_k must be an integer >= 0")
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2 ** 63):
        raise BadRequest("seed must be an integer in [0, 2^63)")
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    data = prompt.encode()
    if len(data) + max_tokens > n_positions:
        raise BadRequest(f"prompt ({len(data)} tokens) + max_tokens ({max_tokens}) exceed "
                         f"n_positions ({n_positions})")
    return Request(data, max_tokens, float(temperature), top_k, seed), stream


class TextDecoder:
    """Byte tokens -> text pieces: UTF-8 with each ill-formed part as U+FFFD; a token >= 256 is
    U+FFFD."""

    def __init__(self):
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")

    def piece(self, tok):
        if tok < 256:
            return self.dec.decode(bytes([tok]))
        rest = self.dec.decode(b"", final=True)
        self.dec.reset()
        return rest + "\ufffd"

    def rest(self):
        return self.dec.decode(b"", final=True)


def make_handler(engine, model_name):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # no access log
            pass

        def handle(self):  # a keep-alive client closing its connection is no error
            try:
                super().handle()
            except ConnectionError:
                pass

        def send_json(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def error(self, code, kind, message):
            self.send_json(code, {"error": {"message": message, "type": kind, "code": None}})

        def do_GET(self):
            if self.path != "/health":
                return self.error(404, "not_found_error", f"no route GET {self.path}")
            if engine.state == "ready":
                return self.send_json(200, {"status": "ready"})
            self.send_json(503, {"status": engine.state, "reason": engine.reason})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path != "/v1/completions":
                return self.error(404, "not_found_error", f"no route POST {self.path}")
            if engine.shape is None:
                return self.error(503, "unavailable", "loading")
            try:
                req, stream = parse_body(raw, engine.shape.positions)
            except BadRequest as e:
                return self.error(400, "invalid_request_error", str(e))
            if req.max_tokens > 0:
                refused = engine.submit(req)
                if refused:
                    return self.error(503, "overloaded_error" if refused == "queue full"
                                      else "unavailable", refused)
            else:
                req.tokens.put(None)
            chunk = lambda text, finish: {
                "id": req.id, "object": "text_completion", "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
            dec = TextDecoder()
            if not stream:
                pieces, n = [], 0
                while (tok := req.tokens.get()) is not None:
                    if isinstance(tok, str):
                        return self.error(503, "unavailable", tok)
                    pieces.append(dec.piece(tok))
                    n += 1
                doc = chunk("".join(pieces) + dec.rest(), "length")
                doc["usage"] = {"prompt_tokens": len(req.prompt), "completion_tokens": n,
                                "total_tokens": len(req.prompt) + n}
                return self.send_json(200, doc)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def event(obj):
                data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            try:
                while (tok := req.tokens.get()) is not None:
                    if isinstance(tok, str):
                        event({"error": {"message": tok, "type": "unavailable", "code": None}})
                        self.close_connection = True
                        return
                    event(chunk(dec.piece(tok), None))
                event(chunk(dec.rest(), "length"))
                event(b"[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:  # the client went away: stop delivering to it
                req.gone = True
                self.close_connection = True

    return Handler


# ----------------------------------------------------------------------------------------------
# Processes


def rank_child(rank, a, port):
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 stops us; PDEATHSIG if it dies
        torch.set_num_threads(a.threads)
        comm = tpi.Comm(rank, a.tp)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=a.tp, timeout=timedelta(seconds=a.timeout))
        with torch.no_grad():
            model, _ = load_model(a, comm)
            dist.barrier()
            follower(model, comm)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported, then a non-zero exit
        print(f"python_serve rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


def serve(a):
    a.threads = a.threads or max(1, len(os.sched_getaffinity(0)) // a.tp)
    port = 0
    if a.tp > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    # Fork the other ranks before any thread starts.
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=rank_child, args=(r, a, port), daemon=True) for r in range(1, a.tp)]
    for p in procs:
        p.start()
    engine = Engine(a)
    handler = make_handler(engine, os.path.basename(os.path.abspath(a.checkpoint)))
    http.server.ThreadingHTTPServer.request_queue_size = 128  # 32 clients connect at once
    server = http.server.ThreadingHTTPServer((a.host, a.port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, bound = server.server_address[:2]
    print(f"python_serve: listening on http://{host}:{bound}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: engine.drain())
    signal.signal(signal.SIGINT, lambda *_: engine.drain())

    def watch():  # a rank that dies takes the server down (its peers would wait in gloo)
        while True:
            for p in procs:
                if p.exitcode not in (None, 0):
                    print(f"python_serve: rank {procs.index(p) + 1} died (exit code {p.exitcode})",
                          file=sys.stderr, flush=True)
                    for q in procs:
                        q.kill()
                    os._exit(1)
            time.sleep(0.2)
    threading.Thread(target=watch, daemon=True).start()

    torch.set_num_threads(a.threads)
    comm = tpi.Comm(0, a.tp)
    t0 = time.perf_counter()
    if a.tp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=a.tp, timeout=timedelta(seconds=a.timeout))
    with torch.no_grad():
        engine.model, engine.shape = load_model(a, comm)
        engine.comm = comm
        if a.tp > 1:
            dist.barrier()
        with engine.cv:
            if engine.state == "loading":
                engine.state = "ready"
        print(f"python_serve: ready (tensor parallel {a.tp}, {a.threads} thread(s) per rank, "
              f"max batch {a.max_batch}, loaded in {time.perf_counter() - t0:.2f} s)", flush=True)
        engine.loop()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    if a.tp > 1:
        dist.destroy_process_group()
    server.shutdown()
    server.server_close()
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="directory holding model.pt + model.json")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--drain-timeout", type=float, default=30)
    ap.add_argument("--timeout", type=float, default=600, help="gloo's collective timeout (s)")
    ap.add_argument("--save-checkpoint", metavar="DIR")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--inner", type=int, default=0)
    a = ap.parse_args()
    if a.save_checkpoint:
        save_checkpoint(a)
        return 0
    if not a.checkpoint:
        ap.error("--checkpoint DIR or --save-checkpoint DIR is required")
    if a.tp < 1 or a.max_batch < 1 or a.max_queue < 0:
        ap.error("--tp and --max-batch must be >= 1, --max-queue >= 0")
    return serve(a)


if __name__ == "__main__":
    sys.exit(main())
