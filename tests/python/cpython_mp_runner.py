#!/usr/bin/python3
"""Runs CPython's own multiprocessing tests against one multiprocessing context.

CPython's `test/_test_multiprocessing.py` (Debian package libpython3.11-testsuite)
writes each test once and binds `Queue`, `Lock`, `Pool`, `Pipe`, ... per test class
through `ProcessesMixin`. This runner imports that module (it copies none of it),
rebinds those names to the objects of either

    multiprocessing.get_context(start_method)            (--impl python)
    torchpar.multiprocessing.get_context(start_method)   (--impl torchpar)

and runs the process-type test classes of the chosen groups, so both
implementations go through the identical code path. It reports passed / failed /
errors / skipped per group and in total, with a one-line reason per failing test.
It is a report: it exits 0 even when tests fail, 2 when torchpar.multiprocessing
cannot be imported, 1 when the runner itself breaks.

Usage (from the repository root):

    /usr/bin/python3 tests/python/cpython_mp_runner.py --impl python --start-method fork
    /usr/bin/python3 tests/python/cpython_mp_runner.py --impl torchpar --start-method spawn \\
        --groups queues,pools --json /tmp/mp.json -v -k test_put

`--impl torchpar` needs `import torchpar.multiprocessing` to work: put the package
on PYTHONPATH or pass --torchpar-path.

Groups and the CPython classes they run (`_TestX` becomes `WithProcessesTestX`):

    queues      _TestQueue, TestSimpleQueue
    locks       _TestLock                  (Lock and RLock)
    semaphores  _TestSemaphore             (Semaphore, BoundedSemaphore)
    conditions  _TestCondition
    events      _TestEvent
    barriers    _TestBarrier
    values      _TestValue, _TestArray, _TestSharedCTypes   (Value, Array, Raw*)
    pipes       _TestConnection, _TestPoll, _TestPicklingConnections
    pools       _TestPool, _TestPoolWorkerErrors, _TestPoolWorkerLifetime

Left out: the manager and thread variants of the same classes, and the classes
that test parts torchpar does not replace (Process, Listener/Client, heap,
shared_memory, managers, logging, resource tracker).

How the binding works: `cpython_mp_suite.py` (next to this file) does it at import
time, reading the implementation and start method from environment variables this
runner sets, and then calls CPython's `install_tests_in_module_dict`, as
`test_multiprocessing_spawn.py` does. Spawned children re-import that module and so
see the same bindings. By default the name `multiprocessing` inside the CPython test
module is also replaced by a proxy whose factories come from the context, because
some tests call `multiprocessing.Pool(...)` or `multiprocessing.SimpleQueue()`
directly; --mixin-only turns that off. The bindings are printed, with the names the
context lacks (Python's own object is used) and, for torchpar, the names its context
inherits unchanged from Python's `BaseContext`.

Bounds: each group runs in a worker process (this script with --worker) in its own
session. A test that runs past --timeout gets a TestTimeout exception (SIGALRM) and
its child processes are killed; one that cannot be interrupted (a C call that does
not return to Python on a signal) is stopped --grace seconds later by faulthandler,
which dumps every thread's stack and ends the worker. The runner records that test
as an error, kills what the worker left, and starts a new worker for the rest of the
group.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

IMPL_ENV = "TORCHPAR_CPYTHON_MP_IMPL"
START_METHOD_ENV = "TORCHPAR_CPYTHON_MP_START_METHOD"
PATCH_MODULE_ENV = "TORCHPAR_CPYTHON_MP_PATCH_MODULE"
SUITE_MODULE = "cpython_mp_suite"

GROUPS = {
    "queues": ["WithProcessesTestQueue", "TestSimpleQueue"],
    "locks": ["WithProcessesTestLock"],
    "semaphores": ["WithProcessesTestSemaphore"],
    "conditions": ["WithProcessesTestCondition"],
    "events": ["WithProcessesTestEvent"],
    "barriers": ["WithProcessesTestBarrier"],
    "values": ["WithProcessesTestValue", "WithProcessesTestArray",
               "WithProcessesTestSharedCTypes"],
    "pipes": ["WithProcessesTestConnection", "WithProcessesTestPoll",
              "WithProcessesTestPicklingConnections"],
    "pools": ["WithProcessesTestPool", "WithProcessesTestPoolWorkerErrors",
              "WithProcessesTestPoolWorkerLifetime"],
}
ALIASES = {
    "queue": "queues", "lock": "locks", "rlocks": "locks", "semaphore": "semaphores",
    "condition": "conditions", "event": "events", "barrier": "barriers",
    "value": "values", "arrays": "values", "array": "values", "pipe": "pipes",
    "connections": "pipes", "connection": "pipes", "pool": "pools",
}
OUTCOMES = ("passed", "failed", "errors", "skipped")
# The worst outcome wins when a test reports several (an error in a cleanup after
# a failure, a failing subtest after a passing one).
_SEVERITY = {"passed": 0, "skipped": 1, "failed": 2, "errors": 3}

MAX_WORKER_RESTARTS = 10
LEFTOVER_GRACE_S = 2.0


# --------------------------------------------------------------------------- worker

class TestTimeout(BaseException):
    """Raised in a test that runs past the per-test timeout.

    A BaseException so that a test's own `except Exception` does not swallow it;
    unittest still records it as an error of that test.
    """


def _one_line(err):
    exc_type, value, _ = err
    text = str(value).strip().splitlines()
    line = f"{exc_type.__name__}: {text[0]}" if text else exc_type.__name__
    return line if len(line) <= 240 else line[:237] + "..."


class _EventResult(unittest.TestResult):
    """A unittest result that writes one JSON line per event to the events file."""

    def __init__(self, events, timeout_s, grace_s, verbose):
        super().__init__()
        self._events = events
        self._timeout_s = timeout_s
        self._grace_s = grace_s
        self._verbose = verbose
        self._current = None
        self._outcome = None
        self._reason = ""
        self._started = 0.0
        self._timed_out = False

    def emit(self, **record):
        self._events.write(json.dumps(record) + "\n")
        self._events.flush()

    def _arm(self):
        import faulthandler
        faulthandler.dump_traceback_later(self._timeout_s + self._grace_s, exit=True)
        signal.setitimer(signal.ITIMER_REAL, self._timeout_s)

    def _disarm(self):
        import faulthandler
        signal.setitimer(signal.ITIMER_REAL, 0)
        # Class fixtures (a pool's setUpClass) run between tests: keep a hard bound.
        faulthandler.dump_traceback_later(self._timeout_s + self._grace_s, exit=True)

    def on_alarm(self, signum, frame):
        self._timed_out = True
        raise TestTimeout(f"test ran past the per-test timeout of {self._timeout_s:g} s")

    def startTest(self, test):
        super().startTest(test)
        self._current = test.id()
        self._outcome = "passed"
        self._reason = ""
        self._timed_out = False
        self._started = time.monotonic()
        self.emit(event="start", id=self._current)
        if self._verbose:
            print(f"{self._current} ...", file=sys.__stderr__, flush=True)
        self._arm()

    def stopTest(self, test):
        super().stopTest(test)
        self._disarm()
        if self._timed_out:
            _kill_children()
        seconds = time.monotonic() - self._started
        self.emit(event="end", id=self._current, outcome=self._outcome,
                  reason=self._reason, seconds=round(seconds, 3))
        if self._verbose:
            tail = f": {self._reason}" if self._reason else ""
            print(f"{self._current} ... {self._outcome} ({seconds:.2f} s){tail}",
                  file=sys.__stderr__, flush=True)
        self._current = None

    def _record(self, test, outcome, reason):
        if self._current is None or test.id() != self._current:
            # A module or class fixture (setUpClass, tearDownModule): no startTest.
            self.emit(event="end", id=test.id(), outcome=outcome, reason=reason,
                      seconds=0.0)
            if self._verbose:
                print(f"{test.id()} ... {outcome}: {reason}", file=sys.__stderr__,
                      flush=True)
            return
        if _SEVERITY[outcome] > _SEVERITY[self._outcome]:
            self._outcome, self._reason = outcome, reason

    def addSuccess(self, test):
        pass

    def addError(self, test, err):
        self._record(test, "errors", _one_line(err))

    def addFailure(self, test, err):
        self._record(test, "failed", _one_line(err))

    def addSkip(self, test, reason):
        self._record(test, "skipped", str(reason))

    def addExpectedFailure(self, test, err):
        pass

    def addUnexpectedSuccess(self, test):
        self._record(test, "failed", "unexpected success")

    def addSubTest(self, test, subtest, err):
        if err is not None:
            failed = issubclass(err[0], test.failureException)
            self._record(test, "failed" if failed else "errors",
                         f"{subtest._subDescription()}: {_one_line(err)}")

    def addDuration(self, test, elapsed):  # Python 3.12+
        pass


def _kill_children():
    """Kills the child processes a timed-out test left, so the next test starts clean."""
    import multiprocessing
    for child in multiprocessing.active_children():
        child.kill()
        child.join(1.0)


def run_worker(args):
    """Runs one group's tests in this process, writing events to args.events."""
    import faulthandler

    suite_module = __import__(SUITE_MODULE)
    with open(args.exclude, encoding="utf-8") as f:
        excluded = set(json.load(f))
    with open(args.events, "a", encoding="utf-8") as events:
        result = _EventResult(events, args.timeout, args.grace, args.verbose)
        result.emit(event="bindings", impl=suite_module.IMPL,
                    start_method=suite_module.START_METHOD,
                    patch_module=suite_module.PATCH_MODULE,
                    bindings=suite_module.BINDINGS)
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
        result.emit(event="done")
    return 0


