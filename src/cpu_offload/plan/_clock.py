"""The pace of steady training, against the profile's: the device's clock (NOTE [A GPU at
its power limit]) and what recomputation costs (NOTE [Recomputation at the pace of
steady training])."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .._args import check_count, check_seconds
from ._probe import Clock, plain_step_ms, run_for
from ._rounds import calm
from .costs import Choice
from .model import Profile, estimate

__all__ = [
    "WARMUP_S",
    "DEVICE_BOUND_SHARE",
    "SCALE_RANGE",
    "SteadyPace",
    "parts_at_pace",
    "recompute_scale",
    "recompute_scaled",
    "steady_pace",
]

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

# NOTE [Recomputation at the pace of steady training]
# The factor above covers the clock of the whole step, not what recomputation costs in
# it. On an H200 (compare's model) the profile's device times read a layer's
# recomputation at 0.722 ms, whether the stream was held back before each layer or
# once before each pass (the holds' idle time is not the cause), against 0.810 ms from
# events around the layers and 0.825 ms from plain steps, after 1 s of steps back to
# back (benchmarks/device_clock.py --what holds). So the pairs of readings above also
# time plain steps with every layer recomputed, back to back after the same warm-up
# as the steady reading beside them, and the device's costs of recomputation (of
# layers and of their parts) are scaled by one factor, so that the model of
# recomputing every layer runs the measured ratio of its model of keeping every layer.
# On compare's model five readings of the ratio lay within 1.30 to 1.37.
# Only where the device bounds the recomputation: on models the host bounds, what
# recomputing adds is host time, which the profile's rounds take as a median of many
# steps, and readings of a few steps spread far: five of them read 1.37 to 1.93 on
# Megatron-Core's GPT in one process (the Llama: 1.29 to 1.44). The factor is 1 where
# scaling the device's recomputation moves the model's step by less than
# ``DEVICE_BOUND_SHARE`` of it: on those two models' profiles it moved it by 0.15 and
# 0.73 of it, on compare's model by all of it.
# Nor where the host ran slow while the ratio was read: on the Llama, with the profile's
# rounds calm enough for the model to take the recomputation as the device's, one
# reading in a slow phase (probe 12 ms against 5.5 calm) gave a factor of 1.438, and the
# model read recomputing every layer 18.6% slow. So each reading of the ratio counts only
# if the host probe beside it read calm against the profile's rounds
# (``_rounds.calm``); with none, the ratio is not known and nothing is scaled.

#: Seconds of untimed steps back to back before a reading at the pace of steady
#: training: :func:`steady_pace`'s default, and what ``cpu-offload plan`` and
#: ``benchmarks/plan.py`` give ``measure_choices`` (``warmup_s``).
WARMUP_S = 0.3


@dataclass(frozen=True)
class SteadyPace:
    """What :func:`steady_pace` read.

    Attributes:
        factor: How much slower plain steps run back to back than right after a pause
            (>= 1; 1.0 on the CPU stand-in, which has no clock to read).
        recompute_ratio: Steps with every layer recomputed over plain steps, both back
            to back; None where not measured.
    """

    factor: float = 1.0
    recompute_ratio: float | None = None


def steady_pace(
    step: Callable[[], torch.Tensor],
    clock: Clock,
    steps: int = 3,
    pairs: int = 3,
    warm_s: float = WARMUP_S,
    pause_s: float = 0.05,
    recompute: Callable[[], contextlib.AbstractContextManager] | None = None,
    probe: Callable[[], float] | None = None,
    calm_ms: float = math.nan,
) -> SteadyPace:
    """Plain steps back to back against steps right after a pause, and, given
    ``recompute``, against steps with every layer recomputed, back to back.

    Args:
        step: Runs the forward and returns the loss (its backward is run here).
        clock: The profile's clock.
        steps: Steps timed in each reading (the fastest is kept).
        pairs: Steady readings and readings after a pause, taken in turns.
        warm_s: Seconds of untimed steps back to back before each steady reading.
        pause_s: Seconds the device idles before each reading after a pause.
        recompute: Returns a context manager under which every layer is recomputed.
        probe: Times a fixed piece of the host's work (``_probe.host_probe_ms``), read
            before and after each reading of the ratio.
        calm_ms: The host's calm reference (``_rounds.calm_reference``): a reading of
            the ratio counts only where ``probe`` read calm against it (NOTE
            [Recomputation at the pace of steady training]). NaN: every reading counts.

    Returns:
        The medians over ``pairs`` (NOTE [A GPU at its power limit], NOTE
        [Recomputation at the pace of steady training]); the factor at least 1.0, the
        ratio None where no steady step took any time or no reading was calm.
        ``SteadyPace()`` on the CPU stand-in, which reads nothing.

    Raises:
        ValueError: If ``steps`` or ``pairs`` is not an int >= 1, or ``warm_s`` or
            ``pause_s`` not a finite number >= 0.
    """
    check_count("steps", steps)
    check_count("pairs", pairs)
    check_seconds("warm_s", warm_s)
    check_seconds("pause_s", pause_s)
    if not clock.cuda:
        return SteadyPace()  # no clock to read, and no device to bound recomputation

    def fastest(warm: float) -> float:
        run_for(step, clock, warm)
        return min(plain_step_ms(step, clock, 1) for _ in range(steps))

    factors, ratios = [], []
    for _ in range(pairs):
        before = probe() if probe is not None else math.nan
        steady = fastest(warm_s)
        if recompute is not None:
            with recompute():
                again = fastest(warm_s)
            host = max(before, probe()) if probe is not None else math.nan
            if steady > 0 and calm([host], calm_ms)[0]:
                ratios.append(again / steady)
        torch.cuda.synchronize()
        time.sleep(pause_s)
        paused = fastest(0.0)
        factors.append(steady / paused if paused > 0 else 1.0)
    return SteadyPace(
        max(statistics.median(factors), 1.0), statistics.median(ratios) if ratios else None
    )


#: The range :func:`recompute_scale` keeps to: a reading outside it says more about the
#: readings than about recomputation.
SCALE_RANGE = (0.5, 2.0)
#: The least share of the device's recomputation that the model's step must count for
#: :func:`recompute_scale` to scale it: where the host hides more, a reading of the ratio
#: holds the host's moment too (NOTE [Recomputation at the pace of steady training]).
DEVICE_BOUND_SHARE = 0.9


def recompute_scaled(profile: Profile, scale: float) -> Profile:
    """``profile`` with the device's costs of recomputation multiplied by ``scale``:
    each layer's ``recompute_ms`` (taken as ``forward_ms`` where None) and each part's
    ``forward_ms``, what recomputing it runs again. The host's are left as measured.

    Example:
        >>> from cpu_offload.plan.costs import HostCost, LayerCost
        >>> from cpu_offload.plan.model import Link, Profile
        >>> layer = LayerCost(1.0, 2.0, 0, 0, 0, host=HostCost(1.0, 1.0, recompute_backward_ms=0.5))
        >>> got = recompute_scaled(Profile((layer,), Link(1.0, 1.0)), 2.0).layers[0]
        >>> got.forward_ms, got.recompute_ms, got.host.recompute_backward_ms
        (1.0, 2.0, 0.5)
    """
    if scale == 1.0:
        return profile
    profile = parts_at_pace(profile, scale)
    layers = tuple(replace(c, recompute_ms=c.rerun_ms * scale) for c in profile.layers)
    return replace(profile, layers=layers)


def recompute_scale(profile: Profile, ratio: float) -> float:
    """The factor :func:`recompute_scaled` needs so that the model of recomputing every
    layer runs ``ratio`` times its model of keeping every layer, where the device bounds
    that recomputation.

    Args:
        profile: The profile as measured.
        ratio: :attr:`SteadyPace.recompute_ratio`.

    Returns:
        The factor, within :data:`SCALE_RANGE`; 1.0 where the device's recomputation
        does not bound the model's step (less than :data:`DEVICE_BOUND_SHARE` of it
        counts there), where ``ratio`` is not a finite number above 1 (recomputing
        every layer never runs faster than keeping them: such a reading is noise), or
        where the model's step keeping every layer takes no time.

    Example:
        >>> from cpu_offload.plan.costs import LayerCost
        >>> from cpu_offload.plan.model import Link, Profile
        >>> profile = Profile((LayerCost(1.0, 2.0, 0, 0, 0),) * 2, Link(1.0, 1.0))
        >>> round(recompute_scale(profile, 8.0 / 6.0), 6)  # 6 ms kept, 8 ms recomputed
        1.0
        >>> round(recompute_scale(profile, 9.0 / 6.0), 6)
        1.5
    """
    n = profile.num_layers
    keep = estimate(profile, [Choice.KEEP] * n).step_ms
    if not (math.isfinite(ratio) and ratio > 1.0 and keep > 0):
        return 1.0
    target = ratio * keep

    def again(scale: float) -> float:
        return estimate(recompute_scaled(profile, scale), [Choice.RECOMPUTE] * n).step_ms

    lo, hi = SCALE_RANGE
    low, high = again(lo), again(hi)
    device_ms = sum(c.rerun_ms for c in profile.layers)
    if high <= low or high - low < DEVICE_BOUND_SHARE * (hi - lo) * device_ms:
        return 1.0
    if target <= low:
        return lo
    if target >= high:
        return hi
    for _ in range(40):  # the range in log space, to about 1e-12
        mid = math.sqrt(lo * hi)
        if again(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def parts_at_pace(profile: Profile, factor: float) -> Profile:
    """``profile`` with its parts' device times multiplied by ``factor``.

    Args:
        profile: A profile with parts (``LayerCost.parts``); without, it is returned.
        factor: :attr:`SteadyPace.factor`.

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
