#!/usr/bin/python3
"""The `elastic` section of `torchpar bench`: one run of a node's loss and return under an
elastic launcher, `torchpar run --nnodes 1:2` or torchrun (--launcher), on one host (issue 41,
Measure). run_bench.py runs the two launchers interleaved, one run each per round.

The scenario: two "nodes" on this host, two agents on loopback with one rank each, both
running `torchpar train --strategy ddp --model mnist` on Fashion-MNIST (--limit samples an
epoch, 10 epochs: the job is stopped long before) with --checkpoint-every N (rank 0 writes a
checkpoint every N optimizer steps) and the trainer's default --snapshot-every 1 (every step
into the memory `torchpar run` keeps per rank; torchrun keeps none, so its ranks resume from
the newest checkpoint).
  1. Node A starts (its agent hosts the rendezvous store at the endpoint), then node B once
     the endpoint listens. Both train (if B missed round 0, the job grows first).
  2. --kill-after seconds after rank 0 printed its plan for 2 ranks, node B is lost: its agent
     and every process under it are SIGKILLed at once, as a host's crash would (torchrun's
     worker outlives a SIGKILL of its agent alone: nothing ties it to its agent, and it goes
     on training with the survivor).
  3. The survivor, A, starts its rank again alone: (a) is the time from the SIGKILL to rank 0's
     "resumed at epoch E step S from memory|checkpoint" line (the state restored, before the
     first step).
  4. --rejoin-after seconds after that line node B is started again; the job grows: (b) is the
     time from B's start to the grown round's resume line.
  5. Once the grown round has written a checkpoint (it trains on both), both agents get SIGTERM.
Each rank line is timed when the driver reads it: torchpar run forwards its ranks' output
through pipes; torchrun's -t copy of a worker's stdout comes through a file it polls every
0.1 s, so its workers' stdout.log files are read here directly, every 10 ms.
(c), steps lost per failure: the steps complete when node B was killed against the step the
next round resumed at. Complete steps: the survivor's error names its group's collective call
that failed ("all_reduce call #C", numbered over every collective of the group); `torchpar
train` makes 3 before its first step and one all_reduce a step, so C - 4 steps were complete.
Also estimated from time alone (kill_step_estimate): rank 0's checkpoint lines and first-round
progress lines (samples / (batch x world size)) are exact (time, step) points; from the last
one before the kill at the rate since the one before, never past the next checkpoint the
round did not print. It runs a few steps low (the step rate still climbs 2 s into training).

Timeline: a process scan every 0.05 s records when each agent's rank (its child running
`torchpar train`) starts and stops, splitting (a) into detection (SIGKILL to the survivor's
rank stopped), new round (to its new rank started) and the rank's start-up and restore (to its
resume line); (b) alike (the newcomer's agent up and joined, and the survivor's rank stopped;
to the grown round's ranks started; to the resume line).

Launchers (the same settings: monitor interval, last call, join timeout, restarts):
  torchpar  `torchpar run --nnodes 1:2 -n 1 --rdzv-endpoint 127.0.0.1:P --rdzv-id ID
            --max-restarts 2 --rdzv-timeout LAST_CALL --monitor-interval M
            --heartbeat-timeout H -- torchpar train ...`
  torchrun  `/usr/bin/python3 -m torch.distributed.run --nnodes=1:2 --nproc_per_node=1
            --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:P --rdzv_id=ID --max_restarts=2
            --monitor_interval=M --rdzv_conf=last_call_timeout=LAST_CALL,join_timeout=600
            -r 1 -t 1 --log_dir DIR --no_python torchpar train ...`; -r 1 -t 1 because
            Debian's torch 1.13 on Python 3.11 fails with the default redirects before any
            worker starts (Std.from_str("0") is None: iterating an IntFlag skips 0 on 3.11);
            its node keep-alive is fixed at 5 s x 3 attempts (not configurable in 1.13).
Both agents of a run get one fresh TORCHPAR_AUTHKEY in their environment (torchpar run needs
it for a job of several nodes; under torchrun the ranks inherit it).

Every wait is bounded (--timeout bounds the whole run). The agents stay in our process group
(a runner that kills the group on its timeout kills them too). On the way out any process seen
under an agent that is still there is an error (and SIGKILLed), and so is a /dev/shm name a
rank made (torchpar_<pid>_...) that its cleaner had not removed 5 s after the end (removed).
The training output (checkpoints, model) lives in a temporary directory under --work, removed
at the end. Writes the agents' timestamped output and the ranks' start and stop times to
stderr; prints one JSON object (times in seconds, steps; null where not measured):
  launcher, kill_to_resume_s (a), join_to_resume_s (b), kill_step (steps complete at the kill),
  kill_failed_call, kill_step_estimate, kill_last_checkpoint, kill_resumed_step,
  kill_steps_lost (c), kill_source (memory|checkpoint), grow_resumed_step, grow_source,
  detect_s, relaunch_s, rank_start_s, grow_detect_s, grow_relaunch_s, grow_rank_start_s,
  resumes, rounds (rank 0's plans), run_s
and exits 0; or exits 1 with the reason on stderr.

usage: elastic_scenario.py --launcher torchpar|torchrun --torchpar PATH [--work DIR]
       [--limit N] [--checkpoint-every N] [--kill-after S] [--rejoin-after S]
       [--monitor-interval S] [--last-call S] [--heartbeat-timeout S] [--timeout S]
"""
import argparse
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

