"""What the GPU benchmark scripts share: one workload per process, the conditions of timing
and of exact comparison, and the files they write."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from cpu_offload.plan._probe import probed as _probed
from cpu_offload.plan._rounds import HOST_NOISE, calm, calm_reference

_T = TypeVar("_T")


def run_isolated(script: str, argv: list[str], on_failure: dict[str, Any]) -> dict[str, Any]:
    """Run ``script`` with ``argv`` in a fresh Python; return the JSON of its last line.

    A fresh process starts from an empty GPU, so that nothing one workload leaves
    behind can push the next one out of memory. When the process fails, the result is
    ``on_failure`` with an ``error`` naming the exit code.
    """
    proc = subprocess.run(
        [sys.executable, script, *argv], stdout=subprocess.PIPE, text=True, check=False
    )
    if proc.returncode != 0:
        return {**on_failure, "error": f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


_CUBLAS = "CUBLAS_WORKSPACE_CONFIG"


@contextlib.contextmanager
def timed_as_users_train() -> Iterator[None]:
    """Time steps as users train: without ``CUBLAS_WORKSPACE_CONFIG``, without
    deterministic algorithms.

    PyTorch (2.11 at least) reads and parses ``CUBLAS_WORKSPACE_CONFIG`` at every cuBLAS
    call once it is set: on the H100 host of our measurements a small matmul's launch took
    58 us with it set against 15 us without, which makes models of 1k-2k hidden host-bound
    and their step times drift by up to 20 % between rounds. The variable is read per call,
    so it is taken out of the environment here and put back on exit; exact comparisons run
    under :func:`exact` in the same process.
    """
    saved, deterministic = (
        os.environ.pop(_CUBLAS, None),
        torch.are_deterministic_algorithms_enabled(),
    )
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[_CUBLAS] = saved
        torch.use_deterministic_algorithms(deterministic)


@contextlib.contextmanager
def exact() -> Iterator[None]:
    """Deterministic kernels (cuBLAS with a fixed workspace) for bit-exact comparisons."""
    saved, deterministic = os.environ.get(_CUBLAS), torch.are_deterministic_algorithms_enabled()
    os.environ[_CUBLAS] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        if saved is None:
            del os.environ[_CUBLAS]
        else:
            os.environ[_CUBLAS] = saved
        torch.use_deterministic_algorithms(deterministic)


def bit_identical(
    got: tuple[torch.Tensor, list[torch.Tensor]], want: tuple[torch.Tensor, list[torch.Tensor]]
) -> bool:
    """Whether a step's loss and every gradient equal another's, bit for bit."""
    return torch.equal(got[0], want[0]) and all(
        torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True)
    )


def write_reports(
    json_path: str | None,
    markdown_path: str | None,
    device: str,
    results: list[dict[str, Any]],
    markdown: str,
    **meta: Any,
) -> None:
    """Write the figures as JSON (with device, torch version and date) and the tables."""
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(
                {
                    "device": device,
                    "torch": torch.__version__,
                    "date": datetime.date.today().isoformat(),
                    **meta,
                    "results": results,
                },
                fh,
                indent=2,
                default=str,
            )
    if markdown_path:
        with open(markdown_path, "w") as fh:
            fh.write(markdown)


def rotated(items: Sequence[_T], turn: int) -> list[_T]:
    """``items`` in the order of turn ``turn``: over ``len(items)`` turns each item runs
    first, second, ... once.

    Example:
        >>> rotated("abc", 4)
        ['b', 'c', 'a']
    """
    shift = turn % len(items)
    return [*items[shift:], *items[:shift]]


def probed(fn: Callable[..., None], *args: Any) -> float:
    """Run ``fn(*args)``; the slower of the host probes just before and just after it (ms).

    The probe is a fixed piece of host-only work (``cpu_offload.plan._probe.host_probe_ms``)
    that a slow phase of the host stretches as it stretches the host's part of a step
    (NOTE [The host's pace] in ``cpu_offload/plan/_rounds.py``).
    """
    return _probed(lambda: fn(*args))[1]


class CalmTurns:
    """Which turns of a run the host probe read calm, as the planner's rounds judge it.

    A turn is calm when its probe lies within ``HOST_NOISE`` (10%) of the lower quartile
    of every turn's probe. The reference is the run's own: where the host runs slow for
    most of a run, its lower quartile is slow too and slow turns pass for calm (NOTE [The
    host's pace] in ``cpu_offload/plan/_rounds.py``); only the slowest turns are left out.

    Example:
        >>> turns = CalmTurns([6.0, 6.2, 12.0, 6.1, 6.5])
        >>> turns.flags
        [True, True, False, True, True]
        >>> turns.describe()
        '4 of 5 turns whose probe read at most 6.7 ms (10% above the lower quartile 6.1 ms; probes 6.0 to 12.0 ms)'
    """

    def __init__(self, probe_ms: Sequence[float]) -> None:
        self.probe_ms = list(probe_ms)
        self.reference_ms = calm_reference(self.probe_ms)
        self.flags = calm(self.probe_ms, self.reference_ms)

    def keep(self, values: Sequence[float]) -> list[float]:
        """The values of the calm turns (one value per turn)."""
        return [v for v, ok in zip(values, self.flags, strict=True) if ok]

    def describe(self) -> str:
        """How many turns were calm, the threshold and its reference, and the probes' range."""
        limit = (1 + HOST_NOISE) * self.reference_ms
        return (
            f"{sum(self.flags)} of {len(self.flags)} turns whose probe read at most "
            f"{limit:.1f} ms ({HOST_NOISE:.0%} above the lower quartile "
            f"{self.reference_ms:.1f} ms; probes {min(self.probe_ms):.1f} to "
            f"{max(self.probe_ms):.1f} ms)"
        )


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The lower and upper quartiles of ``values`` (inclusive: within their range).

    Example:
        >>> quartiles([1.0, 2.0])
        (1.25, 1.75)
    """
    if len(values) < 2:
        return (values[0], values[0])
    q = statistics.quantiles(values, n=4, method="inclusive")
    return (q[0], q[2])


def paired_ratios(times: Sequence[float], base: Sequence[float]) -> list[float]:
    """Per turn, ``times`` over ``base`` measured in the same turn.

    Example:
        >>> paired_ratios([11.0, 22.0], [10.0, 20.0])
        [1.1, 1.1]
    """
    if len(times) != len(base):
        raise ValueError(f"one reading per turn each: {len(times)} against {len(base)}")
    return [t / b for t, b in zip(times, base, strict=True)]
