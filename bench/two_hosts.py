#!/usr/bin/python3
"""Two "hosts" on one machine for run_bench.py's scale-out section: two network namespaces
joined by a veth pair (as tests/integration/two_host_test.sh makes them), the link shaped
with tc or not, and a launcher that starts one `torchpar run` per namespace.

usage:
  two_hosts.py check [--seconds S]
      creates two hosts, measures the link (TCP round trip and throughput) unshaped and
      shaped, prints one JSON object, removes everything; a check of this plumbing
  two_hosts.py launch --ns A,B --master-addr IP --torchpar PATH [-n 2] [--timeout S]
                      -- PROGRAM [ARGS...]
      node k runs `torchpar run --nnodes 2 --node-rank k ... -- PROGRAM ARGS` in namespace k,
      both with one fresh TORCHPAR_AUTHKEY in their environment (never on a command line);
      prints rank 0's stdout lines (the "[0]: " prefix removed) on stdout and every other
      line on stderr (prefixed "[node k] "); exits 0 when both nodes exit 0, else 1 after
      stopping the other node, with the reason on the last line of stderr

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2's `ip` and `tc`. Every command is
an argv list. A TwoHosts removes its namespaces (and with them the veth pair and whatever
qdisc was on it) and stops processes still inside them in close(), which its `with` block
calls on every path, exceptions and Ctrl-C included.
"""
import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

PY = "/usr/bin/python3"
SUBNET = "10.213.9"  # inside the two namespaces only: no clash with the machine's routes
# netem is what the issue asks for (1 Gbit/s and 0.2 ms each way); kernels without sch_netem
# get tbf at the same rate and no delay. tbf: burst 128 KiB holds two 64 KiB GSO packets, so
# the bucket never drops a TSO burst; latency 50 ms bounds the queue (6 MB at 1 Gbit/s).
NETEM = ["netem", "delay", "0.2ms", "rate", "1gbit"]
TBF = ["tbf", "rate", "1gbit", "burst", "128kb", "latency", "50ms"]


class HostsError(Exception):
    """Setting up or using the namespaces failed; the message is a one-line reason."""


def run(cmd, timeout=20, check=True):
    """Runs a short command (argv list); returns its CompletedProcess. check: raise HostsError
    with the command and its stderr when it fails or outlives timeout."""
    cmd = [str(c) for c in cmd]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostsError(f"{' '.join(cmd)}: {e}") from None
    if check and p.returncode != 0:
        raise HostsError(f"{' '.join(cmd)}: {(p.stderr or p.stdout).strip() or p.returncode}")
    return p


