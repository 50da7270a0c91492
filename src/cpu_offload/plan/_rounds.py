"""What a choice adds to the host's time, from rounds that take configurations in turn.

The host's speed drifts by tens of percent over seconds on a shared machine (phases of
about a second, seen on the H100 host of our benchmarks). The profile therefore times
its configurations in rounds, each round taking every configuration once beside a plain
step: what a choice adds is the difference of two configurations measured in the same
round, median over the rounds the host's pace picks: every round, or those in which the
host ran calm (NOTE [The host's pace]); the plain step and the device's times come from
the rounds of the fast phase of the plain step (:func:`fast_rounds`).
"""

# NOTE [The host's pace]
# A plain step bounded by the device hides the host's phases: on an H100 host a
# transformers Llama's plain step stayed at 48 to 49 ms while the same plan's host time
# per step went from 17 to 30 ms and back within seconds. Choosing the rounds of the fast
# phase by the plain step then kept slow phases in the profile (a whole layer's
# recomputation read 2.44 ms of host time in one profile and 1.72 in the next). Each
# configuration of a round is therefore timed between two runs of a fixed piece of
# host-only work (:func:`._probe.host_probe_ms`), which a slow phase stretches as it
# stretches the host's part of a step: in four runs of 30 to 45 s of alternation on that
# host (benchmarks/host_pace.py), the probe and a host-bound plan's CPU time per step
# correlated at 0.66 to 0.88 (0.63 in a fifth run with one OpenMP thread). The slower
# of the two runs is the configuration's probe. The calm reference is the lower
# quartile of every probe of the profile (a fixed piece of work has a floor, but its
# calm runs spread by about 10% above it); a probe within :data:`HOST_NOISE` of it is
# calm. With the pace "calm", the host's times come from calm configurations only, and
# what a choice adds from rounds where both configurations were calm (where none is,
# the calmest rounds: :func:`quiet_rounds`). Where the host runs slow for most of a
# profile, its lower quartile is slow too, and slow runs pass for calm. The times are
# not scaled by the probe: in one run the probe ran up to 2.3 times its calm time where
# the plan's CPU time ran 1.9 times, and scaling by it modelled plans up to 13% fast.
#
# The calm host is not the host a user trains on: a plan that adds host work turns
# host-bound and stretches with the slow phases, so against the median of measured
# rounds the calm model reads low (Megatron-Core's GPT, H200: -7 to -14%). The host's
# times therefore come from every round by default (pace ``"every"``,
# :func:`host_rounds`): medians over rounds that meet the slow phases as often as
# training does. On an H100 host, with each layer's host time counted from the previous
# layer's end (NOTE [A layer's host time runs from the previous layer's end] in
# ``_probe.py``), every plan for Megatron-Core's GPT, a transformers Llama and compare's
# model came within -2.9 to +3.8% of its measured median step with the pace "every"
# (-10.5 to +3.8% with "calm"); in each of three more runs, on slower and less steady
# hosts (rounds of one configuration 11 to 52% apart), five of the seven within 5% and
# two at 6.2 to 10.5%. The pace "calm" stays for comparison:
# benchmarks/plan.py models each plan both ways from one profile's rounds (without
# --parts).

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from ._probe import StepTimes, median_times

__all__ = [
    "HOST_NOISE",
    "HOST_PACES",
    "calm",
    "calm_reference",
    "extra",
    "fast_rounds",
    "flat",
    "host_rounds",
    "offload_extras",
    "offloaded_half",
    "picked",
    "quiet_rounds",
]

#: A probe within this share of the calm reference is calm: the probe's own jitter on a
#: calm host (NOTE [The host's pace]).
HOST_NOISE = 0.10


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


def calm_reference(probe_ms: Iterable[float]) -> float:
    """The host's calm speed: the lower quartile of ``probe_ms`` (NOTE [The host's pace]).

    Example:
        >>> round(calm_reference([5.0, 5.2, 9.0, 5.1, 8.0, 5.0, 7.5, 5.3]), 3)
        5.075
    """
    finite = sorted(ms for ms in probe_ms if math.isfinite(ms) and ms > 0)
    if not finite:
        return math.nan
    if len(finite) == 1:
        return finite[0]
    return statistics.quantiles(finite, n=4, method="inclusive")[0]


def calm(probe_ms: Sequence[float], reference: float) -> list[bool]:
    """Whether each probe read the host calm: within :data:`HOST_NOISE` of the calm
    ``reference`` (or either is not finite, which says nothing of the host).

    Example:
        >>> calm([5.0, 5.4, 10.0, float("nan")], 5.0)
        [True, True, False, True]
    """
    if not math.isfinite(reference):
        return [True] * len(probe_ms)
    return [not (math.isfinite(ms) and ms > (1 + HOST_NOISE) * reference) for ms in probe_ms]


