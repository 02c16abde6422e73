#!/usr/bin/python3
"""Peer of bench/server/pserver_bench.cpp: a gradient parameter server written with
torch.distributed.rpc (TensorPipe backend, Debian's python3-torch), as machin's
PushPullGradServer does it, mirroring torchpar's PushPullGradServerImpl.

Four workers, "server" (rank 0) and "trainer1" .. "trainer3", are fork children of this process;
all call rpc.init_rpc (TensorPipe, env:// rendezvous on 127.0.0.1 and a free port). The server
hosts one gradient server per model (made on first use), each with its own copy of the model,
SGD (lr 0.01) and a reducer thread, with torchpar's default options: the pushes go to a queue,
batches of 4 are stacked and summed, batches of 4 of those are set as the model's gradients,
the optimizer steps and a copy of the new state dict is published with the next version
(version 0: the initial model); a queue holds at most 64 entries (a push into a full one drops
the oldest), and a queue whose oldest entry waited 1 s is reduced short. The server's main
thread coordinates: it tells the first T trainers over a pipe to run N cycles and waits for
all of them (one timed batch). A cycle of a trainer, on its own copy of the model:
  every parameter's .grad filled with 1e-4 (no forward/backward), then
  rpc_sync(server, push, (model, {name: grad}))      the gradients into the server's queue
  zero_grad(); rpc_sync(server, pull, (model,))      the newest (state dict, version); loaded
                                                      with load_state_dict when newer
two round trips, as torchpar's PushPullGradServer.push (push, then pull). The gradients are
sent as they are (torchpar's push copies them first).
Models: "mnist", pytorch/examples' mnist_hogwild Net (21,840 float32 parameters, 85 KiB), and
"16m", 4 x Linear(1024, 1024, bias=False) (4 Mi float32 parameters, 16 MiB). Measures, for
each model and T in (1, 3): a warm-up batch (20 cycles per trainer, 2 for 16m), then --batches
timed batches of --cycles (--cycles-16m) cycles per trainer, each timed with
time.perf_counter() in the server; "<model>/<T>": all cycles / all time (cycles/s, all
trainers together), "<model>/<T>/steps": optimizer steps in that time (steps/s),
"<model>/<T>/dropped": queue entries dropped per push. Every RPC has a 60 s timeout, and the
parent stops the run (killing the workers) after --timeout seconds.
Prints one JSON object per line: {"name", "value", "unit"}.

usage: python_pserver.py [--quick] [--cycles N] [--cycles-16m N] [--batches N]
                         [--timeout SECONDS]
"""
import argparse
import collections
import json
import multiprocessing
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn

torch.set_num_threads(1)
CTX = multiprocessing.get_context("fork")
TIMEOUT = 60.0  # seconds; any single RPC longer than this fails the run instead of hanging
MAX_TRAINERS = 3
WARMUP = {"mnist": 20, "16m": 2}  # cycles per trainer
GRAD, LR = 1e-4, 0.01
# torchpar's PushPullGradServerOptions defaults
REDUCE_BATCH_SIZE, MAX_QUEUE_SIZE, FLUSH_AFTER = 4, 64, 1.0
PRIMARY, SECONDARY = 0, 1  # queue levels, the primary served first


