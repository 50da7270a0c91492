"""Shared test configuration.

Tests that need a GPU carry ``@pytest.mark.cuda``; they are skipped cleanly where
CUDA is not available (CI), and selected with ``-m cuda`` on a GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch

# Scripts that tests run in subprocesses: not test modules, and not to be imported (their
# doctests are collected with --doctest-modules otherwise).
collect_ignore = ["scripts"]


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
