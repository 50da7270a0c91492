"""The two ways :func:`.profile.profile_model` times the layers (see its module notes).

* :class:`Together`: one time per layer, host and device together, as a plain step
  shows them (the CPU stand-in, or ``host=False``).
* :class:`HostAndDevice`: the host's time and the device's apart, for each choice, from
  rounds that take the configurations in turn (:mod:`._rounds`).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .._switch import use_v1
from ._clock import recompute_scale, recompute_scaled, steady_pace
from ._parts_host import part_probes, with_part_host
from ._probe import (
    Clock,
    StepTimes,
    host_probe_ms,
    median_times,
    plain_step_ms,
    probed,
    scaled_times,
    sleep_cycles,
    timed_step,
)
from ._rounds import (
    calm_reference,
    extra,
    fast_rounds,
    flat,
    host_rounds,
    offload_extras,
    offloaded_half,
    picked,
)
from .model import Choice, HostCost, LayerCost, Profile, estimate

__all__ = ["HostAndDevice", "Together"]


class Together:
    """One time per layer: host and device together, as a plain step shows them."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        step: Callable[[], torch.Tensor],
        clock: Clock,
        steps: int,
        runs: list[StepTimes],
        plain_ms: float,
        min_tensor_size_to_offload: int,
    ) -> None:
        self.layers, self.step, self.clock, self.steps = layers, step, clock, steps
        self.runs, self.plain_ms = runs, plain_ms
        self.min_tensor_size_to_offload = min_tensor_size_to_offload

    def _under(self, runs: int, **kwargs: Any) -> list[StepTimes]:
        """``runs`` probed steps under :func:`cpu_offload.offload_layers` (one warm-up),
        of which only the host's times are read: timed on the host's clock alone (NOTE
        [The probe's own host time] in ``_probe.py``)."""
        from ..layers import offload_layers

        parts = kwargs.get("parts") or {}
        moves = kwargs.get("offloaded") or any("offload" in p.values() for p in parts.values())
        if moves or kwargs.get("recast"):
            kwargs["min_tensor_size_to_offload"] = self.min_tensor_size_to_offload
        clock = Clock(self.clock.cuda, events=False)
        with offload_layers(self.layers, **kwargs):
            timed_step(self.layers, self.step, clock)
            return [timed_step(self.layers, self.step, clock)[1] for _ in range(runs)]

    def _recompute_all(self) -> Any:
        """The context under which every layer is recomputed."""
        from ..layers import offload_layers

        return offload_layers(self.layers, offloaded=(), recomputed=range(len(self.layers)))

    def profile(self, base: Profile, costs: list[LayerCost], recompute: bool) -> Profile:
        n = len(self.layers)
        fwd, bwd, other_ms = scaled_times(
            median_times(self.runs, "forward"),
            median_times(self.runs, "backward"),
            statistics.median(r.step_ms for r in self.runs),
            self.plain_ms,
        )
        rerun: list[float | None] = [None] * n
        if recompute:
            with self._recompute_all():
                plain_step_ms(self.step, self.clock, 1)
                recompute_all_ms = plain_step_ms(self.step, self.clock, self.steps)
            # Recomputation's cost measured as a whole (its per-layer share is too small
            # to time alone), shared out by forward time.
            extra = max(recompute_all_ms - self.plain_ms, 0.0)
            total_fwd = sum(fwd) or 1.0
            rerun = [extra * f / total_fwd for f in fwd]
        layers = tuple(
            replace(c, forward_ms=fwd[j], backward_ms=bwd[j], recompute_ms=rerun[j])
            for j, c in enumerate(costs)
        )
        return replace(base, layers=layers, other_ms=other_ms)


