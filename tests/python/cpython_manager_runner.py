#!/usr/bin/python3
"""Runs CPython's own manager tests against an external manager server.

CPython's `test/_test_multiprocessing.py` (Debian package libpython3.11-testsuite)
writes its manager tests against `multiprocessing.Manager()`, a server process each
test class starts. This runner starts one server outside the tests, either

    Python's own SyncManager server, `SyncManager(address, authkey).get_server()
    .serve_forever()` in a separate /usr/bin/python3 process     (--impl python)
    `torchpar manager --address A --authkey-file F`             (--impl torchpar)

and makes the tests' manager a `SyncManager(address, authkey)` that `connect()`s
to it (`cpython_manager_suite.py`, next to this file, does the binding; it copies
no test). Both implementations go through the identical test code path. It
reports passed / failed / errors / skipped per group and in total, with a
one-line reason per failing test, and the objects each class left on the server.
It is a report: it exits 0 even when tests fail, 2 when the server cannot be
started, 1 when the runner itself breaks.

Usage (from the repository root):

    /usr/bin/python3 tests/python/cpython_manager_runner.py --impl python
    /usr/bin/python3 tests/python/cpython_manager_runner.py --impl torchpar \\
        --torchpar-bin build/bin/torchpar --json /tmp/mgr.json -v -k test_dict

Groups and the CPython classes they run (`_TestX` becomes `WithManagerTestX`):

    queues      _TestQueue          (Queue, JoinableQueue)
    locks       _TestLock           (Lock, RLock)
    semaphores  _TestSemaphore      (Semaphore, BoundedSemaphore)
    conditions  _TestCondition
    events      _TestEvent
    barriers    _TestBarrier
    containers  _TestContainers     (list, dict, Namespace, proxies in containers)
    synctypes   TestSyncManagerTypes (every type shared with a child process)

Left out: `_TestMyManager`, `_TestRemoteManager`, `_TestManagerRestart` (they start
managers of their own, with their own registered types) and the Pool classes
(a pool lives in the server process). Tests of the chosen classes that need a
manager the test starts itself are skipped with a reason
(`cpython_manager_suite.SKIPS`).

The server: one per group, started by this runner before the group's worker, on
--address (default 127.0.0.1:0: any free port; a path gives AF_UNIX) with a fresh
random key in a 0600 file, and stopped with SIGTERM after the group (its exit
status is reported when it is not 0). Before each test the worker checks that the
server still runs; a server that died is reported against the test it died in,
and a new one is started for the rest of the group.

Bounds (as cpython_mp_runner.py): each group runs in a worker process (this script
with --worker) in its own session; a test past --timeout gets a TestTimeout
exception and its children are killed; one that cannot be interrupted is ended
--grace seconds later by faulthandler; the runner records it as an error, kills
what the worker left, and starts a new worker for the rest of the group.
"""

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.dont_write_bytecode = True  # no __pycache__ in tests/python from either module

import cpython_mp_runner as mp_runner  # noqa: E402  (beside this file)

ADDRESS_ENV = "TORCHPAR_CPYTHON_MANAGER_ADDRESS"
AUTHKEY_ENV = "TORCHPAR_CPYTHON_MANAGER_AUTHKEY"
START_METHOD_ENV = "TORCHPAR_CPYTHON_MANAGER_START_METHOD"
SERVER_PID_ENV = "TORCHPAR_CPYTHON_MANAGER_SERVER_PID"
SUITE_MODULE = "cpython_manager_suite"

GROUPS = {
    "queues": ["WithManagerTestQueue"],
    "locks": ["WithManagerTestLock"],
    "semaphores": ["WithManagerTestSemaphore"],
    "conditions": ["WithManagerTestCondition"],
    "events": ["WithManagerTestEvent"],
    "barriers": ["WithManagerTestBarrier"],
    "containers": ["WithManagerTestContainers"],
    "synctypes": ["TestSyncManagerTypes"],
}
ALIASES = {
    "queue": "queues", "lock": "locks", "rlocks": "locks", "semaphore": "semaphores",
    "condition": "conditions", "event": "events", "barrier": "barriers",
    "container": "containers", "list": "containers", "dict": "containers",
    "types": "synctypes", "syncmanagertypes": "synctypes",
}
OUTCOMES = mp_runner.OUTCOMES
LISTENING = ": listening on "  # `torchpar manager: listening on <address>`
SERVER_START_S = 30.0
SERVER_STOP_S = 10.0
MAX_SERVER_RESTARTS = 5


