"""The device's pace in steady training, against the profile's (NOTE [A GPU at its power
limit])."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from .._args import check_count, check_seconds
from ._probe import Clock, plain_step_ms, run_for
from .model import Profile

__all__ = ["WARMUP_S", "parts_at_pace", "steady_factor"]

# NOTE [A GPU at its power limit]
# A GPU that reaches its power limit under steady load lowers its clock, and clocks
# higher again after any pause: on an H200 at 700 W, compare's plain steps back to back
# took the SM clock from 1980 to 1680-1845 MHz within 3 s, and the first three steps
# after a pause of 50 ms to 1 s, or after two host probes, ran 2.5 to 5% faster than
# back to back (benchmarks/device_clock.py). The profile times the device right after
# pauses (its host probes) and with the stream held back before each layer, where the
# device idles; training runs back to back. So beside its rounds the profile times plain
# steps back to back and right after a pause, in pairs close in time, and scales the
# device's times by the median ratio of the fastest steps of each pair: a slow moment of
# the host makes a step longer, never shorter, so the fastest steps are the least
# touched by it (a step the host bounds never brings the device to its limit, and should
# read about 1). A ratio below 1 is noise (a paused device is never slower) and counts
# as 1.

#: Seconds of untimed steps back to back before a reading at the pace of steady
#: training: :func:`steady_factor`'s default, and what ``cpu-offload plan`` and
#: ``benchmarks/plan.py`` give ``measure_choices`` (``warmup_s``).
WARMUP_S = 0.3


def steady_factor(
    step: Callable[[], torch.Tensor],
    clock: Clock,
    steps: int = 3,
    pairs: int = 3,
    warm_s: float = WARMUP_S,
    pause_s: float = 0.05,
) -> float:
    """How much slower plain steps run back to back than right after a pause (>= 1).

    Args:
        step: Runs the forward and returns the loss (its backward is run here).
        clock: The profile's clock; 1.0 on the CPU stand-in.
        steps: Steps timed in each reading (the fastest is kept).
        pairs: Steady readings and readings after a pause, taken in turns.
        warm_s: Seconds of untimed steps back to back before each steady reading.
        pause_s: Seconds the device idles before each reading after a pause.

    Returns:
        The median over ``pairs`` of steady over paused, at least 1.0.

    Raises:
        ValueError: If ``steps`` or ``pairs`` is not an int >= 1, or ``warm_s`` or
            ``pause_s`` not a finite number >= 0.
    """
    check_count("steps", steps)
    check_count("pairs", pairs)
    check_seconds("warm_s", warm_s)
    check_seconds("pause_s", pause_s)
    if not clock.cuda:
        return 1.0

    def fastest() -> float:
        return min(plain_step_ms(step, clock, 1) for _ in range(steps))

    ratios = []
    for _ in range(pairs):
        run_for(step, clock, warm_s)
        steady = fastest()
        torch.cuda.synchronize()
        time.sleep(pause_s)
        paused = fastest()
        ratios.append(steady / paused if paused > 0 else 1.0)
    return max(statistics.median(ratios), 1.0)


def parts_at_pace(profile: Profile, factor: float) -> Profile:
    """``profile`` with its parts' device times multiplied by ``factor``.

    Args:
        profile: A profile with parts (``LayerCost.parts``); without, it is returned.
        factor: What :func:`steady_factor` read.

    Returns:
        The profile with each part's ``forward_ms`` scaled; the layers' own times (scaled
        where they were measured) and the host's times unchanged.

    Example:
        >>> from cpu_offload.plan.costs import LayerCost, PartCost
        >>> from cpu_offload.plan.model import Link, Profile
        >>> part = PartCost("mlp", forward_ms=2.0, host_ms=1.0, saved=(), inputs=())
        >>> layer = LayerCost(1.0, 2.0, 0, 0, 0, parts=(part,))
        >>> profile = Profile((layer,), Link(1.0, 1.0, 2.0))
        >>> parts_at_pace(profile, 1.5).layers[0].parts[0].forward_ms
        3.0
    """
    if factor == 1.0:
        return profile
    layers = tuple(
        replace(c, parts=tuple(replace(p, forward_ms=p.forward_ms * factor) for p in c.parts))
        for c in profile.layers
    )
    return replace(profile, layers=layers)
