#!/usr/bin/python3
"""The benchmark runner behind `torchpar bench` and `make bench`: runs every torchpar benchmark
beside its peers, interleaved, and writes a report with medians, ratios, targets and plots.

usage: run_bench.py --bin BUILD/bin [--quick] [--only NAME[,NAME]] [--out DIR] [--rounds N]

Benchmarks (names for --only), run in this order:
  limits       shm_bench: one thread's memcpy and a fresh shared segment's create+map+touch,
               the physical limits the other sections are compared with
  handoff      ipc_bench vs peers/torch_ipc.py (both sharing strategies); shm_bench's
               share_memory_ and dumps+loads vs peers/torch_share_memory.py
  pools        pool_bench vs peers/python_pool.py (multiprocessing.Pool, torch.multiprocessing.Pool)
  manager      manager_bench vs peers/python_manager.py (multiprocessing.Manager): dict set+get and
               list append from a child, 4 KiB tensors through a manager Queue; each over TCP and
               an abstract Unix socket (ours) and AF_UNIX and TCP (Python's); and
               peers/python_manager_client.py: CPython's own SyncManager client against
               `torchpar manager` vs Python's server (dict set+get, list append; TCP, AF_UNIX)
  rpc          rpc_bench vs peers/python_rpc.py (torch.distributed.rpc, TensorPipe backend): rpc_sync
               round trips (tiny; 1 MiB tensor fresh, and ours from shared memory), 64 rpc_async
               calls in flight; and raw TensorPipe ping-pong (tiny, 1 MiB; rpc_bench drives
               TensorPipe's own API) as the transport's limit
  pserver      pserver_bench vs peers/python_pserver.py (the same gradient server written with
               torch.distributed.rpc): push+pull cycles/s for the mnist_hogwild model and a 16 MiB
               model, 1 server + 1 trainer and 1 server + 3 trainers
  collectives  coll_bench (torchpar-shm, torchpar-gloo, c10d-gloo-cpp) vs
               peers/torch_dist_collectives.py and peers/mpi_collectives.c (Open MPI, compiled
               with mpicc into <out>/raw/ when the benchmark starts); 4 B and 4 KiB also in
               back-to-back pairs of torchpar-shm and Open MPI (COLL_SMALL_PAIRS per round)
  scale-out    scaleout_bench between two network namespaces joined by a veth pair (2 hosts x 2
               ranks, two_hosts.py): all_reduce with the hierarchical backend vs flat Gloo, on the
               bare link and on one shaped to 1 Gbit/s with tc (netem with 0.2 ms delay, else tbf);
               needs root (skipped with a note otherwise); OpenMPI only where mpirun runs
  train        torchpar train --strategy single|hogwild|ddp vs peers/mnist_hogwild.py, mnist_ddp.py
  elastic      peers/elastic_scenario.py: `torchpar run --nnodes 1:2` vs torchrun (python3-torch's
               torch.distributed.run) on one scenario, two agents on loopback with one
               `torchpar train --strategy ddp` rank each: one node SIGKILLed mid-run, started again;
               seconds to training again on the survivor and on both, steps lost (in-memory
               snapshots vs checkpoints)
  inference    infer_bench (TensorParallel::generate on a seeded GPT-2-small-shaped model) at TP = 2
               (2 processes x 1 thread) and TP = 1 (1 process x 2 threads) vs
               peers/python_tp_infer.py (the same Megatron-style TP = 2 with torch.distributed gloo):
               tokens/s at batch 1 and 8, memory per rank
  serve        `torchpar serve` (continuous batching) vs peers/python_serve.py (the same model as
               python_tp_infer.py behind http.server, static batching), TP = 1 and 2, on one
               checkpoint (a 4-layer GPT-2-small-wide model, bytes vocabulary) the peer writes;
               serve_load.py's 1, 8 and 32 streaming clients: tokens/s, p50/p99 time to first
               token and per output token
  python       peers/python_mp.py: torchpar.multiprocessing vs torch.multiprocessing and
               multiprocessing from /usr/bin/python3 (4 KiB tensor Queue round trip and rate, a
               dict of 16 tensors, Pool.map and apply_async, DataLoader with 4 workers); imports
               torchpar from <build>/python beside --bin or the install prefix's
               lib/python3.X/dist-packages ("Python package not built" when it cannot)
  python_dist  peers/python_dist.py: torch.distributed from /usr/bin/python3 on the c10d backend
               "torchpar" (torchpar.distributed) vs "gloo", 2 ranks: all_reduce, broadcast and
               all_gather of float32 at 4 B to 64 MiB, DDP training of the mnist_hogwild network
               (samples/s, test accuracy); torchpar found as for python

Method: every round runs ours, then each peer (round r: ours, peer1, peer2, ...). A full run does
3 rounds of every benchmark and no untimed warm-up round: each run is a fresh set of processes
that warms up outside its timed region (every program does its own untimed warm-up calls), and a
median of 3 rounds already discards one slow round (a full run projected to ~38 min with 5 rounds and a
warm-up round; it is meant to take under 20). --quick does 1 round, smaller sizes and fewer
tasks (a smoke check in under 3 minutes, not a measurement); --rounds N overrides the round count
of every benchmark.
The value reported for a (system, measure) is the median over rounds of each run's own value.
Every subprocess runs in its own process group with a timeout (the whole group is killed when it
expires). A peer that fails is reported as "not run: <reason>"
and is not retried; ours failing makes the exit status 1, after the report has been written.

Output in --out (default bench/results/<YYYY-MM-DD_HHMMSS>/ of this repository): report.md,
results.json (every round's values and the medians), PNG plots (matplotlib, Agg) and raw/
(each run's stdout and stderr, the MPI binary, the training output directories; ignored by git).
When the out dir is inside bench/results/, bench/results/latest is pointed at it (relative
symlink), so the README can link bench/results/latest/report.md.
"""
import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.dont_write_bytecode = True
import two_hosts  # noqa: E402  (bench/two_hosts.py, beside this file; no __pycache__ written)

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
PEERS = BENCH_DIR / "peers"
RESULTS = BENCH_DIR / "results"
PY = "/usr/bin/python3"
BENCHMARKS = ("limits", "handoff", "pools", "manager", "rpc", "pserver", "collectives", "scale-out",
              "train", "elastic", "inference", "serve", "python", "python_dist")
KiB, MiB = 1 << 10, 1 << 20
# The programs each section runs from --bin (the CMake target `benchmarks` builds them all).
SECTION_PROGRAMS = {"limits": ("shm_bench",), "handoff": ("ipc_bench", "shm_bench"),
                    "pools": ("pool_bench",), "manager": ("manager_bench",), "rpc": ("rpc_bench",),
                    "pserver": ("pserver_bench",), "collectives": ("coll_bench",),
                    "scale-out": ("scaleout_bench",), "inference": ("infer_bench",)}
TIME_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


# ----------------------------------------------------------------------------------------------
# Configuration, subprocesses, interleaved rounds


@dataclass
class Config:
    bin: Path
    quick: bool
    out: Path
    rounds_override: Optional[int]
    cli: Optional[Path] = None  # the torchpar program (default: bin/torchpar)
    sections: tuple = BENCHMARKS  # the benchmarks this run does (--only)

    @property
    def torchpar(self):
        return self.cli or self.bin / "torchpar"

    @property
    def raw(self):
        return self.out / "raw"

    def pick(self, quick, full):
        return quick if self.quick else full

    def rounds(self, bench):
        return self.rounds_override or self.pick(1, 3)


class RunError(Exception):
    """A benchmark process failed; the message is a one-line reason."""


@dataclass
class Runner:
    name: str  # shown in progress lines and in the report
    ours: bool
    cmd: list
    parse: Callable[[str], dict]  # stdout -> {measure: value}
    timeout: float  # seconds
    skip: Optional[str] = None  # reason not to run it at all
    before: Optional[Callable[[], None]] = None  # called before each run


def progress(msg, end="\n"):
    print(msg, end=end, flush=True)


def slug(name):
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def kill_group(proc):
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def run_cmd(cmd, timeout, log_stem):
    """Runs cmd in its own process group and returns its stdout; keeps stdout and stderr in
    log_stem.out / .err. Raises RunError if it cannot start, exits non-zero or outlives timeout
    seconds (then the whole group is killed)."""
    cmd = [str(c) for c in cmd]
    log_stem.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)
    except OSError as e:
        raise RunError(f"cannot run {cmd[0]}: {e.strerror}") from None
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        timed_out = True
    except BaseException:  # Ctrl-C: leave nothing behind
        kill_group(proc)
        proc.wait()
        raise
    Path(f"{log_stem}.out").write_text(out)
    Path(f"{log_stem}.err").write_text(err)
    if timed_out:
        raise RunError(f"timed out after {timeout:g} s")
    if proc.returncode != 0:
        how = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
               else f"exit code {proc.returncode}")
        last = next((l.strip() for l in reversed((err or out).splitlines()) if l.strip()), "")
        raise RunError(f"{how}: {last[:200]}" if last else how)
    return out


def medians(rounds):
    keys = dict.fromkeys(k for r in rounds for k in r)
    return {k: statistics.median([r[k] for r in rounds if k in r]) for k in keys}


def interleave(cfg, bench, runners):
    """Runs the runners in turn, round after round; returns {runner name: record} with every
    round's values, their medians and the error that stopped the runner, if any."""
    rounds = cfg.rounds(bench)
    runs = {r.name: {"ours": r.ours, "cmd": shlex.join(str(c) for c in r.cmd), "values": [],
                     "seconds": [], "error": r.skip, "failed_in": "setup" if r.skip else None}
            for r in runners}
    for i in range(rounds):
        label, tag = f"round {i + 1}/{rounds}", f"r{i + 1}"
        for r in runners:
            rec = runs[r.name]
            if rec["error"]:
                continue
            progress(f"[{bench}] {label}: {r.name} ...", end="")
            t0 = time.monotonic()
            try:
                if r.before:
                    r.before()
                values = r.parse(run_cmd(r.cmd, r.timeout, cfg.raw / bench / f"{slug(r.name)}_{tag}"))
            except RunError as e:
                rec["error"], rec["failed_in"] = str(e), label
                progress(f" FAILED: {e}")
                continue
            dt = time.monotonic() - t0
            progress(f" {dt:.1f} s")
            rec["values"].append(values)
            rec["seconds"].append(round(dt, 2))
    for rec in runs.values():
        rec["median"] = medians(rec["values"])
    return runs


def failure_notes(runs):
    """Report lines for runners that failed: 'not run' for peers, FAILED for ours."""
    notes = []
    for name, rec in runs.items():
        if not rec["error"]:
            continue
        what = "**FAILED** (ours)" if rec["ours"] else "not run"
        if rec["values"]:
            notes.append(f"- {name}: {what} from {rec['failed_in']} on: {rec['error']} "
                         f"(medians use its {len(rec['values'])} completed rounds)")
        else:
            notes.append(f"- {name}: {what}: {rec['error']}")
    return notes


# ----------------------------------------------------------------------------------------------
# Output parsers


def gbench(out):
    """Google Benchmark JSON -> {name: benchmark entry plus 'us' (real time in microseconds)}."""
    try:
        data = json.loads(out)
    except json.JSONDecodeError:
        raise RunError("output is not Google Benchmark JSON") from None
    res = {}
    for b in data.get("benchmarks", []):
        if b.get("error_occurred"):
            raise RunError(f"{b['name']}: {b.get('error_message', 'error')}")
        res[b["name"]] = dict(b, us=b["real_time"] * TIME_US[b["time_unit"]])
    if not res:
        raise RunError("no benchmark results in the output")
    return res


def json_lines(out):
    try:
        rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    except json.JSONDecodeError as e:
        raise RunError(f"bad JSON line: {e}") from None
    if not rows:
        raise RunError("no JSON lines in the output")
    return rows


def pick_bench(g, name):
    if name not in g:
        raise RunError(f"{name} missing from the output")
    return g[name]


# ----------------------------------------------------------------------------------------------
# Formatting


def fmt(v):
    """A number with a sensible precision; None -> n/a."""
    if v is None:
        return "n/a"
    if isinstance(v, int):
        return f"{v:,}"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def fmt_x(r):
    return "n/a" if r is None else (f"{r:,.0f}x" if r >= 1000 else f"{r:.3g}x")


def fmt_pct(f):
    return "n/a" if f is None else (f"{100 * f:.0f}%" if f >= 0.1 else f"{100 * f:.1f}%")


def fmt_GBps(v):
    """busbw: coll_bench prints 4 decimals, so 0 means below 0.0001 GB/s."""
    return "n/a" if v is None else ("<1e-4" if v < 1e-4 else f"{v:.3g}")


