#!/usr/bin/python3
"""Runs PyTorch's own distributed test suite against backend "torchpar" or "gloo".

python3-torch ships torch/testing/_internal/distributed/distributed_test.py: the cases of
DistributedTest._DistTestBase (about 280 with their parametrized forms), which PyTorch runs
upstream through test/distributed/test_distributed_spawn.py with the environment variables
BACKEND and WORLD_SIZE. This runner imports that module from the installed python3-torch (it
copies none of it), builds the same test class (TestDistBackend + _DistTestBase, each test
spawning WORLD_SIZE rank processes with the "spawn" start method and a FileStore
rendezvous), and runs the chosen cases, so both backends go through the identical code.
--start-method fork starts the ranks by fork instead (MultiProcessTestCase's
_start_processes with a fork context, as the older test_distributed_fork.py did): the same
cases without importing torch in every rank, several seconds less per case.

One repair, for both backends alike: Debian's python3-torch 1.13 on Python 3.11 cannot
import torch.distributed._shard, which the suite's DDP mode loads in every rank, so every
DDP case would fail on every backend; _import_shard() below says how it is made to import.

How "torchpar" is plugged in: the suite's hook for third-party backends is
common_distributed.DistTestCases.backend_feature. The runner imports torchpar.distributed
(which calls torch.distributed.Backend.register_backend("torchpar", ...)) and adds
"torchpar" to the sets "plugin" (the backend exists), "ddp" (DistributedDataParallel cases)
and "subgroup" (new_group / new_subgroups cases), before the suite module is imported (its
skip decorators read those sets at import time). Not to "gpu" / "cuda": the backend is
CPU-only. Cases the suite gates on a backend's name (require_backend({"gloo", ...}),
BACKEND == "gloo") skip on "torchpar"; that is the suite's own rule for plugins.
--as-gloo runs them anyway: the suite is told BACKEND=gloo (its gates and its case
bodies, which branch on the name, behave as for gloo) while torch.distributed's
init_process_group and new_group, asked for "gloo", make "torchpar" groups in every rank.
What still tells them apart: dist.get_backend() says "torchpar" (test_get_backend expects
"gloo"), and c10d's Gloo-only calls (monitored_barrier) refuse a torchpar group. Spawned
ranks re-import this file as __mp_main__ and repeat the registration (the environment
variable TORCHPAR_DIST_RUNNER tells them to).

Usage (from the repository root; the package on PYTHONPATH):

    PYTHONPATH=build/python /usr/bin/python3 tests/python/dist_test_runner.py \\
        --backend torchpar --world-size 2 --subset ci
    PYTHONPATH=build/python /usr/bin/python3 tests/python/dist_test_runner.py \\
        --backend gloo --world-size 3 -k all_reduce -k broadcast --json /tmp/gloo3.json
    /usr/bin/python3 tests/python/dist_test_runner.py --diff /tmp/gloo.json /tmp/tp.json

-k PATTERN selects cases whose name contains PATTERN (or matches it as a shell pattern
when it has * ? [), any of several; --subset NAME takes a named list (SUBSETS below);
both together take their intersection. --list prints the selection and exits.

Bounds: --timeout (seconds, default 120) replaces the suite's own per-case limit (300 s)
for the wait on the ranks; on expiry the suite terminates them and the case is an error.
A SIGALRM 30 s later ends a case whose parent part does not return (an error too). The
ranks' own output (the suite logs every rank's traceback) goes to --rank-log (default: a
file in the temporary directory, removed when every case passed or skipped, else named at
the end; -v leaves it on the terminal). torchpar /dev/shm names that this run's ranks left
(their owner pid is in the name) are listed at the end.

Output: one line per case (PASS / FAIL / ERROR / SKIP, seconds, and for FAIL / ERROR a
one-line reason: the first rank's exception, or the timeout), then the counts. --json
writes them with the date and machine. Exit status: 0 when no selected case failed or
errored, 1 otherwise, 2 when torch.distributed or the backend is unavailable, 3 when the
selection is empty. --diff A.json B.json prints the cases that pass in A and do not pass
in B (used for docs/python_c10d.md).

Python original: PyTorch's test/distributed/test_distributed_spawn.py and run_test.py.
"""