# --------------------------------------------------------------------------- runner

def _read_events(path):
    events = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass  # the last line of a worker that was killed mid-write
    except FileNotFoundError:
        pass
    return events


def _kill_session(pgid):
    """Waits briefly for what a worker left in its session to exit, then kills it."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _log_tail(path, lines=40):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except FileNotFoundError:
        return ""


def _worker_exit_reason(returncode, timed_out):
    if timed_out:
        return "the worker ran past --max-worker-seconds and was killed"
    if returncode is not None and returncode < 0:
        return f"the worker died of signal {signal.Signals(-returncode).name}"
    return (f"the worker exited with status {returncode} inside the test (the hard "
            "per-test timeout dumps the stacks and exits with status 1)")


def run_group(group, args, workdir, bindings_out):
    """Runs one group in workers until all its tests have reported; returns records."""
    records = {}
    order = []
    log_path = os.path.join(workdir, f"{group}.log")
    for attempt in range(MAX_WORKER_RESTARTS + 1):
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
        with open(log_path, "ab") as log:
            output = None if args.verbose else log
            proc = subprocess.Popen(cmd, stdout=output, stderr=output,
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
                _kill_session(proc.pid)

        events = _read_events(events_path)
        in_flight = None
        done = False
        for event in events:
            kind = event.get("event")
            if kind == "bindings":
                bindings_out.update(event)
            elif kind == "start":
                in_flight = event["id"]
            elif kind == "end":
                if event["id"] not in records:
                    order.append(event["id"])
                records[event["id"]] = event
                if event["id"] == in_flight:
                    in_flight = None
            elif kind == "done":
                done = True
        if done and proc.returncode == 0:
            break
        reason = _worker_exit_reason(proc.returncode, timed_out)
        if not args.verbose:
            tail = _log_tail(log_path)
            print(f"[{group}] {reason}; last lines of {log_path}:\n{tail}",
                  file=sys.stderr)
        if in_flight is None:
            # Died outside a test (import, setUpModule, a class fixture, teardown):
            # nothing to skip past, so a new worker would die the same way.
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
                            "reason": f"gave up after {MAX_WORKER_RESTARTS} restarts"}
    return [records[test_id] for test_id in order]


def _short_id(test_id):
    prefix = SUITE_MODULE + "."
    return test_id[len(prefix):] if test_id.startswith(prefix) else test_id


def _clean_record(record):
    return {"id": _short_id(record["id"]), "outcome": record["outcome"],
            "reason": record["reason"], "seconds": record["seconds"]}


def _counts(records):
    counts = dict.fromkeys(OUTCOMES, 0)
    for record in records:
        counts[record["outcome"]] += 1
    counts["total"] = len(records)
    return counts


def _parse_groups(text):
    if not text or text == "all":
        return list(GROUPS)
    groups = []
    for name in text.split(","):
        name = ALIASES.get(name.strip(), name.strip())
        if name not in GROUPS:
            raise SystemExit(f"unknown group {name!r}; groups: {', '.join(GROUPS)}")
        if name not in groups:
            groups.append(name)
    return groups


def _check_torchpar():
    try:
        import torchpar.multiprocessing  # noqa: F401
    except Exception as e:  # any import failure means: nothing to test
        print(f"cannot import torchpar.multiprocessing ({type(e).__name__}: {e}).\n"
              "Build the Python package and put it on PYTHONPATH, or pass "
              "--torchpar-path DIR.", file=sys.stderr)
        return False
    return True


def _describe_bindings(info):
    bindings = info.get("bindings", {})
    by_source = {}
    for name, source in sorted(bindings.items()):
        by_source.setdefault(source, []).append(name)
    lines = [f"bound from the context: {', '.join(by_source.get('context', [])) or '-'}"]
    if by_source.get("inherited"):
        lines.append("inherited unchanged from Python's BaseContext: "
                     + ", ".join(by_source["inherited"]))
    if by_source.get("fallback"):
        lines.append("not in the context, Python's own used: "
                     + ", ".join(by_source["fallback"]))
    if not info.get("patch_module", True):
        lines.append("--mixin-only: tests calling multiprocessing.X directly use "
                     "Python's own")
    return lines


def print_report(report, show_skips):
    print(f"\nCPython {report['python']} test._test_multiprocessing: "
          f"impl={report['impl']} start_method={report['start_method']}")
    for line in report["binding_notes"]:
        print("  " + line)
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
    if show_skips and report["skips"]:
        print("\nskipped tests:")
        for s in report["skips"]:
            print(f"  [{s['group']}] {s['id']}: {s['reason']}")


def run(args):
    here = os.path.dirname(os.path.abspath(__file__))
    if args.torchpar_path:
        path = os.path.abspath(args.torchpar_path)
        sys.path.insert(0, path)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (path, os.environ.get("PYTHONPATH")) if p)
    if args.impl == "torchpar" and not _check_torchpar():
        return 2
    # The workers, and the processes they spawn, read the choice from here.
    os.environ[IMPL_ENV] = args.impl
    os.environ[START_METHOD_ENV] = args.start_method
    os.environ[PATCH_MODULE_ENV] = "0" if args.mixin_only else "1"
    assert os.path.exists(os.path.join(here, SUITE_MODULE + ".py"))

    groups = _parse_groups(args.groups)
    report = {"impl": args.impl, "start_method": args.start_method,
              "python": sys.version.split()[0], "timeout_s": args.timeout,
              "groups": {}, "failures": [], "skips": []}
    bindings = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cpython_mp_") as workdir:
        for group in groups:
            group_started = time.monotonic()
            records = run_group(group, args, workdir, bindings)
            seconds = time.monotonic() - group_started
            report["groups"][group] = {"counts": _counts(records),
                                       "seconds": round(seconds, 1),
                                       "tests": [_clean_record(r) for r in records]}
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
    report["total"] = _counts([r for g in report["groups"].values() for r in g["tests"]])
    report["bindings"] = bindings.get("bindings", {})
    report["binding_notes"] = _describe_bindings(bindings) if bindings else []
    print_report(report, args.verbose)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Run CPython's multiprocessing tests against a context.")
    parser.add_argument("--impl", choices=("python", "torchpar"), default="python")
    parser.add_argument("--start-method", choices=("fork", "spawn", "forkserver"),
                        default="fork")
    parser.add_argument("--groups", default="all",
                        help="comma-separated: " + ",".join(GROUPS) + " (default all)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="one line per test as it runs, the tests' own output, "
                             "and the skipped tests")
    parser.add_argument("-k", action="append", metavar="PATTERN",
                        help="only tests whose id matches (as unittest -k); repeatable")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="per-test timeout in seconds (default 120)")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds after --timeout before the worker is aborted")
    parser.add_argument("--max-worker-seconds", type=float, default=3600.0,
                        help="bound on one group's worker process (default 3600)")
    parser.add_argument("--mixin-only", action="store_true",
                        help="rebind only ProcessesMixin, not multiprocessing.X "
                             "as the test module calls it")
    parser.add_argument("--torchpar-path", metavar="DIR",
                        help="directory to put first on sys.path / PYTHONPATH")
    # Internal: run one group in this process (the runner starts these).
    parser.add_argument("--worker", choices=tuple(GROUPS), help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    parser.add_argument("--exclude", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return run_worker(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