def fmt_bytes(n):
    for unit, size in (("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def table(header, rows, left=1):
    """A Markdown table; the first `left` columns are left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(":---" if i < left else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def advantage(ours, other, higher):
    """How many times better ours is than other (> 1: ours better)."""
    if not ours or not other:
        return None
    return ours / other if higher else other / ours


def best(values, higher):
    values = [v for v in values if v is not None]
    return (max(values) if higher else min(values)) if values else None


def verdict(value, target, higher):
    """'yes (1.3x margin)' / 'no (needs 2.4x)' against a target, or '-' without one."""
    if target is None:
        return "-"
    if value is None:
        return "n/a"
    f = value / target if higher else target / value
    return f"yes ({fmt_x(f)} margin)" if f >= 1 else f"no (needs {fmt_x(1 / f)})"


def target_text(target, higher, unit=""):
    if target is None:
        return "-"
    return f"{'≥' if higher else '≤'} {fmt(target)}{' ' + unit if unit else ''}"


# ----------------------------------------------------------------------------------------------
# limits: shm_bench's memcpy and fresh segment


def parse_shm(out):
    """shm_bench -> {'<kind>/<bytes>': microseconds}."""
    kinds = {"ShareMemorySteady": "share_memory_steady", "ShareMemoryCold": "share_memory_cold",
             "Memcpy": "memcpy", "SegmentCreateTouch": "segment_create_touch"}
    res = {}
    for name, b in gbench(out).items():
        m = re.fullmatch(r"BM_(\w+)/(?:bytes:)?(\d+)(?:/copy:(\d))?", name)
        if not m:
            continue
        kind, n, copy = m.groups()
        key = (("dumps_loads_copy" if copy == "1" else "dumps_loads_shared")
               if kind == "DumpsLoads" else kinds.get(kind))
        if key:
            res[f"{key}/{n}"] = b["us"]
    return res


def shm_bench_cmd(cfg, pattern, min_time):
    return [cfg.bin / "shm_bench", "--benchmark_format=json", f"--benchmark_filter={pattern}",
            f"--benchmark_min_time={min_time}"]


def runners_limits(cfg):
    cmd = shm_bench_cmd(cfg, "BM_Memcpy|BM_SegmentCreateTouch", cfg.pick(0.05, 0.3))
    return [Runner("shm_bench", True, cmd, parse_shm, cfg.pick(120, 300))]


def physical_limits(results):
    """{'memcpy/<n>': us, 'segment_create_touch/<n>': us, 'source'} from the limits benchmark,
    else from handoff's shm_bench run (which measures the same), else None."""
    for bench in ("limits", "handoff"):
        med = results.get(bench, {}).get("shm_bench", {}).get("median", {})
        if f"memcpy/{64 * MiB}" in med:
            lim = {k: v for k, v in med.items() if k.startswith(("memcpy/", "segment_create_touch/"))}
            lim["source"] = bench
            return lim
    return None


def memcpy_GBps(limits):
    return 64 * MiB / limits[f"memcpy/{64 * MiB}"] / 1e3 if limits else None


def report_limits(runs, limits, cfg):
    med = runs["shm_bench"]["median"]
    rows = []
    for kind, label in (("memcpy", "memcpy, one thread, warm buffers"),
                        ("segment_create_touch", "fresh segment: memfd_create + fallocate + mmap + touch")):
        sizes = sorted(int(k.split("/")[1]) for k in med if k.startswith(kind + "/"))
        for n in sizes:
            us = med[f"{kind}/{n}"]
            rows.append((label, fmt_bytes(n), fmt(us), fmt(n / us / 1e3)))
    md = table(["limit", "size", "time (us)", "GB/s"], rows, left=2)
    md += ("\n\nThe 64 MiB memcpy (DRAM-bound) is the reference for the \"fraction of limit\" columns "
           "below: limit time / our time for hand-offs that copy, and busbw / memcpy GB/s for "
           "large collectives. Smaller copies run from cache and are faster than DRAM.")
    summary = {"memcpy_64MiB_GBps": memcpy_GBps(limits),
               "memcpy_64MiB_ms": med.get(f"memcpy/{64 * MiB}", 0) / 1e3 or None,
               "segment_create_touch_64MiB_ms": med.get(f"segment_create_touch/{64 * MiB}", 0) / 1e3 or None}
    return md, summary


# ----------------------------------------------------------------------------------------------
# handoff: ipc_bench vs torch_ipc.py, shm_bench vs torch_share_memory.py

# label, ours' benchmark, peer measure, unit, target, higher is better
IPC_ROWS = [
    ("Queue 4 KiB round trip", "BM_QueuePingPong4K/real_time", "queue_pingpong_4k", "us", 25, False),
    ("Queue 4 KiB one way", "BM_QueueOneWay4K/20000/real_time", "queue_oneway_4k", "items/s", 400_000, True),
    ("Pipe 4 KiB round trip", "BM_PipePingPong4K/real_time", "pipe_pingpong_4k", "us", 25, False),
    ("Pipe 4 KiB one way", "BM_PipeOneWay4K/20000/real_time", "pipe_oneway_4k", "items/s", None, True),
    ("64 MiB fresh hand-off", "BM_QueueHandoff64M/resend:0/real_time", "queue_handoff_64m_fresh",
     "ms", 20, False),
    ("64 MiB re-send (already shared)", "BM_QueueHandoff64M/resend:1/real_time",
     "queue_handoff_64m_resend", "us", 50, False),
]
# bench/results/2026-11-28_release: Queue 4 KiB one way (items/s), issue 42's baseline
QUEUE_ONEWAY_RELEASE = 638_189
STRATEGIES = ("file_descriptor", "file_system")
SHM_SIZES = (4 * KiB, MiB, 64 * MiB)


def parse_ipc(out):
    """ipc_bench -> {peer measure name: value in the row's unit}."""
    g = gbench(out)
    res = {}
    for _, bname, measure, unit, _, _ in IPC_ROWS:
        b = pick_bench(g, bname)
        res[measure] = b["items_per_second"] if unit == "items/s" else b["us"] / (1e3 if unit == "ms" else 1)
    return res


def parse_torch_ipc(out):
    return {f"{r['name']}/{r['strategy']}": r["value"] for r in json_lines(out)}


def parse_torch_share_memory(out):
    return {f"{r['name']}/{r['bytes']}": r["median_us"] for r in json_lines(out)}


def runners_handoff(cfg):
    quick = ["--quick"] if cfg.quick else []
    ipc = [cfg.bin / "ipc_bench", "--benchmark_format=json",
           f"--benchmark_min_time={cfg.pick(0.1, 0.25)}"]
    # 0.1 s in full runs too: the share_memory_ benchmarks pause the timer around a clone per
    # iteration, so 0.3 s of timed work (the former compare_shm.py's setting) took ~20 s per run.
    # The limits (memcpy, fresh segment) only when the limits benchmark does not measure them.
    shm = shm_bench_cmd(cfg, "BM_(ShareMemory|DumpsLoads)" if "limits" in cfg.sections
                        else "BM_(ShareMemory|DumpsLoads|Memcpy|SegmentCreateTouch)", cfg.pick(0.05, 0.1))
    return [
        Runner("ipc_bench", True, ipc, parse_ipc, cfg.pick(180, 600)),
        Runner("torch_ipc.py", False, [PY, PEERS / "torch_ipc.py"] + quick, parse_torch_ipc,
               cfg.pick(180, 900)),
        Runner("shm_bench", True, shm, parse_shm, cfg.pick(120, 600)),
        Runner("torch_share_memory.py", False, [PY, PEERS / "torch_share_memory.py"] + quick,
               parse_torch_share_memory, cfg.pick(120, 600)),
    ]


def copy_fraction(limit_us, ours_us, nbytes):
    """memcpy time / our time for operations that copy nbytes; '-' below 1 MiB (fixed costs)."""
    if nbytes < MiB:
        return "-"
    return fmt_pct(limit_us / ours_us) if limit_us and ours_us else "n/a"


def report_handoff(runs, limits, cfg):
    ours, peer = runs["ipc_bench"]["median"], runs["torch_ipc.py"]["median"]
    memcpy_us = limits[f"memcpy/{64 * MiB}"] if limits else None
    rows, summary = [], {}
    for label, _, measure, unit, target, higher in IPC_ROWS:
        mine = ours.get(measure)
        peers = [peer.get(f"{measure}/{s}") for s in STRATEGIES]
        frac = None
        if measure == "queue_handoff_64m_fresh" and mine and memcpy_us:
            frac = memcpy_us / (mine * 1e3)
        rows.append((label, unit, fmt(mine), *map(fmt, peers),
                     fmt_x(advantage(mine, best(peers, higher), higher)), fmt_pct(frac) if frac else "-",
                     target_text(target, higher), verdict(mine, target, higher)))
        summary[measure] = {"torchpar": mine, **dict(zip(STRATEGIES, peers)), "unit": unit,
                            "target": target, "met": None if target is None or mine is None else
                            (mine >= target if higher else mine <= target)}
    md = table(["measure", "unit", "torchpar", "torch.mp file_descriptor", "torch.mp file_system",
                "torchpar vs best peer", "fraction of limit", "target", "met"], rows, left=2)
    md += ("\n\n\"torchpar vs best peer\": how many times faster torchpar is than the better of the two "
           "sharing strategies (> 1: torchpar better). Fraction of limit (fresh hand-off only): "
           "one thread's memcpy of 64 MiB / our hand-off time; a fresh tensor has to be copied "
           "into shared memory once.")
    # issue 42: the Pipe against the Queue of the same run; the Queue's one-way rate against the
    # release run's (another VM: indicative only, the issue asks for the same sitting)
    pipe_rt, queue_rt = ours.get("pipe_pingpong_4k"), ours.get("queue_pingpong_4k")
    pq = pipe_rt / queue_rt if pipe_rt and queue_rt else None
    oneway = ours.get("queue_oneway_4k")
    vs_release = oneway / QUEUE_ONEWAY_RELEASE if oneway else None
    summary["target42_pipe_over_queue_rt"] = {"ratio": pq, "target": 3,
                                              "met": None if pq is None else pq <= 3}
    summary["target42_queue_oneway_vs_release"] = {"ratio": vs_release, "target": 1.6,
                                                   "met": None if vs_release is None else vs_release >= 1.6}
    md += ("\n\n### Targets (issue 42)\n\n"
           + table(["target", "measured", "goal", "met"],
                   [("Pipe 4 KiB round trip ≤ 3x the Queue 4 KiB round trip of this run",
                     f"{fmt(pipe_rt)} vs {fmt(queue_rt)} us = {fmt_x(pq)}", "≤ 3x",
                     "n/a" if pq is None else ("yes" if pq <= 3 else "no")),
                    ("Queue 4 KiB one way ≥ 1.6x the 2026-11-28 release run's "
                     f"{QUEUE_ONEWAY_RELEASE:,} items/s (another VM: indicative)",
                     f"{fmt(oneway)} items/s = {fmt_x(vs_release)}", "≥ 1.6x",
                     verdict(vs_release, 1.6, True))]))

    # share_memory_ and dumps+loads, as the former bench/compare_shm.py printed them
    so, sp = runs["shm_bench"]["median"], runs["torch_share_memory.py"]["median"]
    rows2 = []
    for n in SHM_SIZES:
        size = fmt_bytes(n)
        lim = (limits or {}).get(f"memcpy/{n}")
        peer_share = sp.get(f"torch_share_memory_/{n}")
        for kind, label in (("share_memory_steady", "share_memory_ (steady)"),
                            ("share_memory_cold", "share_memory_ (cold)")):
            mine = so.get(f"{kind}/{n}")
            rows2.append((f"{label} {size}", "torch share_memory_", fmt(mine), fmt(peer_share),
                          fmt_x(advantage(mine, peer_share, False)), fmt(lim), copy_fraction(lim, mine, n)))
        for s in STRATEGIES:
            mine, p = so.get(f"dumps_loads_shared/{n}"), sp.get(f"torch_pickle_shared_{s}/{n}")
            rows2.append((f"dumps+loads shared {size}", f"ForkingPickler {s}", fmt(mine), fmt(p),
                          fmt_x(advantage(mine, p, False)), "-", "-"))
        mine = so.get(f"dumps_loads_copy/{n}")
        rows2.append((f"dumps+loads copy {size}", "-", fmt(mine), "-", "-", fmt(lim),
                      copy_fraction(lim, mine, n)))
    md += ("\n\nshare_memory_ and serialisation (microseconds, one process; fraction of limit: "
           "memcpy of the same size / ours, from 1 MiB up):\n\n")
    md += table(["torchpar", "peer", "torchpar us", "peer us", "peer / torchpar", "memcpy us (limit)",
                 "fraction of limit"], rows2, left=2)
    seg = [f"{fmt_bytes(n)}: {fmt(limits[f'segment_create_touch/{n}'])} us" for n in SHM_SIZES
           if limits and f"segment_create_touch/{n}" in limits]
    if seg:
        md += "\n\nFresh segment create+map+touch: " + ", ".join(seg) + "."
    md += ("\n\nNote: torch_share_memory.py times `src.clone()` together with `share_memory_()`, "
           "shm_bench pauses its timer around the clone, so the share_memory_ peer column includes "
           "one extra copy of the tensor. dumps+loads copy: `loads(std::move(payload))`, as every "
           "channel's receive calls it; a tensor of at least 1 MiB then aliases the payload's "
           "bytes, and a buffer of 32 MiB or more comes back to the next dumps when the tensor "
           "is freed, so the round trip is one copy into warm memory.")
    return md, summary


def plot_handoff(runs, out):
    ours, peer = runs["ipc_bench"]["median"], runs["torch_ipc.py"]["median"]
    panels = []
    for label, _, measure, unit, target, higher in IPC_ROWS:
        bars = [("torchpar", ours.get(measure))] + [(f"torch.mp\n{s}", peer.get(f"{measure}/{s}"))
                                                     for s in STRATEGIES]
        panels.append((f"{label} ({unit})", bars, target, higher))
    bar_grid(out / "handoff.png", "Tensor hand-off between two processes", panels, cols=3)


# ----------------------------------------------------------------------------------------------
# pools: pool_bench vs python_pool.py

POOL_ROWS = [  # label, measure, unit, higher is better
    ("map(inc), chunksize 1", "map_chunksize_1", "tasks/s", True),
    ("map(inc), chunksize 1000", "map_chunksize_1000", "tasks/s", True),
    ("apply_async round trip", "apply_async_rtt", "us", False),
    ("map over 2000 x 1 KiB tensors", "map_tensors_1k", "ms", False),
]
POOL_PEERS = ("multiprocessing.Pool", "torch.multiprocessing.Pool")


# Starting a worker: start methods (ours and Python's), and Python's extra forkserver run with
# torch preloaded in its server; timed starts per method and run (quick, full).
START_METHODS = ("fork", "forkserver", "spawn")
POOL_QUICK_TASKS = 10000  # per map in a --quick run (Python's chunksize-1 maps: ~1 s per pool)
START_COUNTS = (1, 5)  # Python spawn and forkserver starts take 1.3-2 s each here (they import torch)
START_PEER = "multiprocessing.Process"


def parse_pool_bench(out):
    g = gbench(out)
    res = {"map_chunksize_1": pick_bench(g, "BM_PoolMapTrivial/chunksize:1/real_time")["tasks_per_s"],
           "map_chunksize_1000": pick_bench(g, "BM_PoolMapTrivial/chunksize:1000/real_time")["tasks_per_s"],
           "apply_async_rtt": pick_bench(g, "BM_PoolApplyAsyncRoundTrip/real_time")["us"],
           "map_tensors_1k": pick_bench(g, "BM_PoolMapTensors1K/real_time")["us"] / 1e3}
    for method in START_METHODS:  # BM_ProcessStart/<method>/iterations:1/manual_time
        prefix = f"BM_ProcessStart/{method}/"
        b = pick_bench(g, next((n for n in g if n.startswith(prefix)), prefix))
        res[f"start_median/{method}"] = b["start_us_median"]
        res[f"start_p99/{method}"] = b["start_us_p99"]
    return res


def parse_python_pool(out):
    return {f"{r['system']}/{r['name']}": r["value"] for r in json_lines(out)}


def runners_pools(cfg):
    tasks, starts = cfg.pick(POOL_QUICK_TASKS, 200000), cfg.pick(*START_COUNTS)
    ours = [cfg.bin / "pool_bench", "--benchmark_format=json", "--tasks", tasks, "--starts", starts]
    if cfg.quick:
        ours.append("--benchmark_min_time=0.1")
    timeout = cfg.pick(240, 900)
    peer = [PY, PEERS / "python_pool.py", "--tasks", tasks, "--starts", starts, "--timeout", timeout - 30]
    if cfg.quick:
        peer.append("--quick")
    return [Runner("pool_bench", True, ours, parse_pool_bench, timeout),
            Runner("python_pool.py", False, peer, parse_python_pool, timeout)]


def report_pools(runs, limits, cfg):
    ours, peer = runs["pool_bench"]["median"], runs["python_pool.py"]["median"]
    rows, summary = [], {}
    for label, measure, unit, higher in POOL_ROWS:
        mine = ours.get(measure)
        peers = [peer.get(f"{p}/{measure}") for p in POOL_PEERS]
        rows.append((label, unit, fmt(mine), *map(fmt, peers),
                     *(fmt_x(advantage(mine, p, higher)) for p in peers)))
        summary[measure] = {"torchpar": mine, **dict(zip(POOL_PEERS, peers)), "unit": unit}
    md = table(["measure", "unit", "torchpar", *POOL_PEERS, *(f"torchpar vs {p}" for p in POOL_PEERS)],
               rows, left=2)
    md += (f"\n\nPools of 2 worker processes (fork), {cfg.pick(POOL_QUICK_TASKS, 200000):,} tasks per map. "
           "Ratios: how many times better torchpar is (> 1: torchpar better). pool_bench reports "
           "Google Benchmark's mean per iteration, python_pool.py medians (apply_async, tensors) "
           "or total rates (maps). No issue target and no meaningful physical limit here.")
    srows = []
    for method, label in [(m, m) for m in START_METHODS] + [
            ("forkserver_preload", "forkserver; Python's server preloads torch")]:
        mine_m = method.replace("_preload", "")
        mine = (ours.get(f"start_median/{mine_m}"), ours.get(f"start_p99/{mine_m}"))
        theirs = (peer.get(f"{START_PEER}/start_median/{method}"),
                  peer.get(f"{START_PEER}/start_p99/{method}"))
        ratio = advantage(mine[0], theirs[0], False)
        srows.append((label, *map(fmt, mine), *map(fmt, theirs), fmt_x(ratio)))
        summary[f"start_{method}"] = {"torchpar_median": mine[0], "torchpar_p99": mine[1],
                                      f"{START_PEER}_median": theirs[0], f"{START_PEER}_p99": theirs[1],
                                      "unit": "us", "ratio_medians": ratio}
    starts = cfg.pick(*START_COUNTS)
    md += ("\n\n### Starting a worker (Process.start to the child running its target)\n\n"
           + table(["start method", "torchpar median (us)", "torchpar p99 (us)",
                    f"{START_PEER} median (us)", f"{START_PEER} p99 (us)",
                    "torchpar vs Python (medians)"], srows)
           + f"\n\nThe parent reads CLOCK_MONOTONIC just before `start()`; the child's target reads it as "
           "its first action and stores it in shared memory (torchpar `Value<int64_t>`, Python "
           "`RawValue('q')`), read by the parent after joining the child: the value is child - parent, "
           "so the hand-back is not in it. Per run and start method: one untimed start first (on both "
           f"sides: it starts the forkserver's server, and Python's resource tracker), then {starts} "
           "timed starts one after another, each joined before the next; the median and the p99 "
           f"(nearest rank, so with {starts} starts the slowest one) of the run; the table shows the "
           "median over rounds of each. torchpar's spawn child execs pool_bench (LibTorch loaded by the "
           "dynamic linker) and reaches the target from `torchpar::init`; Python's spawn child starts "
           "an interpreter that re-runs the main script, which imports torch (as a torch user's "
           "script does). Before Python 3.13 the forkserver does not preload `__main__` (CPython "
           "gh-126631, gh-137996), so each of its children also re-runs the script and imports "
           "torch; the last row restarts Python's forkserver with "
           "`set_forkserver_preload(['torch'])`, the documented way to import torch once in the "
           "server, against torchpar's same forkserver row.")
    return md, summary


def plot_pools(runs, out):
    ours, peer = runs["pool_bench"]["median"], runs["python_pool.py"]["median"]
    panels = [(f"{label} ({unit})", [("torchpar", ours.get(m))] +
               [(p.replace("multiprocessing", "mp"), peer.get(f"{p}/{m}")) for p in POOL_PEERS], None, higher)
              for label, m, unit, higher in POOL_ROWS]
    for method in START_METHODS:
        bars = [("torchpar", ours.get(f"start_median/{method}")),
                ("mp", peer.get(f"{START_PEER}/start_median/{method}"))]
        if method == "forkserver":
            bars.append(("mp, torch\npreloaded", peer.get(f"{START_PEER}/start_median/forkserver_preload")))
        panels.append((f"Process start, {method}, median (us)", bars, None, False))
    bar_grid(out / "pools.png", "Process pools, 2 workers; process start (mp = multiprocessing)", panels,
             cols=4)


# ----------------------------------------------------------------------------------------------
# manager: manager_bench vs python_manager.py

# label, measure, unit; higher is better for all, target: >= 10x Python's rate (issue 16)
MANAGER_ROWS = [
    ("dict set+get from a child (one pair = 2 round trips)", "dict_setget", "pairs/s"),
    ("list append from a child", "list_append", "appends/s"),
    ("Queue of 4 KiB float32 tensors, child -> parent", "queue_tensor_4k", "items/s"),
]
MANAGER_BENCH = {"dict_setget": "BM_ManagerDictSetGet", "list_append": "BM_ManagerListAppend",
                 "queue_tensor_4k": "BM_ManagerQueueTensor4K"}
MANAGER_TRANSPORTS = ("tcp", "unix")  # ours: 0 = TCP 127.0.0.1 (the default), 1 = "@name"
MANAGER_TARGET = 10  # x Python's default Manager (AF_UNIX)
# CPython's own SyncManager client (peers/python_manager_client.py) against `torchpar manager` and
# against Python's server, each a process of its own (issue 44); target: >= 3x Python's server.
PYCLIENT_ROWS = [("dict set+get (one pair = 2 round trips)", "dict_setget", "pairs/s"),
                 ("list append", "list_append", "appends/s")]
PYCLIENT_OURS = "SyncManager client -> torchpar manager"
PYCLIENT_PEER = "SyncManager client -> Python manager"
PYCLIENT_TARGET = 3


def manager_sizes(cfg):
    """(ops per dict/list batch, tensors per queue batch), the same for ours and the peer."""
    return cfg.pick(1000, 2000), cfg.pick(200, 1000)


def parse_manager_bench(out):
    """manager_bench -> {'<measure>/<tcp|unix>': items/s}."""
    g = gbench(out)
    res = {}
    for measure, bname in MANAGER_BENCH.items():
        for i, transport in enumerate(MANAGER_TRANSPORTS):
            res[f"{measure}/{transport}"] = pick_bench(g, f"{bname}/unix:{i}/real_time")["items_per_second"]
    return res


def parse_python_manager(out):
    return {f"{r['name']}/{r['transport']}": r["value"] for r in json_lines(out)}


def runners_manager(cfg):
    ops, items = manager_sizes(cfg)
    ours = [cfg.bin / "manager_bench", "--benchmark_format=json", "--ops", ops, "--items", items,
            f"--benchmark_min_time={cfg.pick(0.1, 0.5)}"]
    timeout = cfg.pick(120, 600)
    peer = [PY, PEERS / "python_manager.py", "--ops", ops, "--items", items,
            "--batches", cfg.pick(1, 3), "--timeout", timeout - 30]
    client = [PY, PEERS / "python_manager_client.py", "--ops", ops, "--batches", cfg.pick(1, 3),
              "--timeout", timeout - 30]
    why = manager_cli_missing(cfg)
    return [Runner("manager_bench", True, ours, parse_manager_bench, timeout),
            Runner("python_manager.py", False, peer, parse_python_manager, timeout),
            Runner(PYCLIENT_OURS, why is None, client + ["--server", "torchpar", "--torchpar", cfg.torchpar],
                   parse_python_manager, timeout, skip=why),
            Runner(PYCLIENT_PEER, False, client + ["--server", "python"], parse_python_manager, timeout)]


def manager_cli_missing(cfg):
    """None when `torchpar manager` exists, else why the Python-client rows are not run."""
    try:
        r = subprocess.run([str(cfg.torchpar), "manager", "--help"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {cfg.torchpar} manager --help: {e}"
    # Without the subcommand, `torchpar manager --help` prints the top-level help (status 0).
    if r.returncode == 0 and re.search(r"^Usage: \S+ manager\b", r.stdout, re.M):
        return None
    return f"{cfg.torchpar} has no manager subcommand"


def report_manager(runs, limits, cfg):
    ours, peer = runs["manager_bench"]["median"], runs["python_manager.py"]["median"]
    ops, items = manager_sizes(cfg)
    rows, trows, summary = [], [], {}
    for label, measure, unit in MANAGER_ROWS:
        o_tcp, o_unix = ours.get(f"{measure}/tcp"), ours.get(f"{measure}/unix")
        p_unix, p_tcp = peer.get(f"{measure}/unix"), peer.get(f"{measure}/tcp")
        vs_default = advantage(o_tcp, p_unix, True)
        vs_unix = advantage(o_unix, p_unix, True)
        vs_tcp = advantage(o_tcp, p_tcp, True)
        rows.append((label, unit, fmt(o_tcp), fmt(o_unix), fmt(p_unix), fmt(p_tcp), fmt_x(vs_default),
                     fmt_x(vs_unix), fmt_x(vs_tcp), fmt_x(advantage(o_unix, o_tcp, True))))
        trows.append((f"{label}: torchpar (TCP, default) ≥ {MANAGER_TARGET}x Python (AF_UNIX, default)",
                      fmt_x(vs_default), verdict(vs_default, MANAGER_TARGET, True)))
        trows.append((f"{label}: torchpar (Unix) ≥ {MANAGER_TARGET}x Python (AF_UNIX)",
                      fmt_x(vs_unix), verdict(vs_unix, MANAGER_TARGET, True)))
        summary[measure] = {"torchpar_tcp": o_tcp, "torchpar_unix": o_unix, "python_unix": p_unix,
                            "python_tcp": p_tcp, "unit": unit, "ratio_default": vs_default,
                            "ratio_unix": vs_unix, "ratio_tcp": vs_tcp, "target": MANAGER_TARGET,
                            "met": None if vs_default is None else vs_default >= MANAGER_TARGET}
    md = table(["measure", "unit", "torchpar TCP (default)", "torchpar Unix", "Python AF_UNIX (default)",
                "Python TCP", "default vs default", "Unix vs AF_UNIX", "TCP vs TCP",
                "torchpar Unix / TCP"], rows, left=2)
    md += (f"\n\nA manager (fork) and one child (fork) per measure; {ops:,} dict pairs or list appends "
           f"per timed batch, {items:,} fresh 1024-element float32 tensors per queue batch (Queue of 64, "
           "producer child, consumer parent). Rates are items over the time of whole batches, each "
           "timed in the parent from its request to the child's reply or to the last item got. "
           "Ratios: how many times faster torchpar is (> 1: torchpar better); \"torchpar Unix / TCP\" "
           "compares our two transports (> 1: the abstract Unix socket is faster). torchpar copies "
           "the tensors; Python (with torch imported) passes them to and from the server as "
           "shared-memory fds.\n\n### Targets (issue 16)\n\n")
    md += table(["target", "measured", "met"], trows)
    py_md, py_summary = report_manager_pyclient(runs, ops)
    summary.update(py_summary)
    md += py_md + "\n\n![manager](manager.png)"
    return md, summary


def report_manager_pyclient(runs, ops):
    """The rows of CPython's SyncManager client against torchpar manager vs Python's server."""
    ours, peer = runs[PYCLIENT_OURS]["median"], runs[PYCLIENT_PEER]["median"]
    rows, trows, summary = [], [], {}
    for label, measure, unit in PYCLIENT_ROWS:
        vals = {(who, t): med.get(f"{measure}/{t}") for who, med in (("ours", ours), ("peer", peer))
                for t in ("tcp", "unix")}
        cpu = {(who, t): med.get(f"{measure}_client_cpu/{t}") for who, med in (("ours", ours), ("peer", peer))
               for t in ("tcp", "unix")}
        ratio = {t: advantage(vals["ours", t], vals["peer", t], True) for t in ("tcp", "unix")}
        server_cpu = {(who, t): med.get(f"{measure}_server_cpu/{t}") for who, med in (("ours", ours), ("peer", peer))
                      for t in ("tcp", "unix")}
        # The client's CPU per operation is the part no server saves: Python's wall time per
        # operation over it bounds the speed-up any server could give this client.
        ceiling = {t: (1e6 / vals["peer", t] / cpu["peer", t]) if vals["peer", t] and cpu["peer", t] else None
                   for t in ("tcp", "unix")}
        rows.append((label, unit, fmt(vals["ours", "tcp"]), fmt(vals["peer", "tcp"]), fmt_x(ratio["tcp"]),
                     fmt(vals["ours", "unix"]), fmt(vals["peer", "unix"]), fmt_x(ratio["unix"]),
                     f"{fmt(cpu['ours', 'tcp'])} / {fmt(cpu['peer', 'tcp'])}",
                     f"{fmt(server_cpu['ours', 'tcp'])} / {fmt(server_cpu['peer', 'tcp'])}", fmt_x(ceiling["tcp"])))
        for t, name in (("tcp", "TCP 127.0.0.1"), ("unix", "AF_UNIX path")):
            trows.append((f"{label} from CPython's SyncManager client, {name}: torchpar manager "
                          f"≥ {PYCLIENT_TARGET}x Python's server", fmt_x(ratio[t]),
                          verdict(ratio[t], PYCLIENT_TARGET, True)))
        summary[f"pyclient_{measure}"] = {
            "torchpar_tcp": vals["ours", "tcp"], "python_tcp": vals["peer", "tcp"],
            "torchpar_unix": vals["ours", "unix"], "python_unix": vals["peer", "unix"], "unit": unit,
            "client_cpu_us": {f"{w}_{t}": v for (w, t), v in cpu.items()},
            "server_cpu_us": {f"{w}_{t}": v for (w, t), v in server_cpu.items()}, "ratio_tcp": ratio["tcp"],
            "ratio_unix": ratio["unix"], "ceiling_tcp": ceiling["tcp"], "ceiling_unix": ceiling["unix"],
            "target": PYCLIENT_TARGET, "met": None if ratio["tcp"] is None else ratio["tcp"] >= PYCLIENT_TARGET}
    md = ("\n\n### CPython's own SyncManager client (issue 44)\n\n"
          "/usr/bin/python3's `SyncManager(address, authkey).connect()` in the benchmark's own process, "
          "against `torchpar manager` and against Python's SyncManager server, each a process of its "
          f"own (peers/python_manager_client.py); {ops:,} dict pairs or list appends per timed batch, "
          "the same client code for both. \"Client CPU\" is the client process's CPU time per "
          "operation (torchpar run / Python run): the part no server can save, so Python's wall time "
          "per operation over it (\"ceiling\") bounds the speed-up any server could give this "
          "client. \"Server CPU\" is the server process's CPU time per operation (torchpar / Python; "
          "TCP, /proc clock ticks): what the server itself spends.\n\n")
    md += table(["measure", "unit", "torchpar TCP", "Python TCP", "TCP vs TCP", "torchpar Unix path",
                 "Python AF_UNIX", "Unix vs AF_UNIX", "client CPU (us/op)", "server CPU (us/op)", "ceiling (TCP)"],
                rows, left=2)
    md += "\n\n### Targets (issue 44)\n\n" + table(["target", "measured", "met"], trows)
    return md, summary


def plot_manager(runs, out):
    ours, peer = runs["manager_bench"]["median"], runs["python_manager.py"]["median"]
    panels = [(f"{label} ({unit})",
               [("torchpar\nTCP", ours.get(f"{m}/tcp")), ("torchpar\nUnix", ours.get(f"{m}/unix")),
                ("Python\nAF_UNIX", peer.get(f"{m}/unix")), ("Python\nTCP", peer.get(f"{m}/tcp"))],
               None, True)
              for label, m, unit in MANAGER_ROWS]
    py_ours, py_peer = runs[PYCLIENT_OURS]["median"], runs[PYCLIENT_PEER]["median"]
    panels += [(f"CPython's SyncManager client:\n{label} ({unit})",
                [("torchpar\nTCP", py_ours.get(f"{m}/tcp")), ("torchpar\nUnix", py_ours.get(f"{m}/unix")),
                 ("Python\nTCP", py_peer.get(f"{m}/tcp")), ("Python\nAF_UNIX", py_peer.get(f"{m}/unix"))],
                None, True)
               for label, m, unit in PYCLIENT_ROWS]
    bar_grid(out / "manager.png", "Manager: torchpar vs Python's multiprocessing.Manager", panels, cols=3)


# ----------------------------------------------------------------------------------------------
# rpc: rpc_bench vs python_rpc.py

# label, ours' measure, Python's counterpart, Python's measure, unit, higher is better
RPC_ROWS = [
    ("rpc_sync round trip, tiny: add(int, int)", "tiny",
     "rpc_sync to a Python function add(a, b)", "tiny_python_fn", "us/call", False),
    ("rpc_sync round trip, tiny: add(int, int)", "tiny",
     "rpc_sync to a builtin op: torch.add of two 2-element tensors", "tiny_builtin", "us/call", False),
    ("rpc_sync, fresh 1 MiB float32 tensor each call, first element back", "tensor_1m_fresh",
     "the same", "tensor_1m_fresh", "us/call", False),
    ("rpc_sync, 1 MiB tensor in torchpar shared memory, first element back", "tensor_1m_shared",
     "a fresh 1 MiB tensor each call (no shared-memory path)", "tensor_1m_fresh", "us/call", False),
    ("rpc_sync, 1 MiB tensor in torchpar shared memory, first element back", "tensor_1m_shared",
     "one 1 MiB tensor re-sent (no allocation per call)", "tensor_1m_reused", "us/call", False),
    ("rpc_async add(int, int), 64 calls in flight", "inflight_64",
     "rpc_async to add(a, b), 64 in flight", "inflight_64", "calls/s", True),
]
RPC_BENCH = {"tiny": "BM_RpcSyncTiny/real_time",
             "tensor_1m_fresh": "BM_RpcSyncTensor1M/shared:0/real_time",
             "tensor_1m_shared": "BM_RpcSyncTensor1M/shared:1/real_time",
             "raw_tiny": "BM_RawTensorPipeTiny/real_time",
             "raw_tensor_1m": "BM_RawTensorPipeTensor1M/real_time"}
# The transport's limit: label, torchpar's measure, the raw TensorPipe measure (both rpc_bench)
RPC_LIMIT_ROWS = [
    ("round trip, tiny (rpc_sync add(int, int); raw: 8 bytes there, 4 back)", "tiny", "raw_tiny"),
    ("round trip, fresh 1 MiB float32 tensor there, first element back", "tensor_1m_fresh",
     "raw_tensor_1m"),
]
RPC_TARGET = 10  # x Python (issue 14): tiny vs a Python function, 1 MiB shared vs Python's 1 MiB


def rpc_sizes(cfg):
    """(calls per tiny / in-flight batch, calls per 1 MiB batch), the same for ours and the peer."""
    return cfg.pick(500, 1000), cfg.pick(50, 100)


def parse_rpc_bench(out):
    """rpc_bench -> {measure: us per call, 'inflight_64': calls/s}."""
    g = gbench(out)
    res = {}
    for measure, bname in RPC_BENCH.items():
        b = pick_bench(g, bname)
        if "us_per_call" not in b:
            raise RunError(f"{bname}: no us_per_call counter")
        res[measure] = b["us_per_call"]
    res["inflight_64"] = pick_bench(g, "BM_RpcAsyncInFlight64/real_time")["items_per_second"]
    return res


def parse_python_rpc(out):
    return {r["name"]: r["value"] for r in json_lines(out)}


def runners_rpc(cfg):
    calls, tensor_calls = rpc_sizes(cfg)
    ours = [cfg.bin / "rpc_bench", "--benchmark_format=json", "--calls", calls,
            "--tensor-calls", tensor_calls, f"--benchmark_min_time={cfg.pick(0.1, 0.5)}"]
    timeout = cfg.pick(120, 300)
    peer = [PY, PEERS / "python_rpc.py", "--calls", calls, "--tensor-calls", tensor_calls,
            "--batches", 3, "--timeout", timeout - 30]
    return [Runner("rpc_bench", True, ours, parse_rpc_bench, timeout),
            Runner("python_rpc.py", False, peer, parse_python_rpc, timeout)]


def report_rpc(runs, limits, cfg):
    ours, peer = runs["rpc_bench"]["median"], runs["python_rpc.py"]["median"]
    calls, tensor_calls = rpc_sizes(cfg)
    rows, summary = [], {}
    for label, measure, plabel, pmeasure, unit, higher in RPC_ROWS:
        mine, theirs = ours.get(measure), peer.get(pmeasure)
        ratio = advantage(mine, theirs, higher)
        rows.append((label, plabel, unit, fmt(mine), fmt(theirs), fmt_x(ratio)))
        summary[f"{measure}_vs_{pmeasure}"] = {"torchpar": mine, "python": theirs, "unit": unit,
                                               "ratio": ratio}
    tiny = ours.get("tiny")
    shared = ours.get("tensor_1m_shared")
    trows = []
    for key, label, mine, pmeasure, factor in (
            ("tiny_vs_python_fn", f"tiny rpc_sync ≤ 1/{RPC_TARGET} of Python's rpc_sync to a Python "
             "function", tiny, "tiny_python_fn", RPC_TARGET),
            ("tiny_vs_builtin", "tiny rpc_sync below Python's builtin-op path (torch.add)", tiny,
             "tiny_builtin", 1),
            ("shared_1m_vs_fresh", f"1 MiB tensor from torchpar shared memory ≤ 1/{RPC_TARGET} of "
             "Python's fresh 1 MiB", shared, "tensor_1m_fresh", RPC_TARGET),
            ("shared_1m_vs_reused", f"(stricter) 1 MiB from shared memory ≤ 1/{RPC_TARGET} of Python "
             "re-sending one 1 MiB tensor", shared, "tensor_1m_reused", RPC_TARGET)):
        theirs = peer.get(pmeasure)
        ratio = advantage(mine, theirs, False)
        trows.append((label, f"{fmt(mine)} vs {fmt(theirs)} us = {fmt_x(ratio)}", f"≥ {factor}x",
                      verdict(ratio, factor, True)))
        summary[f"target_{key}"] = {"ratio": ratio, "target": factor,
                                    "met": None if ratio is None else ratio >= factor}
    lrows = []
    for label, measure, raw in RPC_LIMIT_ROWS:
        mine, limit = ours.get(measure), ours.get(raw)
        ratio = mine / limit if mine and limit else None
        lrows.append((label, fmt(mine), fmt(limit), fmt_x(ratio)))
        summary[f"{measure}_vs_{raw}"] = {"torchpar": mine, "raw_tensorpipe": limit, "unit": "us/call",
                                          "torchpar_over_raw": ratio}
    md = table(["measure (torchpar)", "Python counterpart (torch.distributed.rpc)", "unit", "torchpar",
                "Python", "torchpar vs Python"], rows, left=3)
    memcpy_1m = limits.get(f"memcpy/{MiB}") if limits else None
    md += (f"\n\n2 processes on 127.0.0.1 (fork), a caller and a callee; {calls:,} calls per timed "
           f"batch ({tensor_calls:,} for 1 MiB) after a warm-up batch, every reply checked. Round "
           "trips: the median batch time / calls (torchpar over Google Benchmark's batches, Python "
           f"over 3 batches); in flight: all calls / all time. torchpar: rpc_bench is "
           "rank 0 of a World and forks rank 1, both join one RpcGroup over torchpar's default transport "
           "(authenticated TCP on 127.0.0.1); the callee runs a call on the thread that read it "
           "from its connection, which hands the connection to a new reader when a call runs past "
           "10 ms or waits on a future. Python: two fork children call rpc.init_rpc (TensorPipe "
           "backend, env:// rendezvous, 16 worker threads, its defaults). The 1 MiB tensors are "
           "float32, made with full() inside the timed loop when fresh; the reply is one float. "
           "torchpar's shared-memory tensor is moved once with share_memory_ before the loop and "
           "travels as a handle (no copy); Python RPC copies every tensor. Ratios: how many times "
           "faster torchpar is (> 1: torchpar better)."
           + (f" For scale, one thread's 1 MiB memcpy takes {fmt(memcpy_1m)} us (limits)."
              if memcpy_1m else "")
           + "\n\n### The transport's limit: raw TensorPipe ping-pong\n\n"
           + table(["round trip (2 processes, one host)", "torchpar rpc_sync (us/call)",
                    "raw TensorPipe (us/call)", "torchpar / raw"], lrows)
           + "\n\nrpc_bench's BM_RawTensorPipe* drive TensorPipe's own API (tensorpipe/tensorpipe.h) "
           "between the benchmark and a spawned peer, with the context torchpar's TensorPipe transport "
           "uses (TORCHPAR_RPC_SHM=1; uv and shm transports, cma and basic channels; shm and cma "
           "on one host; its reactors busy-poll): no handshake, "
           "framing, serialization, thread pool or future. The 1 MiB tensor is a fresh full() each "
           "call as in torchpar's row; the peer reads it into one reused buffer and answers its first "
           "4 bytes. torchpar / raw: how many raw round trips one of torchpar's takes (1x: at the "
           "transport's limit; the rest is torchpar's RPC layer).\n\n### Targets (issue 14)\n\n")
    md += table(["target", "measured", "goal", "met"], trows)
    # issue 42: the transport's limit and the raised ratios against Python
    raw_ratio = summary.get("tiny_vs_raw_tiny", {}).get("torchpar_over_raw")
    r42 = []
    for key, label, ratio, goal, higher in (
            ("tiny_vs_raw", "tiny rpc_sync ≤ 1.15x the raw TensorPipe ping-pong of this run",
             raw_ratio, 1.15, False),
            ("tiny_vs_python_fn_12x", "tiny rpc_sync ≥ 12x Python's rpc_sync to a Python function",
             advantage(tiny, peer.get("tiny_python_fn"), False), 12, True),
            ("fresh_1m_vs_python_3x", "fresh 1 MiB tensor rpc_sync ≥ 3x Python's",
             advantage(ours.get("tensor_1m_fresh"), peer.get("tensor_1m_fresh"), False), 3, True),
            ("inflight_64_vs_python_12x", "64 rpc_async calls in flight ≥ 12x Python's calls/s",
             advantage(ours.get("inflight_64"), peer.get("inflight_64"), True), 12, True)):
        r42.append((label, fmt_x(ratio), f"{'≥' if higher else '≤'} {goal}x", verdict(ratio, goal, higher)))
        summary[f"target42_{key}"] = {"ratio": ratio, "target": goal,
                                      "met": None if ratio is None else
                                      (ratio >= goal if higher else ratio <= goal)}
    md += "\n\n### Targets (issue 42)\n\n" + table(["target", "measured", "goal", "met"], r42)
    md += "\n\n![rpc](rpc.png)"
    return md, summary


def plot_rpc(runs, out):
    ours, peer = runs["rpc_bench"]["median"], runs["python_rpc.py"]["median"]
    tenth = lambda v: v / RPC_TARGET if v else None
    panels = [
        ("rpc_sync, tiny (us/call)", [("torchpar", ours.get("tiny")),
                                      ("Python\nfunction", peer.get("tiny_python_fn")),
                                      ("Python\nbuiltin op", peer.get("tiny_builtin")),
                                      ("raw\nTensorPipe", ours.get("raw_tiny"))],
         tenth(peer.get("tiny_python_fn")), False),
        ("rpc_sync, fresh 1 MiB (us/call)", [("torchpar", ours.get("tensor_1m_fresh")),
                                             ("Python", peer.get("tensor_1m_fresh")),
                                             ("raw\nTensorPipe", ours.get("raw_tensor_1m"))],
         None, False),
        ("rpc_sync, 1 MiB, ours in shared memory (us/call)",
         [("torchpar\nshared", ours.get("tensor_1m_shared")),
          ("Python\nfresh", peer.get("tensor_1m_fresh")),
          ("Python\nre-sent", peer.get("tensor_1m_reused"))],
         tenth(peer.get("tensor_1m_fresh")), False),
        ("rpc_async, 64 in flight (calls/s)", [("torchpar", ours.get("inflight_64")),
                                               ("Python", peer.get("inflight_64"))], None, True),
    ]
    bar_grid(out / "rpc.png", "RPC: torchpar RpcGroup vs torch.distributed.rpc (TensorPipe)", panels,
             cols=4)


# ----------------------------------------------------------------------------------------------
# pserver: pserver_bench vs python_pserver.py

# model key, label, the benchmark's model argument, parameter bytes
PS_MODELS = (("mnist", "mnist_hogwild Net (85 KiB)", 0, 21840 * 4),
             ("16m", "4 x Linear(1024, 1024) (16 MiB)", 1, 16 * MiB))
PS_TRAINERS = (1, 3)


def pserver_sizes(cfg):
    """Cycles per trainer per batch, {model: cycles}, the same for ours and the peer."""
    return {"mnist": cfg.pick(100, 300), "16m": cfg.pick(4, 10)}


def parse_pserver_bench(out):
    """pserver_bench -> {'<model>/<T>': cycles/s, '.../steps': steps/s, '.../dropped': per push}."""
    g = gbench(out)
    res = {}
    for model, _, arg, _ in PS_MODELS:
        for t in PS_TRAINERS:
            bname = f"BM_PushPull/model:{arg}/trainers:{t}/real_time"
            b = pick_bench(g, bname)
            for key, counter in (("", "cycles_per_s"), ("/steps", "steps_per_s"),
                                 ("/dropped", "dropped_per_push")):
                if counter not in b:
                    raise RunError(f"{bname}: no {counter} counter")
                res[f"{model}/{t}{key}"] = b[counter]
    return res


def parse_python_pserver(out):
    return {r["name"]: r["value"] for r in json_lines(out)}


def runners_pserver(cfg):
    cycles = pserver_sizes(cfg)
    ours = [cfg.bin / "pserver_bench", "--benchmark_format=json", "--cycles", cycles["mnist"],
            "--cycles-16m", cycles["16m"], f"--benchmark_min_time={cfg.pick(0.1, 0.5)}"]
    timeout = cfg.pick(180, 600)
    peer = [PY, PEERS / "python_pserver.py", "--cycles", cycles["mnist"], "--cycles-16m",
            cycles["16m"], "--batches", cfg.pick(1, 3), "--timeout", timeout - 30]
    return [Runner("pserver_bench", True, ours, parse_pserver_bench, timeout),
            Runner("python_pserver.py", False, peer, parse_python_pserver, timeout)]


def report_pserver(runs, limits, cfg):
    ours, peer = runs["pserver_bench"]["median"], runs["python_pserver.py"]["median"]
    cycles = pserver_sizes(cfg)
    rows, summary = [], {}
    for model, label, _, nbytes in PS_MODELS:
        for t in PS_TRAINERS:
            key = f"{model}/{t}"
            mine, theirs = ours.get(key), peer.get(key)
            ratio = advantage(mine, theirs, True)
            drops = [ours.get(f"{key}/dropped"), peer.get(f"{key}/dropped")]
            rows.append((label, f"1 + {t}", fmt(mine), fmt(theirs), fmt_x(ratio),
                         fmt(ours.get(f"{key}/steps")), fmt(peer.get(f"{key}/steps")),
                         " / ".join(fmt_pct(d) for d in drops)))
            summary[key] = {"torchpar": mine, "python": theirs, "unit": "cycles/s", "ratio": ratio,
                            "torchpar_steps_per_s": ours.get(f"{key}/steps"),
                            "python_steps_per_s": peer.get(f"{key}/steps"),
                            "torchpar_dropped_per_push": drops[0],
                            "python_dropped_per_push": drops[1],
                            "model_bytes": nbytes}
    md = table(["model", "server + trainers", "torchpar cycles/s", "Python cycles/s",
                "torchpar vs Python", "torchpar steps/s", "Python steps/s",
                "dropped per push (torchpar / Python)"], rows, left=2)
    cores = len(os.sched_getaffinity(0))
    md += (f"\n\nOne server process and 1 or 3 trainer processes on 127.0.0.1 (fork); 1 + 3 "
           f"processes on this machine's {cores} cores"
           + (" oversubscribe it" if cores < 4 else "") + ". A cycle of a trainer: every gradient "
           "filled with 1e-4 (no forward/backward, so the measure is the server path), then "
           "push + pull: two round trips, the gradients to the server's queue, then the newest "
           "state dict back (loaded when newer). cycles/s: all trainers' cycles over the wall "
           f"time of whole batches ({cycles['mnist']:,} cycles per trainer per batch for mnist, "
           f"{cycles['16m']:,} for 16 MiB, after a warm-up batch), timed in the server; torchpar "
           f"over Google Benchmark's batches, Python over {cfg.pick(1, 3)}. The server reduces in "
           "the background, on both sides as torchpar's PushPullGradServerImpl with its defaults: "
           "batches of 4 pushes summed (torchpar: as they arrive; Python: stacked), batches of 4 "
           "of those set as gradients, SGD "
           "step (lr 0.01), a copy of the new state dict published; queues of 64 drop their "
           "oldest entry when full; a queue whose oldest entry waited 1 s is reduced short. "
           "steps/s: the server's optimizer steps in the timed batches (about cycles/s / 16 when "
           "it keeps up); dropped: queue entries dropped per push. torchpar: pserver_bench is "
           "rank 0 (\"server\": the PushPullGradServerImpl and its ordered server) of a World and "
           "forks the 3 trainers; a trainer's PushPullGradServer::push(module) copies the "
           "gradients into one shared-memory segment of its own (made once, reused by every push: "
           "one host), sends it as a handle with registered_sync (the server copies it out before "
           "replying), then pulls the ordered server's newest version, stored in shared memory "
           "and loaded from there (pull_view: handles, one copy into the module). Python: python_pserver.py, the same server written with "
           "torch.distributed.rpc (TensorPipe, its defaults) and a reducer thread in the server "
           "process; trainers call rpc_sync(push, {name: grad}), then rpc_sync(pull) and "
           "load_state_dict. Ratios: how many times faster torchpar is (> 1: torchpar better).")
    r42 = []
    for t in PS_TRAINERS:
        ratio = summary.get(f"16m/{t}", {}).get("ratio")
        r42.append((f"16 MiB model, 1 + {t}: torchpar ≥ 2x Python's cycles/s", fmt_x(ratio), "≥ 2x",
                    verdict(ratio, 2, True)))
        summary[f"target42_16m_{t}"] = {"ratio": ratio, "target": 2,
                                        "met": None if ratio is None else ratio >= 2}
    md += ("\n\n### Targets (issue 42)\n\n" + table(["target", "measured", "goal", "met"], r42)
           + "\n\n![pserver](pserver.png)")
    return md, summary


def plot_pserver(runs, out):
    ours, peer = runs["pserver_bench"]["median"], runs["python_pserver.py"]["median"]
    panels = [(f"{label}, 1 + {t} (cycles/s)",
               [("torchpar", ours.get(f"{model}/{t}")), ("Python\nrpc", peer.get(f"{model}/{t}"))],
               None, True)
              for model, label, _, _ in PS_MODELS for t in PS_TRAINERS]
    bar_grid(out / "pserver.png", "Parameter server push+pull: torchpar vs torch.distributed.rpc",
             panels, cols=4)


# ----------------------------------------------------------------------------------------------
# collectives: coll_bench vs torch_dist_collectives.py vs Open MPI

COLL_OURS = ("torchpar-shm", "torchpar-gloo", "c10d-gloo-cpp")
COLL_SYSTEMS = COLL_OURS + ("torch.distributed-gloo", "openmpi")
COLL_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
# torch_dist_collectives.py's ops (Gloo has no reduce_scatter on CPU)
COLL_OPS_TORCH = ("all_reduce", "broadcast", "all_gather")
# Issue 42: torchpar-shm against Open MPI at every size, median and p99
COLL_MPI_TARGET_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
# The sizes a vCPU placement flip decides (a cache line's round trip between the two vCPUs, which
# the hypervisor may change between two programs' launches or within one: 0.15 against 0.48 µs
# at 4 B in one run): besides the full runs, torchpar-shm and Open MPI each run them again in
# short back-to-back pairs, the pairs in alternating order (ours first, then Open MPI first, ...),
# so both sample the same stretch of time; their figures at these sizes are the medians over
# every run, the full runs' and the pairs' (COLL_SMALL_PAIRS + 1 per round each).
COLL_SMALL_SIZES = (4, 4 * KiB)
COLL_SMALL_PAIRS = 3


def parse_coll(out):
    """{system/op/bytes/us: median, .../p99: p99, .../min: fastest call, .../busbw: GB/s} of one
    run; p99 and min only where the program printed them (p99_us, min_us)."""
    res = {}
    for r in json_lines(out):
        key = f"{r['system']}/{r['op']}/{r['bytes']}"
        res[key + "/us"], res[key + "/busbw"] = r["median_us"], r["busbw_GBps"]
        for field, suffix in (("p99_us", "/p99"), ("min_us", "/min")):
            if r.get(field) is not None:
                res[key + suffix] = r[field]
    return res


def coll_params(cfg):
    sizes = [4, 4 * KiB, MiB, 16 * MiB] + ([] if cfg.quick else [64 * MiB])
    return sizes, cfg.pick(50, 200), cfg.pick(5, 10)


def build_mpi(cfg):
    """Compiles peers/mpi_collectives.c into raw/; returns (binary, None) or (None, reason)."""
    for tool in ("mpicc", "mpirun"):
        if not shutil.which(tool):
            return None, f"{tool} not found (Open MPI; `make deps-bench` installs it)"
    exe = cfg.raw / "mpi_collectives"
    progress("[collectives] compiling peers/mpi_collectives.c with mpicc ...", end="")
    try:
        run_cmd(["mpicc", "-O2", "-o", exe, PEERS / "mpi_collectives.c"], 120,
                cfg.raw / "collectives" / "mpicc")
    except RunError as e:
        progress(f" FAILED: {e}")
        return None, f"mpicc failed: {e}"
    progress(" done")
    return exe, None


def runners_collectives(cfg):
    sizes, iters, warmup = coll_params(cfg)
    common = ["--sizes", ",".join(map(str, sizes)), "--iters", iters, "--warmup", warmup]
    flags = ["--ops", ",".join(COLL_OPS)] + common
    exe, why = build_mpi(cfg)
    # --oversubscribe: Open MPI counts cores and may refuse -np 2 where it sees fewer slots.
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", exe or "mpi_collectives"]
    mpi = mpirun + flags
    timeout = cfg.pick(180, 900)
    runners = [Runner("coll_bench", True, [cfg.bin / "coll_bench", "--systems", ",".join(COLL_OURS)] + flags,
                      parse_coll, timeout),
               Runner("torch_dist_collectives.py", False,
                      [PY, PEERS / "torch_dist_collectives.py", "--ops", ",".join(COLL_OPS_TORCH)] + common,
                      parse_coll, timeout),
               Runner("mpi", False, mpi, parse_coll, timeout, skip=why)]
    small = ["--ops", ",".join(COLL_OPS), "--sizes", ",".join(map(str, COLL_SMALL_SIZES)),
             "--iters", iters, "--warmup", warmup]
    for i in range(1, cfg.pick(1, COLL_SMALL_PAIRS) + 1):
        pair = [Runner(f"coll_bench small {i}", True,
                       [cfg.bin / "coll_bench", "--systems", "torchpar-shm"] + small, parse_coll, 120),
                Runner(f"mpi small {i}", False, mpirun + small, parse_coll, 120, skip=why)]
        runners += pair if i % 2 == 1 else pair[::-1]
    return runners


def merge_small_pairs(runs):
    """Folds the runs of "coll_bench small <i>" and "mpi small <i>" (COLL_SMALL_SIZES) into
    coll_bench's and mpi's records: their values join the full runs', the medians are taken
    again. A pair's record stays, emptied (merged_into names where its values went), so a
    failed one is still reported."""
    for name, rec in runs.items():
        target = next((t for t in ("coll_bench", "mpi") if name.startswith(t + " small ")), None)
        if target is None or target not in runs:
            continue
        runs[target]["values"].extend(rec["values"])
        runs[target]["median"] = medians(runs[target]["values"])
        rec.update(values=[], median={}, merged_into=target)
    return runs


def coll_medians(runs):
    """Every runner's medians over rounds (.../us, .../p99, .../busbw, ...) plus, per latency
    key, .../worst_us and .../best_us: the largest and smallest of the rounds' medians."""
    merged = {}
    for rec in runs.values():
        merged.update(rec["median"])
        for key in rec["median"]:
            if key.endswith("/us"):
                per_round = [v[key] for v in rec["values"] if key in v]
                merged[key[:-3] + "/worst_us"] = max(per_round)
                merged[key[:-3] + "/best_us"] = min(per_round)
    return merged


def coll_spread_rows(med, op, sizes):
    """Latency rows (size, system, median, p99, worst round's median) of one op; the worst
    round's median is bold when it is over 2x the best round's (a bimodal row)."""
    rows = []
    for n in sizes:
        for s in COLL_SYSTEMS:
            key = f"{s}/{op}/{n}"
            us, p99, worst, best_ = (med.get(f"{key}/{k}") for k in ("us", "p99", "worst_us", "best_us"))
            if us is None:
                continue
            flag = worst is not None and best_ and worst > 2 * best_
            rows.append((fmt_bytes(n), s, fmt(us), fmt(p99), f"**{fmt(worst)}**" if flag else fmt(worst)))
    return rows


def report_collectives(runs, limits, cfg):
    med = coll_medians(runs)
    sizes, iters, warmup = coll_params(cfg)
    bw_limit = memcpy_GBps(limits)
    others = COLL_SYSTEMS[1:]
    md, summary = [], {}
    md.append(f"2 ranks, each bound to a core of its own (coll_bench as mpirun does by default), "
              f"float32, --iters {iters} --warmup {warmup} (fewer timed calls above 1 MiB: "
              "max(3, iters x 1 MiB / bytes); warm-up calls max(1, min(warmup, timed calls))). Latency: median of rank 0's timed calls. busbw as "
              "nccl-tests. \"shm vs X\": X's latency / torchpar-shm's (> 1: torchpar-shm faster). "
              "Fraction of limit: torchpar-shm busbw / one thread's 64 MiB memcpy GB/s "
              "(sizes ≥ 16 MiB only; smaller ones are latency-bound or cache-resident; above 100% the "
              "data stayed in cache). Under each op, its latency spread per system: \"median (µs)\" "
              "is the median over rounds of each round's median (the column above), \"p99 (µs)\" the "
              "median over rounds of each round's nearest-rank 99th percentile of rank 0's calls "
              "(the slowest call when a round timed fewer than 100), \"worst round's median (µs)\" "
              "the largest of the rounds' medians, in bold when over 2x the smallest (a bimodal "
              "row: one round ran much slower than another, which the median over rounds hides). "
              f"At {' and '.join(fmt_bytes(n) for n in COLL_SMALL_SIZES)}, where the vCPU placement "
              "(a cache line's round trip between the two vCPUs) decides the figure and may change "
              "between two programs' launches, torchpar-shm and Open MPI also run those sizes alone "
              f"in {cfg.pick(1, COLL_SMALL_PAIRS)} back-to-back pair(s) per round, in alternating "
              "order; their rows there are over every run, the full ones' and the pairs' "
              f"({cfg.pick(1, COLL_SMALL_PAIRS) + 1} per round each; \"worst round's median\" then "
              "is the worst run's).")
    for op in COLL_OPS:
        rows = []
        for n in sizes:
            us = [med.get(f"{s}/{op}/{n}/us") for s in COLL_SYSTEMS]
            bw = [med.get(f"{s}/{op}/{n}/busbw") for s in COLL_SYSTEMS]
            ratios = [fmt_x(advantage(us[0], u, False)) for u in us[1:]]
            frac = bw[0] / bw_limit if bw[0] is not None and bw_limit and n >= 16 * MiB else None
            rows.append((fmt_bytes(n), *map(fmt, us), *map(fmt_GBps, bw),
                         *ratios, fmt_pct(frac) if frac else "-"))
        header = (["size"] + [f"{s} us" for s in COLL_SYSTEMS] + [f"{s} GB/s" for s in COLL_SYSTEMS]
                  + [f"shm vs {s}" for s in others] + ["fraction of limit"])
        md.append(f"### {op}\n\n" + table(header, rows) + f"\n\n![{op}](collectives_{op}.png)")
        spread = coll_spread_rows(med, op, sizes)
        if spread:
            md.append(f"#### {op} latency spread\n\n"
                      + table(["size", "system", "median (µs)", "p99 (µs)", "worst round's median (µs)"],
                              spread, left=2))

    # issue 5's targets
    lat = med.get("torchpar-shm/all_reduce/4/us")
    lat_p99 = med.get("torchpar-shm/all_reduce/4/p99")
    lat_worst = med.get("torchpar-shm/all_reduce/4/worst_us")
    key16 = f"all_reduce/{16 * MiB}/busbw"
    shm16 = med.get(f"torchpar-shm/{key16}")
    trows = [("torchpar-shm all_reduce 4 B latency (median)",
              f"{fmt(lat)} us (p99 {fmt(lat_p99)}, worst round's median {fmt(lat_worst)})", "≤ 5 us",
              verdict(lat, 5, False))]
    summary["all_reduce_4B_us"] = {"value": lat, "p99": lat_p99, "worst_round": lat_worst, "target": 5,
                                   "met": lat is not None and lat <= 5}
    for other, factor in (("c10d-gloo-cpp", 5), ("torch.distributed-gloo", 5), ("openmpi", 1)):
        o = med.get(f"{other}/{key16}")
        r = shm16 / o if shm16 and o else None
        trows.append((f"torchpar-shm all_reduce busbw at 16 MiB vs {other}",
                      f"{fmt(shm16)} vs {fmt(o)} GB/s = {fmt_x(r)}", f"≥ {factor}x",
                      verdict(r, factor, True)))
        summary[f"busbw_16MiB_vs_{other}"] = {"ratio": r, "target": factor,
                                              "met": None if r is None else r >= factor}
    md.append("### Targets (issue 5)\n\n" + table(["target", "measured", "goal", "met"], trows))
    md.append("Bandwidth targets use all_reduce; other ops at 16 MiB are in the tables above.")
    mrows = []
    for op in COLL_MPI_TARGET_OPS:
        for stat, name in (("us", "median"), ("p99", "p99")):
            pairs = [(n, advantage(med.get(f"torchpar-shm/{op}/{n}/{stat}"),
                                   med.get(f"openmpi/{op}/{n}/{stat}"), False)) for n in sizes]
            pairs = [(n, r) for n, r in pairs if r is not None]
            if not pairs:
                mrows.append((f"{op} {name} vs openmpi, every size", "n/a", "≥ 1x", "n/a"))
                continue
            n_low, low = min(pairs, key=lambda x: x[1])
            behind = [fmt_bytes(n) for n, r in pairs if r < 1]
            mrows.append((f"{op} {name} vs openmpi, every size",
                          f"lowest {fmt_x(low)} at {fmt_bytes(n_low)}"
                          + (f"; behind at {', '.join(behind)}" if behind else ""),
                          "≥ 1x", verdict(low, 1, True)))
            summary[f"{op}_{name}_vs_openmpi_lowest"] = {"ratio": low, "at_bytes": n_low, "target": 1,
                                                         "met": low >= 1}
    md.append("### Targets (issue 42)\n\n" + table(["target", "measured", "goal", "met"], mrows)
              + "\n\nRatios: Open MPI's latency (median, or p99) / torchpar-shm's at each size, "
              "the lowest over sizes shown. reduce_scatter and all_to_all sizes are each rank's "
              "whole input (n pieces); torchpar-shm copies large broadcast, all_gather, "
              "reduce_scatter and all_to_all straight between the ranks' tensors "
              "(process_vm_readv/writev), as Open MPI's vader does.")
    return "\n\n".join(md), summary


def busbw_axes(ax, sizes, title):
    """Bus bandwidth against message size (log2 axis, one tick per size)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([fmt_bytes(n) for n in sizes])
    ax.set_xlabel("message size per rank")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)


def plot_collectives(runs, out, cfg):
    import matplotlib.pyplot as plt
    med = coll_medians(runs)
    sizes = coll_params(cfg)[0]
    for op in COLL_OPS:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in COLL_SYSTEMS:
            pts = [(n, med[f"{s}/{op}/{n}/busbw"]) for n in sizes if f"{s}/{op}/{n}/busbw" in med]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s, linewidth=2.5 if s == "torchpar-shm" else 1.2)
        busbw_axes(ax, sizes, f"{op}, 2 ranks (median over rounds)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"collectives_{op}.png", dpi=110)
        plt.close(fig)


# ----------------------------------------------------------------------------------------------
# scale-out: hierarchical vs flat Gloo all_reduce between two network namespaces (two_hosts.py)

SCALE = "scale-out"
SCALE_SYSTEMS = (("torchpar-hier", "hierarchical"), ("torchpar-gloo", "flat gloo"))
SCALE_BACKEND = {"torchpar-hier": "hierarchical", "torchpar-gloo": "gloo"}
SCALE_LINKS = ("unshaped", "shaped")
SCALE_HOSTS, SCALE_PER_HOST = 2, 2


def scaleout_params(cfg):
    return [4 * KiB, MiB, 16 * MiB], cfg.pick(20, 200), cfg.pick(3, 10)


def ring_link_bytes(system, nbytes, hosts=SCALE_HOSTS, per_host=SCALE_PER_HOST):
    """Payload bytes crossing between hosts (both directions together) per all_reduce of nbytes,
    for a ring all_reduce (Gloo's) over r ranks placed host by host: each rank sends
    2(r-1)/r x nbytes to the next, and `hosts` of the ring's edges leave a host. Flat Gloo's ring
    has r = hosts x per_host; hierarchical's is the host leaders', r = hosts (the shm steps stay
    inside the hosts)."""
    r = hosts * per_host if system == "torchpar-gloo" else hosts
    return hosts * 2 * (r - 1) / r * nbytes


def note_record(error=None, values=None, **extra):
    """A runs record for something that is not a runner (a skip, the link check, a failed
    setup), shaped as interleave()'s so failure_notes and results.json treat it alike; not
    'ours' (a failure that makes the exit status 1) unless extra says ours=True."""
    values = values or []
    return dict({"ours": False, "cmd": "", "values": values, "seconds": [], "error": error,
                 "failed_in": "setup" if error else None, "median": medians(values)}, **extra)


def scaleout_runner(cfg, hosts, system, label, link, counters):
    sizes, iters, warmup = scaleout_params(cfg)
    name = f"{label} {link}"
    job_s = cfg.pick(240, 600)
    cmd = [PY, BENCH_DIR / "two_hosts.py", "launch", "--ns", ",".join(hosts.ns),
           "--master-addr", hosts.addr[0], "--torchpar", cfg.torchpar, "-n", SCALE_PER_HOST,
           "--timeout", job_s, "--", cfg.bin / "scaleout_bench", "--systems", system,
           "--sizes", ",".join(map(str, sizes)), "--iters", iters, "--warmup", warmup,
           "--link", link, "--timeout", 120]

    def before():
        try:
            if link == "shaped":
                if hosts.shaping is None:
                    hosts.shape()
            elif hosts.shaping is not None:
                hosts.unshape()
            counters[name] = hosts.tx_bytes()
        except two_hosts.HostsError as e:
            raise RunError(f"link setup: {e}") from None

    def parse(out):
        res, model = {}, 0.0
        for r in json_lines(out):
            if r.get("backend") != SCALE_BACKEND[system]:
                raise RunError(f"{system}'s group ran backend {r.get('backend')!r}, not "
                               f"{SCALE_BACKEND[system]!r}")
            key = str(r["bytes"])
            res[key + "/us"], res[key + "/p99"], res[key + "/min"] = (
                r["median_us"], r["p99_us"], r["min_us"])
            res[key + "/busbw"] = r["busbw_GBps"]
            model += r["calls"] * ring_link_bytes(system, r["bytes"], r["hosts"],
                                                  r["ranks"] // r["hosts"])
        missing = [n for n in sizes if f"{n}/us" not in res]
        if missing:
            raise RunError(f"no result for {', '.join(map(fmt_bytes, missing))}")
        try:
            sent = hosts.tx_bytes() - counters[name]
        except two_hosts.HostsError as e:
            raise RunError(str(e)) from None
        res.update({"link_bytes": sent, "link_model_bytes": model, "link_vs_model": sent / model})
        return res

    return Runner(name, True, cmd, parse, job_s + 60, before=before)


def run_scaleout(cfg):
    """Makes two hosts, checks the link, runs the runners interleaved on it, removes the hosts
    (on every path). A machine where namespaces cannot be made skips the section: not an error."""
    why = two_hosts.unavailable()
    hosts = two_hosts.TwoHosts()
    if not why:
        try:
            hosts.open()
        except two_hosts.HostsError as e:
            why = f"cannot create network namespaces: {e}"
    if why:
        progress(f"[{SCALE}] skipped: {why}")
        return {SCALE: note_record(f"skipped: {why}")}
    try:
        return scaleout_on(cfg, hosts)
    except Exception as e:  # a bug here must not lose the other sections' results
        progress(f"[{SCALE}] FAILED: {type(e).__name__}: {e}")
        return {SCALE: note_record(f"{type(e).__name__}: {e}", ours=True)}
    finally:
        hosts.close()


def scaleout_on(cfg, hosts):
    runs, link, shaped_why, note = {}, {}, None, None
    seconds = cfg.pick(0.5, 2.0)
    # --quick runs the shaped link only (the one the targets are about), to stay a 3-minute run.
    links = ("shaped",) if cfg.quick else SCALE_LINKS
    progress(f"[{SCALE}] namespaces {' and '.join(hosts.ns)}; link check ...", end="")
    try:
        if "unshaped" in links:
            link.update({f"unshaped/{k}": v for k, v in hosts.measure(seconds).items()})
    except two_hosts.HostsError as e:
        progress(f" unshaped link check failed: {e}", end="")
    try:
        qdisc, note = hosts.shape()
    except two_hosts.HostsError as e:
        qdisc, shaped_why = None, f"neither netem nor tbf could shape the link: {e}"
    if qdisc:
        try:
            link.update({f"shaped/{k}": v for k, v in hosts.measure(seconds).items()})
        except two_hosts.HostsError as e:
            progress(f" shaped link check failed: {e}", end="")
    progress(" " + ", ".join(f"{k} {v}" for k, v in link.items()))
    runs["link check"] = note_record(values=[link] if link else [], qdisc=qdisc, note=note,
                                     cmd=f"tc qdisc add dev <veth> root {qdisc}" if qdisc else "")
    counters, runners = {}, []
    for ln in SCALE_LINKS:
        if ln not in links:
            runs[f"{ln} link"] = note_record("skipped: --quick runs the shaped link only")
            continue
        if ln == "shaped" and shaped_why:
            runs["shaped link"] = note_record(f"skipped: {shaped_why}")
            continue
        runners += [scaleout_runner(cfg, hosts, s, label, ln, counters) for s, label in SCALE_SYSTEMS]
    runs.update(interleave(cfg, SCALE, runners))
    mpi = ("mpirun not installed (`make deps-bench` installs Open MPI)" if not shutil.which("mpirun")
           else "launching mpirun across network namespaces (an rsh agent running `ip netns "
                "exec`) is not written yet")
    runs["openmpi"] = note_record(mpi)
    return runs


def report_scaleout(runs, limits, cfg):
    if SCALE in runs:
        rec = runs[SCALE]
        if rec["ours"]:
            return f"**FAILED**: {rec['error']}", {"failed": rec["error"]}
        return f"Skipped (not an error): {rec['error'].removeprefix('skipped: ')}.", {
            "skipped": rec["error"]}
    sizes, iters, warmup = scaleout_params(cfg)
    get = lambda label, ln, key: runs.get(f"{label} {ln}", {}).get("median", {}).get(key)
    lk = runs["link check"]
    lmed = lk["median"]
    md, summary = [], {"link": {"qdisc": lk.get("qdisc"), "note": lk.get("note"), **lmed}}
    md.append(
        f"{SCALE_HOSTS} hosts x {SCALE_PER_HOST} ranks: two network namespaces joined by a veth "
        f"pair, one `torchpar run --nnodes 2 -n {SCALE_PER_HOST}` in each (one fresh "
        "TORCHPAR_AUTHKEY for both, in the environment). scaleout_bench times all_reduce (SUM, "
        f"float32) with --iters {iters} --warmup {warmup} (fewer timed calls above 1 MiB: "
        "max(3, iters x 1 MiB / bytes); warm-up calls max(1, min(warmup, timed calls))), after checking the sums. Latency: median over rounds of "
        "each round's upper median of rank 0's calls; p99: nearest-rank 99th percentile (the "
        "slowest call below 100 calls). busbw = 2(n-1)/n x bytes / median, n = 4 ranks. "
        "hier/flat: hierarchical busbw / flat Gloo's (> 1: hierarchical faster). Each job is a "
        f"fresh set of processes; {cfg.rounds(SCALE)} round(s), each running hierarchical then "
        f"flat on the unshaped link, then both on the shaped one. This machine has "
        f"{len(os.sched_getaffinity(0))} cores for the 4 ranks.")
    lrows = []
    for ln in SCALE_LINKS:
        q = "none (veth default)" if ln == "unshaped" else (lk.get("qdisc") or "not shaped")
        lrows.append((ln, q, fmt(lmed.get(f"{ln}/Gbps")), fmt(lmed.get(f"{ln}/rtt_us"))))
    md.append("### Link\n\n" + table(["link", "qdisc on both veth ends", "TCP Gbit/s (1 stream)",
                                      "TCP 1-byte round trip (µs)"], lrows, left=2)
              + ("\n\n" + f"**Note:** {lk['note']}." if lk.get("note") else "")
              + "\n\nLink check: a Python TCP stream from one namespace to the other (one core "
              "bounds the unshaped figure) and 200 1-byte ping-pongs.")
    trows, ratios16 = [], {}
    for ln in SCALE_LINKS:
        if runs.get(f"{ln} link", {}).get("error"):
            md.append(f"### {ln} link\n\nNot run: {runs[f'{ln} link']['error']}")
            continue
        rows, worst = [], None
        for n in sizes:
            h = [get("hierarchical", ln, f"{n}/{k}") for k in ("us", "p99", "busbw")]
            f = [get("flat gloo", ln, f"{n}/{k}") for k in ("us", "p99", "busbw")]
            r = advantage(h[2], f[2], True)
            if r is not None and (worst is None or r < worst[0]):
                worst = (r, n)
            if n == 16 * MiB:
                ratios16[ln] = r
            rows.append((fmt_bytes(n), fmt(h[0]), fmt(h[1]), fmt_GBps(h[2]), fmt(f[0]), fmt(f[1]),
                         fmt_GBps(f[2]), fmt_x(r)))
        md.append(f"### {ln} link\n\n" + table(
            ["size", "hierarchical median (µs)", "p99 (µs)", "GB/s", "flat gloo median (µs)",
             "p99 (µs)", "GB/s", "hier/flat busbw"], rows))
        met = None if worst is None else worst[0] >= 1
        trows.append((f"hierarchical not slower than flat Gloo at any size ({ln})",
                      "n/a" if worst is None else f"lowest hier/flat {fmt_x(worst[0])} at {fmt_bytes(worst[1])}",
                      "≥ 1x", "n/a" if met is None else ("met" if met else "not met")))
        summary[f"not_slower_{ln}"] = {"lowest_ratio": worst and worst[0], "met": met}
    n_all, h = SCALE_HOSTS * SCALE_PER_HOST, SCALE_HOSTS
    bound = (2 * (n_all - 1) / n_all) / (2 * (h - 1) / h)  # flat / hierarchical bytes per host
    r = ratios16.get("shaped")
    shaped_q = lk.get("qdisc") or "not shaped"
    trows.insert(0, ("hierarchical busbw vs flat Gloo at 16 MiB, shaped link", fmt_x(r), "≥ 1.8x",
                     "n/a" if r is None else ("met" if r >= 1.8 else "not met")))
    summary["busbw_16MiB_shaped_ratio"] = {"ratio": r, "target": 1.8, "met": None if r is None else r >= 1.8,
                                           "qdisc": shaped_q}
    md.append("### Targets (issue 18)\n\n" + table(["target", "measured", "goal", "met"], trows)
              + f"\n\nShaped link: {shaped_q}" + (" (no delay: see the note above)" if lk.get("note") else "")
              + f". On a size the link bounds, hierarchical can reach at most {bound:.3g}x flat "
              "Gloo's busbw here by the bytes model below, whatever the implementation; the 1.8x "
              "needs more ranks per host (2(n-1)/n / (2(H-1)/H) ≥ 1.8 from 5 ranks per host on 2 "
              f"hosts). OpenMPI: skipped, {runs['openmpi']['error']}.")
    # The bytes model, checked against the veth counters.
    brows = []
    for ln in SCALE_LINKS:
        for s, label in SCALE_SYSTEMS:
            sent, model = get(label, ln, "link_bytes"), get(label, ln, "link_model_bytes")
            if sent is None:
                continue
            brows.append((ln, label, fmt(sent / MiB), fmt(model / MiB), fmt_x(sent / model)))
    md.append(
        "### Bytes crossing the link\n\nModel (ring all_reduce over ranks placed host by host, "
        "as Gloo's): per all_reduce of B bytes, flat Gloo's ring of n = H x L ranks has one edge "
        "leaving each of the H hosts, each carrying 2(n-1)/n x B; hierarchical runs that ring "
        "over the H leaders only: 2(H-1)/H x B per host. Both directions together: H x 2(r-1)/r "
        f"x B with r = n or H. Here (H = {h}, L = {SCALE_PER_HOST}) that is "
        f"{ring_link_bytes('torchpar-gloo', 1):g} B flat and "
        f"{ring_link_bytes('torchpar-hier', 1):g} B hierarchical, so on a link-bound size "
        f"hierarchical can be at most {bound:.3g}x flat's busbw by bytes alone (the rest of a "
        "gain must come from fewer latency steps: 2(H-1) instead of 2(n-1)). Measured: both veth "
        "ends' tx bytes over a whole job (frames with their TCP/IP headers and ACKs, the "
        "rendezvous and the checks included) against the model's payload for the job's "
        "all_reduce calls (warm-up, timed and the check).\n\n"
        + table(["link", "system", "measured (MiB per job)", "model payload (MiB)",
                 "measured / model"], brows, left=2))
    summary["link_bytes_bound_ratio"] = bound
    md.append("![scale-out](scaleout.png)")
    return "\n\n".join(md), summary


def plot_scaleout(runs, out, cfg):
    if SCALE in runs:
        return
    import matplotlib.pyplot as plt
    sizes = scaleout_params(cfg)[0]
    curves = {(ln, label): [(n, runs[f"{label} {ln}"]["median"][f"{n}/busbw"]) for n in sizes
                            if f"{n}/busbw" in runs.get(f"{label} {ln}", {}).get("median", {})]
              for ln in SCALE_LINKS for _, label in SCALE_SYSTEMS}
    if not any(curves.values()):
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), squeeze=False)
    for ax, ln in zip(axes.flat, SCALE_LINKS):
        for _, label in SCALE_SYSTEMS:
            if curves[ln, label]:
                ax.plot(*zip(*curves[ln, label]), marker="o", label=label)
        busbw_axes(ax, sizes, f"all_reduce, 2 hosts x 2 ranks, {ln} link")
        if any(curves[ln, label] for _, label in SCALE_SYSTEMS):
            ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scaleout.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# train: torchpar train vs the PyTorch recipes

TRAIN_QUICK_LIMIT = 12000  # training samples of a --quick run (fewer: accuracy near chance, 12% at 4,000)
TRAIN_STRATEGIES = ("single", "hogwild", "ddp", "pserver")
# pserver has no PyTorch recipe among the peers: its row shows torchpar alone. With --workers 2
# it is 1 server + 1 trainer, so its samples/s are one trainer's (no speed-up target).
# issue 19: samples/s of 2 workers against torchpar single
TRAIN_SCALING_TARGETS = {"hogwild": 1.9, "ddp": 1.85}
TRAIN_PEERS = {"single": ["mnist_hogwild.py", "--workers", "1", "--single"],
               "hogwild": ["mnist_hogwild.py", "--workers", "2"],
               "ddp": ["mnist_ddp.py", "--workers", "2"]}


def parse_peer_train(out):
    r = json_lines(out)[-1]
    return {"samples_per_s": r["samples_per_s"], "test_accuracy": r["test_accuracy"]}


def torchpar_train_runner(cfg, strategy, limit):
    out_dir = cfg.raw / "train" / f"torchpar_{strategy}"

    def clear():
        shutil.rmtree(out_dir, ignore_errors=True)

    def parse(_stdout):
        try:
            m = json.loads((out_dir / "metrics.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RunError(f"no metrics.json: {e}") from None
        if m.get("status") != "completed" or not m.get("epochs"):
            raise RunError(f"training status {m.get('status')}: {m.get('error', '')}")
        last = m["epochs"][-1]
        res = {"samples_per_s": m["samples_per_s"], "test_accuracy": last["test_accuracy"]}
        if "synchronize_us_per_step" in last:  # ddp: DistributedDataParallel::stats()
            res["sync_us_per_step"] = last["synchronize_us_per_step"]
            res["sync_fraction"] = last["synchronize_fraction"]
        return res

    # --no-plot: curves.png (about 1 s of matplotlib a run) is not part of the measurement.
    cmd = [cfg.torchpar, "train", "--strategy", strategy, "--workers", "2", "--epochs", "1", "--no-plot",
           "--out", out_dir] + limit
    return Runner(f"torchpar {strategy}", True, cmd, parse, cfg.pick(300, 900), before=clear)


def runners_train(cfg):
    limit = ["--limit", str(TRAIN_QUICK_LIMIT)] if cfg.quick else []
    runners = []
    for s in TRAIN_STRATEGIES:
        runners.append(torchpar_train_runner(cfg, s, limit))
        if s not in TRAIN_PEERS:
            continue
        peer = [PY, PEERS / TRAIN_PEERS[s][0]] + TRAIN_PEERS[s][1:] + limit
        runners.append(Runner(f"pytorch {s}", False, peer, parse_peer_train, cfg.pick(300, 900)))
    return runners


def report_train(runs, limits, cfg):
    get = lambda who, s, k: runs.get(f"{who} {s}", {}).get("median", {}).get(k)
    ours_single = get("torchpar", "single", "samples_per_s")
    peer_single = get("pytorch", "single", "samples_per_s")
    acc_single = get("torchpar", "single", "test_accuracy")
    rows, trows, summary = [], [], {}
    for s in TRAIN_STRATEGIES:
        o, p = get("torchpar", s, "samples_per_s"), get("pytorch", s, "samples_per_s")
        oa, pa = get("torchpar", s, "test_accuracy"), get("pytorch", s, "test_accuracy")
        rows.append((s, fmt(o), fmt(p), fmt_x(advantage(o, p, True)), fmt_x(advantage(o, ours_single, True)),
                     fmt_x(advantage(p, peer_single, True)), fmt(oa), fmt(pa)))
        summary[s] = {"torchpar_samples_per_s": o, "pytorch_samples_per_s": p,
                      "torchpar_accuracy": oa, "pytorch_accuracy": pa}
        if s in ("single", "pserver"):
            continue
        speedup = advantage(o, ours_single, True)
        trows.append((f"{s} samples/s ≥ 1.6x torchpar single", fmt_x(speedup), verdict(speedup, 1.6, True)))
        goal = TRAIN_SCALING_TARGETS[s]
        trows.append((f"{s} samples/s ≥ {goal}x torchpar single (issue 19)", fmt_x(speedup),
                      verdict(speedup, goal, True)))
        vs_peer = advantage(o, p, True)
        trows.append((f"{s} samples/s ≥ PyTorch {s}", fmt_x(vs_peer), verdict(vs_peer, 1.0, True)))
        if oa is not None and acc_single is not None:
            gap = acc_single - oa
            trows.append((f"{s} accuracy within 2 points of single", f"{oa:.2f}% vs {acc_single:.2f}% "
                          f"({-gap:+.2f} points)", "yes" if gap <= 2 else f"no ({gap - 2:.2f} points over)"))
        else:
            trows.append((f"{s} accuracy within 2 points of single", "n/a", "n/a"))
    data = (f"the first {TRAIN_QUICK_LIMIT:,} training samples (--limit {TRAIN_QUICK_LIMIT})"
            if cfg.quick else "all 60,000 training samples")
    md = table(["strategy", "torchpar samples/s", "PyTorch samples/s", "torchpar vs PyTorch",
                "torchpar vs its single", "PyTorch vs its single", "torchpar test acc %",
                "PyTorch test acc %"], rows)
    md += (f"\n\n1 epoch on {data}, 2 workers, 1 thread each; {cfg.rounds('train')} round(s) "
           "(each run is 5-15 s and starts fresh processes; data loading is outside the "
           "timed phase). samples/s: training phase only. Accuracy: test set after the epoch. "
           "`torchpar train --strategy ddp` scales the lr by the number of workers by default "
           "(--lr-scaling linear); mnist_ddp.py keeps the recipe's lr. pserver: 1 server + 1 trainer "
           "(asynchronous push/pull over RpcGroup), no PyTorch peer in this table.\n\n### Targets (issues 6 and 19)\n\n")
    md += table(["target", "measured", "met"], trows)
    sync_us = get("torchpar", "ddp", "sync_us_per_step")
    sync_frac = get("torchpar", "ddp", "sync_fraction")
    if sync_us is not None and sync_frac is not None:
        summary["ddp"]["sync_us_per_step"] = sync_us
        md += (f"\n\nddp waits on communication: the ranks spent {sync_us:.0f} µs a step in "
               f"`synchronize_gradients()` ({100 * sync_frac:.1f}% of the training time; median over "
               "rounds of the ranks' mean, from DistributedDataParallel::stats()): the 87 KiB "
               "all_reduce itself and the wait for the slower rank's backward (the collectives "
               "section times the transfer alone).")
    md += "\n\n![train](train.png)"
    return md, summary


def plot_train(runs, out):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.38
    for j, who in enumerate(("torchpar", "pytorch")):
        vals = [runs.get(f"{who} {s}", {}).get("median", {}).get("samples_per_s") or 0
                for s in TRAIN_STRATEGIES]
        xs = [i + (j - 0.5) * width for i in range(len(TRAIN_STRATEGIES))]
        bars = ax.bar(xs, vals, width, label="torchpar" if who == "torchpar" else "PyTorch recipe")
        ax.bar_label(bars, labels=[fmt(v) if v else "n/a" for v in vals], fontsize=8)
    ax.set_xticks(range(len(TRAIN_STRATEGIES)))
    ax.set_xticklabels(TRAIN_STRATEGIES)
    ax.set_ylabel("training samples/s")
    ax.set_title("Fashion-MNIST, 1 epoch, 2 workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "train.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# elastic: a node lost and back under `torchpar run --nnodes 1:2` and torchrun (elastic_scenario.py)

ELASTIC_DATA = Path("/usr/share/datasets/fashion-mnist")
# The scenario's settings, the same for both launchers (elastic_scenario.py's flags).
ELASTIC = {"checkpoint_every": 20, "kill_after": 3.0, "rejoin_after": 2.0, "monitor_interval": 0.5,
           "last_call": 5, "heartbeat_timeout": 5.0, "limit": 60000, "timeout": 240}
ELASTIC_SYSTEMS = (("torchpar run", "torchpar"), ("torchrun", "torchrun"))
# label, measure, unit (lower is better everywhere); (a1)-(a3) split (a), (b1)-(b3) split (b)
ELASTIC_ROWS = [
    ("(a) node lost: SIGKILL to the survivor's resume line", "kill_to_resume_s", "s"),
    ("(a1) detection: to the survivor's rank stopped", "detect_s", "s"),
    ("(a2) new round: to the survivor's new rank started", "relaunch_s", "s"),
    ("(a3) rank start-up and restore: to its resume line", "rank_start_s", "s"),
    ("(b) node back: its agent started to the grown round's resume line", "join_to_resume_s", "s"),
    ("(b1) newcomer's agent up and joined, the survivor's rank stopped", "grow_detect_s", "s"),
    ("(b2) new round: to the grown round's ranks started", "grow_relaunch_s", "s"),
    ("(b3) ranks' start-up and restore: to the resume line", "grow_rank_start_s", "s"),
    ("(c) steps lost per failure: steps complete at the SIGKILL - step resumed at",
     "kill_steps_lost", "steps"),
    ("(c1) steps complete at the SIGKILL (the failed call #C - 4)", "kill_step", "step"),
    ("(c2) the newest checkpoint written before it", "kill_last_checkpoint", "step"),
    ("(c3) step resumed at", "kill_resumed_step", "step"),
    ("whole scenario: first agent started to both agents stopped", "run_s", "s"),
]


def fmt_steps(v):
    """A step count: whole numbers without a decimal point (values come back as floats)."""
    return fmt(int(v)) if isinstance(v, float) and v.is_integer() else fmt(v)


def parse_elastic(out):
    r = json_lines(out)[-1]
    res = {k: float(v) for k, v in r.items() if isinstance(v, (int, float))}
    res["kill_from_memory"] = float(r.get("kill_source") == "memory")
    res["grow_from_memory"] = float(r.get("grow_source") == "memory")
    return res


def runners_elastic(cfg):
    skip = None if ELASTIC_DATA.is_dir() else f"{ELASTIC_DATA} not found (Fashion-MNIST)"
    # whether torch is there, without importing it (1.5 s)
    has_torch = skip is None and quiet(
        [PY, "-c", "import importlib.util as u; print(u.find_spec('torch') is not None)"]).strip()
    peer_skip = skip or (None if has_torch == "True" else
                         f"{PY} has no torch (Debian: python3-torch), so no torchrun")
    runners = []
    for name, launcher in ELASTIC_SYSTEMS:
        cmd = [PY, PEERS / "elastic_scenario.py", "--launcher", launcher, "--torchpar", cfg.torchpar,
               "--work", cfg.raw / "elastic"]
        for key, value in ELASTIC.items():
            cmd += [f"--{key.replace('_', '-')}", value]
        runners.append(Runner(name, launcher == "torchpar", cmd, parse_elastic, ELASTIC["timeout"] + 60,
                              skip=skip if launcher == "torchpar" else peer_skip,
                              before=lambda: (cfg.raw / "elastic").mkdir(parents=True, exist_ok=True)))
    return runners


def report_elastic(runs, limits, cfg):
    med = {name: runs.get(name, {}).get("median", {}) for name, _ in ELASTIC_SYSTEMS}
    ours, peer = (med[name] for name, _ in ELASTIC_SYSTEMS)
    rows, summary = [], {}
    for label, key, unit in ELASTIC_ROWS:
        o, p = ours.get(key), peer.get(key)
        top = key in ("kill_to_resume_s", "join_to_resume_s")
        ratio = advantage(o, p, False) if top else None
        f = fmt if unit == "s" else fmt_steps
        rows.append((label, unit, f(o), f(p), fmt_x(ratio) if ratio else "-"))
        summary[key] = {"torchpar": o, "torchrun": p, "unit": unit}
        if top:
            summary[key]["torchrun_over_torchpar"] = ratio

    def sources(key):
        cells = []
        for name, _ in ELASTIC_SYSTEMS:
            vals = [v.get(key) for v in runs.get(name, {}).get("values", []) if key in v]
            mem = sum(1 for v in vals if v == 1.0)
            cells.append("n/a" if not vals else "memory" if mem == len(vals) else
                         "checkpoint" if mem == 0 else f"memory in {mem} of {len(vals)} rounds")
        return cells
    names = [name for name, _ in ELASTIC_SYSTEMS]
    for label, key in (("(c4) resumed from, after the failure", "kill_from_memory"),
                       ("resumed from, after the grow", "grow_from_memory")):
        rows.insert(len(rows) - 1, (label, "-", *sources(key), "-"))
        summary.setdefault("sources", {})[key] = dict(zip(names, sources(key)))
    md = table(["measure (median over rounds)", "unit", "torchpar run", "torchrun", "torchpar vs torchrun"],
               rows, left=2)
    prow = []
    for name, _ in ELASTIC_SYSTEMS:
        for i, v in enumerate(runs.get(name, {}).get("values", [])):
            prow.append((name, str(i + 1), fmt(v.get("kill_to_resume_s")), fmt(v.get("join_to_resume_s")),
                         *(fmt_steps(v.get(k)) for k in (
                             "kill_failed_call", "kill_step", "kill_last_checkpoint",
                             "kill_resumed_step", "kill_steps_lost")),
                         "memory" if v.get("kill_from_memory") else "checkpoint",
                         fmt_steps(v.get("grow_resumed_step")),
                         "memory" if v.get("grow_from_memory") else "checkpoint"))
    e = ELASTIC
    md += (
        "\n\n\"torchpar vs torchrun\": torchrun's time / torchpar's (> 1: torchpar faster); no target "
        "(issue 41 asks for the figures). The scenario (bench/peers/elastic_scenario.py, one run per "
        f"launcher and round, {cfg.rounds('elastic')} round(s), interleaved): two \"nodes\" on this "
        "host, two agents on loopback (`--nnodes 1:2`, 1 rank each, the rendezvous endpoint "
        "127.0.0.1 on node A), both running `torchpar train --strategy ddp --model mnist` on "
        f"Fashion-MNIST (--limit {e['limit']} per epoch, batch 64, collectives on shm: both ranks "
        f"share the host) with --checkpoint-every {e['checkpoint_every']} (rank 0 writes a "
        f"checkpoint every {e['checkpoint_every']} optimizer steps) and the trainer's default "
        "--snapshot-every 1 (a "
        "snapshot every step into the memory `torchpar run` keeps per rank; torchrun keeps none, "
        f"so its ranks resume from the newest checkpoint). {e['kill_after']:g} s after rank 0 "
        "printed its plan for 2 ranks (about 2 s of training), node B is lost: its agent and every "
        "process under it are SIGKILLed at once, as a host's crash would (torchrun's worker "
        "outlives a SIGKILL of its agent alone: tried once, the orphaned worker finished the "
        "epoch with the survivor, whose agent then waited 300 s on its exit barrier for the dead "
        f"agent before exiting 0). {e['rejoin_after']:g} s after the survivor's resume line B is started "
        "again; once the grown round has resumed and written a checkpoint, both agents get "
        "SIGTERM. (a) and (b) end at rank 0's \"resumed at epoch E step S from memory|checkpoint\" "
        "line, printed once the state is restored, before the first step; each rank line is "
        "timed when it reaches the driver (torchpar run's pipes; torchrun's workers' stdout.log "
        "read every 10 ms, since its -t copy comes through a file it polls every 0.1 s). The "
        "splits come from a process scan every 0.05 s (a rank: the agent's child running "
        "`torchpar train`). (c): the steps complete when node B was killed against the step the "
        "next round resumed at. The survivor's error names its group's collective call that "
        "failed (\"all_reduce call #C\"); `torchpar train` makes 3 collective calls before its "
        "first step and one all_reduce a step, so C - 4 steps were complete: exactly the step "
        "torchpar's ranks resumed at from memory in every run so far (results.json also holds "
        "an estimate from the timed checkpoint lines alone, kill_step_estimate, which runs a "
        "few steps low while the step rate still climbs). From a checkpoint every N steps a "
        "failure costs up to N - 1 steps (N/2 on average; the step under way, lost by both, "
        "is not counted); at a grow torchrun restarts its job from the newest checkpoint as "
        "well, torchpar from memory (the step each resumed at is in the table below).\n\n"
        "Where the time goes. (a2), torchpar run: the survivor's round ends on its own rank's "
        "failure (the collective sees the peer die within a second); the lost node's agent is "
        "known gone at once (its ephemeral key left the store with its connection), so the new "
        "round closes without it: what remains is stopping the old rank and starting the new "
        "one. torchrun: its rendezvous keeps the lost node until its keep-alive expires (15 s), "
        "then waits the last call. (b1): "
        "the newcomer's agent start-up (a C++ program against Python importing torch), its "
        "join, the survivor's agent noticing it (one monitor interval) and stopping its rank. "
        "(a3) and (b3) run the same program under both launchers (in (b3) both ranks start at "
        "once on the 2 cores).\n\n"
        "Settings, the same for both launchers: --monitor-interval / --monitor_interval "
        f"{e['monitor_interval']:g} s, last call (--rdzv-timeout / rdzv_conf last_call_timeout) "
        f"{e['last_call']} s, join timeout 600 s, 2 restarts. Node heartbeat: torchpar run's "
        f"--heartbeat-timeout {e['heartbeat_timeout']:g} s; torchrun 1.13's is fixed at 5 s x 3 "
        "attempts (a lost node leaves its rendezvous 15 s after its last keep-alive: most of "
        "torchrun's \"new round\" after a failure). torchrun runs as `python3 -m "
        "torch.distributed.run --nnodes=1:2 --nproc_per_node=1 --rdzv_backend=c10d ... -r 1 -t 1 "
        "--no_python torchpar train ...`: Debian's torch 1.13 fails on Python 3.11 with the "
        "default redirects (`AttributeError: 'NoneType' object has no attribute 'get'` in "
        "to_map: Std.from_str(\"0\") returns None because iterating an IntFlag skips 0 on 3.11) "
        "before starting any worker; -r 1 -t 1 (stdout to a file and copied to the console, "
        "stderr direct) avoids it. Both agents of a run get one fresh TORCHPAR_AUTHKEY in their "
        "environment (torchrun's ranks inherit it). After each run no process of either agent and "
        "no /dev/shm name of its ranks is left (the driver checks, and fails the run otherwise).\n\n"
        "Each round:\n\n"
        + table(["launcher", "round", "(a) s", "(b) s", "failed call #C", "steps complete",
                 "last checkpoint", "resumed at", "steps lost", "from", "grow resumed at",
                 "from"], prow, left=2)
        + "\n\n![elastic](elastic.png)")
    return md, summary


def plot_elastic(runs, out):
    med = {name: runs.get(name, {}).get("median", {}) for name, _ in ELASTIC_SYSTEMS}
    if not any(med.values()):
        return
    panels = [(title, [(name, med[name].get(key)) for name, _ in ELASTIC_SYSTEMS], None, False)
              for title, key in (("(a) node lost to training again (s)", "kill_to_resume_s"),
                                 ("(b) node back to training on both (s)", "join_to_resume_s"),
                                 ("(c) steps lost per failure", "kill_steps_lost"))]
    bar_grid(out / "elastic.png", "Elastic job, a node lost and back: torchpar run vs torchrun",
             panels, cols=3)


# ----------------------------------------------------------------------------------------------
# inference: infer_bench (TensorParallel) vs python_tp_infer.py (torch.distributed gloo)

INFER_BATCHES = (1, 8)
INFER_NEW_TOKENS, INFER_PROMPT = 64, 16  # --quick: a quarter of the new tokens
# runner name, label in the report, ranks
INFER_SYSTEMS = (("torchpar TP=2", "torchpar TP = 2 (2 processes x 1 thread, shm)", 2),
                 ("torchpar TP=1", "torchpar TP = 1 (1 process x 2 threads)", 1),
                 ("python gloo TP=2", "Python TP = 2 (2 processes x 1 thread, gloo)", 2))


def parse_infer(out):
    return {r["name"]: r["value"] for r in json_lines(out)}


def runners_inference(cfg):
    reps = 1  # timed generates per run: the rounds repeat them
    common = ["--batches", ",".join(map(str, INFER_BATCHES)), "--new-tokens",
              cfg.pick(INFER_NEW_TOKENS // 4, INFER_NEW_TOKENS),
              "--prompt", INFER_PROMPT, "--reps", reps]
    timeout = cfg.pick(600, 1200)
    ours = lambda tp, threads: [cfg.bin / "infer_bench", "--tp", tp, "--threads", threads,
                                "--timeout", timeout - 60] + common
    peer = [PY, PEERS / "python_tp_infer.py", "--tp", 2, "--threads", 1, "--timeout",
            timeout - 30] + common
    return [Runner("torchpar TP=2", True, ours(2, 1), parse_infer, timeout),
            Runner("torchpar TP=1", True, ours(1, 2), parse_infer, timeout),
            Runner("python gloo TP=2", False, peer, parse_infer, timeout)]


def infer_memory(values, ranks, key):
    """The largest of the ranks' `key` (rss_mib, hwm_mib, anon_mib), or None."""
    vals = [values.get(f"rank{r}/{key}") for r in range(ranks)]
    return max(vals) if vals and all(v is not None for v in vals) else None


def report_inference(runs, limits, cfg):
    med = {name: runs.get(name, {}).get("median", {}) for name, _, _ in INFER_SYSTEMS}
    tp2, tp1, py = (med[n] for n, _, _ in INFER_SYSTEMS)
    rows, summary = [], {}
    for b in INFER_BATCHES:
        tps = [m.get(f"batch{b}/tokens_per_s") for m in (tp2, tp1, py)]
        mspt = [m.get(f"batch{b}/ms_per_token") for m in (tp2, tp1, py)]
        rows.append((f"batch {b}", *(fmt(v) for v in tps), *(fmt(v) for v in mspt),
                     fmt_x(advantage(tps[0], tps[1], True)), fmt_x(advantage(tps[0], tps[2], True))))
        summary[f"batch{b}"] = {"tokens_per_s": dict(zip([n for n, _, _ in INFER_SYSTEMS], tps)),
                                "ms_per_token": dict(zip([n for n, _, _ in INFER_SYSTEMS], mspt))}
    md = table(["generate", "torchpar TP=2 tokens/s", "torchpar TP=1 (2 threads) tokens/s",
                "Python gloo TP=2 tokens/s", "torchpar TP=2 ms/token", "torchpar TP=1 ms/token",
                "Python TP=2 ms/token", "TP=2 vs TP=1", "torchpar vs Python (TP=2)"], rows)
    mrows = []
    for name, label, ranks in INFER_SYSTEMS:
        m = med[name]
        for r in range(ranks):
            mrows.append((label, str(r), fmt(m.get(f"rank{r}/rss_mib")), fmt(m.get(f"rank{r}/hwm_mib")),
                          fmt(m.get(f"rank{r}/anon_mib")),
                          fmt(m.get("parameters_per_rank") / 1e6 if m.get("parameters_per_rank") else None),
                          fmt(m.get("startup_s"))))
        summary[f"memory {name}"] = {k: infer_memory(m, ranks, k) for k in ("rss_mib", "hwm_mib", "anon_mib")}
    md += "\n\n### Memory per rank\n\n" + table(
        ["system", "rank", "resident MiB (VmRSS)", "peak MiB (VmHWM)", "private MiB (RssAnon)",
         "parameters (M)", "start-up (s)"], mrows, left=2)
    b8 = advantage(tp2.get("batch8/tokens_per_s"), tp1.get("batch8/tokens_per_s"), True)
    lat = advantage(tp2.get("batch1/ms_per_token"), py.get("batch1/ms_per_token"), False)
    lat8 = advantage(tp2.get("batch8/ms_per_token"), py.get("batch8/ms_per_token"), False)
    anon2, anon1 = infer_memory(tp2, 2, "anon_mib"), infer_memory(tp1, 1, "anon_mib")
    rss2, rss1 = infer_memory(tp2, 2, "rss_mib"), infer_memory(tp1, 1, "rss_mib")
    hwm2, hwm1 = infer_memory(tp2, 2, "hwm_mib"), infer_memory(tp1, 1, "hwm_mib")
    frac = lambda a, b: a / b if a and b else None
    mem_frac = frac(anon2, anon1)
    b1 = advantage(tp2.get("batch1/tokens_per_s"), tp1.get("batch1/tokens_per_s"), True)
    trows = [
        ("TP = 2 at batch 8 ≥ 1.0x the 2-thread single process (tokens/s)", fmt_x(b8), "≥ 1x",
         verdict(b8, 1.0, True)),
        ("(issue 42) TP = 2 ≥ 1.3x the 2-thread single process at batch 1", fmt_x(b1), "≥ 1.3x",
         verdict(b1, 1.3, True)),
        ("(issue 42) TP = 2 ≥ 1.3x the 2-thread single process at batch 8", fmt_x(b8), "≥ 1.3x",
         verdict(b8, 1.3, True)),
        ("per-token latency (batch 1, ms/token) ≥ 3x better than Python gloo TP = 2", fmt_x(lat),
         "≥ 3x", verdict(lat, 3.0, True)),
        ("(same at batch 8)", fmt_x(lat8), "", ""),
        ("per-rank private memory (largest rank's RssAnon) ≤ 60% of the single process's",
         fmt_pct(mem_frac), "≤ 60%",
         "n/a" if mem_frac is None else ("yes" if mem_frac <= 0.6 else "no")),
        ("(for reference: VmRSS, VmHWM, with LibTorch's shared code pages)",
         f"{fmt_pct(frac(rss2, rss1))}, {fmt_pct(frac(hwm2, hwm1))}", "", ""),
    ]
    summary["targets"] = {"tp2_vs_tp1_batch1": b1, "tp2_vs_tp1_batch8": b8, "latency_vs_python_batch1": lat,
                          "latency_vs_python_batch8": lat8, "private_memory_fraction": mem_frac,
                          "rss_fraction": frac(rss2, rss1), "hwm_fraction": frac(hwm2, hwm1)}
    md += ("\n\nThe GPT-2-small shape (12 layers, 768 wide, 12 heads, 1024 positions, 50,257 tokens: "
           "124.4M parameters), float32, seeded GPT-2 initialisation (each rank builds only its "
           f"shard). Greedy generate of {cfg.pick(INFER_NEW_TOKENS // 4, INFER_NEW_TOKENS)} new tokens after a {INFER_PROMPT}-token "
           "prompt (seed 0), per batch size: one untimed warm-up generate of 4 tokens, then "
           "one timed generate, the prompt's forward included; "
           f"{cfg.rounds('inference')} round(s), the median over rounds. tokens/s = batch x new "
           "tokens / wall time; ms/token = wall time / new tokens. Both sides are Megatron-style: "
           "attention heads and MLP units split across ranks (an all_reduce after each block's "
           "two row-parallel projections), the token embedding and its tied head split by "
           "vocabulary rows (an all_reduce after the lookup, an all_gather of the logits), a KV "
           "cache, rank 0 picking each token and broadcasting it. torchpar: infer_bench drives "
           "a TensorParallel engine (spawned workers, a shm CollectiveGroup, the caller sending "
           "one request per generate); TP = 1 is the same engine with one worker and 2 intra-op "
           "threads. Python: python_tp_infer.py, fork children in a torch.distributed gloo group "
           "on 127.0.0.1, torch.set_num_threads(1). Memory: each worker's /proc/<pid>/status "
           "after the timed runs; private memory (RssAnon) is what a rank costs the machine, "
           "VmRSS adds the LibTorch code pages every process on the host shares. Ratios: how "
           "many times better the first system is (> 1: better).\n\n### Targets (issue 17)\n\n")
    md += table(["target", "measured", "goal", "met"], trows) + "\n\n![inference](inference.png)"
    return md, summary


def plot_inference(runs, out):
    med = {name: runs.get(name, {}).get("median", {}) for name, _, _ in INFER_SYSTEMS}
    short = {"torchpar TP=2": "torchpar\nTP=2", "torchpar TP=1": "torchpar\nTP=1 x2thr",
             "python gloo TP=2": "Python\ngloo TP=2"}
    panels = [(f"generate, batch {b} (tokens/s)",
               [(short[n], med[n].get(f"batch{b}/tokens_per_s")) for n, _, _ in INFER_SYSTEMS],
               None, True) for b in INFER_BATCHES]
    panels.append(("largest rank's private memory (MiB)",
                   [(short[n], infer_memory(med[n], r, "anon_mib")) for n, _, r in INFER_SYSTEMS],
                   None, False))
    bar_grid(out / "inference.png", "Tensor-parallel GPT-2-small generate: torchpar vs Python gloo",
             panels, cols=3)


# ----------------------------------------------------------------------------------------------
# serve: `torchpar serve` vs peers/python_serve.py (http.server), loaded by serve_load.py

SERVE_TPS, SERVE_CLIENTS = (1, 2), (1, 8, 32)
SERVE_REQUESTS = {"quick": (2, 1, 1), "full": (6, 3, 2)}  # per client at each client count
SERVE_MAX_TOKENS, SERVE_PROMPT, SERVE_MAX_BATCH, SERVE_WARMUP = 32, 32, 8, 8
# GPT-2-small's block shape with 4 layers and the byte vocabulary: 28.7M parameters, so that the
# section (2 servers x 2 TP x 3 client counts, 3 rounds) takes ~5 min on 2 cores.
SERVE_MODEL = (("layers", 4), ("width", 768), ("heads", 12), ("vocab", 256), ("positions", 256))


def serve_names(tp):
    return f"torchpar serve TP={tp}", f"python http.server TP={tp}"


def runners_serve(cfg):
    ckpt = cfg.raw / "serve" / "checkpoint"
    skip = None
    try:  # one checkpoint both servers load: the same weights
        run_cmd([PY, PEERS / "python_serve.py", "--save-checkpoint", ckpt]
                + [x for k, v in SERVE_MODEL for x in (f"--{k}", v)], 300,
                cfg.raw / "serve" / "save_checkpoint")
    except RunError as e:
        skip = f"the checkpoint was not written: {e}"
    timeout = cfg.pick(300, 600)
    load = [PY, BENCH_DIR / "serve_load.py", "--clients", ",".join(map(str, SERVE_CLIENTS)),
            "--requests", ",".join(map(str, SERVE_REQUESTS[cfg.pick("quick", "full")])),
            "--max-tokens", SERVE_MAX_TOKENS, "--prompt-bytes", SERVE_PROMPT,
            "--warmup", SERVE_WARMUP, "--timeout", timeout - 30, "--"]
    server = ["--checkpoint", ckpt, "--port", 0, "--max-batch", SERVE_MAX_BATCH]
    runners = []
    for tp in SERVE_TPS:
        ours, peer = serve_names(tp)
        runners += [Runner(ours, True, load + [cfg.torchpar, "serve", "--tp", tp] + server,
                           parse_infer, timeout, skip),
                    Runner(peer, False, load + [PY, PEERS / "python_serve.py", "--tp", tp] + server,
                           parse_infer, timeout, skip)]
    return runners


def report_serve(runs, limits, cfg):
    # Both servers have run: the 115 MB checkpoint is not a result to keep.
    shutil.rmtree(cfg.raw / "serve" / "checkpoint", ignore_errors=True)
    med = {name: rec.get("median", {}) for name, rec in runs.items()}
    rows, trows, lrows, summary = [], [], [], {}
    for tp in SERVE_TPS:
        names = serve_names(tp)
        o, p = (med.get(n, {}) for n in names)
        for c in SERVE_CLIENTS:
            get = lambda key: (o.get(f"c{c}/{key}"), p.get(f"c{c}/{key}"))
            tps, t50, t99, p50, p99 = (get(k) for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
                                                         "tpot_p50_ms", "tpot_p99_ms"))
            rows.append((f"TP = {tp}", str(c), *(fmt(v) for v in tps),
                         fmt_x(advantage(*tps, True)), *(fmt(v) for v in t50 + t99),
                         fmt_x(advantage(*t99, False)), *(fmt(v) for v in p50 + p99)))
            summary[f"tp{tp}/c{c}"] = {k: dict(zip(names, v)) for k, v in (
                ("tokens_per_s", tps), ("ttft_p50_ms", t50), ("ttft_p99_ms", t99),
                ("tpot_p50_ms", p50), ("tpot_p99_ms", p99))}
        c = SERVE_CLIENTS[-1]
        thr = advantage(o.get(f"c{c}/tokens_per_s"), p.get(f"c{c}/tokens_per_s"), True)
        trows.append((f"TP = {tp}: tokens/s at {c} clients ≥ 2x the Python peer's",
                      f"{fmt(o.get(f'c{c}/tokens_per_s'))} vs {fmt(p.get(f'c{c}/tokens_per_s'))}: "
                      f"{fmt_x(thr)}", "≥ 2x", verdict(thr, 2.0, True)))
        for c in reversed(SERVE_CLIENTS):
            ttft = advantage(o.get(f"c{c}/ttft_p99_ms"), p.get(f"c{c}/ttft_p99_ms"), False)
            what = (f"TP = {tp}: p99 time to first token at {c} clients ≤ the peer's"
                    if c == SERVE_CLIENTS[-1] else f"(same at {c} client{'s' if c > 1 else ''})")
            trows.append((what, f"{fmt(o.get(f'c{c}/ttft_p99_ms'))} vs "
                          f"{fmt(p.get(f'c{c}/ttft_p99_ms'))} ms: {fmt_x(ttft)}",
                          "≥ 1x" if c == SERVE_CLIENTS[-1] else "",
                          verdict(ttft, 1.0, True) if c == SERVE_CLIENTS[-1] else ""))
            summary[f"tp{tp}/c{c}"]["ttft_p99_vs_python"] = ttft
        summary[f"tp{tp}/c{SERVE_CLIENTS[-1]}"]["tokens_per_s_vs_python"] = thr
        for n in names:
            lrows.append((n, fmt(med.get(n, {}).get("startup_s")), fmt(med.get(n, {}).get("stop_s"))))
    md = table(["TP", "clients", "torchpar tokens/s", "Python tokens/s", "vs Python",
                "torchpar TTFT p50 (ms)", "Python TTFT p50", "torchpar TTFT p99", "Python TTFT p99",
                "TTFT p99 vs Python", "torchpar TPOT p50 (ms)", "Python TPOT p50",
                "torchpar TPOT p99", "Python TPOT p99"], rows, left=2)
    requests = SERVE_REQUESTS[cfg.pick("quick", "full")]
    model = dict(SERVE_MODEL)
    md += ("\n\nThe model: GPT-2-small's block shape with fewer layers and the byte vocabulary "
           f"({model['layers']} layers, {model['width']} wide, {model['heads']} heads, MLP "
           f"{4 * model['width']}, {model['vocab']} tokens, {model['positions']} positions: 28.7M "
           "parameters, float32), chosen so that the section runs in about 5 minutes on 2 cores; "
           "written once per run by `python_serve.py --save-checkpoint` (model.pt with GPT-2 "
           "names and Conv1D weights + model.json, tokenizer \"bytes\") and loaded by both "
           "servers: the same weights, the same greedy text. Load (serve_load.py, stdlib threads "
           "+ http.client): C concurrent clients, each on its own keep-alive connection sending "
           f"streaming requests back to back ({', '.join(f'{n} per client at {c}' for c, n in zip(SERVE_CLIENTS, requests))} "
           f"clients), distinct {SERVE_PROMPT}-byte prompts, max_tokens {SERVE_MAX_TOKENS}, "
           f"temperature 0, after an untimed warm-up of {SERVE_WARMUP} requests at once. "
           "tokens/s = every request's token events / (last end - start of the level); TTFT = "
           "the first token event's arrival - the request's send (queueing included); TPOT = "
           "each gap between two token events of a request (all gaps are the samples). "
           f"Both servers: `--tp N --max-batch {SERVE_MAX_BATCH}`, cores / N intra-op threads "
           "per rank. torchpar: `torchpar serve` (continuous batching: sequences join and leave "
           "the running batch between decoding steps). Python: peers/python_serve.py, "
           "python_tp_infer.py's Megatron-style model (gloo, fork children) behind "
           "http.server.ThreadingHTTPServer with static batching: rank 0's scheduler takes the "
           f"oldest waiting request and up to {SERVE_MAX_BATCH - 1} more of the same prompt "
           "length, runs one batched generate of them to the end, streaming each step's tokens; "
           "requests that arrive meanwhile wait for the next generate. "
           f"{cfg.rounds('serve')} round(s) (torchpar TP=1, Python TP=1, torchpar TP=2, Python "
           "TP=2), a fresh server each run; the median over rounds. Ratios: how many times "
           "better torchpar is (> 1: better).\n\n### Targets (issue 43)\n\n")
    md += table(["target", "measured (torchpar vs Python)", "goal", "met"], trows)
    md += ("\n\n### Start-up and drain\n\n"
           + table(["server", "start to /health 200 (s)", "SIGTERM to exit (s)"], lrows)
           + "\n\n![serve](serve.png)")
    return md, summary


def plot_serve(runs, out):
    med = {name: rec.get("median", {}) for name, rec in runs.items()}
    c = SERVE_CLIENTS[-1]
    panels = []
    for tp in SERVE_TPS:
        o, p = (med.get(n, {}) for n in serve_names(tp))
        for key, title, higher, factor in (("tokens_per_s", "tokens/s", True, 2.0),
                                           ("ttft_p99_ms", "p99 TTFT (ms)", False, 1.0),
                                           ("tpot_p50_ms", "p50 TPOT (ms)", False, None)):
            peer = p.get(f"c{c}/{key}")
            panels.append((f"TP = {tp}, {c} clients: {title}",
                           [("torchpar\nserve", o.get(f"c{c}/{key}")), ("Python\nhttp.server", peer)],
                           peer * factor if factor and peer else None, higher))
    bar_grid(out / "serve.png", f"HTTP serving, {c} streaming clients: torchpar serve vs Python",
             panels, cols=3)

# ----------------------------------------------------------------------------------------------
# python: torchpar.multiprocessing vs torch.multiprocessing and multiprocessing (python_mp.py)

# The implementations python_mp.py runs (--impl) and their names in the report.
PY_IMPLS = {"torchpar": "torchpar.multiprocessing", "torch": "torch.multiprocessing",
            "mp": "multiprocessing"}
# Cases run by one process per implementation and round (one runner each), and which
# implementations run them (multiprocessing only the pools: with torch imported its queues carry
# tensors through torch's reducers, i.e. torch.multiprocessing again).
PY_GROUPS = (("queue", ("queue_rt_4k", "queue_rate_4k", "dict16"), ("torchpar", "torch")),
             ("pool", ("pool_map", "pool_apply_rt"), ("torchpar", "torch", "mp")),
             ("dataloader", ("dataloader", "dataloader_list"), ("torchpar", "torch")))
# case, title; rows: measure, label, unit, higher is better, the peer of the target, target (x)
PY_CASES = [
    ("queue_rt_4k", "4 KiB tensor Queue round trip",
     [("rtt", "round trip (same tensor echoed)", "us", False, "torch", 20)]),
    ("queue_rate_4k", "4 KiB tensors one way through a Queue",
     [("rate", "fresh tensors, child sums them", "messages/s", True, "torch", 20)]),
    ("dict16", "dict of 16 small tensors (16 x 64 float32) through a Queue",
     [("rtt", "round trip (fresh dict each trip)", "us", False, "torch", 10)]),
    ("pool_map", "Pool(2).map(f, range(N), chunksize=1)",
     [("rate", "map, chunksize 1", "tasks/s", True, "mp", 5)]),
    ("pool_apply_rt", "Pool(2).apply_async(f, (i,)).get()",
     [("rtt", "round trip", "us", False, "mp", 5)]),
    ("dataloader", "DataLoader, 4 workers, batches of 64 x 3x32x32 (default collate)",
     [("rate", "samples/s", "samples/s", True, "torch", 2),
      ("fds_end", "main process's open fds at the end", "fds", False, "torch", None),
      ("fds_max", "most open fds between batches", "fds", False, "torch", None)]),
    ("dataloader_list", "DataLoader, 4 workers, batches as lists of 64 tensors of 3x32x32",
     [("rate", "samples/s", "samples/s", True, "torch", 2),
      ("fds_end", "main process's open fds at the end", "fds", False, "torch", None),
      ("fds_max", "most open fds between batches", "fds", False, "torch", None)]),
]
# Work per case (quick, full), passed to python_mp.py: pool_map's 200,000 tasks are the issue's;
# the others keep torch.multiprocessing's runs (~430 tensors/s, ~50 dict trips/s, ~550
# list-collated samples/s here) to about a minute a round in a full run.
PY_SIZES = {"trips": (500, 2000), "messages": (1000, 5000), "dict_trips": (100, 500),
            "tasks": (20000, 200000), "samples": (3200, 12800)}
PY_NOT_BUILT = "Python package not built"
# Per-case error lines of the runs ({runner name: {case: message}}): a case that cannot run
# (torchpar's Pool missing, say) is "not available" in the report, not a failed runner.
PY_CASE_ERRORS = {}


def py_runner_name(impl, group):
    return f"{PY_IMPLS[impl]}: {group}"


def python_package_dir(cfg):
    """The directory holding the torchpar package for /usr/bin/python3: <build>/python beside
    a build tree's bin/, or <prefix>/lib[/<multiarch>]/python3.X/dist-packages of an install
    (--bin is then <prefix>/libexec/torchpar, --cli <prefix>/bin/torchpar); None when neither
    has it (it may still be importable from Python's own path, e.g. an install in /usr/local)."""
    candidates = [cfg.bin.parent / "python"]
    prefixes = [cfg.bin.parent.parent] + ([cfg.cli.parent.parent] if cfg.cli else [])
    for prefix in dict.fromkeys(prefixes):
        candidates += sorted(prefix.glob("lib*/python3*/dist-packages"))
        candidates += sorted(prefix.glob("lib/*/python3*/dist-packages"))
    return next((d for d in candidates if (d / "torchpar" / "__init__.py").exists()), None)


def python_package_check(cfg, module="torchpar.multiprocessing"):
    """(directory for sys.path or None, None) when /usr/bin/python3 imports `module` (a
    torchpar module) from there, else (None, reason)."""
    d = python_package_dir(cfg)
    code = ("import importlib, sys\nif sys.argv[1]: sys.path.insert(0, sys.argv[1])\n"
            "import torch, torchpar\nimportlib.import_module(sys.argv[2])\nprint(torchpar.__file__)")
    try:
        r = subprocess.run([PY, "-c", code, str(d or ""), module], capture_output=True, text=True,
                           timeout=180, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{PY_NOT_BUILT} ({PY} did not run: {e})"
    if r.returncode != 0:
        last = next((l.strip() for l in reversed(r.stderr.splitlines()) if l.strip()), "")
        where = f"looked in {d}" if d else f"none beside {cfg.bin} or in its prefix"
        return None, f"{PY_NOT_BUILT} ({where}): {last[:200]}"
    return d, None


def parse_python_mp(name):
    """python_mp.py's lines -> {'<case>/<measure>': value}; error lines go to PY_CASE_ERRORS."""
    def parse(out):
        values, errors = {}, PY_CASE_ERRORS.setdefault(name, {})
        for r in json_lines(out):
            if "error" in r:
                errors[r["case"]] = r["error"]
            elif "value" in r:
                values[f"{r['case']}/{r['name']}"] = r["value"]
        if not values and errors:
            values["cases_failed"] = len(errors)  # the run itself worked; the cases say why not
        return values
    return parse


def runners_python(cfg):
    progress("[python] checking that /usr/bin/python3 imports torchpar ...", end="")
    d, why = python_package_check(cfg)
    progress(f" {why or 'yes, from ' + str(d or 'its own path')}")
    if why:  # not ours: a build without the Python package is not a failed benchmark
        return [Runner(PY_IMPLS["torchpar"], False, [PY], lambda out: {}, 0, skip=why)]
    timeout = cfg.pick(240, 600)
    runners = []
    for group, cases, impls in PY_GROUPS:
        for impl in impls:
            cmd = [PY, PEERS / "python_mp.py", "--impl", impl, "--case", ",".join(cases),
                   "--timeout", timeout - 30] + (["--pythonpath", d] if d else [])
            for key, sizes in PY_SIZES.items():
                cmd += [f"--{key.replace('_', '-')}", cfg.pick(*sizes)]
            name = py_runner_name(impl, group)
            runners.append(Runner(name, impl == "torchpar", cmd, parse_python_mp(name), timeout))
    return runners


def python_cell(runs, impl, case, measure):
    """(value or None, text for the table) of one implementation's measure."""
    group = next(g for g, cases, _ in PY_GROUPS if case in cases)
    name = py_runner_name(impl, group)
    rec = runs.get(name)
    if rec is None:
        return None, "-"
    v = rec["median"].get(f"{case}/{measure}")
    if v is not None:
        return v, fmt(v)
    err = PY_CASE_ERRORS.get(name, {}).get(case) or rec["error"]
    return None, f"not available: {err}" if err else "n/a"


def report_python(runs, limits, cfg):
    skipped = runs.get(PY_IMPLS["torchpar"])
    if skipped and skipped["error"] and skipped["error"].startswith(PY_NOT_BUILT):
        return f"{skipped['error']}: nothing measured.", {"error": skipped["error"]}
    md, summary, trows = [], {}, []
    for case, title, rows in PY_CASES:
        trs = []
        for measure, label, unit, higher, peer, target in rows:
            (mine, mine_t), *peers = [python_cell(runs, i, case, measure) for i in PY_IMPLS]
            ratio = advantage(mine, python_cell(runs, peer, case, measure)[0], higher)
            met = verdict(ratio, target, True)
            trs.append((label, unit, mine_t, *(t for _, t in peers),
                        fmt_x(ratio) + f" vs {PY_IMPLS[peer]}" if ratio else "n/a",
                        "-" if target is None else f"≥ {target}x", met))
            summary[f"{case}/{measure}"] = dict(
                {PY_IMPLS[i]: python_cell(runs, i, case, measure)[0] for i in PY_IMPLS},
                unit=unit, ratio=ratio, vs=PY_IMPLS[peer], target=target,
                met=None if target is None or ratio is None else ratio >= target)
            if target is not None:
                trows.append((f"{title}: {label}, torchpar ≥ {target}x {PY_IMPLS[peer]}",
                              fmt_x(ratio), met))
        md.append(f"### {title} ({case})\n\n" + table(
            ["measure", "unit", *PY_IMPLS.values(), "torchpar vs peer", "target", "met"], trs,
            left=2))
    errors = {f"{n}/{c}": e for n, errs in PY_CASE_ERRORS.items() for c, e in errs.items()}
    if errors:
        summary["case_errors"] = errors
    n = {key: cfg.pick(*sizes) for key, sizes in PY_SIZES.items()}
    md.append(
        "Method: bench/peers/python_mp.py from /usr/bin/python3, one process per implementation, "
        "case group and round (interleaved: torchpar, then each peer), fork start method, "
        "torch.set_num_threads(1), 2 processes (a parent and one child, or a pool of 2 workers; "
        f"the DataLoader 4 workers on {len(os.sched_getaffinity(0))} cores). Queues: "
        f"{n['trips']:,} timed round trips of one torch.ones(1024) echoed back (after 50 "
        f"untimed), {n['messages']:,} fresh 4 KiB tensors one way (messages/s until the "
        f"child's reply to an end marker), {n['dict_trips']:,} round trips of a fresh dict of "
        "16 torch.full((64,), k) (made outside the timed region); medians of the trips. Pools: "
        f"map of {n['tasks']:,} tasks of f(x) = x + 1 with chunksize 1 after an "
        f"untimed map of 1,000; {n['trips']:,} apply_async(f, (i,)).get() after 100 "
        "untimed (median). torchpar's Pool sends consecutive tasks of a map as one message (its "
        "batch sizes are at least chunksize), Python's one message per chunk. DataLoader: "
        f"{n['samples']:,} samples (torch.full((3, 32, 32), ...), label), batch_size "
        "64, shuffle off; torchpar passes multiprocessing_context=torchpar.multiprocessing."
        "get_context('fork'), torch the default context (sharing strategy file_descriptor); "
        "samples/s from the first batch to the end (worker start-up outside); fds: "
        "len(os.listdir('/proc/self/fd')) of the main process after the last batch (still "
        "held, the workers gone) and the most seen between batches. multiprocessing (no torch "
        "imported) runs only the pools: with torch imported its queues carry tensors through "
        "torch's reducers, which is torch.multiprocessing's row. Ratios: how many times better "
        "torchpar is (> 1: better). The DataLoader rows carry the issue's 2x target twice: "
        "default collate (one 64x3x32x32 tensor a batch) and batches as lists of 64 tensors."
        + (" --quick: one round of small sizes, a smoke check." if cfg.quick else ""))
    md.append("### Targets (issue 39)\n\n" + table(["target", "measured", "met"], trows)
              + "\n\n![python](python.png)")
    return "\n\n".join(md), summary


def plot_python(runs, out):
    if not any(py_runner_name("torchpar", g) in runs for g, _, _ in PY_GROUPS):
        return
    short = {"torchpar": "torchpar", "torch": "torch.mp", "mp": "mp"}
    panels = []
    for case, title, rows in PY_CASES:
        for measure, label, unit, higher, peer, target in rows:
            if target is None:
                continue
            impls = [i for g, cases, im in PY_GROUPS if case in cases for i in im]
            panels.append((f"{case} ({unit})",
                           [(short[i], python_cell(runs, i, case, measure)[0]) for i in impls],
                           None, higher))
    bar_grid(out / "python.png", "torchpar.multiprocessing vs torch.multiprocessing (torch.mp) and "
             "multiprocessing (mp)", panels, cols=4)


# ----------------------------------------------------------------------------------------------
# python_dist: torch.distributed on the c10d backend "torchpar" vs "gloo" (python_dist.py)

# The backends python_dist.py runs (--impl) and their names in the report.
PYD_IMPLS = {"torchpar": "torch.distributed torchpar", "gloo": "torch.distributed gloo"}
PYD_OPS = ("all_reduce", "broadcast", "all_gather")
PYD_SIZES = (4, 4 * KiB, MiB, 16 * MiB, 64 * MiB)  # bytes per rank, the issue's
PYD_PG_SIZES = (4, 4 * KiB)  # where python_dist.py also times pg.allreduce([t]).wait()
# Case groups, each run by one process per backend and round (round r: torchpar's collectives,
# gloo's, the small all_reduces with the ranks bound to cores (torchpar's, gloo's), torchpar's
# DDP, gloo's): group, cases, python_dist.py's sizes and extra flags.
PYD_GROUPS = (("collectives", PYD_OPS, PYD_SIZES, []),
              ("bound", ("all_reduce",), PYD_PG_SIZES, ["--bind"]),
              ("ddp", ("ddp",), PYD_SIZES, []))
# issue 40: torchpar's dist.all_reduce latency at least this many times below gloo's
PYD_TARGETS = {("all_reduce", 4): 50, ("all_reduce", 16 * MiB): 4}
PYD_DDP_TARGET = 1.3  # DDP samples/s, x gloo's
PYD_ACC_POINTS = 1.0  # DDP test accuracy within this many points of gloo's
# Work (quick, full) passed to python_dist.py: timed calls of the sizes up to 1 MiB (fewer
# above: 31 at 16 MiB, 7 at 64 MiB in a full run, where gloo's all_gather took 0.8 s and 4.8 s
# a call at load 9), untimed calls, DDP training samples (1 epoch; quick as the train section's).
PYD_WORK = {"iters": (100, 500), "warmup": (10, 20), "samples": (TRAIN_QUICK_LIMIT, 60000)}
# Per-case error lines and notes of the runs ({runner name: {case: text}}).
PYD_CASE_ERRORS, PYD_NOTES = {}, {}
# Every section's runs of this run (main fills it): the report puts coll_bench's C++ figures
# beside the Python calls when the collectives section ran too.
ALL_RESULTS = {}


def pyd_runner_name(impl, group):
    return f"{PYD_IMPLS[impl]}: {group}"


def pyd_group(case):
    """The unbound group that runs `case`."""
    return next(g for g, cases, _, flags in PYD_GROUPS if case in cases and not flags)


def parse_python_dist(name):
    """python_dist.py's lines -> {'<case>/<measure>': value}; error and note lines go to
    PYD_CASE_ERRORS and PYD_NOTES."""
    def parse(out):
        values = {}
        errors, notes = PYD_CASE_ERRORS.setdefault(name, {}), PYD_NOTES.setdefault(name, {})
        for r in json_lines(out):
            if "error" in r:
                errors[r["case"]] = r["error"]
            elif "note" in r:
                notes[r["case"]] = r["note"]
            elif "value" in r:
                values[f"{r['case']}/{r['name']}"] = r["value"]
        if not values and errors:
            values["cases_failed"] = len(errors)
        return values
    return parse


def runners_python_dist(cfg):
    progress("[python_dist] checking that /usr/bin/python3 imports torchpar.distributed ...",
             end="")
    d, why = python_package_check(cfg, "torchpar.distributed")
    progress(f" {why or 'yes, from ' + str(d or 'its own path')}")
    if why:  # not ours: a build without the Python package is not a failed benchmark
        return [Runner(PYD_IMPLS["torchpar"], False, [PY], lambda out: {}, 0, skip=why)]
    timeout = cfg.pick(300, 900)
    runners = []
    for group, cases, sizes, flags in PYD_GROUPS:
        for impl in PYD_IMPLS:
            cmd = [PY, PEERS / "python_dist.py", "--impl", impl, "--case", ",".join(cases),
                   "--sizes", ",".join(map(str, sizes)), "--timeout", timeout - 30,
                   "--case-timeout", timeout - 60] + flags + (["--pythonpath", d] if d else [])
            for key, work in PYD_WORK.items():
                cmd += [f"--{key}", cfg.pick(*work)]
            name = pyd_runner_name(impl, group)
            runners.append(Runner(name, impl == "torchpar", cmd, parse_python_dist(name), timeout))
    return runners


def pyd_get(runs, impl, case, measure, group=None):
    """One backend's median of '<case>/<measure>' (from `group`, default the unbound one), or
    None."""
    rec = runs.get(pyd_runner_name(impl, group or pyd_group(case)))
    return rec["median"].get(f"{case}/{measure}") if rec else None


def pyd_cell(runs, impl, case, measure):
    """Text of one backend's measure: the value, or why there is none."""
    v = pyd_get(runs, impl, case, measure)
    if v is not None:
        return fmt(v)
    name = pyd_runner_name(impl, pyd_group(case))
    rec = runs.get(name)
    err = PYD_CASE_ERRORS.get(name, {}).get(case) or (rec or {}).get("error")
    return f"not available: {err}" if err else "n/a"


def report_python_dist(runs, limits, cfg):
    skipped = runs.get(PYD_IMPLS["torchpar"])
    if skipped and skipped["error"] and skipped["error"].startswith(PY_NOT_BUILT):
        return f"{skipped['error']}: nothing measured.", {"error": skipped["error"]}
    md, summary, trows = [], {}, []
    for op in PYD_OPS:
        rows = []
        for n in PYD_SIZES:
            us = [pyd_get(runs, i, op, f"{n}/us") for i in PYD_IMPLS]
            ratio = advantage(us[0], us[1], False)
            target = PYD_TARGETS.get((op, n))
            rows.append((fmt_bytes(n), *(pyd_cell(runs, i, op, f"{n}/us") for i in PYD_IMPLS),
                         *(fmt(pyd_get(runs, i, op, f"{n}/p99")) for i in PYD_IMPLS),
                         *(fmt_GBps(pyd_get(runs, i, op, f"{n}/busbw")) for i in PYD_IMPLS),
                         fmt_x(ratio), "-" if target is None else f"≥ {target}x",
                         verdict(ratio, target, True)))
            summary[f"{op}/{n}"] = {"torchpar_us": us[0], "gloo_us": us[1], "ratio": ratio,
                                    "target": target,
                                    "met": None if target is None or ratio is None
                                    else ratio >= target}
            if target is not None:
                trows.append((f"dist.{op} {fmt_bytes(n)}: torchpar ≥ {target}x gloo (latency)",
                              f"{fmt(us[0])} vs {fmt(us[1])} us = {fmt_x(ratio)}",
                              verdict(ratio, target, True)))
        md.append(f"### dist.{op}\n\n" + table(
            ["size", "torchpar median (µs)", "gloo median (µs)", "torchpar p99 (µs)",
             "gloo p99 (µs)", "torchpar busbw (GB/s)", "gloo busbw (GB/s)", "torchpar vs gloo",
             "target", "met"], rows))

    # What the Python call costs: the process group called directly, the ranks bound to cores
    # (as coll_bench binds its), and C++ (coll_bench) when the collectives section ran too.
    coll = coll_medians(ALL_RESULTS["collectives"]) if "collectives" in ALL_RESULTS else {}
    crows = []
    for n in PYD_PG_SIZES:
        for impl, cpp in (("torchpar", "torchpar-shm"), ("gloo", "c10d-gloo-cpp")):
            call, pg = (pyd_get(runs, impl, "all_reduce", f"{n}/{m}") for m in ("us", "pg_us"))
            bcall, bpg = (pyd_get(runs, impl, "all_reduce", f"{n}/{m}", "bound")
                          for m in ("us", "pg_us"))
            c = coll.get(f"{cpp}/all_reduce/{n}/us")
            crows.append((fmt_bytes(n), impl, fmt(call), fmt(pg), fmt(bcall), fmt(bpg),
                          fmt(c) if coll else "not run",
                          fmt(bcall - c) if bcall is not None and c is not None else "n/a"))
            summary[f"call_cost/{impl}/{n}"] = {"dist_us": call, "pg_us": pg,
                                                "bound_dist_us": bcall, "bound_pg_us": bpg,
                                                "cpp_us": c}
    b4 = pyd_get(runs, "torchpar", "all_reduce", "4/us", "bound")
    g4 = best([pyd_get(runs, "gloo", "all_reduce", "4/us", g) for g in ("collectives", "bound")],
              False)
    summary["all_reduce/4/bound_vs_gloo_best"] = advantage(b4, g4, False)
    bound_target = PYD_TARGETS[("all_reduce", 4)]
    trows.insert(1, (f"(beside it) dist.all_reduce 4 B with torchpar's ranks bound to cores (as "
                     f"coll_bench's), gloo at its better placement: ≥ {bound_target}x",
                     f"{fmt(b4)} vs {fmt(g4)} us = {fmt_x(advantage(b4, g4, False))}",
                     verdict(advantage(b4, g4, False), bound_target, True)))
    md.append("### What the Python call costs (all_reduce)\n\n" + table(
        ["size", "backend", "dist.all_reduce (µs)", "pg.allreduce([t]).wait() (µs)",
         "dist.all_reduce, ranks bound (µs)", "pg.allreduce, ranks bound (µs)",
         "C++ in this run, ranks bound (µs)", "Python's share, bound (µs)"], crows, left=2)
        + "\n\npg.allreduce: the same group's c10d ProcessGroup called directly (what "
        "dist.all_reduce runs after its Python argument checks); the difference is "
        "distributed_c10d's Python wrapper. Ranks bound: each rank pinned to a core of its own "
        "(python_dist.py --bind), as coll_bench pins its ranks; the tables above leave the "
        "ranks where the kernel puts them, as torch.distributed users run them. C++: "
        "coll_bench's torchpar-shm and c10d-gloo-cpp (the collectives section); "
        + ("Python's share: dist.all_reduce with the ranks bound minus C++. " if coll else
           "not run here: `--only collectives,python_dist` puts them beside. ")
        + f"4 B all_reduce, torchpar's ranks bound, against gloo's better placement: "
        f"{fmt(b4)} vs {fmt(g4)} us = {fmt_x(summary['all_reduce/4/bound_vs_gloo_best'])}.")

    # DDP
    sps = [pyd_get(runs, i, "ddp", "samples_per_s") for i in PYD_IMPLS]
    acc = [pyd_get(runs, i, "ddp", "test_accuracy") for i in PYD_IMPLS]
    free = [pyd_get(runs, i, "ddp", "nosync_samples_per_s") for i in PYD_IMPLS]
    drows = [(PYD_IMPLS[i], pyd_cell(runs, i, "ddp", "samples_per_s"),
              pyd_cell(runs, i, "ddp", "test_accuracy"), fmt(pyd_get(runs, i, "ddp", "final_loss")),
              fmt(pyd_get(runs, i, "ddp", "test_loss")), fmt(f),
              fmt_pct(1 - v / f) if v and f else "n/a")
             for i, v, f in zip(PYD_IMPLS, sps, free)]
    speed = advantage(sps[0], sps[1], True)
    ceiling = advantage(best(free, True), sps[1], True)
    gap = acc[0] - acc[1] if None not in acc else None
    summary["ddp"] = {"torchpar_samples_per_s": sps[0], "gloo_samples_per_s": sps[1],
                      "ratio": speed, "target": PYD_DDP_TARGET,
                      "torchpar_accuracy": acc[0], "gloo_accuracy": acc[1], "accuracy_gap": gap,
                      "torchpar_nosync_samples_per_s": free[0],
                      "gloo_nosync_samples_per_s": free[1], "ceiling_ratio": ceiling}
    trows.append((f"DDP samples/s: torchpar ≥ {PYD_DDP_TARGET}x gloo",
                  f"{fmt(sps[0])} vs {fmt(sps[1])} = {fmt_x(speed)} (ceiling {fmt_x(ceiling)})",
                  verdict(speed, PYD_DDP_TARGET, True)))
    trows.append((f"DDP test accuracy within {PYD_ACC_POINTS:g} point of gloo",
                  "n/a" if gap is None else f"{acc[0]:.2f}% vs {acc[1]:.2f}% ({gap:+.2f} points)",
                  "n/a" if gap is None else ("yes" if abs(gap) <= PYD_ACC_POINTS else "no")))
    data = next((notes["ddp"] for notes in PYD_NOTES.values() if "ddp" in notes),
                "not known (no run printed it)")
    md.append("### DDP training, mnist_hogwild network, 2 ranks\n\n" + table(
        ["backend", "samples/s", "test accuracy (%)", "final training loss", "test loss",
         "samples/s under no_sync()", "communication's share"], drows)
        + f"\n\nData: {data.removeprefix('data: ')}. samples/s under no_sync(): a quarter epoch "
        "more with DDP's gradient all_reduce skipped (model.no_sync()), after the evaluation: "
        "training with free communication, which no backend can pass; communication's share = "
        "1 - samples/s / that. Ceiling: the better no_sync() samples/s / gloo's samples/s, the "
        "most any backend could gain over gloo here.")

    errors = {f"{n}/{c}": e for n, errs in PYD_CASE_ERRORS.items() for c, e in errs.items()}
    if errors:
        summary["case_errors"] = errors
    groups = sorted({v for notes in PYD_NOTES.values() for k, v in notes.items() if k == "group"})
    w = {key: cfg.pick(*sizes) for key, sizes in PYD_WORK.items()}
    md.append(
        "Method: bench/peers/python_dist.py from /usr/bin/python3, one process per backend, case "
        "group and round (interleaved: torchpar, then gloo), each case 2 fresh ranks (fork, "
        "torch.set_num_threads(1); not bound to cores but in the \"ranks bound\" columns) meeting "
        "through a FileStore. Each timed "
        "call is the plain synchronous call torch.distributed users make (dist.all_reduce(t), "
        "SUM in place; dist.broadcast(t, src=0); dist.all_gather(list, t)), timed alone in "
        f"rank 0: {w['iters']:,} calls after {w['warmup']} untimed at sizes up to 1 MiB, fewer "
        "above (max(3, calls x 1 MiB / bytes)); median and nearest-rank p99 of the calls, then "
        "the median over rounds; busbw as nccl-tests. Ratios: gloo's latency / torchpar's (> 1: "
        "torchpar faster). DDP: torch.nn.parallel.DistributedDataParallel (default buckets) of "
        "peers/mnist_hogwild.py's Net, 1 epoch, batch 64 per rank, SGD(0.01, momentum 0.5), the "
        "same seeds on both backends (the runs differ only in summation order); samples/s of "
        "the epoch between two barriers in rank 0, test accuracy after it. "
        + (f"torchpar's group: {'; '.join(g.split(': ', 1)[1] for g in groups)}. " if groups else "")
        + ("--quick: one round, fewer calls and samples, a smoke check." if cfg.quick else ""))
    md.append("### Targets (issue 40)\n\n" + table(["target", "measured", "met"], trows)
              + "\n\n![python_dist](python_dist.png)")
    return "\n\n".join(md), summary


def plot_python_dist(runs, out, cfg):
    import matplotlib.pyplot as plt
    if not any(pyd_runner_name("torchpar", g[0]) in runs for g in PYD_GROUPS):
        return
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, op in zip(axes, PYD_OPS):
        for impl, name in PYD_IMPLS.items():
            pts = [(n, pyd_get(runs, impl, op, f"{n}/us")) for n in PYD_SIZES]
            pts = [p for p in pts if p[1] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl,
                        linewidth=2.5 if impl == "torchpar" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(PYD_SIZES)
        ax.set_xticklabels([fmt_bytes(n) for n in PYD_SIZES], fontsize=7, rotation=45)
        ax.set_ylabel("µs per call (median)")
        ax.set_title(f"dist.{op}, 2 ranks", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[3]
    vals = [pyd_get(runs, i, "ddp", "samples_per_s") or 0 for i in PYD_IMPLS]
    bars = ax.bar(range(len(vals)), vals, color=["C0", "C1"])
    ax.bar_label(bars, labels=[fmt(v) if v else "n/a" for v in vals], fontsize=8)
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(list(PYD_IMPLS), fontsize=8)
    ax.axhline(vals[1] * PYD_DDP_TARGET, color="C3", linestyle="--", linewidth=1)
    ax.set_title(f"DDP samples/s (target ≥ {PYD_DDP_TARGET}x gloo, dashed)", fontsize=9)
    fig.suptitle("torch.distributed from Python: backend torchpar vs gloo"
                 + (" (--quick)" if cfg.quick else ""))
    fig.tight_layout()
    fig.savefig(out / "python_dist.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Plots, machine facts, report


def bar_grid(path, title, panels, cols):
    """One small bar chart per panel: (title, [(system, value)], target or None, higher). A
    panel whose values span more than 20x gets a log scale starting a decade below its minimum."""
    import math
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.3 * rows), squeeze=False)
    for ax, (ptitle, bars, target, higher) in zip(axes.flat, panels):
        names = [b[0] for b in bars]
        vals = [b[1] or 0 for b in bars]
        drawn = ax.bar(range(len(vals)), vals, color=["C0"] + ["C1"] * (len(vals) - 1))
        ax.bar_label(drawn, labels=[fmt(b[1]) for b in bars], fontsize=7)
        ax.set_xticks(range(len(vals)))
        ax.set_xticklabels(names, fontsize=7)
        sub = f"{'higher' if higher else 'lower'} is better"
        if target is not None:
            ax.axhline(target, color="C3", linestyle="--", linewidth=1)
            sub += f", target (dashed) {target_text(target, higher)}"
        shown = [v for v in vals + ([target] if target else []) if v > 0]
        if shown and max(shown) / min(shown) > 20:
            ax.set_yscale("log")
            ax.set_ylim(10 ** math.floor(math.log10(min(shown))), max(shown) * 3)
            ax.yaxis.set_minor_formatter(NullFormatter())
        else:
            ax.set_ylim(0, max(shown or [1]) * 1.15)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v == int(v) else fmt(v)))
        ax.set_title(f"{ptitle}\n{sub}", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_plots(cfg, results):
    """Draws the PNGs of the benchmarks that ran; returns notes on plots that failed."""
    notes = []
    try:
        import matplotlib
        matplotlib.use("Agg")
    except ImportError:
        return ["plots not drawn: matplotlib is missing (Debian: python3-matplotlib)"]
    plotters = {"handoff": lambda r: plot_handoff(r, cfg.out),
                "pools": lambda r: plot_pools(r, cfg.out),
                "manager": lambda r: plot_manager(r, cfg.out),
                "rpc": lambda r: plot_rpc(r, cfg.out),
                "pserver": lambda r: plot_pserver(r, cfg.out),
                "collectives": lambda r: plot_collectives(r, cfg.out, cfg),
                "scale-out": lambda r: plot_scaleout(r, cfg.out, cfg),
                "train": lambda r: plot_train(r, cfg.out),
                "elastic": lambda r: plot_elastic(r, cfg.out),
                "inference": lambda r: plot_inference(r, cfg.out),
                "serve": lambda r: plot_serve(r, cfg.out),
                "python": lambda r: plot_python(r, cfg.out),
                "python_dist": lambda r: plot_python_dist(r, cfg.out, cfg)}
    for bench, runs in results.items():
        if bench in plotters:
            try:
                plotters[bench](runs)
            except Exception as e:  # a plot must not lose the report
                notes.append(f"{bench} plot not drawn: {type(e).__name__}: {e}")
    return notes


def quiet(cmd, timeout=60):
    """stdout of a small command, or '' if it fails."""
    try:
        return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_facts(cfg):
    facts = {"nproc": len(os.sched_getaffinity(0))}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        facts["cpu"] = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M).group(1).strip()
    except (OSError, AttributeError):
        facts["cpu"] = "unknown"
    facts["kernel"] = platform.release()
    try:
        kb = int(re.search(r"^MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text(), re.M).group(1))
        facts["memory"] = f"{kb / 2 ** 20:.1f} GiB"
    except (OSError, AttributeError):
        pass
    info = quiet([cfg.torchpar, "info"])
    for key, name in (("torchpar", "torchpar"), ("libtorch", "LibTorch")):
        m = re.search(rf"^{name}\s+(\S+)", info, re.M)
        if m:
            facts[key] = m.group(1)
    # The package's version, without importing torch (1.5 s here).
    torch_version = quiet([PY, "-c", "import importlib.metadata as m; print(m.version('torch'))"]).strip()
    if torch_version:
        facts["pytorch (peers)"] = torch_version
    mpi = quiet(["mpirun", "--version"]).splitlines()
    if mpi:
        facts["openmpi"] = mpi[0].strip()
    facts["python"] = platform.python_version()
    facts["load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return facts


def placement_signal(results):
    """The 4-byte all_reduce of torchpar-shm and Open MPI (2 ranks, each bound to a core), as
    measured by the collectives section: one cache line going back and forth between the two
    vCPUs, which shows where the hypervisor placed them (two hyperthreads of one core or cores
    sharing a cache: a fraction of a microsecond; farther apart: several times more). Every
    small-message figure of the report moves with it, ours and the peers' alike. None when the
    section did not run."""
    if "collectives" not in results:
        return None
    med = coll_medians(results["collectives"])
    ours, mpi = med.get("torchpar-shm/all_reduce/4/us"), med.get("openmpi/all_reduce/4/us")
    if ours is None and mpi is None:
        return None
    return (f"4 B all_reduce, 2 bound ranks: torchpar-shm {fmt(ours)} us, Open MPI {fmt(mpi)} us "
            "(a cache line's round trip between the two vCPUs; the 2026-11-28 release run's fast "
            "placement measured 0.16 / 0.29 us: several times those means distant vCPUs, and every "
            "small-message row of this report is slower for every system)")


TITLES = {"limits": "Physical limits", "handoff": "Tensor hand-off", "pools": "Process pools",
          "manager": "Manager", "rpc": "RPC", "pserver": "Parameter server",
          "collectives": "Collectives", "scale-out": "Scale-out: two hosts", "train": "Training",
          "elastic": "Elastic jobs: a node lost and back",
          "inference": "Tensor-parallel inference", "serve": "HTTP serving", "python": "Python package",
          "python_dist": "Python torch.distributed backend"}


def write_report(cfg, path, meta, sections, notes):
    m = meta["machine"]
    kind = "quick run (--quick: smaller sizes, 1 round)" if cfg.quick else "full run"
    lines = ["# torchpar benchmarks", "",
             f"{meta['started']} · {kind} · wall time {meta['wall_seconds'] / 60:.1f} min", "",
             "Command:", "", "```", meta["command"], "```", "",
             "## Machine", "", table(["fact", "value"], [(k, v) for k, v in m.items()], left=2), "",
             "## Method", "",
             "Each benchmark runs torchpar and its peers interleaved: round r runs ours, then each "
             "peer. Reported values are medians over rounds of each run's own value (itself a "
             "median or mean over many iterations, see each program's header). Rounds: "
             + ", ".join(f"{b} {cfg.rounds(b)}" for b, _, _ in sections) + ", no untimed warm-up "
             "round (each program warms up outside its timed region). "
             "\"vs\" ratios are how many times better torchpar is (> 1: torchpar better). The "
             "machine is shared: other load (see the load averages) shows up as noise."
             + (" One round: a disturbed run shows as it is, with nothing to outvote it: "
                "--quick is a smoke check, not a measurement." if cfg.quick else ""), ""]
    for bench, md, runs in sections:
        lines += [f"## {TITLES[bench]} ({bench})", "", md, ""]
        failed = failure_notes(runs)
        if failed:
            lines += ["Failures:", ""] + failed + [""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    path.write_text("\n".join(lines))


def update_latest(out):
    """Points bench/results/latest at out (relative) if out is inside bench/results/."""
    try:
        rel = out.resolve().relative_to(RESULTS.resolve())
    except ValueError:
        return False
    tmp = RESULTS / ".latest.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(rel)
    os.replace(tmp, RESULTS / "latest")
    return True


RUNNERS = {"limits": runners_limits, "handoff": runners_handoff, "pools": runners_pools,
           "manager": runners_manager, "rpc": runners_rpc, "pserver": runners_pserver,
           "collectives": runners_collectives, "train": runners_train,
           "elastic": runners_elastic, "inference": runners_inference, "serve": runners_serve,
           "python": runners_python,
           "python_dist": runners_python_dist}
REPORTS = {"limits": report_limits, "handoff": report_handoff, "pools": report_pools,
           "manager": report_manager, "rpc": report_rpc, "pserver": report_pserver,
           "collectives": report_collectives, "scale-out": report_scaleout, "train": report_train,
           "elastic": report_elastic, "inference": report_inference, "serve": report_serve,
           "python": report_python,
           "python_dist": report_python_dist}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True,
                    help="the build's bin directory (ipc_bench, coll_bench, torchpar, ...)")
    ap.add_argument("--cli", help="the torchpar program (default: <--bin>/torchpar)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, 1 round: a smoke check")
    ap.add_argument("--only", default=",".join(BENCHMARKS),
                    help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    ap.add_argument("--out", help="output directory (default bench/results/<YYYY-MM-DD_HHMMSS>)")
    ap.add_argument("--rounds", type=int,
                    help="interleaved rounds of every benchmark (default 3; quick 1)")
    args = ap.parse_args()
    only = [b for b in args.only.split(",") if b]
    unknown = [b for b in only if b not in BENCHMARKS]
    if unknown or not only:
        ap.error(f"--only: unknown benchmark {','.join(unknown)} (choose from {','.join(BENCHMARKS)})")
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be >= 1")
    # The benchmark programs are not part of a build's default target (`make test` and `make demo`
    # skip them): say how to build them instead of failing in the middle of a run.
    missing = sorted({p for b in only for p in SECTION_PROGRAMS.get(b, ())
                      if not (Path(args.bin) / p).exists()})
    if missing:
        ap.error(f"{', '.join(missing)} not built in {args.bin}: run `make bench`, or "
                 f"`cmake --build <build dir> --target benchmarks`")
    started = datetime.datetime.now()
    stamp = started.strftime("%Y-%m-%d_%H%M%S")
    # From an install prefix (not writable by the user) results go under the working directory.
    results_root = RESULTS if os.access(BENCH_DIR, os.W_OK) else Path.cwd() / "torchpar-bench-results"
    out = Path(args.out) if args.out else results_root / stamp
    cfg = Config(bin=Path(args.bin).resolve(), quick=args.quick, out=out.resolve(),
                 rounds_override=args.rounds, cli=Path(args.cli).resolve() if args.cli else None,
                 sections=tuple(only))
    cfg.raw.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    command = shlex.join([sys.executable] + sys.argv)
    progress(f"torchpar bench: {'quick' if cfg.quick else 'full'} run of {', '.join(only)} -> {cfg.out}")
    progress("[setup] machine facts (torchpar info, torch and mpirun versions) ...", end="")
    meta = {"command": command, "started": started.isoformat(timespec="seconds"), "quick": cfg.quick,
            "machine": machine_facts(cfg)}
    progress(f" {time.monotonic() - t0:.1f} s")

    results = ALL_RESULTS  # the sections' runs, also read by report_python_dist
    for bench in (b for b in BENCHMARKS if b in only):
        # scale-out owns its setup (namespaces made and removed around its rounds)
        results[bench] = (run_scaleout(cfg) if bench == SCALE
                          else interleave(cfg, bench, RUNNERS[bench](cfg)))
        if bench == "collectives":
            merge_small_pairs(results[bench])

    limits = physical_limits(results)
    sections, summaries, notes = [], {}, []
    for bench, runs in results.items():
        try:
            md, summaries[bench] = REPORTS[bench](runs, limits, cfg)
        except Exception as e:  # a broken section must not lose the others
            md, summaries[bench] = f"Report section failed: {type(e).__name__}: {e}", {}
            notes.append(f"{bench}: report section failed ({type(e).__name__}: {e})")
        sections.append((bench, md, runs))
    if limits is None and {"handoff", "collectives"} & set(results):
        notes.append("no memcpy limit measured (run with limits or handoff): fraction columns are n/a")
    progress("[report] plots ...", end="")
    t_plots = time.monotonic()
    notes += draw_plots(cfg, results)
    progress(f" {time.monotonic() - t_plots:.1f} s")

    meta["machine"]["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    signal = placement_signal(results)
    if signal:
        meta["machine"]["vCPU placement signal"] = signal
    meta["wall_seconds"] = round(time.monotonic() - t0, 1)
    report = cfg.out / "report.md"
    write_report(cfg, report, meta, sections, notes)
    doc = dict(meta, rounds={b: cfg.rounds(b) for b in results}, limits=limits,
               benchmarks={b: {"runs": results[b], "summary": summaries.get(b)} for b in results})
    (cfg.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    if update_latest(cfg.out):
        progress(f"bench/results/latest -> {cfg.out.name}")
    ours_failed = [f"{b}/{n}" for b, runs in results.items() for n, r in runs.items()
                   if r["ours"] and r["error"]]
    progress(f"done in {meta['wall_seconds'] / 60:.1f} min; report: {report}")
    if ours_failed:
        progress(f"error: torchpar benchmark(s) failed: {', '.join(ours_failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
