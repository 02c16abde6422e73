"""A stand-in for the `expecttest` package, which Debian does not ship.

torch.testing._internal.common_utils (python3-torch) imports `expecttest` at import time
and uses exactly two names from it: the flag `ACCEPT` (set from its `--accept` option) and
the base class `TestCase` of its own TestCase. dist_test_runner.py puts this directory on
sys.path so that PyTorch's distributed_test.py can be imported from the installed
python3-torch. Nothing here rewrites expected output: `assertExpectedInline` only compares.

Python original: the `expecttest` package on PyPI (pytorch/expecttest).
"""
import unittest

#: Whether expected-output assertions may rewrite the test source (never, here).
ACCEPT = False


class TestCase(unittest.TestCase):
    """unittest.TestCase plus expecttest's inline comparison (comparison only)."""

    longMessage = True

    def assertExpectedInline(self, actual, expect, skip=0):
        """Asserts that the string `actual` equals `expect` (no source rewriting).

        Errors: AssertionError when they differ. `skip` (stack frames) is accepted for
        expecttest's signature and unused.
        """
        del skip
        self.assertMultiLineEqual(expect, actual)

    def assertExpectedRaisesInline(self, exc_type, callable, expect, *args, **kwargs):
        """Asserts that callable(*args, **kwargs) raises exc_type with message `expect`.

        Errors: AssertionError when nothing or another message is raised.
        """
        with self.assertRaises(exc_type) as ctx:
            callable(*args, **kwargs)
        self.assertExpectedInline(str(ctx.exception), expect)