PY = "/usr/bin/python3"
DATA = "/usr/share/datasets/fashion-mnist"

# rank 0's lines (found anywhere in a line: torchpar run prefixes "[0]: ", torchrun "[default0]:")
RE_PLAN = re.compile(r"torchpar train: ddp, (\d+) ranks? \(RANK/WORLD_SIZE")
RE_RESUME = re.compile(r"resumed at epoch (\d+) step (\d+) from (memory|checkpoint)\b.* in ([\d.]+) s")
RE_CKPT = re.compile(r"checkpoint step (\d+) -> ")
# The survivor's error when its peer died mid-step (torchpar's collectives, under either
# launcher), numbering every collective call of the group. `torchpar train` (ddp, mnist) makes
# 3 before its first step and one all_reduce a step, so when call #C failed, C - 4 steps were
# complete (in the trial runs torchpar's ranks resumed from memory at exactly that step).
RE_FAILED_CALL = re.compile(r"died before finishing all_reduce call #(\d+)")
CALLS_BEFORE_FIRST_STEP = 3
RE_TEE = re.compile(r"^\[default\d+\]:")  # torchrun -t: a worker's stdout, copied late
RE_PROGRESS = re.compile(r"epoch (\d+)/\d+\s+\d+% (\d+)/\d+ samples")


class ScenarioError(Exception):
    """The scenario could not be completed; the message says where."""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port):
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ----------------------------------------------------------------------------------------------
# Processes


