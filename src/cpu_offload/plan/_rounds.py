"""What a choice adds to the host's time, from rounds that take configurations in turn.

The host's speed drifts by tens of percent over seconds on a shared machine (phases of
about a second, seen on the H100 host of our benchmarks). The profile therefore times
its configurations in rounds, each round taking every configuration once beside a plain
step: what a choice adds is the difference of two configurations measured in the same
round, median over rounds, each round's difference scaled by its pace (the fast phase's
plain step over the round's); and the plain step and the host's own times come from the
rounds of the fast phase only (:func:`fast_rounds`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from ._probe import StepTimes, median_times

__all__ = ["extra", "fast_rounds", "flat", "offload_extras", "paces"]


def fast_rounds(plain_ms: Sequence[float], share: float) -> list[int]:
    """The rounds of the host's fast phase: those whose plain step took at most
    ``1 + share`` times the fastest round's.

    Example:
        >>> fast_rounds([53.1, 46.4, 46.3, 51.9, 52.3], 0.03)
        [1, 2]
    """
    finite = [ms for ms in plain_ms if math.isfinite(ms)]
    if not finite:
        return list(range(len(plain_ms)))
    fastest = min(finite)
    return [i for i, ms in enumerate(plain_ms) if ms <= fastest * (1 + share)]


def paces(plain_ms: Sequence[float], fastest: float) -> list[float]:
    """Each round's pace: the fast phase's plain step ``fastest`` over the round's (1
    where a time is not finite).

    Example:
        >>> paces([50.0, 40.0, 80.0], 40.0)
        [0.8, 1.0, 0.5]
    """
    return [
        fastest / ms if math.isfinite(ms) and ms > 0 and math.isfinite(fastest) else 1.0
        for ms in plain_ms
    ]


def flat(rounds: list[list[StepTimes]]) -> list[StepTimes]:
    return [run for one in rounds for run in one]


def extra(
    variant: list[list[StepTimes]],
    kept: list[list[StepTimes]],
    field: str,
    per: int,
    layers: Sequence[int] | None = None,
    speed: Sequence[float] | None = None,
) -> float:
    """Host time ``variant`` took beyond ``kept`` in ``layers`` (all if None), per ``per``
    layers: the median over rounds of each round's difference, each scaled by its
    round's ``speed`` (the fast phase's plain step over the round's: a slow phase of the
    host stretches a difference as it stretches the step).

    At least 0: a difference below 0 is the host's noise, not a saving.
    """
    diffs = []
    speeds = [1.0] * len(kept) if speed is None else speed
    for v, k, pace in zip(variant, kept, speeds, strict=True):
        vm, km = median_times(v, field), median_times(k, field)
        js = range(len(vm)) if layers is None else layers
        diffs.append(pace * sum(vm[j] - km[j] for j in js))
    return max(statistics.median(diffs) / per, 0.0)


def offload_extras(
    offload: list[list[StepTimes]],
    kept: list[list[StepTimes]],
    n: int,
    m: int,
    speed: Sequence[float] | None = None,
) -> dict[str, float]:
    """The host time offloading the first ``m`` of ``n`` layers adds, split in two.

    Every layer runs under the offload context once one is offloaded: what that adds to
    a layer the engine does not offload (``engaged_*``) is measured on layers whose steps
    do no offload work of the schedule's (forwards after the first offloaded layer's
    copies were queued; the last layer's backward, before any reload); the rest of the
    step's extra is the offloaded layers', shared out among them, since the schedule
    puts their copies and reloads in other layers' steps.
    """
    out = {}
    for way, clean in (("forward", range(m + 1, n)), ("backward", range(n - 1, n))):
        field = f"host_{way}"
        engaged = extra(offload, kept, field, len(clean), clean, speed) if clean else 0.0
        total = extra(offload, kept, field, 1, speed=speed)
        out[f"engaged_{way}_ms"] = engaged
        out[f"offload_{way}_ms"] = max((total - (n - m) * engaged) / m, 0.0)
    return out
