"""Runs last (file order): nothing of this test run is left behind.

No child process of this run is alive; no /dev/shm name made by one of its (now dead)
children remains; and a workload run as a process of its own (leak_workload.py) leaves no
name of its own or of its children once it has exited. Names are torchpar_<creator pid>_...;
the creator's cleaner unlinks them when the creator exits, so the checks wait for it.

Known (xfail, measured): a name whose handle is in flight stays for its receiver up to an
hour (torchpar-shm-cleaner's kHoldSeconds, as torch_shm_manager) even once no receiver can
exist: a message left in a queue whose last holder exited, or a segment a process exported
when it was SIGKILLed inside put (test_faults.py's SIGKILL case). The tests that provoke it
unlink those names themselves so that the suite leaves /dev/shm clean.
"""
import json
import os
import subprocess
import sys

import pytest

import conftest
import tp_helpers

HERE = os.path.dirname(os.path.abspath(__file__))


def test_no_children_left():
    left = set(tp_helpers.live_children()) - conftest.infrastructure_pids()
    assert not left, f"children of the test run still alive: {sorted(left)}"
    assert tp_helpers.CHILD_PIDS, "the suite started no child: nothing was checked"


def test_no_shm_names_of_dead_children():
    dead = {p for p in tp_helpers.CHILD_PIDS if not os.path.exists(f"/proc/{p}")}
    assert tp_helpers.names_left_after_exit(dead) == []


def _workload(mode):
    out = subprocess.run([sys.executable, os.path.join(HERE, "leak_workload.py"), mode],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return [report["pid"], *report["children"]]


def test_workload_process_leaves_no_names():
    pids = _workload("clean")
    assert len(pids) == 4
    assert tp_helpers.names_left_after_exit(pids) == [], pids


def test_unreceived_names_outlive_every_process():
    pids = _workload("in_flight")
    left = tp_helpers.names_left_after_exit(pids)
    tp_helpers.unlink_shm(left)
    if left:
        pytest.xfail(f"known: {len(left)} in-flight names of exited processes kept by the "
                     f"cleaner for up to an hour: {left}")