def proc_table():
    """{pid: (ppid, starttime, state)} of every process, read from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(name)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def argv_of(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def descendants(table, root):
    children = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


class Node:
    """One agent (a "node"), its output read line by line with the time each line arrived.
    It stays in our process group, so that a runner killing our group on its timeout kills the
    agents (and torchrun's workers, which stay in their agent's group) too."""

    def __init__(self, scenario, name, cmd, env):
        self.scenario, self.name = scenario, name
        self.killed = self.stopping = False
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            # torchrun's copies of its workers' stdout (-t 1) arrive up to 0.1 s late (it
            # polls the log file): the rank's lines are read from that file instead (FileTail)
            self.scenario.add_line(self.name, line, event=not RE_TEE.match(line))
        self.proc.stdout.close()

    def kill_tree(self):
        """SIGKILLs the agent and every process under it, at once (a lost host)."""
        self.killed = True
        victims = [self.proc.pid] + descendants(proc_table(), self.proc.pid)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class FileTail:
    """torchrun's workers' stdout files (-r 1: <log_dir>/<run>/attempt_<k>/<rank>/stdout.log),
    read every 10 ms: each complete line is added with the time it was read."""

    def __init__(self, scenario):
        self.scenario = scenario
        self.files = {}  # path -> [node, offset, partial]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            self.poll()
            self.stop.wait(0.01)
        self.poll()

    def poll(self):
        for node in list(self.scenario.nodes):
            root = os.path.join(self.scenario.work, f"torchrun_logs_{node.name}")
            for path in sorted(glob.glob(os.path.join(root, "*", "attempt_*", "*", "stdout.log"))):
                st = self.files.setdefault(path, [node.name, 0, b""])
                try:
                    with open(path, "rb") as f:
                        if os.fstat(f.fileno()).st_size < st[1]:
                            # a grown round of the same restart count: torchrun truncates the
                            # attempt's file and writes it again
                            st[1], st[2] = 0, b""
                        f.seek(st[1])
                        data = f.read()
                except OSError:
                    continue
                st[1] += len(data)
                *lines, st[2] = (st[2] + data).split(b"\n")
                for line in lines:
                    self.scenario.add_line(st[0], "(stdout.log) " + line.decode(errors="replace"),
                                           event=True)


class Scenario:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.timeout
        self.cond = threading.Condition()
        self.lines = []  # (t, node name, text, event: a line of the ranks' own output)
        self.nodes = []
        self.procs = {}  # every process seen under an agent: {(pid, starttime): record}
        self.scan_stop = threading.Event()
        self.scanner = threading.Thread(target=self._scan, daemon=True)
        self.tail = None
        self.port = free_port()
        self.rdzv_id = f"bench-{os.getpid()}-{secrets.token_hex(4)}"
        self.key = secrets.token_hex(32)
        self.work = tempfile.mkdtemp(prefix="torchpar_elastic_bench.", dir=args.work)
        self.out = os.path.join(self.work, "out")

    # -- output and processes

    def add_line(self, node, text, event):
        with self.cond:
            self.lines.append((time.monotonic(), node, text, event))
            self.cond.notify_all()

    def _scan(self):
        while not self.scan_stop.is_set():
            now = time.monotonic()
            table = proc_table()
            alive = set()
            for node in list(self.nodes):
                for pid in [node.proc.pid] + descendants(table, node.proc.pid):
                    if pid not in table:  # the agent, reaped
                        continue
                    ppid, start, state = table[pid]
                    key = (pid, start)
                    rec = self.procs.get(key)
                    if rec is None:
                        rec = self.procs[key] = {"pid": pid, "node": node.name, "gone": None,
                                                 "rank_since": None}
                    if state != "Z":
                        alive.add(key)
                    # a rank: the agent's child running `torchpar train` (after its exec)
                    if rec["rank_since"] is None and ppid == node.proc.pid:
                        argv = argv_of(pid)
                        if len(argv) > 1 and argv[1] == "train":
                            rec["rank_since"] = now
            for key, rec in self.procs.items():
                if rec["gone"] is None and key not in alive:
                    rec["gone"] = now  # exited (a zombie counts: it runs no more)
            with self.cond:
                self.cond.notify_all()
            self.scan_stop.wait(0.05)

    def ranks(self, node_name):
        return sorted((r for r in self.procs.values()
                       if r["rank_since"] is not None and r["node"] == node_name),
                      key=lambda r: r["rank_since"])

    def wait_for(self, what, pred, timeout):
        """Waits until pred() returns something truthy (under the lock), at most timeout
        seconds and never past the run's deadline; returns it or raises ScenarioError."""
        end = min(time.monotonic() + timeout, self.deadline)
        with self.cond:
            while True:
                got = pred()
                if got:
                    return got
                left = end - time.monotonic()
                if left <= 0:
                    raise ScenarioError(f"timed out waiting for {what}")
                for n in self.nodes:
                    if (n.proc.poll() is not None and n.proc.returncode != 0
                            and not (n.killed or n.stopping)):
                        raise ScenarioError(f"node {n.name}'s agent exited with "
                                            f"{n.proc.returncode} while waiting for {what}")
                self.cond.wait(min(left, 0.2))

    def find(self, regex, after, world=None):
        """The first (t, node, match) of a rank's line matching regex that arrived after
        `after` (a plan line: for `world` ranks)."""
        for t, node, text, event in self.lines:
            if t > after and event:
                m = regex.search(text)
                if m and (world is None or int(m.group(1)) == world):
                    return t, node, m
        return None

    # -- the launchers

    def train_args(self):
        a = self.args
        return [a.torchpar, "train", "--strategy", "ddp", "--model", "mnist", "--epochs", "10",
                "--limit", str(a.limit), "--batch-size", str(a.batch_size), "--seed", "1",
                "--data", DATA, "--timeout", "60", "--no-plot", "--out", self.out,
                "--checkpoint-every", str(a.checkpoint_every)]

    def agent_cmd(self, name):
        a = self.args
        if a.launcher == "torchpar":
            return [a.torchpar, "run", "--nnodes", "1:2", "-n", "1",
                    "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.rdzv_id,
                    "--max-restarts", "2", "--rdzv-timeout", str(a.last_call),
                    "--monitor-interval", f"{a.monitor_interval:g}",
                    "--heartbeat-timeout", f"{a.heartbeat_timeout:g}", "--"] + self.train_args()
        logs = os.path.join(self.work, f"torchrun_logs_{name}")
        return [PY, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{self.port}",
                f"--rdzv_id={self.rdzv_id}", "--max_restarts=2",
                f"--monitor_interval={a.monitor_interval:g}",
                f"--rdzv_conf=last_call_timeout={a.last_call},join_timeout=600",
                "-r", "1", "-t", "1", "--log_dir", logs, "--no_python"] + self.train_args()

    def start(self, name):
        env = dict(os.environ, TORCHPAR_AUTHKEY=self.key, PYTHONDONTWRITEBYTECODE="1",
                   PYTHONUNBUFFERED="1")
        node = Node(self, name, [str(c) for c in self.agent_cmd(name)], env)
        with self.cond:
            self.nodes.append(node)
        return node

    # -- the scenario

    def run(self):
        a = self.args
        self.scanner.start()
        if a.launcher == "torchrun":
            self.tail = FileTail(self)
        node_a = self.start("A")
        self.wait_for("node A's rendezvous endpoint to listen", lambda: listening(self.port), 60)
        node_b = self.start("B0")
        # Node B may miss round 0 (its agent started after the last call): the job then grows.
        t_plan = self.wait_for("rank 0's plan for 2 ranks",
                               lambda: self.find(RE_PLAN, self.t0, world=2), 120)[0]
        self.wait_for("training on both nodes",
                      lambda: self.find(RE_CKPT, t_plan) or self.find(RE_PROGRESS, t_plan), 60)
        kill_at = t_plan + a.kill_after
        self.wait_for("the moment to kill node B", lambda: time.monotonic() >= kill_at, 60)
        t_kill = time.monotonic()
        node_b.kill_tree()
        try:
            node_b.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            raise ScenarioError("node B's agent did not die within 10 s of SIGKILL") from None
        resume1 = self.wait_for("the survivor's resume line",
                                lambda: self.find(RE_RESUME, t_kill), 120)
        rejoin_at = resume1[0] + a.rejoin_after
        self.wait_for("the moment to restart node B", lambda: time.monotonic() >= rejoin_at, 60)
        t_rejoin = time.monotonic()
        node_b2 = self.start("B1")
        plan2 = self.wait_for("rank 0's plan for 2 ranks after node B came back",
                              lambda: self.find(RE_PLAN, t_rejoin, world=2), 120)
        resume2 = self.wait_for("the grown round's resume line",
                                lambda: self.find(RE_RESUME, plan2[0]), 60)
        # Training on both: the grown round's next checkpoint. Then the job is stopped (SIGTERM
        # to both agents, as a user's Ctrl-C would): its end measures nothing.
        self.wait_for("a checkpoint of the grown round", lambda: self.find(RE_CKPT, resume2[0]), 60)
        for n in (node_a, node_b2):
            n.stopping = True
            n.proc.send_signal(signal.SIGTERM)
        for n in (node_a, node_b2):
            self.wait_for(f"node {n.name}'s agent to stop after SIGTERM",
                          lambda n=n: n.proc.poll() is not None, 30)
        with self.cond:
            return self.results(t_kill, resume1, t_rejoin, resume2)

    # -- results

    def rounds(self):
        """Rank 0's rounds, each from a plan line on: {"t", "node", "world", "points": [(t,
        step)] exact steps (checkpoint lines; in the first round progress lines too), "ckpts"}."""
        rounds = []
        for t, node, text, event in self.lines:
            if not event:
                continue
            m = RE_PLAN.search(text)
            if m:
                rounds.append({"t": t, "node": node, "world": int(m.group(1)), "points": [],
                               "ckpts": [], "resumed": False})
                continue
            if not rounds or node != rounds[-1]["node"]:
                continue
            r = rounds[-1]
            if (m := RE_RESUME.search(text)):
                r["resumed"] = True
                r["points"].append((t, int(m.group(2))))
            elif (m := RE_CKPT.search(text)):
                r["ckpts"].append(int(m.group(1)))
                r["points"].append((t, int(m.group(1))))
            elif (m := RE_PROGRESS.search(text)) and not r["resumed"] and int(m.group(1)) == 1:
                # a round that did not resume starts at step 0 of epoch 1
                r["points"].append((t, int(m.group(2)) / (self.args.batch_size * r["world"])))
        return rounds

    def step_at_kill(self, rnd, t):
        """The step the round was at when its peer was SIGKILLed at t (see the docstring):
        the round could not step past it, so every checkpoint it printed, even after t, was
        written before; it never reached the next one it did not print."""
        pts = sorted(p for p in rnd["points"] if p[0] <= t)
        if not pts:
            return None
        t2, s2 = pts[-1]
        # the rate since the previous point at least 0.1 s older (a checkpoint line and a
        # progress line often arrive together)
        t1, s1 = next((p for p in reversed(pts) if p[0] <= t2 - 0.1), pts[-1])
        rate = (s2 - s1) / (t2 - t1) if t2 > t1 else 0.0
        est = s2 + rate * (t - t2)
        n = self.args.checkpoint_every
        done = max(rnd["ckpts"], default=0)
        return min(max(est, done), (done // n + 1) * n - 1)

    def results(self, t_kill, resume1, t_rejoin, resume2):
        rounds = self.rounds()
        r_kill = [r for r in rounds if r["t"] < t_kill][-1]
        kill_estimate = self.step_at_kill(r_kill, t_kill)
        failed = next((int(m.group(1)) for t, _, text, _ in self.lines
                       if t > t_kill and t < resume1[0] for m in [RE_FAILED_CALL.search(text)] if m),
                      None)
        kill_step = kill_estimate if failed is None else failed - CALLS_BEFORE_FIRST_STEP - 1
        last_ckpt = max(r_kill["ckpts"], default=None)
        # Node A's ranks: the one running at each event and the one that followed it.
        a_ranks = self.ranks("A")

        def running_at(t):
            now = [r for r in a_ranks if r["rank_since"] <= t and (r["gone"] or 1e18) > t]
            return now[-1] if now else None

        def next_after(rec):
            return next((r for r in a_ranks if rec and rec["gone"]
                         and r["rank_since"] > rec["gone"]), None)

        old, solo = running_at(t_kill), running_at(t_rejoin)
        new, grown = next_after(old), next_after(solo)
        t_r1, s_r1, src1 = resume1[0], int(resume1[2].group(2)), resume1[2].group(3)
        t_r2, s_r2, src2 = resume2[0], int(resume2[2].group(2)), resume2[2].group(3)
        d = lambda a, b: None if a is None or b is None else round(b - a, 3)
        get = lambda rec, k: rec[k] if rec else None
        return {
            "launcher": self.args.launcher,
            "kill_to_resume_s": d(t_kill, t_r1),
            "join_to_resume_s": d(t_rejoin, t_r2),
            "kill_step": None if kill_step is None else round(kill_step, 1),
            "kill_failed_call": failed,
            "kill_step_estimate": None if kill_estimate is None else round(kill_estimate, 1),
            "kill_last_checkpoint": last_ckpt,
            "kill_resumed_step": s_r1,
            "kill_steps_lost": None if kill_step is None else round(max(0.0, kill_step - s_r1), 1),
            "kill_source": src1,
            "grow_resumed_step": s_r2, "grow_source": src2,
            "detect_s": d(t_kill, get(old, "gone")),
            "relaunch_s": d(get(old, "gone"), get(new, "rank_since")),
            "rank_start_s": d(get(new, "rank_since"), t_r1),
            "grow_detect_s": d(t_rejoin, get(solo, "gone")),
            "grow_relaunch_s": d(get(solo, "gone"), get(grown, "rank_since")),
            "grow_rank_start_s": d(get(grown, "rank_since"), t_r2),
            "resumes": sum(1 for r in rounds if r["resumed"]),
            "rounds": len(rounds),
            "run_s": d(self.t0, time.monotonic()),
        }

    # -- the way out

    def close(self):
        """Kills whatever is left, checks that nothing stays; returns a list of problems."""
        problems = []
        for n in self.nodes:
            if n.proc.poll() is None:
                problems.append(f"node {n.name}'s agent still ran at the end: killed")
                n.kill_tree()
            try:
                n.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                problems.append(f"node {n.name}'s agent did not die within 10 s of SIGKILL")
        time.sleep(0.15)  # the scanner sees the last exits
        self.scan_stop.set()
        if self.scanner.is_alive():
            self.scanner.join(timeout=5)
        if self.tail:
            self.tail.stop.set()
            self.tail.thread.join(timeout=5)
        for n in self.nodes:
            n.reader.join(timeout=5)
        left = self.leftovers()
        end = time.monotonic() + 5
        while left and time.monotonic() < end:  # a stopped rank's children may take a moment
            time.sleep(0.1)
            left = self.leftovers()
        for rec in left:
            problems.append(f"process {rec['pid']} ({' '.join(argv_of(rec['pid']))[:80]}) of "
                            f"node {rec['node']} outlived the run: killed")
            try:
                os.kill(rec["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        pids = {str(rec["pid"]) for rec in self.procs.values()}
        end = time.monotonic() + 5
        while True:  # the shm cleaners unlink a dead rank's names
            names = sorted(n for n in os.listdir("/dev/shm")
                           if n.startswith("torchpar_") and n.split("_")[1] in pids)
            if not names or time.monotonic() > end:
                break
            time.sleep(0.1)
        for name in names:
            problems.append(f"/dev/shm/{name} outlived its rank: removed")
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass
        shutil.rmtree(self.work, ignore_errors=True)
        return problems

    def leftovers(self):
        table = proc_table()
        return [rec for (pid, start), rec in self.procs.items()
                if pid in table and table[pid][1] == start and table[pid][2] != "Z"]

    def dump(self, stream):
        for t, node, text, _ in self.lines:
            print(f"{t - self.t0:8.3f} {node:>2} {text}", file=stream)
        for rec in sorted((r for r in self.procs.values() if r["rank_since"] is not None),
                          key=lambda r: r["rank_since"]):
            gone = "-" if rec["gone"] is None else f"{rec['gone'] - self.t0:.3f}"
            print(f"rank process {rec['pid']} of node {rec['node']}: exec seen at "
                  f"{rec['rank_since'] - self.t0:.3f}, gone at {gone}", file=stream)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launcher", choices=("torchpar", "torchrun"), required=True)
    ap.add_argument("--torchpar", required=True, help="the torchpar program")
    ap.add_argument("--work", default=None, help="parent of the temporary training directory")
    ap.add_argument("--limit", type=int, default=60000,
                    help="training samples per epoch (10 epochs: the job is stopped long before)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    ap.add_argument("--kill-after", type=float, default=3.0,
                    help="seconds after rank 0's plan for 2 ranks when node B is killed")
    ap.add_argument("--rejoin-after", type=float, default=2.0,
                    help="seconds after the survivor resumed when node B starts again")
    ap.add_argument("--monitor-interval", type=float, default=0.5)
    ap.add_argument("--last-call", type=int, default=5,  # torchrun takes whole seconds
                    help="seconds a round stays open once MIN nodes joined")
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0,
                    help="torchpar run's node heartbeat timeout (torchrun's is 15 s, fixed)")
    ap.add_argument("--timeout", type=float, default=240, help="bound on the whole run (s)")
    args = ap.parse_args()
    for d in (DATA,):
        if not os.path.isdir(d):
            print(f"elastic_scenario: {d} not found (Fashion-MNIST)", file=sys.stderr)
            return 1
    sc = Scenario(args)
    result, error = None, None
    try:
        result = sc.run()
    except ScenarioError as e:
        error = str(e)
    except BaseException as e:  # Ctrl-C or a bug: leave nothing behind
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        problems = sc.close()
        sc.dump(sys.stderr)
        for p in problems:
            print(f"elastic_scenario: {p}", file=sys.stderr)
    if error or problems:
        print(f"elastic_scenario ({args.launcher}): {error or problems[0]}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