import argparse
import atexit
import datetime
import fnmatch
import json
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER_ENV = "TORCHPAR_DIST_RUNNER"
TIMEOUT_ENV = "TORCHPAR_DIST_RUNNER_TIMEOUT"
START_METHOD_ENV = "TORCHPAR_DIST_RUNNER_START_METHOD"
AS_GLOO_ENV = "TORCHPAR_DIST_RUNNER_AS_GLOO"
CLASS_NAME = "TestDistBackendWithSpawn"
BACKENDS = ("torchpar", "gloo")
UNAVAILABLE = "torch.distributed is not available"

# The CI subset (ctest python_dist_suite_test, run with --as-gloo at world size 3, where the
# suite's subgroup cases run): collectives on CPU tensors (sparse too), subgroups, DDP on CPU
# (with comm hooks and get_future), barrier, timeouts, send/recv. Each passes on "torchpar"
# (--as-gloo and, where not gated on gloo's name, plain) and on "gloo" at world sizes 2 and
# 3 (docs/python_c10d.md: what is left out and why).
SUBSETS = {
    "ci": [
        # collectives
        "test_all_reduce_sum",
        "test_all_reduce_sum_async",
        "test_all_reduce_max",
        "test_all_reduce_min",
        "test_all_reduce_product",
        "test_all_reduce_sum_complex",
        "test_all_reduce_complex_unsupported_ops",
        "test_all_reduce_coalesced_sum",
        "test_all_reduce_coalesced_max",
        "test_sparse_all_reduce_sum",
        "test_broadcast",
        "test_reduce_sum",
        "test_reduce_max",
        "test_reduce_sum_twice",
        "test_all_gather",
        "test_all_gather_complex",
        "test_all_gather_coalesced_simple",
        "test_all_gather_coalesced_with_empty",
        "test_gather",
        "test_gather_checks",
        "test_scatter",
        "test_scatter_checks",
        "test_scatter_complex",
        "test_all_gather_object_default_pg",
        "test_broadcast_object_list",
        "test_gather_object",
        "test_scatter_object_list",
        # subgroups (the _group cases need world size 3 or more)
        "test_all_reduce_group_sum",
        "test_all_reduce_coalesced_group_sum",
        "test_broadcast_group",
        "test_reduce_group_sum",
        "test_all_gather_group",
        "test_all_gather_coalesced_group",
        "test_gather_group",
        "test_scatter_group",
        "test_all_reduce_full_group_sum",
        "test_broadcast_full_group",
        "test_all_gather_object_subgroup",
        "test_gather_object_subgroup",
        "test_get_rank_size_group",
        "test_destroy_group",
        # barrier
        "test_barrier",
        "test_barrier_full_group",
        "test_barrier_group",
        # timeouts (rank 0 alone in a barrier with a 1 s / 5 s group timeout)
        "test_barrier_timeout_global",
        "test_barrier_timeout_full_group",
        "test_barrier_timeout_group",
        # send / recv
        "test_send_recv",
        "test_send_recv_any_source",
        "test_send_recv_with_tag",
        "test_isend",
        "test_irecv",
        "test_batch_isend_irecv_gloo",
        "test_batch_isend_irecv_gloo_tags",
        # DDP on CPU
        "test_DistributedDataParallelCPU",
        "test_DistributedDataParallelCPU_grad_is_view",
        "test_DistributedDataParallel_requires_grad",
        "test_accumulate_gradients_no_sync",
        "test_accumulate_gradients_no_sync_allreduce_hook",
        "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
        "test_ddp_create_graph",
        "test_ddp_logging_data_cpu",
        "test_static_graph_api_cpu",
        "test_get_future",
    ],
}


class Unavailable(Exception):
    """torch.distributed or the chosen backend cannot be loaded (exit status 2)."""


