"""CPython's multiprocessing test classes, bound to one multiprocessing context.

This module is what `cpython_mp_runner.py` loads tests from; it holds no test
code of its own. At import time it:

1. reads the implementation and the start method from the environment
   (`TORCHPAR_CPYTHON_MP_IMPL`: `python` or `torchpar`, default `python`;
   `TORCHPAR_CPYTHON_MP_START_METHOD`: default the platform's default method;
   `TORCHPAR_CPYTHON_MP_PATCH_MODULE`: `1` (default) or `0`),
2. builds the context, `multiprocessing.get_context(method)` or
   `torchpar.multiprocessing.get_context(method)`,
3. rebinds every attribute that CPython's `ProcessesMixin` binds (`Queue`, `Lock`,
   `Pool`, `Process`, ...) to that context's object, falling back to Python's own
   where the context has none,
4. unless `TORCHPAR_CPYTHON_MP_PATCH_MODULE=0`, replaces the name `multiprocessing`
   inside `test._test_multiprocessing` by a proxy whose factories (`Queue`,
   `SimpleQueue`, `Pool`, `Lock`, ...) are the context's and whose every other
   attribute is the real module's, so tests that call `multiprocessing.Pool(...)`
   directly (the pool worker tests, `TestSimpleQueue`, ...) test the chosen
   implementation too,
5. calls CPython's `install_tests_in_module_dict(globals(), method)`, as
   `test/test_multiprocessing_spawn.py` does, which defines the `WithProcesses*`
   classes here and a `setUpModule` that sets the start method.

Doing it at import time matters under spawn (and forkserver): a child unpickles a
test's target such as `WithProcessesTestQueue._test_put` by re-importing this
module, and must see the same bindings as the parent. The environment carries the
choice to the children.

`BINDINGS` records, for each rebound name, where the object came from.
"""

import multiprocessing
import multiprocessing.context
import os
import types

IMPL_ENV = "TORCHPAR_CPYTHON_MP_IMPL"
START_METHOD_ENV = "TORCHPAR_CPYTHON_MP_START_METHOD"
PATCH_MODULE_ENV = "TORCHPAR_CPYTHON_MP_PATCH_MODULE"

IMPL = os.environ.get(IMPL_ENV, "python")
START_METHOD = os.environ.get(START_METHOD_ENV) or multiprocessing.get_start_method(
    allow_none=True) or "fork"
PATCH_MODULE = os.environ.get(PATCH_MODULE_ENV, "1") != "0"

import test._test_multiprocessing as cpython_tests  # noqa: E402  (after the env is read)

# Factories the test module reaches as `multiprocessing.<name>(...)`, besides those
# the mixin binds. `SimpleQueue` is used that way only (TestSimpleQueue).
_MODULE_FACTORIES = ("SimpleQueue",)

# Sources recorded in BINDINGS.
FROM_CONTEXT = "context"          # the context's own object
INHERITED = "inherited"           # torchpar's context inherits Python's BaseContext object
FALLBACK = "fallback"             # the context lacks it: Python's own object


def _make_context():
    if IMPL == "python":
        return multiprocessing.get_context(START_METHOD)
    if IMPL == "torchpar":
        import torchpar.multiprocessing as tp_mp
        return tp_mp.get_context(START_METHOD)
    raise ValueError(f"{IMPL_ENV}={IMPL!r}: expected 'python' or 'torchpar'")


def _defining_module(ctx, name):
    """The module of the class in ctx's MRO that defines `name`, or None."""
    if name in vars(ctx):
        return type(ctx).__module__
    for klass in type(ctx).__mro__:
        if name in vars(klass):
            return klass.__module__
    return None


def _source(ctx, name):
    if not hasattr(ctx, name):
        return FALLBACK
    if IMPL == "python":
        return FROM_CONTEXT
    # A BaseContext subclass has every factory; one it does not override is
    # Python's implementation, which is worth telling apart from torchpar's own.
    owner = _defining_module(ctx, name) or ""
    if owner == "multiprocessing" or owner.startswith("multiprocessing."):
        return INHERITED
    return FROM_CONTEXT


def _as_class_attr(obj):
    # Classes are stored as they are (the mixin does so for Process); functions and
    # bound methods are wrapped so that they are not bound to the test case.
    return obj if isinstance(obj, type) else staticmethod(obj)


def _mixin_names():
    mixin = cpython_tests.ProcessesMixin
    return [name for name in vars(mixin)
            if not name.startswith("_") and name != "TYPE"]


class _ModuleProxy(types.ModuleType):
    """`multiprocessing` as the test module sees it: factories from the context."""

    def __init__(self, real, overrides):
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(overrides)
        self._real = real

    def __getattr__(self, name):  # only called for names not in overrides
        return getattr(self._real, name)


def _bind():
    ctx = _make_context()
    bindings = {}
    mixin = cpython_tests.ProcessesMixin
    for name in _mixin_names():
        source = _source(ctx, name)
        bindings[name] = source
        if source != FALLBACK:
            setattr(mixin, name, _as_class_attr(getattr(ctx, name)))
        # else: keep the mixin's own binding, which is Python's default-context object
    if PATCH_MODULE:
        overrides = {}
        for name in list(_mixin_names()) + list(_MODULE_FACTORIES):
            if name == "connection" or not hasattr(multiprocessing, name):
                continue
            source = _source(ctx, name)
            bindings.setdefault(name, source)
            if source != FALLBACK:
                overrides[name] = getattr(ctx, name)
        cpython_tests.multiprocessing = _ModuleProxy(multiprocessing, overrides)
    return ctx, bindings


CONTEXT, BINDINGS = _bind()

cpython_tests.install_tests_in_module_dict(globals(), START_METHOD)