def unavailable():
    """Why two hosts cannot be made here (None when they may be)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc); run `sudo torchpar bench --only scale-out`"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"`{tool}` not found (iproute2)"
    return None


class TwoHosts:
    """Namespaces ns[0], ns[1], veth ends dev[0] (in ns[0], addr[0]) and dev[1] (in ns[1],
    addr[1]). Names carry this process' pid and a random tag, so parallel runs do not meet.

    Lifetime: open() creates everything (and removes what it made if a step fails);
    close() removes the namespaces, the veth pair and processes left inside. Use it as a
    context manager."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.ns = [f"tp_scaleout_{tag}_a", f"tp_scaleout_{tag}_b"]
        self.dev = [f"tpso{tag}a", f"tpso{tag}b"]  # at most 15 characters (IFNAMSIZ)
        self.addr = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.shaping = None  # the qdisc on both ends: None, "netem ..." or "tbf ..."
        self._made = []

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def open(self):
        try:
            for ns in self.ns:
                run(["ip", "netns", "add", ns])
                self._made.append(ns)
            run(["ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1]])
            self._made.append("veth")
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                run(["ip", "link", "set", dev, "netns", ns])
                run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
                run(["ip", "-n", ns, "link", "set", "lo", "up"])
                run(["ip", "-n", ns, "link", "set", dev, "up"])
        except BaseException:
            self.close()
            raise

    def close(self):
        """Removes everything open() made; never raises (leftovers are reported on stderr)."""
        for ns in self.ns:
            if ns not in self._made:
                continue
            pids = run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:  # our own jobs' processes, left by a timeout or a crash
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            p = run(["ip", "netns", "del", ns], check=False)
            if p.returncode != 0:
                print(f"two_hosts: cannot remove namespace {ns}: {p.stderr.strip()}",
                      file=sys.stderr)
        if "veth" in self._made:  # gone with its namespace, unless it never got there
            if run(["ip", "link", "show", self.dev[0]], check=False).returncode == 0:
                run(["ip", "link", "del", self.dev[0]], check=False)
        self._made.clear()

    def exec_argv(self, k, cmd):
        """argv running cmd in namespace k."""
        return ["ip", "netns", "exec", self.ns[k]] + [str(c) for c in cmd]

    def unshape(self):
        for ns, dev in zip(self.ns, self.dev):
            run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        self.shaping = None

    def shape(self):
        """Shapes both ends: netem (1 Gbit/s, 0.2 ms) if the kernel has it, else tbf (1 Gbit/s,
        no delay). Returns (qdisc description, note or None); HostsError if neither works."""
        self.unshape()
        try:
            self._add_qdisc(NETEM)
            self.shaping = " ".join(NETEM)
            return self.shaping, None
        except HostsError as e:
            self.unshape()
            why = str(e).rsplit(": ", 1)[-1].rstrip(".")
        try:
            self._add_qdisc(TBF)
        except HostsError:
            self.unshape()  # neither end keeps half a setup
            raise
        self.shaping = " ".join(TBF)
        if "unknown" in why:  # tc's "Specified qdisc kind is unknown"
            why += ": this kernel has no sch_netem"
        return self.shaping, (f"netem refused ({why}): the link is rate-limited with tbf at "
                              "1 Gbit/s, the 0.2 ms delay is not applied")

    def _add_qdisc(self, qdisc):
        for ns, dev in zip(self.ns, self.dev):
            run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root"] + qdisc)

    def tx_bytes(self):
        """Bytes sent so far on both veth ends together (frames: payload plus headers)."""
        total = 0
        for ns, dev in zip(self.ns, self.dev):
            out = run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev]).stdout
            try:
                total += json.loads(out)[0]["stats64"]["tx"]["bytes"]
            except (ValueError, LookupError) as e:
                raise HostsError(f"cannot read {dev}'s counters: {e}") from None
        return total

    def measure(self, seconds=1.0):
        """TCP from ns[0] to ns[1]: {'rtt_us': median 1-byte round trip, 'Gbps': one stream's
        throughput over `seconds`}."""
        sink = subprocess.Popen(self.exec_argv(1, [PY, __file__, "_sink", self.addr[1]]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        watchdog = threading.Timer(seconds + 40, sink.kill)  # a stuck sink ends the reads below
        watchdog.start()
        try:
            ready = sink.stdout.readline().split()  # "ready PORT"
            if ready[:1] != ["ready"]:
                raise HostsError(f"link check: the sink did not start: {sink.stderr.read().strip()}")
            port = int(ready[1])
            src = run(self.exec_argv(0, [PY, __file__, "_source", self.addr[1], port, seconds]),
                      timeout=seconds + 30)
            try:
                return json.loads(src.stdout)
            except ValueError:
                raise HostsError(f"link check: unexpected output {src.stdout[:200]!r}") from None
        finally:
            watchdog.cancel()
            sink.kill()
            sink.wait()


# ----------------------------------------------------------------------------------------------
# the link check's two ends (one connection for round trips, one for throughput)


def sink_main(addr):
    srv = socket.create_server((addr, 0))
    print("ready", srv.getsockname()[1], flush=True)
    srv.settimeout(60)
    for _ in range(2):
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mode = conn.recv(1)
            if mode == b"p":  # echo single bytes until EOF
                while (b := conn.recv(1)):
                    conn.sendall(b)
            else:  # count until EOF, answer the count
                n = 0
                while (chunk := conn.recv(1 << 20)):
                    n += len(chunk)
                conn.sendall(str(n).encode())


def source_main(addr, port, seconds):
    seconds = float(seconds)
    with socket.create_connection((addr, int(port)), timeout=30) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(b"p")
        rtts = []
        for _ in range(200):
            t0 = time.perf_counter()
            c.sendall(b"x")
            c.recv(1)
            rtts.append((time.perf_counter() - t0) * 1e6)
    with socket.create_connection((addr, int(port)), timeout=30) as c:
        c.sendall(b"s")
        buf = b"\0" * (1 << 20)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            c.sendall(buf)
        c.shutdown(socket.SHUT_WR)
        n = int(c.recv(64))  # arrives once the sink read everything
        dt = time.perf_counter() - t0
    print(json.dumps({"rtt_us": round(statistics.median(rtts), 1), "Gbps": round(n * 8 / dt / 1e9, 3)}))


def check_main(seconds):
    why = unavailable()
    if why:
        print(f"two_hosts check: skipped: {why}")
        return 0
    with TwoHosts() as h:
        res = {"unshaped": h.measure(seconds)}
        qdisc, note = h.shape()
        res["shaped"] = dict(h.measure(seconds), qdisc=qdisc, note=note)
    print(json.dumps(res))
    return 0


# ----------------------------------------------------------------------------------------------
# launch: one `torchpar run` per namespace


def free_port_in(ns, addr):
    """A TCP port free on addr inside namespace ns a moment ago."""
    code = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 0)); "
            "print(s.getsockname()[1])")
    return int(run(["ip", "netns", "exec", ns, PY, "-c", code, addr]).stdout)


