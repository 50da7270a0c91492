"""The host's fixed cost of a part recomputed or offloaded on its own.

A plan part by part charges each part its share of what recomputing or offloading the
whole layer costs the host (:func:`.usage.use_of`). But each part recomputed on its own
runs a checkpoint of its own, and each part offloaded adds hooks and tensor groups of its
own: a fixed cost per part that several small parts of one layer pay several times over.
On a ``transformers`` Llama on an H100 a norm recomputed in every layer cost the host
0.17 to 0.26 ms a layer, most of it that fixed cost, and an offloaded part about 0.25 ms
a layer beyond its share; a plan of such parts was modelled 17% fast.

Two probes measure it, in the rounds of the host's other probes (:mod:`._rounds`): the
cheapest part of every layer recomputed, and the part of each of the first half of the
layers that offloading moves the fewest bytes of offloaded. What a probe adds to the
host beyond what the shares model, per part, is the fixed cost
(``HostCost.part_recompute_forward_ms`` and the like).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ._probe import StepTimes
from ._rounds import extra, host_rounds, offloaded_half, picked
from .costs import Choice, HostCost, LayerCost, Parts
from .model import Profile
from .usage import use_of

__all__ = ["part_probes", "with_part_host"]

#: The probes, each by the choice its parts get.
PROBES = {"recompute": Choice.RECOMPUTE, "offload": Choice.OFFLOAD}


def _only(cost: LayerCost, name: str, choice: Choice) -> Parts:
    return Parts(tuple((p.name, choice if p.name == name else Choice.KEEP) for p in cost.parts))


def _probe_part(cost: LayerCost, choice: Choice) -> str | None:
    """The part the probe of ``choice`` takes in this layer: the one the host recomputes
    soonest, or the one whose offload moves the fewest bytes (None: no such part)."""
    if choice is Choice.RECOMPUTE:
        saving = [p for p in cost.parts if p.saved]
        return min(saving, key=lambda p: (p.host_ms, p.forward_ms)).name if saving else None
    moves = [(use_of(cost, _only(cost, p.name, choice), False).moved, p.name) for p in cost.parts]
    moving = [(b, name) for b, name in moves if b > 0]
    return min(moving)[1] if moving else None


def part_probes(
    profile: Profile, recompute: bool = True, offload: bool = True
) -> dict[str, dict[str, Any]]:
    """The probes' arguments of :func:`cpu_offload.offload_layers`, by probe name.

    Args:
        profile: A profile with parts.
        recompute: Run the recompute probe (the profile timed recomputation).
        offload: Run the offload probe (the backend offloads parts: V2).

    A probe no layer has a part for is left out, as is the offload probe of one layer
    (whose only layer is the last, which the schedule does not offload).
    """
    n = profile.num_layers
    wanted = {Choice.RECOMPUTE: recompute, Choice.OFFLOAD: offload and n > 1}
    out: dict[str, dict[str, Any]] = {}
    for probe, choice in PROBES.items():
        if not wanted[choice]:
            continue
        # Offloading probes the first half of the layers, as the whole-layer probe does.
        layers = range(n) if choice is Choice.RECOMPUTE else range(offloaded_half(n))
        parts = {}
        for j in layers:
            name = _probe_part(profile.layers[j], choice)
            if name is not None:
                parts[j] = {name: choice.value}
        if parts:
            out[probe] = {"offloaded": (), "recomputed": (), "parts": parts}
    return out


def _without_part_costs(host: HostCost) -> HostCost:
    return replace(
        host,
        part_recompute_forward_ms=0.0,
        part_recompute_backward_ms=0.0,
        part_offload_forward_ms=0.0,
        part_offload_backward_ms=0.0,
    )


def _modelled(
    layers: list[LayerCost], plan: list[Choice | Parts], engaged: bool, field: str
) -> float:
    """What ``plan`` adds to the host's ``field`` over keeping every layer, as modelled."""
    return sum(
        getattr(use_of(c, p, engaged), field) - getattr(use_of(c, Choice.KEEP, False), field)
        for c, p in zip(layers, plan, strict=True)
    )


#: A fixed cost small enough to leave every share's remainder positive: the model's
#: slope in the fixed cost is taken with it.
_PROBE_MS = 1e-6


def with_part_host(
    profile: Profile,
    probes: Mapping[str, Mapping[str, Any]],
    rounds: Mapping[str, list[list[StepTimes]]],
    probe_ms: Mapping[str, Sequence[float]],
    reference: float,
    *,
    pace: str,
) -> Profile:
    """``profile`` with the host's fixed cost per part, from the probes' rounds.

    A part's share of the whole layer's cost (:func:`.usage.use_of`) is taken of that
    cost less one fixed cost, which the whole layer pays once; each part pays its own.
    The model is linear in the fixed cost, so it is solved from the model's figures with
    no fixed cost and with a tiny one.

    Args:
        profile: A profile with parts and the host's times (``LayerCost.host``).
        probes: :func:`part_probes` of it.
        rounds: Each probe's probed steps per round, and ``"keep"``'s (no layer
            offloaded or recomputed) of the same rounds.
        probe_ms: Each configuration's host probe per round, and ``reference`` the
            calm reference of the profile's other host times (:func:`._rounds.calm`).
        pace: Which rounds each probe's fixed cost comes from
            (:func:`._rounds.host_rounds`): ``"every"`` round, or ``"calm"``, those in
            which it and ``"keep"`` were calm (:func:`._rounds.quiet_rounds`).
    """
    layers = [
        c if c.host is None else replace(c, host=_without_part_costs(c.host))
        for c in profile.layers
    ]
    fixed: dict[str, float] = {}
    for probe, kwargs in probes.items():
        choice = PROBES[probe]
        chosen = kwargs["parts"]
        engaged = choice is Choice.OFFLOAD
        plan: list[Choice | Parts] = [
            _only(c, next(iter(chosen[j])), choice) if j in chosen else Choice.KEEP
            for j, c in enumerate(layers)
        ]
        both = host_rounds(pace, reference, probe_ms[probe], probe_ms["keep"])
        for way in ("forward", "backward"):
            name = f"part_{probe}_{way}_ms"
            field = f"host_{way}_ms"
            measured = extra(
                picked(rounds[probe], both), picked(rounds["keep"], both), f"host_{way}", 1
            )
            base = _modelled(layers, plan, engaged, field)
            tiny = [
                c if c.host is None else replace(c, host=replace(c.host, **{name: _PROBE_MS}))
                for c in layers
            ]
            slope = (_modelled(tiny, plan, engaged, field) - base) / _PROBE_MS
            fixed[name] = max((measured - base) / slope, 0.0) if slope > 0 else 0.0
    return replace(
        profile,
        layers=tuple(
            c if c.host is None else replace(c, host=replace(c.host, **fixed)) for c in layers
        ),
    )
