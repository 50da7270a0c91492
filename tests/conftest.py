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
from hang_watchdog import HangWatchdog  # noqa: E402

#: A test process still alive this long after pytest is done has hung in its exit (a
#: thread or a child process it waits for): it prints every thread's stack and exits 1.
#: A hung test itself is stopped by pytest-timeout (``timeout`` in pyproject.toml), or
#: where it cannot, by :class:`hang_watchdog.HangWatchdog`.
EXIT_GRACE_S = 120

_WATCHDOG = "hang-watchdog"

# Scripts that tests run in subprocesses: not test modules, and not to be imported (their
# doctests are collected with --doctest-modules otherwise).
collect_ignore = ["scripts"]


def pytest_configure(config: pytest.Config) -> None:
    # A test hung holding the GIL, which pytest-timeout cannot stop, ends its process.
    watchdog = HangWatchdog.start(config)
    if watchdog is not None:
        config.pluginmanager.register(watchdog, _WATCHDOG)


def pytest_unconfigure(config: pytest.Config) -> None:
    watchdog = config.pluginmanager.get_plugin(_WATCHDOG)
    if watchdog is not None:
        config.pluginmanager.unregister(watchdog)
        watchdog.close()
    # Not in an xdist worker: its controller ends it 10 s after telling it to stop, and
    # a worker's normal exit has taken over 8 s there on two busy cores.
    stream = sys.__stderr__
    if stream is not None and not hasattr(config, "workerinput"):
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=stream)


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