def quiet_rounds(reference: float, *probe_ms: Sequence[float]) -> list[int]:
    """The rounds in which every configuration's probe read the host calm (see
    :func:`calm`). Where there is none, the rounds whose slowest probe is within
    :data:`HOST_NOISE` of the least slow round's: the calmest the profile saw, rather
    than every round, whose slow phases read as cost.

    Example:
        >>> quiet_rounds(5.0, [5.0, 5.2, 5.1], [5.3, 9.0, 5.0])
        [0, 2]
        >>> quiet_rounds(5.0, [5.0, 8.0, 9.0], [8.0, 6.0, 12.0])
        [0, 1]
    """
    flags = [calm(ms, reference) for ms in probe_ms]
    rounds = [i for i, ok in enumerate(zip(*flags, strict=True)) if all(ok)]
    if rounds:
        return rounds
    worst = [max(ms) for ms in zip(*probe_ms, strict=True)]
    finite = [w for w in worst if math.isfinite(w)]
    if not finite:
        return list(range(len(worst)))
    least = min(finite)
    return [i for i, w in enumerate(worst) if w <= (1 + HOST_NOISE) * least]


#: The ways :func:`host_rounds` picks the rounds of the host's times.
HOST_PACES = ("calm", "every")


def host_rounds(pace: str, reference: float, *probe_ms: Sequence[float]) -> list[int]:
    """The rounds the host's times come from: ``"calm"``, those :func:`quiet_rounds`
    picks; ``"every"``, all of them, slow phases included, as a user's training meets
    them (NOTE [The host's pace]).

    Example:
        >>> host_rounds("calm", 5.0, [5.0, 9.0, 5.1])
        [0, 2]
        >>> host_rounds("every", 5.0, [5.0, 9.0, 5.1])
        [0, 1, 2]
    """
    if pace == "every":
        return list(range(len(probe_ms[0])))
    if pace == "calm":
        return quiet_rounds(reference, *probe_ms)
    raise ValueError(f"pace must be one of {HOST_PACES}, got {pace!r}")


def picked(rounds: Sequence[list[StepTimes]], which: Sequence[int]) -> list[list[StepTimes]]:
    """The rounds ``which`` of ``rounds``."""
    return [rounds[i] for i in which]


def flat(rounds: list[list[StepTimes]]) -> list[StepTimes]:
    return [run for one in rounds for run in one]


def extra(
    variant: list[list[StepTimes]],
    kept: list[list[StepTimes]],
    field: str,
    per: int,
    layers: Sequence[int] | None = None,
    lead: bool = False,
) -> float:
    """Host time ``variant`` took beyond ``kept`` in ``layers`` (all if None), per ``per``
    layers: the median over rounds of each round's difference. With ``lead``, the step's
    lead too (``StepTimes.host_lead_ms``, where the package's work for the first layer
    lies when it runs outside the layer's hooks: NOTE [A layer's host time runs from the
    previous layer's end] in ``_probe.py``).

    At least 0: a difference below 0 is the host's noise, not a saving.
    """
    diffs = []
    for v, k in zip(variant, kept, strict=True):
        vm, km = median_times(v, field), median_times(k, field)
        js = range(len(vm)) if layers is None else layers
        diff = sum(vm[j] - km[j] for j in js)
        if lead:
            diff += statistics.median(r.host_lead_ms for r in v)
            diff -= statistics.median(r.host_lead_ms for r in k)
        diffs.append(diff)
    return max(statistics.median(diffs) / per, 0.0)


def offloaded_half(n: int) -> int:
    """How many of ``n`` layers the profile's offload configuration offloads, from the
    first: half, at least one (never the last, where ``n > 1``).

    Example:
        >>> [offloaded_half(n) for n in (1, 2, 5, 12)]
        [1, 1, 2, 6]
    """
    return max(n // 2, 1)


def offload_extras(
    offload: list[list[StepTimes]],
    kept: list[list[StepTimes]],
    n: int,
    m: int,
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
    # The forward's total counts the step's lead, where the package's work for the first
    # layer lies when it runs outside the layer's hooks.
    ways = (("forward", range(m + 1, n), True), ("backward", range(n - 1, n), False))
    for way, clean, lead in ways:
        field = f"host_{way}"
        engaged = extra(offload, kept, field, len(clean), clean) if clean else 0.0
        total = extra(offload, kept, field, 1, lead=lead)
        out[f"engaged_{way}_ms"] = engaged
        out[f"offload_{way}_ms"] = max((total - (n - m) * engaged) / m, 0.0)
    return out