# --------------------------------------------------------------------------- servers

def serve_python(address, authkey_file):
    """The --impl python server: Python's SyncManager server in this process, in the
    foreground, printing the same line as `torchpar manager`; SIGTERM ends it (0)."""
    from multiprocessing.managers import SyncManager

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpython_manager_suite import parse_address

    with open(authkey_file, "rb") as f:
        authkey = f.read().rstrip(b"\n")
    # As in a manager process SyncManager.start() makes: proxies the server unpickles
    # (a Barrier's action holding a list proxy) authenticate with the server's key.
    import multiprocessing
    multiprocessing.current_process().authkey = authkey
    server = SyncManager(address=parse_address(address), authkey=authkey).get_server()
    real = server.address
    shown = f"{real[0]}:{real[1]}" if isinstance(real, tuple) else real
    print(f"python manager{LISTENING}{shown}", flush=True)

    def on_term(signum, frame):
        raise SystemExit(0)  # serve_forever() turns SystemExit into sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    server.serve_forever()
    return 0


class Server:
    """One manager server process of --impl, started in its own session."""

    def __init__(self, args, workdir, index):
        self.args = args
        # Random bytes, but never a trailing CR or LF: `torchpar manager --authkey-file` drops
        # those (a key file written by echo), so 1 key in 128 would differ.
        self.authkey = secrets.token_bytes(31) + b"."
        self.key_path = os.path.join(workdir, f"authkey.{index}")
        fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.authkey)
        address = args.address
        if address == "unix":
            address = os.path.join(workdir, f"manager.{index}.sock")
        if args.impl == "python":
            cmd = [sys.executable, os.path.abspath(__file__), "--serve-python",
                   "--address", address, "--authkey-file", self.key_path]
        else:
            cmd = [args.torchpar_bin, "manager", "--address", address,
                   "--authkey-file", self.key_path]
        self.log_path = os.path.join(workdir, f"server.{index}.log")
        self.cmd = cmd
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.address = self._read_address()
        self.exit_status = None

    def _read_address(self):
        import selectors
        deadline = time.monotonic() + SERVER_START_S
        line = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.stop()
                    raise RuntimeError(f"{' '.join(self.cmd)}: no 'listening on' line "
                                       f"within {SERVER_START_S:g} s")
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    self.stop()
                    raise RuntimeError(f"{' '.join(self.cmd)} exited with status "
                                       f"{self.proc.returncode} before listening: "
                                       f"{self.log_tail().strip()[-400:]}")
                line += chunk
        text = line.decode(errors="replace").strip()
        if LISTENING not in text:
            self.stop()
            raise RuntimeError(f"unexpected first line from the server: {text!r}")
        return text.split(LISTENING, 1)[1].strip()

    def alive(self):
        return self.proc.poll() is None

    def log_tail(self, lines=20):
        if not self.log.closed:
            self.log.flush()
        return mp_runner._log_tail(self.log_path, lines)

    def stop(self):
        """SIGTERM, then SIGKILL after SERVER_STOP_S; returns the exit status."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(SERVER_STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                self.exit_status = "did not exit within %g s of SIGTERM (killed)" % SERVER_STOP_S
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything it left in its session
        except ProcessLookupError:
            pass
        self.proc.stdout.close()
        self.log.close()
        if self.exit_status is None:
            self.exit_status = self.proc.returncode
        return self.exit_status


# --------------------------------------------------------------------------- worker

def _server_dead(pid):
    """True when the server (the runner's child, a zombie once dead) no longer runs."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def _reason_line(err):
    """One line for a failing test; for a RemoteError (the server's traceback between two
    rules of dashes) the server's last line, the exception it raised."""
    exc_type, value, _ = err
    if exc_type.__name__ == "RemoteError":
        # torchpar's text has no newline before the closing rule: strip it off the line.
        lines = [l.strip().rstrip("-") for l in str(value).splitlines()
                 if l.strip() and l.strip().strip("-")]
        if lines:
            line = f"RemoteError: {lines[-1]}"
            return line if len(line) <= 240 else line[:237] + "..."
    return mp_runner._one_line(err)


class _ManagerResult(mp_runner._EventResult):
    """The existing runner's event result, plus: after each test, the server must still
    run; when it does not, the event names the test and the run stops (the suite checks
    shouldStop before the next test), so the runner can start a new server."""

    def __init__(self, *args, server_pid, **kwargs):
        super().__init__(*args, **kwargs)
        self._server_pid = server_pid

    def addError(self, test, err):
        self._verbose_traceback(test, err)
        self._record(test, "errors", _reason_line(err))

    def addFailure(self, test, err):
        self._verbose_traceback(test, err)
        self._record(test, "failed", _reason_line(err))

    def _verbose_traceback(self, test, err):
        if self._verbose:
            import traceback
            text = "".join(traceback.format_exception(*err))
            print(f"{test.id()}:\n{text}", file=sys.__stderr__, flush=True)

    def stopTest(self, test):
        test_id = self._current
        super().stopTest(test)
        if self._server_pid and _server_dead(self._server_pid):
            self.emit(event="server_dead", after=test_id)
            self.stop()


def run_worker(args):
    """Runs one group's tests in this process, writing events to args.events."""
    import faulthandler

    suite_module = __import__(SUITE_MODULE)
    with open(args.exclude, encoding="utf-8") as f:
        excluded = set(json.load(f))
    server_pid = int(os.environ.get(SERVER_PID_ENV, "0"))
    with open(args.events, "a", encoding="utf-8") as events:
        result = _ManagerResult(events, args.timeout, args.grace, args.verbose,
                                server_pid=server_pid)
        loader = unittest.TestLoader()
        if args.k:
            loader.testNamePatterns = [p if "*" in p else f"*{p}*" for p in args.k]
        tests = unittest.TestSuite()
        for class_name in GROUPS[args.worker]:
            for test in loader.loadTestsFromTestCase(getattr(suite_module, class_name)):
                if test.id() not in excluded:
                    tests.addTest(test)
        faulthandler.enable()
        signal.signal(signal.SIGALRM, result.on_alarm)
        result._disarm()  # arms the hard bound for setUpModule / setUpClass
        tests.run(result)
        faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        for entry in suite_module.OBJECTS_LEFT:
            result.emit(event="objects_left", **entry)
        result.emit(event="done")
    return 0


# --------------------------------------------------------------------------- runner

def _start_server(args, workdir, index):
    try:
        return Server(args, workdir, index), None
    except (OSError, RuntimeError) as e:
        return None, f"cannot start the server: {e}"


def run_group(group, args, workdir, state):
    """Runs one group in workers (and servers) until all its tests have reported."""
    records, order, notes = {}, [], []
    log_path = os.path.join(workdir, f"{group}.log")
    server, why = _start_server(args, workdir, f"{group}.0")
    if server is None:
        test_id = f"{group} (server)"
        return [{"id": test_id, "outcome": "errors", "reason": why, "seconds": 0.0}], [why]
    state["address"] = server.address
    servers_started = 1
    try:
        for attempt in range(mp_runner.MAX_WORKER_RESTARTS + MAX_SERVER_RESTARTS + 1):
            events_path = os.path.join(workdir, f"{group}.{attempt}.jsonl")
            exclude_path = os.path.join(workdir, f"{group}.{attempt}.exclude.json")
            with open(exclude_path, "w", encoding="utf-8") as f:
                json.dump(sorted(records), f)
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", group,
                   "--events", events_path, "--exclude", exclude_path,
                   "--timeout", str(args.timeout), "--grace", str(args.grace)]
            for pattern in args.k or ():
                cmd += ["-k", pattern]
            if args.verbose:
                cmd.append("-v")
            env = dict(os.environ)
            env[ADDRESS_ENV] = server.address
            env[AUTHKEY_ENV] = server.authkey.hex()
            env[SERVER_PID_ENV] = str(server.proc.pid)
            with open(log_path, "ab") as log:
                output = None if args.verbose else log
                proc = subprocess.Popen(cmd, stdout=output, stderr=output, env=env,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
                timed_out = False
                try:
                    proc.wait(timeout=args.max_worker_seconds)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                except BaseException:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise
                finally:
                    mp_runner._kill_session(proc.pid)

            in_flight, done, server_dead, last_id = None, False, False, None
            for event in mp_runner._read_events(events_path):
                kind = event.get("event")
                if kind == "start":
                    in_flight = event["id"]
                elif kind == "end":
                    if event["id"] not in records:
                        order.append(event["id"])
                    records[event["id"]] = event
                    last_id = event["id"]
                    if event["id"] == in_flight:
                        in_flight = None
                elif kind == "objects_left":
                    state["objects_left"].append(event)
                elif kind == "server_dead":
                    server_dead = True
                    last_id = event["after"]
                elif kind == "done":
                    done = True
            if not server.alive():
                server_dead = True
            if server_dead:
                status = server.stop()
                culprit = in_flight or last_id
                note = (f"the server exited ({_describe_status(status)}) during "
                        f"{_short_id(culprit) if culprit else 'the group setup'}"
                        f"; its log ends: {server.log_tail(5).strip()[-300:]!r}")
                notes.append(note)
                print(f"[{group}] {note}", file=sys.stderr)
                if culprit and culprit in records:
                    rec = records[culprit]
                    rec["outcome"] = "errors"
                    rec["reason"] = f"server died in this test: {rec['reason'] or 'passed'}"
                if servers_started > MAX_SERVER_RESTARTS:
                    test_id = f"{group} (rest of the group)"
                    order.append(test_id)
                    records[test_id] = {"id": test_id, "outcome": "errors", "seconds": 0.0,
                                        "reason": f"not run: the server died "
                                                  f"{servers_started} times"}
                    break
                server, why = _start_server(args, workdir, f"{group}.{attempt + 1}")
                if server is None:
                    notes.append(why)
                    break
                servers_started += 1
                if done and in_flight is None:
                    continue  # the worker stopped cleanly before the next test
            if done and proc.returncode == 0:
                break
            reason = mp_runner._worker_exit_reason(proc.returncode, timed_out)
            if not args.verbose:
                print(f"[{group}] {reason}; last lines of {log_path}:\n"
                      f"{mp_runner._log_tail(log_path)}", file=sys.stderr)
            if in_flight is None:
                test_id = f"{group} (worker, outside any test)"
                order.append(test_id)
                records[test_id] = {"id": test_id, "outcome": "errors", "reason": reason,
                                    "seconds": 0.0}
                break
            order.append(in_flight)
            records[in_flight] = {"id": in_flight, "outcome": "errors", "reason": reason,
                                  "seconds": None}
        else:
            test_id = f"{group} (worker)"
            order.append(test_id)
            records[test_id] = {"id": test_id, "outcome": "errors", "seconds": 0.0,
                                "reason": "gave up after too many restarts"}
    finally:
        if server is not None:
            status = server.stop()
            if status != 0:
                notes.append(f"the server's exit after SIGTERM: {_describe_status(status)}"
                             f"; its log ends: {server.log_tail(5).strip()[-300:]!r}")
    return [records[test_id] for test_id in order], notes


def _describe_status(status):
    if isinstance(status, int) and status < 0:
        return f"signal {signal.Signals(-status).name}"
    if isinstance(status, int):
        return f"status {status}"
    return str(status)


def _short_id(test_id):
    prefix = SUITE_MODULE + "."
    return test_id[len(prefix):] if test_id.startswith(prefix) else test_id


def _parse_groups(text):
    if not text or text == "all":
        return list(GROUPS)
    groups = []
    for name in text.split(","):
        name = ALIASES.get(name.strip().lower(), name.strip().lower())
        if name not in GROUPS:
            raise SystemExit(f"unknown group {name!r}; groups: {', '.join(GROUPS)}")
        if name not in groups:
            groups.append(name)
    return groups


def print_report(report, show_skips):
    print(f"\nCPython {report['python']} test._test_multiprocessing manager tests: "
          f"impl={report['impl']} server={report['server']} address={report['address']} "
          f"start_method={report['start_method']}")
    header = f"{'group':<12}{'passed':>8}{'failed':>8}{'errors':>8}{'skipped':>9}" \
             f"{'total':>7}{'seconds':>9}"
    print(header)
    for group, entry in report["groups"].items():
        c = entry["counts"]
        print(f"{group:<12}{c['passed']:>8}{c['failed']:>8}{c['errors']:>8}"
              f"{c['skipped']:>9}{c['total']:>7}{entry['seconds']:>9.1f}")
    c = report["total"]
    print(f"{'total':<12}{c['passed']:>8}{c['failed']:>8}{c['errors']:>8}"
          f"{c['skipped']:>9}{c['total']:>7}{report['wall_seconds']:>9.1f}")
    if report["failures"]:
        print("\nfailing tests:")
        for f in report["failures"]:
            print(f"  [{f['group']}] {f['id']} ({f['outcome']}): {f['reason']}")
    if report["server_notes"]:
        print("\nserver:")
        for group, note in report["server_notes"]:
            print(f"  [{group}] {note}")
    left = [e for e in report["objects_left"] if e["objects"] != 0]
    if left:
        print("\nobjects left on the server at a class's teardown (cumulative per server):")
        for e in left:
            print(f"  {e['class']}: {e['objects']}")
    if show_skips and report["skips"]:
        print("\nskipped tests:")
        for s in report["skips"]:
            print(f"  [{s['group']}] {s['id']}: {s['reason']}")


def run(args):
    here = os.path.dirname(os.path.abspath(__file__))
    assert os.path.exists(os.path.join(here, SUITE_MODULE + ".py"))
    if args.impl == "torchpar":
        args.torchpar_bin = os.path.abspath(args.torchpar_bin)
        if not os.access(args.torchpar_bin, os.X_OK):
            print(f"{args.torchpar_bin}: not an executable (build the torchpar target or "
                  "pass --torchpar-bin)", file=sys.stderr)
            return 2
    os.environ[START_METHOD_ENV] = args.start_method
    groups = _parse_groups(args.groups)
    report = {"impl": args.impl, "start_method": args.start_method, "address": args.address,
              "server": args.torchpar_bin + " manager" if args.impl == "torchpar"
              else "multiprocessing.managers.SyncManager(...).get_server()",
              "python": sys.version.split()[0], "timeout_s": args.timeout,
              "groups": {}, "failures": [], "skips": [], "server_notes": [],
              "objects_left": []}
    started = time.monotonic()
    broken = 0  # groups whose server did not start
    with tempfile.TemporaryDirectory(prefix="cpython_manager_") as workdir:
        for group in groups:
            group_started = time.monotonic()
            state = {"objects_left": []}
            records, notes = run_group(group, args, workdir, state)
            seconds = time.monotonic() - group_started
            broken += any(r["id"] == f"{group} (server)" for r in records)
            report["groups"][group] = {"counts": mp_runner._counts(records),
                                       "seconds": round(seconds, 1),
                                       "address": state.get("address"),
                                       "tests": [dict(mp_runner._clean_record(r),
                                                      id=_short_id(r["id"]))
                                                 for r in records]}
            report["server_notes"] += [(group, n) for n in notes]
            report["objects_left"] += [{"class": e["class"], "objects": e["objects"]}
                                       for e in state["objects_left"]]
            for r in records:
                entry = {"group": group, "id": _short_id(r["id"]),
                         "outcome": r["outcome"], "reason": r["reason"]}
                if r["outcome"] in ("failed", "errors"):
                    report["failures"].append(entry)
                elif r["outcome"] == "skipped":
                    report["skips"].append(entry)
            if not args.verbose:
                c = report["groups"][group]["counts"]
                print(f"[{group}] {c['passed']} passed, {c['failed']} failed, "
                      f"{c['errors']} errors, {c['skipped']} skipped "
                      f"({seconds:.1f} s)", file=sys.stderr, flush=True)
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    report["total"] = mp_runner._counts(
        [r for g in report["groups"].values() for r in g["tests"]])
    print_report(report, args.verbose)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 2 if broken == len(groups) else 0


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Run CPython's manager tests against an external manager server.")
    parser.add_argument("--impl", choices=("python", "torchpar"), default="python",
                        help="which server: Python's SyncManager server or torchpar manager")
    parser.add_argument("--torchpar-bin", default="build/bin/torchpar",
                        help="the torchpar program (default build/bin/torchpar)")
    parser.add_argument("--address", default="127.0.0.1:0",
                        help="the server's address: HOST:PORT (port 0: any free one), a "
                             "filesystem path, or 'unix' for a socket in a temporary "
                             "directory (default 127.0.0.1:0)")
    parser.add_argument("--start-method", choices=("fork", "spawn", "forkserver"),
                        default="fork", help="for the tests' child processes")
    parser.add_argument("--groups", default="all",
                        help="comma-separated: " + ",".join(GROUPS) + " (default all)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="one line per test as it runs, the tests' own output, "
                             "and the skipped tests")
    parser.add_argument("-k", action="append", metavar="PATTERN",
                        help="only tests whose id matches (as unittest -k); repeatable")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="per-test timeout in seconds (default 60)")
    parser.add_argument("--grace", type=float, default=15.0,
                        help="seconds after --timeout before the worker is aborted")
    parser.add_argument("--max-worker-seconds", type=float, default=1800.0,
                        help="bound on one group's worker process (default 1800)")
    # Internal: run one group in this process (the runner starts these).
    parser.add_argument("--worker", choices=tuple(GROUPS), help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    parser.add_argument("--exclude", help=argparse.SUPPRESS)
    # Internal: be Python's manager server (the runner starts this for --impl python).
    parser.add_argument("--serve-python", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--authkey-file", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve_python:
        return serve_python(args.address, args.authkey_file)
    if args.worker:
        return run_worker(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
