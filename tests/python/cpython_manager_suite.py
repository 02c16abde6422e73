"""CPython's manager test classes, bound to a SyncManager connected to an external server.

This module is what `cpython_manager_runner.py` loads tests from; it holds no test
code of its own. CPython's `test/_test_multiprocessing.py` (Debian package
libpython3.11-testsuite) runs its `WithManager*` classes and `TestSyncManagerTypes`
against a manager each test class (or test) starts itself, `multiprocessing.Manager()`.
At import time this module:

1. reads the server's address and key from the environment the runner sets:
   `TORCHPAR_CPYTHON_MANAGER_ADDRESS` (`HOST:PORT`, or a filesystem path for
   AF_UNIX) and `TORCHPAR_CPYTHON_MANAGER_AUTHKEY` (hex),
2. makes that key this process's `current_process().authkey`, so proxies that
   are unpickled without a manager (in child processes, or nested in a result)
   authenticate to the server as the ones the manager makes,
3. replaces `ManagerMixin.setUpClass` / `tearDownClass` and
   `TestSyncManagerTypes.setUp` / `tearDown`: the manager becomes
   `SyncManager(address, authkey)` + `connect()` to the external server, and the
   teardown neither shuts the server down nor joins a manager process (there is
   none); it records how many objects the server still holds instead,
4. calls CPython's `install_tests_in_module_dict(globals(), method)`, which
   defines the `WithManager*` classes here (and the process and thread variants,
   which the runner does not run),
5. marks as skipped, with a reason, the tests that need what only a manager the
   test starts itself can give (`SKIPS`).

The server itself (Python's or `torchpar manager`) is started by the runner; this
module does not know which one it talks to, so both go through identical code.

`OBJECTS_LEFT` (a list the runner's worker reads) gets one entry per class
teardown: the class and `_number_of_objects()` of the server at that point, or the
error asking for it raised.
"""

import gc
import multiprocessing
import multiprocessing.managers
import os
import time
import unittest

ADDRESS_ENV = "TORCHPAR_CPYTHON_MANAGER_ADDRESS"
AUTHKEY_ENV = "TORCHPAR_CPYTHON_MANAGER_AUTHKEY"
START_METHOD_ENV = "TORCHPAR_CPYTHON_MANAGER_START_METHOD"

import test._test_multiprocessing as cpython_tests  # noqa: E402


def parse_address(text):
    """`HOST:PORT` -> (host, port); anything with a '/' (or no ':') -> an AF_UNIX path."""
    if "/" in text or ":" not in text:
        return text
    host, _, port = text.rpartition(":")
    return (host.strip("[]"), int(port))


ADDRESS = parse_address(os.environ.get(ADDRESS_ENV, "127.0.0.1:0"))
AUTHKEY = bytes.fromhex(os.environ.get(AUTHKEY_ENV, ""))
START_METHOD = os.environ.get(START_METHOD_ENV) or "fork"
if AUTHKEY:
    multiprocessing.current_process().authkey = AUTHKEY

# Tests that need a feature of a manager the test starts itself (a server process it
# owns, types beyond issue 44's), skipped for both implementations alike.
SKIPS = {
    "TestSyncManagerTypes.test_pool":
        "Pool runs worker processes inside the server: not one of the types a foreign "
        "server serves (issue 44 lists dict..Barrier)",
}

OBJECTS_LEFT = []


def connect_manager():
    """A SyncManager connected to the external server (no process of its own)."""
    manager = multiprocessing.managers.SyncManager(address=ADDRESS, authkey=AUTHKEY)
    manager.connect()
    return manager


def _objects_left(manager):
    try:
        return manager._number_of_objects()
    except Exception as e:  # a server without number_of_objects: say so, do not fail
        return f"{type(e).__name__}: {e}"


def _wait_for_children(seconds=5.0):
    """As ManagerMixin.tearDownClass: let children of the class exit, but no manager
    process is among them here, so wait for none."""
    deadline = time.monotonic() + seconds
    delay = 0.01
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


@classmethod
def _mixin_set_up_class(cls):
    cpython_tests.BaseMixin.setUpClass.__func__(cls)
    cls.manager = connect_manager()


@classmethod
def _mixin_tear_down_class(cls):
    _wait_for_children()
    gc.collect()  # proxies of the class's tests decref their objects
    OBJECTS_LEFT.append({"class": cls.__name__, "objects": _objects_left(cls.manager)})
    cls.manager = None
    cpython_tests.BaseMixin.tearDownClass.__func__(cls)


def _types_set_up(self):
    self.manager = connect_manager()
    self.proc = None


def _types_tear_down(self):
    if self.proc is not None and self.proc.is_alive():
        self.proc.terminate()
        self.proc.join()
    self.manager = None
    self.proc = None


def _bind():
    mixin = cpython_tests.ManagerMixin
    mixin.setUpClass = _mixin_set_up_class
    mixin.tearDownClass = _mixin_tear_down_class
    types_case = cpython_tests.TestSyncManagerTypes
    types_case.setUp = _types_set_up
    types_case.tearDown = _types_tear_down


_bind()
cpython_tests.install_tests_in_module_dict(globals(), START_METHOD)

for _test_id, _reason in SKIPS.items():
    _class_name, _method = _test_id.split(".")
    _klass = globals()[_class_name]
    setattr(_klass, _method, unittest.skip(_reason)(getattr(_klass, _method)))
