#!/usr/bin/python3
"""Peer of bench/parallel/infer_bench.cpp: the same Megatron-style tensor-parallel GPT-2 written
in plain PyTorch with torch.distributed (gloo), as a Python user would write it by hand
(Debian's python3-torch).

--tp ranks are fork children of this process; each sets torch.set_num_threads(--threads), joins a
gloo process group on 127.0.0.1 and builds only its shard, with GPT-2's initialisation from
torch.manual_seed(1234) (biases zero, LayerNorms 1 and 0):
  attention  c_attn column-parallel (this rank's n_head / tp heads of q, k and v), c_proj
             row-parallel (local matmul, all_reduce SUM, then the whole bias once)
  MLP        c_fc column-parallel (inner / tp units), c_proj row-parallel + all_reduce
  vocabulary Megatron's VocabParallelEmbedding and parallel LM head: the token embedding split
             by rows into tp parts of Vp = ceil(vocab / tp) rows (the last zero-padded); the
             lookup is masked to the rank's ids and all_reduced, the head's [B, T, Vp] logits
             are all_gathered and trimmed to the vocabulary
  the position embedding and the LayerNorms are replicated; a KV cache per layer.
Generate (greedy, under torch.no_grad): for each batch size of --batches, a prompt of
--prompt ids (torch.manual_seed(0), the same on every rank), one forward over it, then one per
new token; rank 0 takes the argmax of the last position and broadcasts the [B, 1] tokens.
A warm-up generate of 4 new tokens, then --reps timed generates of --new-tokens (a barrier before
each; time.perf_counter on rank 0 around the whole generate); the value is the median.

Prints (rank 0) one JSON object per line, {"name", "value", "unit"}, the names infer_bench uses:
  batch<B>/tokens_per_s, batch<B>/ms_per_token, rank<r>/rss_mib, rank<r>/hwm_mib,
  rank<r>/anon_mib (VmRSS, VmHWM and RssAnon of /proc/self/status after the timed runs),
  startup_s (from the start of this script to every rank holding its shard),
  parameters_per_rank (rank 0's parameter elements).
--check builds the whole model on every rank from one seed, slices it, and checks that the
tensor-parallel greedy tokens equal those of the unsliced model on rank 0 (not used by the
benchmark runner; it proves the slicing right). The parent kills the ranks and exits 1 after
--timeout seconds or when a rank fails.

usage: python_tp_infer.py [--tp 2] [--threads 1] [--batches 1,8] [--new-tokens 64] [--prompt 16]
                          [--reps 3] [--layers 12 --width 768 --heads 12 --vocab 50257
                          --positions 1024 --inner 0] [--timeout 600] [--check]
"""
import argparse
import json
import math
import multiprocessing
import os
import signal
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn import functional as F

T_START = time.perf_counter()


class Comm:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def all_reduce(self, t):
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def all_gather(self, t, dim):
        if self.world == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim)


def normal(*shape, std=0.02):
    return torch.empty(*shape).normal_(0, std)


