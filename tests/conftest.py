"""Shared test configuration.

Tests that need a GPU carry ``@pytest.mark.cuda``; they are skipped cleanly where
CUDA is not available (CI), and selected with ``-m cuda`` on a GPU machine.
"""

from __future__ import annotations

import faulthandler
import os
import sys

# Inductor compiles in this process, not in its pool of compile-worker processes: the
# pool forks workers from a process with threads, and its shutdown can wait on them
# (PyTorch issue 162199); on CI's two cores one compile thread costs nothing. Set before
# torch is imported, since Inductor reads it once, when its config is first imported.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

#: A test process still alive this long after pytest is done has hung in its exit (a
#: thread or a child process it waits for): it prints every thread's stack and exits 1.
#: A hung test itself is stopped by pytest-timeout (``timeout`` in pyproject.toml).
EXIT_GRACE_S = 120

#: pytest-timeout stops a hung test from a Python thread, which never runs while the test
#: is blocked in C++ code that holds the GIL (``destroy_process_group`` has hung so on
#: torch 2.6). This long after pytest-timeout's limit, faulthandler's C watchdog prints
#: every thread's stack and ends the process: xdist reports the test as crashed and
#: starts a new worker, instead of the whole run waiting until CI kills it.
HARD_STOP_AFTER_S = 60
_WATCHDOG_FD = pytest.StashKey[int]()

# Scripts that tests run in subprocesses: not test modules, and not to be imported (their
# doctests are collected with --doctest-modules otherwise).
collect_ignore = ["scripts"]


def pytest_unconfigure(config: pytest.Config) -> None:
    fd = config.stash.get(_WATCHDOG_FD, -1)
    if fd >= 0:
        faulthandler.cancel_dump_traceback_later()
        os.close(fd)
        del config.stash[_WATCHDOG_FD]
    # Not in an xdist worker: its controller ends it 10 s after telling it to stop, and
    # a worker's normal exit has taken over 8 s there on two busy cores.
    stream = sys.__stderr__
    if stream is not None and not hasattr(config, "workerinput"):
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=stream)


def pytest_configure(config: pytest.Config) -> None:
    # The stream as the run starts, before a test's output capture replaces sys.stderr
    # (xdist puts an object without a file descriptor there: fall back to the original).
    try:
        fileno = sys.stderr.fileno()
    except (AttributeError, ValueError):
        fileno = -1
    if fileno < 0 and sys.__stderr__ is not None:
        fileno = sys.__stderr__.fileno()
    if fileno >= 0:
        config.stash[_WATCHDOG_FD] = os.dup(fileno)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    fd = item.config.stash.get(_WATCHDOG_FD, -1)
    limit = _timeout_of(item)
    armed = fd >= 0 and limit > 0
    if armed:
        faulthandler.dump_traceback_later(limit + HARD_STOP_AFTER_S, exit=True, file=fd)
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def _timeout_of(item: pytest.Item) -> float:
    """pytest-timeout's limit for ``item``: its ``timeout`` mark, else the run's (from
    ``--timeout``, ``PYTEST_TIMEOUT`` or the ini file, in pytest-timeout's order); 0: none."""
    if not item.config.pluginmanager.hasplugin("timeout"):
        return 0.0
    mark = item.get_closest_marker("timeout")
    if mark is not None and (mark.args or "timeout" in mark.kwargs):
        return float(mark.args[0] if mark.args else mark.kwargs["timeout"])
    value = item.config.getoption("timeout", None)
    if value is None:
        value = os.environ.get("PYTEST_TIMEOUT") or item.config.getini("timeout")
    return float(value or 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny CPU layers.

    With several threads, synchronisation costs far more than the arithmetic (and a
    loaded CI machine makes it worse). Reference and offloaded runs use the same
    setting, so the comparisons are unaffected.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def deterministic():
    """Deterministic kernels for bit-exact comparisons on the GPU.

    ``CUBLAS_WORKSPACE_CONFIG`` must be set before CUDA starts; the test command on the
    GPU sets it in the environment, and this fixture checks that it did.
    """
    if torch.cuda.is_available() and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (
        ":4096:8",
        ":16:8",
    ):
        pytest.fail("set CUBLAS_WORKSPACE_CONFIG=:4096:8 before running the CUDA tests")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)