def _import_shard():
    """Makes torch.distributed._shard importable on Python 3.11 (torch 1.13 and older).

    The suite turns on DDP's ReplicatedTensor mode in every rank, so every DDP case imports
    torch.distributed._shard, whose sharded_tensor/metadata.py declares
    `tensor_properties: TensorProperties = field(default=TensorProperties())`. Python 3.11's
    dataclasses refuse an unhashable default (ValueError "mutable default"), so with
    Debian's python3-torch 1.13 every DDP case fails on every backend before it starts.
    PyTorch 2.0 changed that line to field(default_factory=TensorProperties); this does the
    same for the one import: while it runs, dataclasses.field turns such a default into a
    default_factory that copies it. Nothing changes when the import works as it is.

    Errors: whatever the import raises other than that ValueError.
    """
    try:
        import torch.distributed._shard  # noqa: F401
        return
    except ValueError as e:
        if "mutable default" not in str(e):
            raise
    import copy
    import dataclasses

    for name in [m for m in sys.modules if m.startswith("torch.distributed._shard")]:
        del sys.modules[name]
    original = dataclasses.field

    def field(*, default=dataclasses.MISSING, **kwargs):
        if (default is not dataclasses.MISSING and dataclasses.is_dataclass(default)
                and type(default).__hash__ is None):
            return original(default_factory=lambda: copy.deepcopy(default), **kwargs)
        return original(default=default, **kwargs)

    dataclasses.field = field
    try:
        import torch.distributed._shard  # noqa: F401,F811
    finally:
        dataclasses.field = original


def _map_gloo_to(backend):
    """Makes torch.distributed's init_process_group and new_group create `backend` groups
    where they are asked for "gloo" (--as-gloo). Patched in the package and in
    distributed_c10d (whose new_subgroups calls new_group), in this process only.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def mapped(fn):
        def call(*args, **kwargs):
            if "backend" in kwargs:
                if kwargs["backend"] is not None and str(kwargs["backend"]).lower() == "gloo":
                    kwargs["backend"] = backend
            elif args and isinstance(args[0], str) and args[0].lower() == "gloo":
                args = (backend,) + args[1:]
            return fn(*args, **kwargs)

        call.__name__ = fn.__name__
        call.__doc__ = fn.__doc__
        return call

    dist.init_process_group = mapped(distributed_c10d.init_process_group)
    dist.new_group = distributed_c10d.new_group = mapped(distributed_c10d.new_group)


def _load_suite():
    """Imports the suite with the backend registered and defines the test class.

    Reads BACKEND and TORCHPAR_DIST_RUNNER_TIMEOUT (seconds) from the environment; puts this
    directory (the expecttest stand-in) on sys.path. Returns the class, also bound in this
    module's globals under CLASS_NAME so that spawned ranks find it by name.

    Errors: Unavailable when torch.distributed is not built or the backend does not import.
    """
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import torch.distributed as dist

    if not dist.is_available():
        raise Unavailable(UNAVAILABLE)
    backend = os.environ["BACKEND"]
    if backend == "gloo" and not dist.is_gloo_available():
        raise Unavailable("torch.distributed has no gloo")
    _import_shard()
    from torch.testing._internal import common_distributed

    if backend == "torchpar":
        try:
            import torchpar.distributed  # noqa: F401  (registers the backend)
        except ImportError as e:
            raise Unavailable(f"import torchpar.distributed failed: {e}") from e
        for feature in ("plugin", "ddp", "subgroup"):
            common_distributed.DistTestCases.backend_feature[feature].add(backend)
    timeout = int(os.environ.get(TIMEOUT_ENV, "0"))
    if timeout > 0:
        # _join_processes reads the module's get_timeout for each case.
        common_distributed.get_timeout = lambda test_id: timeout
    as_gloo = backend != "gloo" and os.environ.get(AS_GLOO_ENV) == "1"
    if as_gloo:
        _map_gloo_to(backend)
        # The suite (gates and case bodies) reads BACKEND: it sees "gloo" throughout.
        os.environ["BACKEND"] = "gloo"
    try:
        from torch.testing._internal.distributed import distributed_test
    finally:
        os.environ["BACKEND"] = backend

    class TestDistBackendWithSpawn(distributed_test.TestDistBackend,
                                   distributed_test.DistributedTest._DistTestBase):
        """test_distributed_spawn.py's class: each case starts WORLD_SIZE rank processes."""

        def setUp(self):
            super().setUp()
            # setUp pointed INIT_METHOD at this case's own file; spawned ranks read it when
            # they import the suite, forked ones get the module's value: give them the same.
            distributed_test.INIT_METHOD = os.environ["INIT_METHOD"]
            if os.environ.get(START_METHOD_ENV, "spawn") == "fork":
                import torch.multiprocessing

                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()

    TestDistBackendWithSpawn.__qualname__ = CLASS_NAME
    TestDistBackendWithSpawn.__module__ = __name__
    globals()[CLASS_NAME] = TestDistBackendWithSpawn
    return TestDistBackendWithSpawn