class Block:
    """One GPT-2 block's shard: this rank's heads and MLP units."""

    def __init__(self, a, comm, full=None):
        c, h, inner, w, r = a.width, a.heads, a.inner or 4 * a.width, comm.world, comm.rank
        self.comm, self.heads, self.head_dim, self.width = comm, h // w, c // h, c
        local, inner_local = c // w, inner // w
        if full is None:
            std_proj = 0.02 / math.sqrt(2 * a.layers)
            self.attn_w = normal(3 * local, c)  # [q_r; k_r; v_r] rows, nn.Linear layout
            self.attn_b = torch.zeros(3 * local)
            self.proj_w = normal(c, local, std=std_proj)
            self.proj_b = torch.zeros(c)
            self.fc_w = normal(inner_local, c)
            self.fc_b = torch.zeros(inner_local)
            self.out_w = normal(c, inner_local, std=std_proj)
            self.out_b = torch.zeros(c)
            self.ln1 = (torch.ones(c), torch.zeros(c))
            self.ln2 = (torch.ones(c), torch.zeros(c))
        else:  # slice the full block (--check)
            rows = lambda z: z[r * local:(r + 1) * local]
            qkv_w, qkv_b = full["attn_w"].split(c), full["attn_b"].split(c)
            self.attn_w = torch.cat([rows(z) for z in qkv_w]).contiguous()
            self.attn_b = torch.cat([rows(z) for z in qkv_b]).contiguous()
            self.proj_w = full["proj_w"][:, r * local:(r + 1) * local].contiguous()
            self.proj_b = full["proj_b"]
            self.fc_w = full["fc_w"][r * inner_local:(r + 1) * inner_local].contiguous()
            self.fc_b = full["fc_b"][r * inner_local:(r + 1) * inner_local].contiguous()
            self.out_w = full["out_w"][:, r * inner_local:(r + 1) * inner_local].contiguous()
            self.out_b = full["out_b"]
            self.ln1, self.ln2 = full["ln1"], full["ln2"]

    def numel(self):
        return sum(t.numel() for t in (self.attn_w, self.attn_b, self.proj_w, self.proj_b,
                                       self.fc_w, self.fc_b, self.out_w, self.out_b, *self.ln1,
                                       *self.ln2))

    def forward(self, x, cache):
        b, t, c = x.shape
        local = self.heads * self.head_dim
        q, k, v = F.linear(F.layer_norm(x, (c,), *self.ln1), self.attn_w, self.attn_b).split(local, 2)
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if cache:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        cache[:] = [k, v]
        past = k.size(2) - t
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if t > 1:
            mask = torch.ones(t, past + t, dtype=torch.bool).triu(past + 1)
            scores = scores.masked_fill(mask, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, local)
        h = x + self.comm.all_reduce(F.linear(y, self.proj_w)) + self.proj_b
        inner = F.gelu(F.linear(F.layer_norm(h, (c,), *self.ln2), self.fc_w, self.fc_b),
                       approximate="tanh")
        return h + self.comm.all_reduce(F.linear(inner, self.out_w)) + self.out_b