class HostAndDevice(Together):
    """The host's time and the device's apart, for each choice (see the module's notes)."""

    def _device_times(self, host_runs: list[StepTimes], **kwargs: Any) -> list[StepTimes]:
        """Steps with the stream held back before each layer: the device's own times."""
        if not self.clock.cuda:
            return host_runs  # the CPU stand-in's device is the host
        host_ms = [
            max(f, b)
            for f, b in zip(
                median_times(host_runs, "host_forward_own"),
                median_times(host_runs, "host_backward"),
                strict=True,
            )
        ]
        from ..layers import offload_layers

        with offload_layers(self.layers, **kwargs):
            sleep = sleep_cycles(host_ms)
            return [
                timed_step(self.layers, self.step, self.clock, sleep=sleep)[1]
                for _ in range(self.steps)
            ]

    #: Rounds that take the host's configurations in turn (see :mod:`._rounds`): the
    #: plain step and the device's times come from the rounds of the fast phase (see
    #: :data:`FAST_PHASE`), the host's times from the rounds :data:`HOST_PACE` picks.
    #: Nine: on an H100 host the host time a recomputed layer's checkpoint added to the
    #: step's forward ran from 0.37 to 1.07 ms a layer from one round to the next
    #: (Megatron-Core's GPT; benchmarks/host_between_layers.py), and with five rounds
    #: plans for a transformers Llama were modelled 10.5% below their measured step in
    #: one run and 6.9% above in another; a median of nine spreads about three quarters
    #: as far as one of five.
    ROUNDS = 9
    #: A round is of the fast phase when its plain step is within this share of the
    #: fastest round's. Slow phases make a step longer, never shorter, and can last
    #: several rounds: on an H100 host the first profile of a process timed
    #: Megatron-Core's GPT at 53.1, 46.4, 46.3, 51.9 and 52.3 ms, and the median of the
    #: rounds modelled the step 13% above the 45.8 ms it trained at.
    FAST_PHASE = 0.03
    #: Which rounds the host's times come from (:func:`._rounds.host_rounds`): ``"every"``
    #: round, or ``"calm"``, those its probe read calm (NOTE [The host's pace]).
    HOST_PACE = "every"
    #: The calm reference of :meth:`profile`'s host probes, and whether it timed
    #: recomputation: what :meth:`part_host` measures beside them.
    calm_probe_ms: float | None = None
    recompute = True
    #: How much slower the device ran plain steps back to back than after a pause
    #: (:func:`._clock.steady_pace`): its times in the profile are scaled by it.
    pace_factor = 1.0
    #: Plain steps with every layer recomputed over plain steps, back to back
    #: (:func:`._clock.steady_pace`); None where recomputation was not timed.
    recompute_ratio: float | None = None
    #: What :meth:`at_steady_pace` scaled the device's costs of recomputation by.
    recompute_scale = 1.0
    #: What :meth:`profile` measured, so that :meth:`rebuild` can model it again.
    measured: _Measured | None = None

    def _rounds(
        self, configs: dict[str, dict[str, Any]]
    ) -> tuple[dict[str, list[list[StepTimes]]], list[float], dict[str, list[float]]]:
        """Each configuration's probed steps per round, the plain step's time per round,
        and each configuration's host probe per round (NOTE [The host's pace])."""
        out: dict[str, list[list[StepTimes]]] = {name: [] for name in configs}
        probes: dict[str, list[float]] = {name: [] for name in configs}
        plain = []
        for _ in range(self.ROUNDS):
            plain.append(plain_step_ms(self.step, self.clock, self.steps))
            for name, kwargs in configs.items():
                times, probe = probed(functools.partial(self._under, self.steps, **kwargs))
                out[name].append(times)
                probes[name].append(probe)
        return out, plain, probes

    def profile(self, base: Profile, costs: list[LayerCost], recompute: bool) -> Profile:
        n = len(self.layers)
        m = offloaded_half(n)
        keep: dict[str, Any] = {"offloaded": (), "recomputed": ()}
        every: dict[str, Any] = {"offloaded": (), "recomputed": range(n)}
        configs = {"keep": keep}
        if recompute:
            configs["recompute"] = every
        if n > 1:
            # Half the layers (at least one, never the last) through the engine.
            configs["offload"] = {"offloaded": range(m), "recomputed": ()}
        recast = _with_casts(costs)
        if recast:
            # Every layer with saved casts kept with its casts rebuilt.
            configs["recast"] = {"offloaded": (), "recomputed": (), "recast": recast}
        every_round, plain_rounds, probes = self._rounds(configs)
        # The device's times and the plain step from the rounds of the fast phase.
        fast = fast_rounds(plain_rounds, self.FAST_PHASE)
        self.calm_probe_ms = calm_reference(v for ms in probes.values() for v in ms)
        self.recompute = recompute
        device = self._device_times(flat(picked(every_round["keep"], fast)), **keep)
        dev_f = median_times(device, "forward")
        dev_b = median_times(device, "backward")
        rerun = list(dev_f)
        if recompute:
            runs = flat(picked(every_round["recompute"], fast))
            rerun = [
                max(b - kb, 0.0)
                for b, kb in zip(
                    median_times(self._device_times(runs, **every), "backward"), dev_b, strict=True
                )
            ]
        # The device's times at the pace of steady training (NOTE [A GPU at its power
        # limit] in ``_clock.py``): these were timed after pauses or held back.
        steady = steady_pace(
            self.step,
            self.clock,
            self.steps,
            recompute=self._recompute_all if recompute else None,
            probe=host_probe_ms,
            calm_ms=self.calm_probe_ms,
        )
        pace = self.pace_factor = steady.factor
        self.recompute_ratio = steady.recompute_ratio
        self.measured = _Measured(
            base=base,
            costs=costs,
            rounds=every_round,
            probes=probes,
            plain_ms=pace * statistics.median(plain_rounds[i] for i in fast),
            forward_ms=[pace * ms for ms in dev_f],
            backward_ms=[pace * ms for ms in dev_b],
            recompute_ms=[pace * ms for ms in rerun],
            head_ms=pace * statistics.median(r.head_ms for r in device),
        )
        return self.rebuild(self.HOST_PACE)

    def rebuild(self, pace: str) -> Profile:
        """The profile of what :meth:`profile` measured, with the host's times from the
        rounds ``pace`` picks (:func:`._rounds.host_rounds`)."""
        assert self.measured is not None and self.calm_probe_ms is not None, "after profile"
        got, ref = self.measured, self.calm_probe_ms
        rounds, probes = got.rounds, got.probes
        n = len(self.layers)
        m = offloaded_half(n)
        host_runs_kept = flat(picked(rounds["keep"], host_rounds(pace, ref, probes["keep"])))
        host_f = median_times(host_runs_kept, "host_forward")
        host_b = median_times(host_runs_kept, "host_backward")
        host_own = median_times(host_runs_kept, "host_forward_own")
        host = HostCost(forward_ms=0.0, backward_ms=0.0)
        if "recompute" in rounds:
            both = host_rounds(pace, ref, probes["recompute"], probes["keep"])
            again, plain = picked(rounds["recompute"], both), picked(rounds["keep"], both)
            host = replace(
                host,
                recompute_forward_ms=extra(again, plain, "host_forward", n, lead=True),
                recompute_backward_ms=extra(again, plain, "host_backward", n),
            )
        if "offload" in rounds:
            both = host_rounds(pace, ref, probes["offload"], probes["keep"])
            extras = offload_extras(
                picked(rounds["offload"], both), picked(rounds["keep"], both), n, m
            )
            host = replace(host, **extras)
        if "recast" in rounds:
            both = host_rounds(pace, ref, probes["recast"], probes["keep"])
            rebuilt, plain = picked(rounds["recast"], both), picked(rounds["keep"], both)
            count = len(_with_casts(got.costs))
            host = replace(
                host,
                recast_forward_ms=extra(rebuilt, plain, "host_forward", count, lead=True),
                recast_backward_ms=extra(rebuilt, plain, "host_backward", count),
            )
        layers = tuple(
            replace(
                c,
                forward_ms=got.forward_ms[j],
                backward_ms=got.backward_ms[j],
                recompute_ms=got.recompute_ms[j],
                host=replace(
                    host,
                    forward_ms=host_f[j],
                    backward_ms=host_b[j],
                    own_forward_ms=host_own[j],
                    # Not measured: a recomputation takes the host the layer's own
                    # forward again.
                    recompute_backward_ms=host.recompute_backward_ms
                    if "recompute" in rounds
                    else host_own[j],
                ),
            )
            for j, c in enumerate(got.costs)
        )
        modelled = replace(
            got.base,
            layers=layers,
            head_ms=got.head_ms,
            head_host_ms=statistics.median(r.host_head_ms for r in host_runs_kept),
        )
        # What the layers leave out of a plain step (embedding, head, loss) is its rest:
        # the plain step of the rounds, not the one block timed before them, which a slow
        # phase of the host would pass on to every estimate.
        kept = estimate(modelled, [Choice.KEEP] * n).step_ms
        return replace(modelled, other_ms=max(got.plain_ms - kept, 0.0))

    def at_steady_pace(self, profile: Profile) -> Profile:
        """``profile`` (this one's, with or without parts) with the device's costs of
        recomputation scaled to what :meth:`profile` read of steady training, where the
        device bounds them (NOTE [Recomputation at the pace of steady training] in
        ``_clock.py``); unchanged where it did not time recomputation. Sets
        :attr:`recompute_scale`."""
        if self.recompute_ratio is None:
            return profile
        self.recompute_scale = recompute_scale(profile, self.recompute_ratio)
        return recompute_scaled(profile, self.recompute_scale)

    def part_host(self, profile: Profile, pace: str | None = None) -> Profile:
        """``profile`` (with parts) with the host's fixed cost per part, from probes in
        rounds beside a step of kept layers (:mod:`._parts_host`), judged against the calm
        reference of :meth:`profile`'s rounds, whose host times the fixed costs go beside;
        the rounds ``pace`` picks (:data:`HOST_PACE` if None)."""
        assert self.calm_probe_ms is not None, "part_host runs after profile"
        probes = part_probes(profile, recompute=self.recompute, offload=not use_v1())
        if not probes:
            return profile
        configs = {"keep": {"offloaded": (), "recomputed": ()}, **probes}
        every_round, _, host_probes = self._rounds(configs)
        return with_part_host(
            profile,
            probes,
            every_round,
            host_probes,
            self.calm_probe_ms,
            pace=self.HOST_PACE if pace is None else pace,
        )


def _with_casts(costs: Sequence[LayerCost]) -> tuple[int, ...]:
    """The layers that save casts: those the profile's recast round keeps with their
    casts rebuilt, and among which it shares out what that round adds."""
    return tuple(j for j, c in enumerate(costs) if c.recast_bytes > 0)


@dataclass(frozen=True)
class _Measured:
    """What :meth:`HostAndDevice.profile` measured: the rounds, with the host's probes,
    and the device's times from the rounds of the fast phase."""

    base: Profile
    costs: list[LayerCost]
    rounds: dict[str, list[list[StepTimes]]]
    probes: dict[str, list[float]]
    plain_ms: float
    forward_ms: list[float]
    backward_ms: list[float]
    recompute_ms: list[float]
    head_ms: float