def launch_main(args):
    namespaces = args.ns.split(",")
    env = dict(os.environ, TORCHPAR_AUTHKEY=secrets.token_hex(32))
    port = args.master_port or free_port_in(namespaces[0], args.master_addr)
    procs, pumps = [], []
    lock = threading.Lock()
    last_said = {}  # node -> the last stderr line of one of its ranks (the likely cause)

    def pump(stream, k, to_stdout):
        for line in stream:
            with lock:
                if to_stdout and line.startswith("[0]: "):
                    sys.stdout.write(line[5:])
                    sys.stdout.flush()
                    continue
                sys.stderr.write(f"[node {k}] {line}")
                sys.stderr.flush()
                if not to_stdout and line.startswith("[") and line.strip():
                    last_said[k] = line.strip()

    failure, failed_node = None, None
    try:
        for k, ns in enumerate(namespaces):
            cmd = ["ip", "netns", "exec", ns, args.torchpar, "run", "--nnodes", len(namespaces),
                   "--node-rank", k, "--master-addr", args.master_addr, "--master-port", port,
                   "-n", args.nproc_per_node, "--"] + args.program
            p = subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            procs.append(p)
            for stream, out in ((p.stdout, k == 0), (p.stderr, False)):
                t = threading.Thread(target=pump, args=(stream, k, out), daemon=True)
                t.start()
                pumps.append(t)
        deadline = time.monotonic() + args.timeout
        term_at = kill_at = None  # once a node failed or time is up: stop the others
        while None in [p.poll() for p in procs]:  # a list, so every node is polled
            now = time.monotonic()
            if failure is None:
                failed = [k for k, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed:
                    failed_node = k = failed[0]
                    failure = f"node {k} ({namespaces[k]}) exited with {procs[k].returncode}"
                    term_at = now + 10  # the other node's ranks notice the lost peer by then
                elif now > deadline:
                    failure = f"timed out after {args.timeout:g} s"
                    term_at = now
            if term_at is not None and now >= term_at:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()  # torchpar run forwards it to its ranks
                term_at, kill_at = None, now + 5
            if kill_at is not None and now >= kill_at:
                for p in procs:
                    if p.poll() is None:
                        p.kill()  # torchpar run's job group ends its ranks then
                kill_at = None
            time.sleep(0.05)
    finally:
        for p in procs:  # Ctrl-C or an error here: leave nothing running
            if p.poll() is None:
                p.kill()
            p.wait()
        for t in pumps:
            t.join(timeout=5)
    if failure is None:
        bad = [k for k, p in enumerate(procs) if p.returncode != 0]
        if bad:
            failed_node = k = bad[0]
            failure = f"node {k} ({namespaces[k]}) exited with {procs[k].returncode}"
    if failure:
        said = last_said.get(failed_node if failed_node is not None else 0)
        print(f"two_hosts launch: {failure}"
              + (f"; its ranks last said: {said[:240]}" if said else ""), file=sys.stderr)
        return 1
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_sink":
        return sink_main(sys.argv[2])
    if len(sys.argv) > 1 and sys.argv[1] == "_source":
        return source_main(*sys.argv[2:5])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("check", help="measure the link unshaped and shaped, then clean up")
    c.add_argument("--seconds", type=float, default=2.0)
    la = sub.add_parser("launch", help="one `torchpar run` per namespace")
    la.add_argument("--ns", required=True, help="namespaces, comma-separated, node 0 first")
    la.add_argument("--master-addr", required=True, help="node 0's address (in its namespace)")
    la.add_argument("--master-port", type=int, default=0, help="default: a free port there")
    la.add_argument("--torchpar", required=True, help="the torchpar program")
    la.add_argument("-n", "--nproc-per-node", type=int, default=2)
    la.add_argument("--timeout", type=float, default=600, help="seconds for the whole job")
    la.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")
    args = ap.parse_args()
    if args.what == "check":
        return check_main(args.seconds)
    if args.program[:1] == ["--"]:
        args.program = args.program[1:]
    if not args.program:
        ap.error("launch: give the program after --")
    return launch_main(args)


if __name__ == "__main__":
    sys.exit(main())