class Gpt:
    def __init__(self, a, comm, full=None):
        self.a, self.comm = a, comm
        self.vp = -(-a.vocab // comm.world)  # rows per rank (Vp)
        self.start = comm.rank * self.vp
        self.held = max(0, min(self.vp, a.vocab - self.start))
        self.wte = torch.zeros(self.vp, a.width)
        if full is None:
            self.wte[:self.held].normal_(0, 0.02)
            self.wpe = normal(a.positions, a.width, std=0.01)
            self.blocks = [Block(a, comm) for _ in range(a.layers)]
            self.ln_f = (torch.ones(a.width), torch.zeros(a.width))
        else:
            self.wte[:self.held] = full["wte"][self.start:self.start + self.held]
            self.wpe = full["wpe"]
            self.blocks = [Block(a, comm, fb) for fb in full["blocks"]]
            self.ln_f = full["ln_f"]

    def numel(self):
        return (self.wte.numel() + self.wpe.numel() + sum(b.numel() for b in self.blocks)
                + 2 * self.a.width)

    def forward(self, ids, caches):
        past = caches[0][0].size(2) if caches[0] else 0
        local = ids - self.start
        foreign = (local < 0) | (local >= self.held)
        x = F.embedding(local.masked_fill(foreign, 0), self.wte).masked_fill_(foreign.unsqueeze(-1), 0)
        x = self.comm.all_reduce(x) + self.wpe[past:past + ids.size(1)]
        for block, cache in zip(self.blocks, caches):
            x = block.forward(x, cache)
        logits = F.linear(F.layer_norm(x, (self.a.width,), *self.ln_f), self.wte)
        return self.comm.all_gather(logits, -1)[..., :self.a.vocab]


def generate(model, prompt, new_tokens, comm):
    caches = [[] for _ in model.blocks]
    logits = model.forward(prompt, caches)
    pieces = [prompt]
    for i in range(new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # every rank computes it; rank 0's wins
        if comm.world > 1:
            dist.broadcast(nxt, 0)
        pieces.append(nxt)
        if i + 1 == new_tokens:
            break
        logits = model.forward(nxt, caches)
    return torch.cat(pieces, 1)


def full_model(a):
    """The unsliced model's parameters (--check), from one seed."""
    torch.manual_seed(99)
    c, inner = a.width, a.inner or 4 * a.width
    rnd = lambda *s: torch.randn(*s) * 0.05
    blocks = [{"attn_w": rnd(3 * c, c), "attn_b": rnd(3 * c), "proj_w": rnd(c, c), "proj_b": rnd(c),
               "fc_w": rnd(inner, c), "fc_b": rnd(inner), "out_w": rnd(c, inner), "out_b": rnd(c),
               "ln1": (1 + rnd(c), rnd(c)), "ln2": (1 + rnd(c), rnd(c))} for _ in range(a.layers)]
    return {"wte": rnd(a.vocab, c), "wpe": rnd(a.positions, c), "blocks": blocks,
            "ln_f": (1 + rnd(c), rnd(c))}


def memory_mib():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(rest.split()[0]) / 1024.0
    return [out.get("VmRSS", -1.0), out.get("VmHWM", -1.0), out.get("RssAnon", -1.0)]


def emit(name, value, unit):
    print(json.dumps({"name": name, "value": value, "unit": unit}), flush=True)


def rank_main(rank, a, port):
    torch.set_num_threads(a.threads)
    comm = Comm(rank, a.tp)
    if a.tp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=a.tp, timeout=timedelta(seconds=a.timeout))
    with torch.no_grad():  # not inference_mode: gloo writes results from its own thread
        if a.check:
            full = full_model(a)
            model = Gpt(a, comm, full)
        else:
            torch.manual_seed(1234)
            model = Gpt(a, comm)
        if a.tp > 1:
            dist.barrier()
        startup = time.perf_counter() - T_START
        torch.manual_seed(0)
        if a.check:
            prompt = torch.randint(a.vocab, (2, a.prompt))
            got = generate(model, prompt, a.new_tokens, comm)
            if rank == 0:
                want = generate(Gpt(a, Comm(0, 1), full), prompt, a.new_tokens, Comm(0, 1))
                if not torch.equal(got, want):
                    raise AssertionError(f"TP={a.tp} tokens {got.tolist()} != unsliced {want.tolist()}")
                print(f"check: TP={a.tp} greedy tokens equal the unsliced model's", flush=True)
            return
        results = []
        for b in a.batches:
            prompt = torch.randint(a.vocab, (b, a.prompt))
            generate(model, prompt, min(4, a.new_tokens), comm)
            secs = []
            for _ in range(a.reps):
                if a.tp > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                out = generate(model, prompt, a.new_tokens, comm)
                secs.append(time.perf_counter() - t0)
                assert out.shape == (b, a.prompt + a.new_tokens)
            results.append((b, statistics.median(secs)))
        mem = torch.tensor(memory_mib(), dtype=torch.float64)
        mems = [torch.empty_like(mem) for _ in range(a.tp)]
        if a.tp > 1:
            dist.all_gather(mems, mem)
        else:
            mems = [mem]
    if rank == 0:
        emit("startup_s", startup, "s")
        for b, s in results:
            emit(f"batch{b}/tokens_per_s", b * a.new_tokens / s, "tokens/s")
            emit(f"batch{b}/ms_per_token", s * 1e3 / a.new_tokens, "ms")
        for r, m in enumerate(mems):
            for key, v in zip(("rss_mib", "hwm_mib", "anon_mib"), m.tolist()):
                emit(f"rank{r}/{key}", v, "MiB")
        emit("parameters_per_rank", model.numel(), "elements")
    if a.tp > 1:
        dist.barrier()
        dist.destroy_process_group()


def child(rank, a, port):
    try:
        rank_main(rank, a, port)
    except BaseException as e:  # noqa: BLE001 - reported, then a non-zero exit
        print(f"python_tp_infer rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--inner", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    a.batches = [int(b) for b in a.batches.split(",") if b]
    inner = a.inner or 4 * a.width
    if a.tp < 1 or a.heads % a.tp or a.width % a.heads or inner % a.tp:
        ap.error(f"--tp {a.tp} must divide --heads {a.heads} and the MLP width {inner}")
    if a.prompt + a.new_tokens > a.positions:
        ap.error("--prompt + --new-tokens exceed --positions")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=child, args=(r, a, port), daemon=True) for r in range(a.tp)]
    for p in procs:
        p.start()

    def kill_all(*_):
        for p in procs:
            if p.is_alive():
                p.kill()

    def on_alarm(*_):
        print(f"python_tp_infer: timed out after {a.timeout:.0f} s", file=sys.stderr, flush=True)
        kill_all()
        os._exit(1)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(a.timeout)))
    failed = False
    while any(p.is_alive() for p in procs):
        for p in procs:
            p.join(0.05)
            if p.exitcode not in (None, 0):
                failed = True
        if failed:
            kill_all()
            break
    for p in procs:
        p.join()
    signal.alarm(0)
    if failed or any(p.exitcode != 0 for p in procs):
        print(f"python_tp_infer: a rank failed (exit codes {[p.exitcode for p in procs]})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
