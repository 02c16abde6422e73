"""Fixtures of torchpar's pytest suite (python/tests): start-method contexts, a watchdog
per test, and the sharing strategy and children reset between tests.

Run from a build tree:
    PYTHONPATH=build/python /usr/bin/python3 -m pytest -q python/tests
(ctest's python_test does this). Without PYTHONPATH the suite looks for ../../build/python.
"""
import faulthandler
import multiprocessing
import os
import sys

import pytest

try:
    import torchpar  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "build", "python"))

import torch  # noqa: E402,F401
import torchpar.multiprocessing as tmp  # noqa: E402

import tp_helpers  # noqa: E402

#: A test that runs longer than this many seconds is hung: its stacks are dumped and the run
#: ends (there is no pytest-timeout on Debian's python3-pytest).
WATCHDOG_S = 90

# forkserver children import torch once, in the server, rather than each on its own.
multiprocessing.set_forkserver_preload(["torch", "torchpar.multiprocessing", "tp_helpers"])


@pytest.fixture(params=["fork", "spawn"])
def ctx(request):
    """torchpar's context of each start method that costs a child: fork and spawn."""
    return tmp.get_context(request.param)


@pytest.fixture(params=["fork", "spawn", "forkserver"])
def any_ctx(request):
    """torchpar's context of every start method (for tests that start no child)."""
    return tmp.get_context(request.param)


@pytest.fixture(params=["file_descriptor", "file_system"])
def strategy(request):
    """Each sharing strategy, set in this process for the test."""
    tmp.set_sharing_strategy(request.param)
    return request.param


@pytest.fixture(autouse=True)
def _guard():
    """Per test: a watchdog, the default sharing strategy back, and no child left alive
    (children of tp_helpers.start are killed and fail the test)."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    before = set(tp_helpers.live_children())
    yield
    faulthandler.cancel_dump_traceback_later()
    tmp.set_sharing_strategy("file_descriptor")
    for p in multiprocessing.active_children():  # reaps, and finds ours still running
        if p.pid in tp_helpers.CHILD_PIDS:
            p.kill()
            p.join(5)
            pytest.fail(f"the test left child {p.pid} running")
    # Processes a fixture of a wider scope keeps (a module's Pool) are multiprocessing
    # Process objects still alive: theirs to end. What is left besides is a leak.
    kept = {p.pid for p in multiprocessing.active_children()}
    left = set(tp_helpers.live_children()) - before - kept - infrastructure_pids()
    assert not left, f"children left: {sorted(left)}"


def infrastructure_pids():
    """multiprocessing's own long-lived children: the forkserver and the resource tracker."""
    from multiprocessing import forkserver, resource_tracker
    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {p for p in pids if p}
