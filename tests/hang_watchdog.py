"""A watchdog that ends a test process hung where pytest-timeout cannot stop it.

pytest-timeout stops a hung test from a Python thread (``timeout_method = "thread"``),
which never runs while the test is blocked in C++ code that holds the GIL: on torch 2.6,
``destroy_process_group`` hung so in an xdist worker, and the run waited until CI killed
it. :class:`HangWatchdog` arms faulthandler's C timer, which needs no GIL, for each phase
of a test (setup, call, teardown) with the time left until :data:`HARD_STOP_AFTER_S`
past the test's pytest-timeout limit. When it fires it prints every thread's stack and
ends the process: xdist reports the test as crashed and starts a new worker.

Each phase re-arms the timer because faulthandler has one timer per process, which
pytest's own faulthandler plugin cancels when a phase fails (``pytest_exception_interact``)
and replaces when ``faulthandler_timeout`` is set: re-arming at each phase start keeps the
remaining phases watched either way.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass

import pytest

#: How long after pytest-timeout's limit the watchdog ends the process.
HARD_STOP_AFTER_S = 60
#: The limit where pytest-timeout is not installed (the ``timeout`` of pyproject.toml).
DEFAULT_LIMIT_S = 900.0


@dataclass(frozen=True)
class _Watch:
    """One test's watch: pytest-timeout's limit, from ``start`` or (``func_only``) from
    the start of the test's call."""

    limit: float
    func_only: bool
    start: float

    def left(self, phase: str) -> float | None:
        """Seconds left in ``phase`` until the limit; None: the phase is not timed."""
        if self.func_only:
            return self.limit if phase == "call" else None
        return max(self.start + self.limit - time.monotonic(), 0.0)


_WATCH = pytest.StashKey[_Watch]()


class HangWatchdog:
    """The plugin: register one per session (see ``tests/conftest.py``)."""

    def __init__(self, config: pytest.Config, fd: int) -> None:
        self.config, self.fd = config, fd
        self.timeout_plugin = config.pluginmanager.hasplugin("timeout")

    @classmethod
    def start(cls, config: pytest.Config) -> HangWatchdog | None:
        """The watchdog, writing to a copy of stderr as the session starts (before a
        test's output capture replaces it); None where stderr has no file descriptor."""
        fileno = _stderr_fileno()
        return None if fileno < 0 else cls(config, os.dup(fileno))

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        os.close(self.fd)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        limit, func_only = self._limit(item)
        if limit > 0 and not self._debugging():
            # With func_only, pytest-timeout times the test's body alone: so does this.
            item.stash[_WATCH] = _Watch(limit, func_only, time.monotonic())
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            if _WATCH in item.stash:
                del item.stash[_WATCH]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        self._arm(item, "setup")
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        self._arm(item, "call")
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        self._arm(item, "teardown")
        yield

    def _arm(self, item: pytest.Item, phase: str) -> None:
        watch = item.stash.get(_WATCH, None)
        left = None if watch is None else watch.left(phase)
        if left is None:
            faulthandler.cancel_dump_traceback_later()
        else:
            faulthandler.dump_traceback_later(left + HARD_STOP_AFTER_S, exit=True, file=self.fd)

    def _limit(self, item: pytest.Item) -> tuple[float, bool]:
        """pytest-timeout's limit for ``item`` (0: none) and whether it times the call
        alone: its ``timeout`` mark, else the run's setting from ``--timeout``,
        ``PYTEST_TIMEOUT`` or the ini file, in pytest-timeout's order."""
        config = self.config
        if not self.timeout_plugin:
            return DEFAULT_LIMIT_S, False
        mark = item.get_closest_marker("timeout")
        value = None
        func_only = config.getini("timeout_func_only")
        if mark is not None:
            value = mark.args[0] if mark.args else mark.kwargs.get("timeout")
            func_only = mark.kwargs.get("func_only", func_only)
        if value is None:
            value = config.getoption("timeout", None)
        if value is None:
            value = os.environ.get("PYTEST_TIMEOUT") or config.getini("timeout")
        return float(value or 0), bool(func_only)

    def _debugging(self) -> bool:
        """A debugger is attached: pytest-timeout does not stop the test then (unless
        its debugger detection is turned off), nor does this."""
        if self.config.getoption("usepdb", False):
            return True
        if not self.timeout_plugin or self.config.getoption(
            "timeout_disable_debugger_detection", False
        ):
            return False
        from pytest_timeout import is_debugging

        return is_debugging()


def _stderr_fileno() -> int:
    # xdist puts an object without a file descriptor in sys.stderr: use the original.
    try:
        fileno = sys.stderr.fileno()
    except (AttributeError, ValueError):
        fileno = -1
    if fileno < 0 and sys.__stderr__ is not None:
        fileno = sys.__stderr__.fileno()
    return fileno
