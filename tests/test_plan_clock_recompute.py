"""Recomputation at the pace of steady training (``cpu_offload/plan/_clock.py``, NOTE
[Recomputation at the pace of steady training]): steps with every layer recomputed read
beside the plain ones, and the profile's costs of recomputation scaled to them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import cpu_offload.plan._clock as clock_module
import cpu_offload.plan._probe as probe_module
from cpu_offload.plan import Choice, estimate, profile_model
from cpu_offload.plan._clock import (
    SCALE_RANGE,
    SteadyPace,
    recompute_scale,
    recompute_scaled,
    steady_pace,
)
from cpu_offload.plan._probe import Clock
from cpu_offload.plan.costs import HostCost, LayerCost, PartCost, Storage
from cpu_offload.plan.model import Link, Profile


class _Device:
    """Plain steps of a device at its power limit, ``recomputed_ms`` under the recompute
    context; records what ran."""

    def __init__(self, steady_ms: float, paused_ms: float, recomputed_ms: float) -> None:
        self.steady_ms, self.paused_ms, self.recomputed_ms = steady_ms, paused_ms, recomputed_ms
        self.paused = self.recomputing = False
        self.log: list[str] = []

    def plain(self, step: Any, clock: Clock, steps: int) -> float:
        self.log.append("again" if self.recomputing else "plain")
        ms = self.paused_ms if self.paused else self.steady_ms
        self.paused = False
        return self.recomputed_ms if self.recomputing else ms

    def sleep(self, seconds: float) -> None:
        self.log.append("pause")
        self.paused = True

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        self.recomputing = True
        try:
            yield
        finally:
            self.recomputing = False


def _device(monkeypatch: pytest.MonkeyPatch, **ms: float) -> _Device:
    device = _Device(**ms)
    monkeypatch.setattr(clock_module, "plain_step_ms", device.plain)
    monkeypatch.setattr(probe_module, "plain_step_ms", device.plain)  # run_for's steps
    monkeypatch.setattr(clock_module.time, "sleep", device.sleep)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return device


def _cuda_clock() -> Clock:
    clock = Clock(False, events=False)
    clock.cuda = True  # read as CUDA; every device call is stood in
    return clock


def _read(device: _Device, steps: int, pairs: int) -> SteadyPace:
    """``steady_pace`` of the stand-in ``device``, with no warm-up steps."""
    return steady_pace(
        lambda: torch.zeros(()),
        _cuda_clock(),
        steps=steps,
        pairs=pairs,
        warm_s=0.0,
        recompute=device.recompute,
    )


def test_each_pair_reads_recomputation_back_to_back_beside_the_steady_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = _device(monkeypatch, steady_ms=20.0, paused_ms=19.0, recomputed_ms=26.0)
    got = _read(device, steps=2, pairs=2)
    assert got == SteadyPace(pytest.approx(20.0 / 19.0), pytest.approx(26.0 / 20.0))
    # Each pair: the steady reading, the reading with every layer recomputed, a pause,
    # the reading after it (no warm-up steps: warm_s is 0).
    pair = ["plain", "plain", "again", "again", "pause", "plain", "plain"]
    assert device.log == pair + pair


def test_the_ratio_is_the_median_of_the_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    device = _device(monkeypatch, steady_ms=20.0, paused_ms=19.0, recomputed_ms=0.0)
    again = iter([26.0, 40.0, 27.0])
    real = device.plain

    def plain(step: Any, clock: Clock, steps: int) -> float:
        ms = real(step, clock, steps)
        return next(again) if device.recomputing else ms

    monkeypatch.setattr(clock_module, "plain_step_ms", plain)
    got = _read(device, steps=1, pairs=3)
    assert got.recompute_ratio == pytest.approx(27.0 / 20.0)  # not the last, 1.35


def test_the_warm_up_runs_under_the_recomputation_too(monkeypatch: pytest.MonkeyPatch) -> None:
    device = _device(monkeypatch, steady_ms=20.0, paused_ms=19.0, recomputed_ms=26.0)
    steady_pace(
        lambda: torch.zeros(()),
        _cuda_clock(),
        steps=1,
        pairs=1,
        warm_s=1e-3,
        recompute=device.recompute,
    )
    first_again = device.log.index("again")
    # At least one untimed step back to back before the timed one, under the context.
    assert device.log[first_again + 1] == "again" and device.log.index("pause") > first_again + 1


def test_the_cpu_stand_in_reads_nothing() -> None:
    calls: list[int] = []

    def step() -> torch.Tensor:
        calls.append(1)
        return torch.zeros((), requires_grad=True).sum()

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        calls.append(2)
        yield

    clock = Clock(False, events=False)
    assert steady_pace(step, clock, steps=3) == SteadyPace()
    assert steady_pace(step, clock, steps=3, recompute=recompute) == SteadyPace()
    assert calls == []


def _layer(host: HostCost | None = None, **kwargs: Any) -> LayerCost:
    return LayerCost(1.0, 2.0, 100, 80, 10, recompute_ms=1.0, host=host, **kwargs)


def test_scaled_costs_are_the_recomputations_and_only_those() -> None:
    host = HostCost(
        0.5,
        0.6,
        offload_forward_ms=0.1,
        offload_backward_ms=0.2,
        recompute_forward_ms=0.3,
        recompute_backward_ms=0.7,
        engaged_forward_ms=0.05,
        part_recompute_forward_ms=0.01,
        part_recompute_backward_ms=0.02,
        part_offload_forward_ms=0.03,
        own_forward_ms=0.4,
    )
    part = PartCost("mlp", forward_ms=0.6, host_ms=0.2, saved=(0,), inputs=())
    layer = _layer(host, storages=(Storage(100, 80),), parts=(part,))
    profile = Profile((layer, replace(layer, recompute_ms=None)), Link(1.0, 1.0), other_ms=3.0)
    got = recompute_scaled(profile, 2.0)
    assert got.other_ms == 3.0 and got.link == profile.link
    # The host's costs stay as the profile's rounds measured them.
    want_part = replace(part, forward_ms=1.2)
    assert got.layers[0] == replace(layer, recompute_ms=2.0, parts=(want_part,))
    # A layer whose recomputation is its forward (recompute_ms None) gets it as a figure.
    assert got.layers[1].recompute_ms == 2.0 and got.layers[1].forward_ms == 1.0
    assert recompute_scaled(profile, 1.0) is profile


@pytest.mark.parametrize("host_ms", [None, 0.5])
def test_the_scale_makes_the_model_run_the_measured_ratio(host_ms: float | None) -> None:
    # The device bounds: 1 ms of recomputation a layer on the device, with no host
    # times or with host times shorter than the device's.
    host = None if host_ms is None else HostCost(host_ms, host_ms, recompute_backward_ms=0.2)
    profile = Profile((_layer(host),) * 4, Link(1.0, 1.0), other_ms=2.0)
    keep = estimate(profile, [Choice.KEEP] * 4).step_ms
    for want in (1.2, 1.3, 1.4):
        scale = recompute_scale(profile, want)
        assert SCALE_RANGE[0] < scale < SCALE_RANGE[1]
        again = estimate(recompute_scaled(profile, scale), [Choice.RECOMPUTE] * 4).step_ms
        assert again / keep == pytest.approx(want, rel=1e-9)
        assert estimate(recompute_scaled(profile, scale), [Choice.KEEP] * 4).step_ms == keep


def test_a_step_the_host_bounds_keeps_its_recomputation_as_measured() -> None:
    # 4 ms of host time a layer's backward, 2 ms more recomputed, against the device's
    # 2 ms backward and 1 ms recomputation: the device's costs barely move the step, and
    # a reading of the ratio is left to the host's times from the profile's rounds.
    host = HostCost(4.0, 4.0, recompute_backward_ms=2.0)
    profile = Profile((_layer(host),) * 4, Link(1.0, 1.0), other_ms=2.0)
    for want in (1.1, 1.3, 1.9):
        assert recompute_scale(profile, want) == 1.0


def test_the_scale_stays_in_its_range_and_is_one_with_nothing_to_scale() -> None:
    profile = Profile((_layer(),) * 4, Link(1.0, 1.0))  # 12 ms kept, 16 ms recomputed
    assert recompute_scale(profile, 1.01) == SCALE_RANGE[0]
    assert recompute_scale(profile, 5.0) == SCALE_RANGE[1]
    # Recomputing read no slower than keeping (noise), or no reading: as measured.
    for ratio in (1.0, 0.99, -1.0, 0.0, float("nan"), float("inf")):
        assert recompute_scale(profile, ratio) == 1.0
    empty = Profile((LayerCost(0.0, 0.0, 0, 0, 0, recompute_ms=1.0),) * 2, Link(1.0, 1.0))
    assert recompute_scale(empty, 1.5) == 1.0  # a kept step of no time
    free = Profile((replace(_layer(), recompute_ms=0.0),) * 4, Link(1.0, 1.0))
    assert recompute_scale(free, 1.3) == 1.0


def test_a_cpu_profile_of_host_and_device_keeps_its_recomputation() -> None:
    # The CPU stand-in's host=True profile reads no ratio: its recomputation stays as
    # its rounds measured it.
    import cpu_offload.plan._timing as timing_module

    runners: list[Any] = []
    real = timing_module.HostAndDevice.profile

    def recorded(self: Any, *args: Any) -> Any:
        runners.append(self)
        return real(self, *args)

    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    x = torch.randn(8, 16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing_module.HostAndDevice, "profile", recorded)
        profile_model(
            model, lambda: model(x).sum(), steps=1, host=True, min_tensor_size_to_offload=64
        )
    (runner,) = runners
    assert runner.recompute_ratio is None and runner.recompute_scale == 1.0


def _recorded_runner(monkeypatch: pytest.MonkeyPatch, got: SteadyPace) -> list[Any]:
    import cpu_offload.plan._timing as timing_module

    runners: list[Any] = []
    real = timing_module.HostAndDevice.profile
    calls: list[Any] = []

    def recorded(self: Any, *args: Any) -> Any:
        runners.append(self)
        return real(self, *args)

    def steady(
        step: Any, clock: Any, steps: int, recompute: Any = None, **judged: Any
    ) -> SteadyPace:
        calls.append(recompute)
        return got if recompute is not None else SteadyPace(got.factor)

    monkeypatch.setattr(timing_module.HostAndDevice, "profile", recorded)
    monkeypatch.setattr(timing_module, "steady_pace", steady)
    return [runners, calls]


def test_a_profile_with_parts_is_scaled_once_after_its_parts_host_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cpu_offload.plan._timing as timing_module

    runners, calls = _recorded_runner(monkeypatch, SteadyPace(1.0, 50.0))  # at the top bound
    scaled: list[tuple[Profile, Profile]] = []
    real_scaled = timing_module.recompute_scaled
    real_part_host = timing_module.HostAndDevice.part_host
    order: list[str] = []

    def recording_scaled(profile: Profile, scale: float) -> Profile:
        order.append("scaled")
        out = real_scaled(profile, scale)
        scaled.append((profile, out))
        return out

    def recording_part_host(self: Any, profile: Profile, pace: Any = None) -> Profile:
        order.append("part_host")
        return real_part_host(self, profile, pace)

    monkeypatch.setattr(timing_module, "recompute_scaled", recording_scaled)
    monkeypatch.setattr(timing_module.HostAndDevice, "part_host", recording_part_host)
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)]
    )
    x = torch.randn(256, 64)
    profile = profile_model(
        model, lambda: model(x).sum(), steps=1, host=True, parts=True, min_tensor_size_to_offload=64
    )
    (runner,) = runners
    assert calls and all(c is not None for c in calls)
    assert order == ["part_host", "scaled"]
    ((before, after),) = scaled
    assert after is profile and all(c.parts for c in before.layers)
    scale = runner.recompute_scale
    for old, new in zip(before.layers, profile.layers, strict=True):
        assert new.recompute_ms == pytest.approx(old.rerun_ms * scale)
        for p, q in zip(old.parts, new.parts, strict=True):
            assert q.forward_ms == pytest.approx(p.forward_ms * scale)
        assert new.host == old.host  # the host's costs stay as the rounds measured them


def test_a_profile_without_recomputation_reads_no_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    runners, calls = _recorded_runner(monkeypatch, SteadyPace(1.0, 1.5))
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    x = torch.randn(8, 16)
    profile_model(
        model,
        lambda: model(x).sum(),
        steps=1,
        host=True,
        recompute=False,
        min_tensor_size_to_offload=64,
    )
    (runner,) = runners
    assert calls == [None]
    assert runner.recompute_ratio is None and runner.recompute_scale == 1.0