class Net(nn.Module):
    """pytorch/examples' mnist_hogwild Net (as bench/peers/mnist_hogwild.py); no forward is run."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)


def make_model(name):
    if name == "mnist":
        return Net()
    return nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)])


class GradServer:
    """One model's server in the server process: queues, reducer thread, published state."""

    def __init__(self, name):
        self.model = make_model(name)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.cv = threading.Condition()
        self.queues = (collections.deque(), collections.deque())  # of (grads, arrival time)
        self.published = (self.state_copy(), 0)
        self.steps = self.dropped = 0
        self.error = None
        threading.Thread(target=self.run, daemon=True).start()

    def state_copy(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def push(self, grads, level):
        with self.cv:
            if self.error:
                raise RuntimeError(f"the reducer stopped: {self.error}")
            q = self.queues[level]
            if len(q) >= MAX_QUEUE_SIZE:
                q.popleft()
                self.dropped += 1
            q.append((grads, time.monotonic()))
            self.cv.notify_all()

    def pull(self):
        with self.cv:
            return self.published

    def take_batch(self):
        """Waits for a full batch (primary queue first) or a queue due for a flush; returns
        (level, batch). Called with self.cv held."""
        while True:
            for level in (PRIMARY, SECONDARY):
                if len(self.queues[level]) >= REDUCE_BATCH_SIZE:
                    q = self.queues[level]
                    return level, [q.popleft()[0] for _ in range(REDUCE_BATCH_SIZE)]
            now, wake = time.monotonic(), None
            for level in (PRIMARY, SECONDARY):
                q = self.queues[level]
                if q:
                    due = q[0][1] + FLUSH_AFTER
                    if due <= now:
                        batch = [g for g, _ in q]
                        q.clear()
                        return level, batch
                    wake = due if wake is None else min(wake, due)
            self.cv.wait(None if wake is None else wake - now)

    def run(self):
        try:
            while True:
                with self.cv:
                    level, batch = self.take_batch()
                reduced = {k: torch.stack([b[k] for b in batch]).sum(0) for k in batch[0]}
                if level == SECONDARY:  # the server is its own primary: a local forward
                    self.push(reduced, PRIMARY)
                    continue
                for name, p in self.model.named_parameters():
                    p.grad = reduced[name]
                self.optimizer.step()
                state = self.state_copy()
                with self.cv:
                    self.published = (state, self.published[1] + 1)
                    self.steps += 1
        except Exception as e:  # pushes report it from now on
            with self.cv:
                self.error = f"{type(e).__name__}: {e}"


SERVERS = {}  # in the server process: model name -> GradServer


def ps_push(model, grads):
    SERVERS[model].push(grads, SECONDARY)


def ps_pull(model):
    return SERVERS[model].pull()


def emit(name, value, unit):
    print(json.dumps({"name": name, "value": value, "unit": unit}), flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer(ctl):
    """Runs the batches the server asks for: (model, cycles), None stops; answers each with ""
    or the error that ended it."""
    models = {}
    while True:
        try:
            cmd = ctl.recv()
        except EOFError:  # the server is gone
            return
        if cmd is None:
            return
        model, cycles = cmd
        try:
            if model not in models:
                net = make_model(model)
                models[model] = [net, -1]
                sd, version = rpc.rpc_sync("server", ps_pull, args=(model,), timeout=TIMEOUT)
                net.load_state_dict(sd)
                models[model][1] = version
            net, version = models[model]
            params = list(net.named_parameters())
            for _ in range(cycles):
                for _, p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.fill_(GRAD)
                rpc.rpc_sync("server", ps_push, args=(model, {n: p.grad for n, p in params}),
                             timeout=TIMEOUT)
                net.zero_grad()
                sd, newest = rpc.rpc_sync("server", ps_pull, args=(model,), timeout=TIMEOUT)
                if newest > version:
                    net.load_state_dict(sd)
                    version = newest
            models[model][1] = version
            ctl.send("")
        except Exception as e:
            ctl.send(f"{type(e).__name__}: {e}")


def server(ctls, cycles, batches):
    def run(trainers, model, n):
        for c in ctls[:trainers]:
            c.send((model, n))
        replies = [c.recv() for c in ctls[:trainers]]
        errors = [f"trainer{t + 1}: {e}" for t, e in enumerate(replies) if e]
        if errors:
            raise RuntimeError("; ".join(errors))

    try:
        for model in ("mnist", "16m"):
            s = SERVERS[model] = GradServer(model)
            for trainers in (1, MAX_TRAINERS):
                run(trainers, model, WARMUP[model])
                steps0, dropped0 = s.steps, s.dropped
                elapsed = 0.0
                for _ in range(batches):
                    t0 = time.perf_counter()
                    run(trainers, model, cycles[model])
                    elapsed += time.perf_counter() - t0
                if s.error:
                    raise RuntimeError(f"{model} server: the reducer stopped: {s.error}")
                pushes = trainers * cycles[model] * batches
                emit(f"{model}/{trainers}", pushes / elapsed, "cycles/s")
                emit(f"{model}/{trainers}/steps", (s.steps - steps0) / elapsed, "steps/s")
                emit(f"{model}/{trainers}/dropped", (s.dropped - dropped0) / pushes, "per push")
    finally:  # the trainers leave their loop, so rpc.shutdown can finish everywhere
        for c in ctls:
            try:
                c.send(None)
            except OSError:
                pass


def worker(rank, ctl, args):
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=TIMEOUT)
    name = "server" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=MAX_TRAINERS + 1, rpc_backend_options=opts)
    try:
        if rank == 0:
            server(ctl, *args)
        else:
            trainer(ctl)
    finally:
        rpc.shutdown()  # graceful: every worker waits here until all are done


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 timed batches, smaller batches")
    ap.add_argument("--cycles", type=int,
                    help="cycles per trainer per mnist batch (300, quick 100)")
    ap.add_argument("--cycles-16m", type=int,
                    help="cycles per trainer per 16 MiB batch (10, quick 4)")
    ap.add_argument("--batches", type=int, help="timed batches per measure (5, quick 3)")
    ap.add_argument("--timeout", type=int, default=600, help="stop the run after this many seconds")
    args = ap.parse_args()
    cycles = {"mnist": args.cycles or (100 if args.quick else 300),
              "16m": args.cycles_16m or (4 if args.quick else 10)}
    batches = args.batches or (3 if args.quick else 5)

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    pipes = [CTX.Pipe() for _ in range(MAX_TRAINERS)]
    procs = [CTX.Process(target=worker, args=(0, [a for a, _ in pipes], (cycles, batches)),
                         daemon=True)]
    procs += [CTX.Process(target=worker, args=(r + 1, b, None), daemon=True)
              for r, (_, b) in enumerate(pipes)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    names = ["server"] + [f"trainer{r}" for r in range(1, MAX_TRAINERS + 1)]
    failed = [f"{names[r]} " + ("timed out" if p.exitcode is None else f"exit code {p.exitcode}")
              for r, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    if failed:
        print(f"python_pserver.py: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