# A spawned rank re-imports this file as __mp_main__ and unpickles its target by the name
# __main__.TestDistBackendWithSpawn._run: define the class here, registration included.
if __name__ == "__mp_main__" and os.environ.get(RUNNER_ENV) == "1":
    _load_suite()


class CaseTimeout(Exception):
    """The parent side of a case ran past its bound (SIGALRM)."""


def _on_alarm(signum, frame):
    raise CaseTimeout("the case's parent side ran past --timeout + 30 s")


def _select(names, patterns, subset):
    """Names kept by -k patterns (any) and the subset's list (when given)."""
    if subset is not None:
        wanted = set(SUBSETS[subset])
        names = [n for n in names if n in wanted]
    if patterns:
        def keep(name):
            for p in patterns:
                if any(c in p for c in "*?[") and fnmatch.fnmatchcase(name, p):
                    return True
                if p in name:
                    return True
            return False

        names = [n for n in names if keep(n)]
    return names


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Timeout)\w*(:|$)")


def _exception_line(lines):
    """The last line of `lines` that starts an exception ("RuntimeError: ..."), or None.

    c10d's messages carry a C++ stack ("Exception raised from ...", "frame #N: ...") after
    the exception line: those are never taken.
    """
    found = [ln.strip() for ln in lines if _EXCEPTION_LINE.match(ln)]
    return found[-1] if found else None


def _reason(err_text):
    """One line from a formatted failure: the first failed rank's exception, else the last.

    The suite raises RuntimeError("Process R exited with error code 10 and exception:\\n
    <traceback>") per failed rank, or "Process R terminated or timed out after S seconds".
    """
    lines = [ln.rstrip() for ln in err_text.splitlines()]
    for i, ln in enumerate(lines):
        if "terminated or timed out after" in ln or "timed out after" in ln:
            return ln.strip()
        if ln.startswith("Process ") and "exited with error code" in ln:
            block = []
            for nxt in lines[i + 1:]:
                if nxt.startswith("Process ") and "exited with error code" in nxt:
                    break
                block.append(nxt)
            exc = _exception_line(block)
            if exc:
                return f"rank {ln.split()[1]}: {exc}"[:300]
    exc = _exception_line(lines)
    if exc is None:
        rest = [ln for ln in lines if ln and not ln.startswith(" ")]
        exc = rest[-1] if rest else "(no message)"
    return exc.strip()[:300]


class _Result(unittest.TestResult):
    """Collects one case's outcome: pass / fail / error / skip with a reason."""

    def __init__(self):
        super().__init__()
        self.outcome = "pass"
        self.reason = ""
        self.detail = ""

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcome, self.reason = "fail", _reason(self.failures[-1][1])
        self.detail = self.failures[-1][1]

    def addError(self, test, err):
        super().addError(test, err)
        self.outcome, self.reason = "error", _reason(self.errors[-1][1])
        self.detail = self.errors[-1][1]

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcome, self.reason = "skip", str(reason).splitlines()[0] if reason else ""

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.outcome = "pass"

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.outcome, self.reason = "fail", "unexpected success"


