"""The device's pace in steady training (``cpu_offload/plan/_clock.py``, NOTE [A GPU at
its power limit]): the factor read from plain steps back to back and after a pause, and
the profile's device times scaled by it."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
import torch
from torch import nn

import cpu_offload.plan._clock as clock_module
import cpu_offload.plan._probe as probe_module
import cpu_offload.plan._timing as timing_module
from cpu_offload.plan import Choice, estimate, profile_model
from cpu_offload.plan._clock import SteadyPace, steady_pace
from cpu_offload.plan._probe import Clock, host_probe_ms

LAYERS = 3


class _PowerLimited:
    """Plain steps of a device at its power limit: ``paused_ms`` for the first step
    after a pause, ``steady_ms`` otherwise; records what ran."""

    def __init__(self, steady_ms: float, paused_ms: float) -> None:
        self.steady_ms, self.paused_ms = steady_ms, paused_ms
        self.paused = False
        self.log: list[str] = []

    def plain(self, step: Any, clock: Clock, steps: int) -> float:
        self.log.append(f"steps {steps}")
        ms = self.paused_ms if self.paused else self.steady_ms
        self.paused = False
        return ms

    def sleep(self, seconds: float) -> None:
        self.log.append("pause")
        self.paused = True


def _power_limited(
    monkeypatch: pytest.MonkeyPatch, steady_ms: float, paused_ms: float
) -> _PowerLimited:
    device = _PowerLimited(steady_ms, paused_ms)
    monkeypatch.setattr(clock_module, "plain_step_ms", device.plain)
    monkeypatch.setattr(probe_module, "plain_step_ms", device.plain)  # run_for's steps
    monkeypatch.setattr(clock_module.time, "sleep", device.sleep)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return device


def test_the_factor_is_steady_over_paused_in_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    device = _power_limited(monkeypatch, steady_ms=22.0, paused_ms=21.0)
    factor = steady_pace(lambda: torch.zeros(()), Clock(False, events=False), steps=3).factor
    assert factor == 1.0 and device.log == []  # the CPU stand-in has no clock to read

    factor = steady_pace(
        lambda: torch.zeros(()), _cuda_clock(), steps=3, pairs=2, warm_s=0.01
    ).factor
    assert factor == pytest.approx(22.0 / 21.0)
    # Each pair: steps back to back (the warm-up, then the steady reading), a pause, the
    # reading after it.
    pauses = [i for i, entry in enumerate(device.log) if entry == "pause"]
    assert len(pauses) == 2 and pauses[0] >= 4 and pauses[1] - pauses[0] >= 3 + 4
    assert len(device.log) - pauses[1] - 1 == 3


def test_a_slow_host_moment_does_not_move_the_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    # Slow steps of the host inside the readings: the fastest step of each reading is
    # the device's (medians would read 30 / 25).
    times = iter([30.0, 22.0, 31.0, 21.0, 27.0, 25.0])
    monkeypatch.setattr(clock_module, "plain_step_ms", lambda step, clock, steps: next(times))
    monkeypatch.setattr(clock_module.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    # No warm-up steps: the readings only.
    factor = steady_pace(
        lambda: torch.zeros(()), _cuda_clock(), steps=3, pairs=1, warm_s=0.0
    ).factor
    assert factor == pytest.approx(22.0 / 21.0)


def test_a_paused_device_read_slower_counts_as_steady(monkeypatch: pytest.MonkeyPatch) -> None:
    _power_limited(monkeypatch, steady_ms=21.0, paused_ms=22.0)
    assert steady_pace(lambda: torch.zeros(()), _cuda_clock()).factor == 1.0


def test_readings_of_recomputation_on_a_slow_host_do_not_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pair 1 on a calm host (probe 5 ms), pairs 2 and 3 in a slow phase (12 ms), where
    # recomputing every layer, the host's work, reads twice as slow.
    slow = iter([False, False, True, True, True, True])
    state = {"recomputing": False, "slow": False}

    def step_ms(step: object, clock: object, steps: int) -> float:
        if not state["recomputing"]:
            return 20.0
        return 60.0 if state["slow"] else 30.0

    def probe() -> float:
        state["slow"] = next(slow)
        return 12.0 if state["slow"] else 5.0

    @contextlib.contextmanager
    def recompute():  # type: ignore[no-untyped-def]
        state["recomputing"] = True
        yield
        state["recomputing"] = False

    monkeypatch.setattr(clock_module, "plain_step_ms", step_ms)
    monkeypatch.setattr(clock_module.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    kwargs = dict(steps=1, pairs=3, warm_s=0.0, recompute=recompute, probe=probe)
    got = steady_pace(lambda: torch.zeros(()), _cuda_clock(), calm_ms=5.0, **kwargs)
    assert got.recompute_ratio == pytest.approx(1.5)  # pair 1 alone
    slow = iter([False, False, True, True, True, True])
    unjudged = steady_pace(lambda: torch.zeros(()), _cuda_clock(), **kwargs)
    assert unjudged.recompute_ratio == pytest.approx(3.0)  # the median of 1.5, 3, 3
    slow = iter([True] * 6)
    assert (
        steady_pace(lambda: torch.zeros(()), _cuda_clock(), calm_ms=5.0, **kwargs).recompute_ratio
        is None
    )


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("steps", 0, "an int >= 1"),
        ("pairs", 1.5, "an int >= 1"),
        ("pairs", True, "an int >= 1"),
        ("warm_s", -0.1, "a finite number of seconds >= 0"),
        ("pause_s", float("nan"), "a finite number of seconds >= 0"),
        ("warm_s", float("inf"), "a finite number of seconds >= 0"),
    ],
)
def test_bad_arguments_are_refused_by_name(name: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be {allowed}, got"):
        steady_pace(lambda: torch.zeros(()), _cuda_clock(), **{name: value})


def _cuda_clock() -> Clock:
    clock = Clock(False, events=False)
    clock.cuda = True  # read as CUDA; every device call is stood in
    return clock


@pytest.mark.parametrize(
    ("pace", "ratio", "scale"), [(1.0, None, 1.0), (1.25, None, 1.0), (1.25, 1.045, 1.5)]
)
def test_the_profile_scales_the_devices_times_by_the_pace(
    monkeypatch: pytest.MonkeyPatch, pace: float, ratio: float | None, scale: float
) -> None:
    # Device times of 1 ms forward, 2 ms backward (3 ms with every layer recomputed:
    # recomputation 1 ms), a head of 0.5 ms and a plain step of 100 ms, as the profile
    # reads them after pauses: the profile holds them at the pace of steady training,
    # and its calm-host rebuild does not scale them again. Where steady steps with
    # every layer recomputed ran 1.045 times the plain ones (4.5 ms of 100 over three
    # layers at 1 ms), recomputation costs 1.5 times what was read.
    real_median = timing_module.median_times
    real_device_times = timing_module.HostAndDevice._device_times
    backward = iter([2.0, 3.0])
    runners: list[Any] = []

    def median_times(runs: Any, key: str) -> list[float]:
        times = real_median(runs, key)
        # The host's times small beside the device's, however loaded the machine is: the
        # device bounds the step (DEVICE_BOUND_SHARE).
        fixed = {"forward": 1.0}.get(key, 0.01 if key.startswith("host_") else None)
        if key == "backward" and runs and runs[0] is not None and runs[0].head_ms == 0.5:
            fixed = next(backward)
        return [fixed] * len(times) if fixed is not None else times

    def device_times(self: Any, host_runs: Any, **kwargs: Any) -> Any:
        runners.append(self)
        runs = real_device_times(self, host_runs, **kwargs)
        for run in runs:
            run.head_ms = 0.5
        return runs

    def steady(
        step: Any, clock: Any, steps: int, recompute: Any = None, **judged: Any
    ) -> SteadyPace:
        assert recompute is not None  # the profile times recomputation
        # Its readings of recomputation are judged against the profile's calm host.
        assert judged["probe"] is host_probe_ms and judged["calm_ms"] > 0
        return SteadyPace(pace, ratio)

    monkeypatch.setattr(timing_module, "median_times", median_times)
    monkeypatch.setattr(timing_module, "extra", lambda *args, **kwargs: 0.0)
    monkeypatch.setattr(timing_module.HostAndDevice, "_device_times", device_times)
    monkeypatch.setattr(timing_module, "plain_step_ms", lambda step, clock, steps: 100.0)
    monkeypatch.setattr(timing_module, "steady_pace", steady)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(LAYERS)])
    x = torch.randn(8, 16)
    profile = profile_model(
        model, lambda: model(x).sum(), steps=1, host=True, min_tensor_size_to_offload=64
    )
    runner = runners[0]
    for got in (profile, runner.at_steady_pace(runner.rebuild("calm"))):
        for cost in got.layers:
            assert cost.forward_ms == pytest.approx(pace * 1.0)
            assert cost.backward_ms == pytest.approx(pace * 2.0)
            assert cost.recompute_ms == pytest.approx(pace * scale)
        assert got.head_ms == pytest.approx(pace * 0.5)
        keep = estimate(got, [Choice.KEEP] * LAYERS).step_ms
        assert keep == pytest.approx(pace * 100.0)
        if ratio is not None:
            again = estimate(got, [Choice.RECOMPUTE] * LAYERS).step_ms
            assert again / keep == pytest.approx(ratio)
    assert runner.pace_factor == pace
    assert runner.recompute_ratio == ratio and runner.recompute_scale == pytest.approx(scale)


def test_measure_choices_warms_up_for_the_seconds_asked() -> None:
    from cpu_offload.plan.profile import measure_choices

    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(LAYERS)])
    x = torch.randn(8, 16)
    calls: list[float] = []

    def step() -> torch.Tensor:
        calls.append(time.perf_counter())
        return model(x).sum()

    measure_choices(model, step, ["keep"] * LAYERS, steps=2, warmup=1)
    assert len(calls) == 3
    calls.clear()
    measure_choices(model, step, ["keep"] * LAYERS, steps=2, warmup=1, warmup_s=0.05)
    # One warm-up step, then steps until 50 ms passed, then the two timed ones.
    assert len(calls) > 3 and calls[-2] - calls[1] >= 0.05
    for bad in (-1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match=r"warmup_s must be a finite number of seconds"):
            measure_choices(model, step, ["keep"] * LAYERS, warmup_s=bad)  # type: ignore[arg-type]