def _run_case(cls, name, timeout):
    """Runs one case; returns (outcome, seconds, reason, the formatted failure or "").

    Bounded by timeout + 30 s (seconds)."""
    import torch.multiprocessing as tmp

    result = _Result()
    start = time.monotonic()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout + 30)
    case = cls(name)
    try:
        case.run(result)
    except CaseTimeout as e:
        result.outcome, result.reason = "error", str(e)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        for child in tmp.active_children():  # a case interrupted before its tearDown
            child.kill()
            child.join(5)
    _RANK_PIDS.update(getattr(case, "pid_to_pipe", {}))
    return result.outcome, time.monotonic() - start, result.reason, result.detail


#: The pids of every rank this runner started (torchpar's /dev/shm names carry their owner's).
_RANK_PIDS = set()


def _shm_left():
    """This run's torchpar_<pid>_... names still in /dev/shm (other jobs' are not counted)."""
    mine = _RANK_PIDS | {os.getpid()}
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    left = []
    for n in names:
        parts = n.split("_")
        if n.startswith("torchpar_") and len(parts) > 2 and parts[1].isdigit() \
                and int(parts[1]) in mine:
            left.append(n)
    return sorted(left)


def _build_info():
    """Where torchpar was imported from and the repository's commit (for the JSON), or None."""
    mod = sys.modules.get("torchpar")
    if mod is None:
        return None
    import subprocess

    try:
        head = subprocess.run(["git", "-C", os.path.dirname(HERE), "rev-parse", "--short",
                               "HEAD"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        head = ""
    return {"path": os.path.dirname(mod.__file__), "git_head": head.strip()}


def _diff(path_a, path_b):
    """Prints the cases that pass in run A and do not pass in run B; returns 0."""
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    b_cases = {c["name"]: c for c in b["cases"]}
    print(f"pass in {a['backend']} (world size {a['world_size']}), "
          f"not in {b['backend']} (world size {b['world_size']}):")
    n = 0
    for c in a["cases"]:
        other = b_cases.get(c["name"])
        if c["outcome"] == "pass" and other is not None and other["outcome"] != "pass":
            n += 1
            print(f"  {c['name']}: {other['outcome'].upper()} {other['reason']}")
    print(f"{n} case(s)")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="PyTorch's distributed_test.py against backend torchpar or gloo.")
    parser.add_argument("--backend", choices=BACKENDS, default="torchpar")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks per case (the suite's WORLD_SIZE; default 2)")
    parser.add_argument("-k", action="append", default=[], metavar="PATTERN",
                        help="keep cases whose name contains / matches PATTERN (repeatable)")
    parser.add_argument("--subset", choices=sorted(SUBSETS),
                        help="a named list of cases (default: the whole suite)")
    parser.add_argument("--start-method", choices=("spawn", "fork"), default="spawn",
                        help="how ranks start (default spawn, as upstream; fork saves the "
                             "import of torch in each rank)")
    parser.add_argument("--as-gloo", action="store_true",
                        help="the suite runs its gloo configuration; the groups it asks of "
                             "gloo are made on the chosen backend")
    parser.add_argument("--timeout", type=int, default=120,
                        help="seconds per case for the ranks (default 120)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--rank-log", metavar="FILE",
                        help="where the ranks' and the suite's output goes")
    parser.add_argument("--list", action="store_true", help="print the selection and exit")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="leave the ranks' output on the terminal")
    parser.add_argument("--diff", nargs=2, metavar=("A.json", "B.json"),
                        help="print the cases passing in A and not in B, and exit")
    args = parser.parse_args(argv)
    if args.diff:
        return _diff(*args.diff)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2")

    # The suite's cases make temporary files (FileStore files) and leave some behind: they all
    # go to a directory of the run's own, removed at the end (the rank log stays outside it).
    outer_tmp = tempfile.gettempdir()
    run_tmp = tempfile.mkdtemp(prefix="dist_test_runner_")
    owner = os.getpid()  # forked ranks inherit the handler: only this process removes it
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(run_tmp, ignore_errors=True))
    tempfile.tempdir = run_tmp
    os.environ["TMPDIR"] = run_tmp  # the spawned ranks' tempfile too
    os.environ.update({
        RUNNER_ENV: "1",
        "BACKEND": args.backend,
        "WORLD_SIZE": str(args.world_size),
        TIMEOUT_ENV: str(args.timeout),
        START_METHOD_ENV: args.start_method,
        AS_GLOO_ENV: "1" if args.as_gloo else "0",
    })
    os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())  # each case makes its own
    # Upstream's "file" configuration (run_test.py): the suite's gates read INIT_METHOD at
    # import; each case's setUp then points it at a file of its own, and the ranks always
    # meet through a FileStore (TestDistBackend.init_method).
    os.environ.setdefault("INIT_METHOD", "file://" + os.path.join(tempfile.gettempdir(),
                                                                "dist_test_runner_init"))
    # common_utils parses sys.argv when imported (and spawned ranks inherit it): hide ours.
    sys.argv = [sys.argv[0]]
    try:
        cls = _load_suite()
    except Unavailable as e:
        print(f"SKIP: {e}")
        return 2

    names = unittest.TestLoader().getTestCaseNames(cls)
    selected = _select(names, args.k, args.subset)
    if args.list:
        print("\n".join(selected))
        return 0
    if not selected:
        print("no case selected")
        return 3

    out = os.fdopen(os.dup(1), "w", buffering=1)
    log_path = None
    if not args.verbose:
        if args.rank_log:
            log_path = args.rank_log
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            log_fd, log_path = tempfile.mkstemp(prefix="dist_test_ranks_", suffix=".log",
                                                dir=outer_tmp)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)

    print(f"backend {args.backend}, world size {args.world_size}, {len(selected)} case(s), "
          f"{args.start_method}, timeout {args.timeout} s"
          + (", as gloo" if args.as_gloo else "")
          + (f", rank log {log_path}" if log_path else ""), file=out)
    counts = {"pass": 0, "fail": 0, "error": 0, "skip": 0}
    cases = []
    started = time.monotonic()
    for name in selected:
        outcome, seconds, reason, detail = _run_case(cls, name, args.timeout)
        counts[outcome] += 1
        cases.append({"name": name, "outcome": outcome, "seconds": round(seconds, 2),
                      "reason": reason, "detail": detail[-4000:]})
        line = f"{outcome.upper():5} {seconds:6.1f}s {name}"
        if outcome in ("fail", "error") or (outcome == "skip" and args.verbose):
            line += f": {reason}"
        print(line, file=out)
    total = time.monotonic() - started
    shm_left = _shm_left()

    print(f"{args.backend} world size {args.world_size}: {counts['pass']} passed, "
          f"{counts['fail']} failed, {counts['error']} errors, {counts['skip']} skipped "
          f"of {len(selected)} in {total:.0f} s", file=out)
    if shm_left:
        print(f"left in /dev/shm: {' '.join(shm_left)}", file=out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "backend": args.backend,
                "world_size": args.world_size,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "machine": f"{platform.node()} {platform.machine()}, "
                           f"{os.cpu_count()} cpus, Python {platform.python_version()}",
                "torch": __import__("torch").__version__,
                "torchpar": _build_info(),
                "subset": args.subset,
                "patterns": args.k,
                "timeout": args.timeout,
                "start_method": args.start_method,
                "as_gloo": args.as_gloo,
                "seconds": round(total, 1),
                "counts": counts,
                "shm_left": shm_left,
                "cases": cases,
            }, f, indent=1)
    ok = counts["fail"] == 0 and counts["error"] == 0
    if log_path is not None and args.rank_log is None:
        if ok:
            os.unlink(log_path)  # a temporary log is kept only when something failed
        else:
            print(f"the ranks' output: {log_path}", file=out)
    out.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
