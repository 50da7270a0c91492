"""Profiling a real layer stack and running a plan on it: bit-identical to no offloading.

CPU stand-in: the layers run on the CPU, offloaded tensors go through ``HostTransport``.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from cpu_offload import HostTransport, offload_layers
from cpu_offload.plan import (
    Choice,
    Plan,
    apply_plan,
    estimate,
    load_plan,
    profile_model,
    save_plan,
    search,
)
from cpu_offload.plan.search import LETTERS

MIN = 256
LAYERS = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2, 32, 64, generator=gen) for _ in range(2)]


def _train(model: nn.Module) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    out = []
    for x in _batches():
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
    return out


def _assert_equal(got, want) -> None:  # type: ignore[no-untyped-def]
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, ref_loss)
        assert len(grads) == len(ref_grads)
        for g, r in zip(grads, ref_grads, strict=True):
            assert torch.equal(g, r)


def _profile(model: nn.TransformerEncoder):  # type: ignore[no-untyped-def]
    x = _batches()[0]
    return profile_model(
        model, lambda: model(x).square().mean(), steps=1, min_tensor_size_to_offload=MIN
    )


def test_profile_counts_what_the_engine_offloads() -> None:
    model = _encoder()
    profile = _profile(model)
    assert profile.num_layers == LAYERS
    assert profile.device == "cpu (CPU stand-in)"
    for cost in profile.layers:
        assert 0 < cost.offload_bytes <= cost.saved_bytes
        assert cost.input_bytes == 2 * 32 * 64 * 4
        assert cost.forward_ms > 0 and cost.backward_ms > 0
        assert cost.recompute_ms is not None
    # Recomputation is timed as a whole and shared out by forward time.
    shares = {round(c.rerun_ms / c.forward_ms, 9) for c in profile.layers}
    assert len(shares) == 1
    assert profile.head_bytes == 0  # measured on the GPU only
    # Offloading layer 0 with the engine moves exactly the bytes the profile counted.
    transport = HostTransport()
    x = _batches()[0]
    with offload_layers(model, 1, transport=transport, min_tensor_size_to_offload=MIN):
        model(x).square().mean().backward()
    assert transport.bytes_offloaded == profile.layers[0].offload_bytes
    # The hooks are gone: the model is as it was.
    assert not model.layers[0]._forward_hooks and not model.layers[0]._forward_pre_hooks


@pytest.mark.parametrize(
    "letters", ["ORKK", "OOKR", "RRRR", "KKKK", "OKOK", "RORK"], ids=lambda s: s
)
def test_apply_is_bit_identical(letters: str) -> None:
    by_letter = {letter: c for c, letter in LETTERS.items()}
    plan = Plan(tuple(by_letter[c] for c in letters), 1, 0.0, 0)
    want = _train(_encoder())
    model = _encoder()
    transport = HostTransport()
    handle = apply_plan(model, plan, transport=transport, min_tensor_size_to_offload=MIN)
    assert handle.offloaded == plan.offloaded and handle.recomputed == plan.recomputed
    got = _train(model)
    handle.remove()
    _assert_equal(got, want)
    assert (transport.bytes_offloaded > 0) == ("O" in letters)


def test_a_plan_offloading_n_minus_1_layers_applies_without_a_warning() -> None:
    # OOOK once warned "num_layers=3 = model_layers - 1 ...: use num_layers <= 2", advice
    # that contradicts the plan, whose estimate already charges compute waiting for copies.
    from cpu_offload.plan.compare import plan_variant

    plan = Plan((Choice.OFFLOAD,) * (LAYERS - 1) + (Choice.KEEP,), 1, 0.0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_plan(_encoder(), plan, transport=HostTransport(), min_tensor_size_to_offload=MIN)
        plan_variant(plan)(LAYERS, 0, MIN, HostTransport)
    # The same schedule asked for directly still warns.
    with pytest.warns(UserWarning, match="num_layers=3 = model_layers - 1"):
        offload_layers(_encoder(), LAYERS - 1, transport=HostTransport())


def test_profile_plan_save_load_apply(tmp_path: Path) -> None:
    model = _encoder()
    profile = _profile(model)
    keep_peak = estimate(profile, ["keep"] * LAYERS).peak_bytes
    plan = search(profile, int(0.6 * keep_peak))
    assert plan.peak_bytes <= 0.6 * keep_peak
    assert plan.choices != (Choice.KEEP,) * LAYERS
    save_plan(plan, tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded == plan
    want = _train(_encoder())
    fresh = _encoder()
    with apply_plan(fresh, loaded, transport=HostTransport(), min_tensor_size_to_offload=MIN):
        got = _train(fresh)
    _assert_equal(got, want)


def test_apply_rejects_a_plan_for_another_model() -> None:
    plan = Plan((Choice.KEEP,) * 3, 1, 0.0, 0)
    with pytest.raises(ValueError, match="made for 3 layers, but the model has 4"):
        apply_plan(_encoder(), plan)
    with pytest.raises(TypeError, match="plan must be a cpu_offload.plan.Plan"):
        apply_plan(_encoder(), ["keep"] * 4)  # type: ignore[arg-type]


def test_apply_refuses_a_memory_budget_beside_the_plans_own() -> None:
    # Bytes kept under it would start after the plan's budget check has passed.
    plan = Plan((Choice.OFFLOAD, Choice.KEEP, Choice.KEEP, Choice.KEEP), 1000, 0.0, 0)
    layers = _encoder()
    with pytest.raises(ValueError, match="apply_plan does not take memory_budget"):
        apply_plan(layers, plan, memory_budget=2000)
    apply_plan(layers, plan).remove()  # nothing was left wrapped


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"steps": 0}, "steps must be an int >= 1"), ({"warmup": -1}, "warmup")]
)
def test_profile_bad_arguments(kwargs: dict, match: str) -> None:
    model = _encoder()
    with pytest.raises(ValueError, match=match):
        profile_model(model, lambda: model(_batches()[0]).sum(), **kwargs)


def test_profile_measures_the_host_apart_when_asked() -> None:
    # On the CPU stand-in both clocks are the wall clock: what is checked is that every
    # choice's host time is measured, and that the model of keeping every layer is the
    # plain step (the rest of the step fills what the layers leave).
    model = _encoder()
    x = _batches()[0]
    profile = profile_model(
        model, lambda: model(x).sum(), steps=2, host=True, min_tensor_size_to_offload=1024
    )
    hosts = [c.host for c in profile.layers]
    assert all(h is not None for h in hosts)
    for h in hosts:
        assert h is not None and h.forward_ms > 0 and h.backward_ms > 0
        assert min(v for v in vars(h).values() if v is not None) >= 0
    # Recomputing costs the host at least part of a forward again in backward.
    assert sum(h.recompute_backward_ms for h in hosts if h is not None) > 0
    assert profile_model(model, lambda: model(x).sum(), steps=1).layers[0].host is None
    with pytest.raises(TypeError, match="host must be a bool or None"):
        profile_model(model, lambda: model(x).sum(), host="yes")  # type: ignore[arg-type]


def test_the_plain_step_is_the_median_of_the_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    # A slow phase of the host while the first plain block is timed, and one slow round
    # among five: the model of keeping every layer is the plain step of the rounds.
    import cpu_offload.plan._timing as timing_module
    import cpu_offload.plan.profile as profile_module

    monkeypatch.setattr(timing_module.HostAndDevice, "ROUNDS", 5)
    times = iter([9000.0, 1000.0, 5000.0, 1000.0, 1000.0, 1000.0])
    calls = []

    def plain(step, clock, steps):  # type: ignore[no-untyped-def]
        calls.append(steps)
        step().backward()
        return next(times)

    monkeypatch.setattr(profile_module, "plain_step_ms", plain)
    monkeypatch.setattr(timing_module, "plain_step_ms", plain)
    model = _encoder()
    x = _batches()[0]
    profile = profile_model(
        model, lambda: model(x).sum(), steps=2, host=True, min_tensor_size_to_offload=1024
    )
    assert len(calls) == 1 + timing_module.HostAndDevice.ROUNDS
    assert estimate(profile, [Choice.KEEP] * LAYERS).step_ms == pytest.approx(1000.0)


def test_the_hosts_pace_picks_the_rounds_of_its_times(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three slow rounds of five (the host's slow phase) in which the plain step, bound by
    # the device, stays flat while every probed step takes 1.5 times as long on the host,
    # and the host probes beside them read it. With the pace "calm" the host's times, and
    # what recomputing and offloading add (1 ms and 0.5 ms a layer's forward on a calm
    # host), come from the two calm rounds (NOTE [The host's pace]); with the pace
    # "every", the profile's own, from all five, whose median is the slow phase's.
    import cpu_offload.plan._timing as timing_module
    from cpu_offload.plan._clock import SteadyPace
    from cpu_offload.plan._rounds import fast_rounds

    slow = [False, True, False, True, True]
    monkeypatch.setattr(timing_module.HostAndDevice, "ROUNDS", len(slow))
    monkeypatch.setattr(timing_module, "plain_step_ms", lambda step, clock, steps: 1000.0)
    rounds = iter(slow)
    real_rounds = timing_module.HostAndDevice._rounds
    real_profile = timing_module.HostAndDevice.profile
    adds = {"keep": 0.0, "recompute": 1.0, "offload": 0.5}
    runners = []

    def rounds_with_phases(self, configs):  # type: ignore[no-untyped-def]
        out, plain, probes = real_rounds(self, configs)
        for i in range(len(plain)):
            factor = 1.5 if next(rounds) else 1.0
            for name, runs in out.items():
                probes[name][i] = factor * 5.0
                for run in runs[i]:
                    run.host_forward = [factor * (2.0 + adds[name])] * len(run.host_forward)
                    run.host_backward = [factor * 3.0] * len(run.host_backward)
                    run.host_head_ms = factor * 4.0
                    run.host_lead_ms = factor * 0.5
        return out, plain, probes

    def recorded(self, *args):  # type: ignore[no-untyped-def]
        runners.append(self)
        return real_profile(self, *args)

    monkeypatch.setattr(timing_module.HostAndDevice, "_rounds", rounds_with_phases)
    monkeypatch.setattr(timing_module.HostAndDevice, "profile", recorded)
    # Plain steps of 1000 ms whatever is recomputed: recomputation's steady cost is not
    # what this test reads (tests/test_plan_clock.py does).
    monkeypatch.setattr(timing_module, "steady_pace", lambda *args, **kwargs: SteadyPace())
    model = _encoder()
    x = _batches()[0]
    every = profile_model(
        model, lambda: model(x).sum(), steps=2, host=True, min_tensor_size_to_offload=1024
    )
    (runner,) = runners
    assert runner.rebuild("every") == every
    profile = runner.rebuild("calm")
    for cost in profile.layers:
        assert cost.host.forward_ms == pytest.approx(2.0)
        assert cost.host.backward_ms == pytest.approx(3.0)
        assert cost.host.recompute_forward_ms == pytest.approx(1.0)
        assert cost.host.engaged_forward_ms == pytest.approx(0.5)
    assert profile.head_host_ms == pytest.approx(4.0)
    assert estimate(profile, [Choice.KEEP] * LAYERS).step_ms == pytest.approx(1000.0)

    for cost, calm in zip(every.layers, profile.layers, strict=True):
        assert cost.host.forward_ms == pytest.approx(3.0)
        assert cost.host.backward_ms == pytest.approx(4.5)
        assert cost.host.recompute_forward_ms == pytest.approx(1.5)
        assert cost.host.engaged_forward_ms == pytest.approx(0.75)
        # The device's times come from the same rounds whatever the host's pace.
        assert (cost.forward_ms, cost.backward_ms) == (calm.forward_ms, calm.backward_ms)
        assert cost.recompute_ms == calm.recompute_ms
    assert every.head_host_ms == pytest.approx(6.0)
    assert estimate(every, [Choice.KEEP] * LAYERS).step_ms == pytest.approx(1000.0)
    with pytest.raises(ValueError, match=r"pace must be one of \('calm', 'every'\), got 'fast'"):
        runner.rebuild("fast")

    assert fast_rounds([1000.0, 1020.0, 1040.0], 0.03) == [0, 1]
    assert fast_rounds([float("nan"), 1000.0, 1040.0], 0.03) == [1]
    assert fast_rounds([float("nan")] * 2, 0.03) == [0, 1]


def test_a_probe_counts_saved_tensors_or_measures_peaks_not_both() -> None:
    # NOTE [Memory peaks in a step of their own]: the hooks that count saved tensors
    # raise the peaks they would measure.
    from cpu_offload.engine.selection import ActivationPolicy
    from cpu_offload.plan._probe import Clock, Probe

    layers = list(_encoder().layers)
    policy = ActivationPolicy(MIN, lambda t: True)
    with pytest.raises(ValueError, match="policy.*memory.*not both"):
        Probe(layers, Clock(False), policy, memory=True)
    # On the CPU stand-in there are no device counters to read.
    probe = Probe(layers, Clock(False), memory=True)
    assert probe.memory is False
    probe.remove()


class _GlueBetweenLayers(nn.Module):
    """A model whose loop spends ``glue_s`` on the host before each layer but the first."""

    def __init__(self, glue_s: float) -> None:
        super().__init__()
        self.glue_s = glue_s
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i:
                time.sleep(self.glue_s)
            x = layer(x)
        return x


def test_a_layers_host_time_runs_from_the_previous_layers_end() -> None:
    # NOTE [A layer's host time runs from the previous layer's end]: what the host does
    # between two layers' hooks goes to the next layer's host time; the device's clock
    # still times each layer from its pre-hook.
    from cpu_offload.plan._probe import Clock, timed_step

    model = _GlueBetweenLayers(0.03)
    x = torch.randn(4, 8)
    _, times = timed_step(list(model.layers), lambda: model(x).sum(), Clock(False))
    assert times.host_forward[0] < 30.0
    assert min(times.host_forward[1:]) >= 30.0
    assert max(times.forward) < 30.0
    # The backward has no glue: the same times for the layers after the first.
    assert max(times.host_backward) < 30.0


def test_a_host_clock_on_cuda_records_no_event() -> None:
    # NOTE [The probe's own host time]: steps of which only the host's times are read
    # synchronize as on the device's clock, but their timestamps are the host's.
    from cpu_offload.plan._probe import Clock

    host = Clock(True, events=False)
    assert host.cuda and not host.events
    start = host.now()
    time.sleep(0.002)
    end = host.now()
    assert isinstance(start, float) and host.ms(start, end) >= 2.0
    assert not Clock(False).events and not Clock(False, events=True).events


class _OwnCall(nn.Linear):
    """A layer whose class defines ``__call__``, as Megatron-Core's and transformers' do:
    offload_layers wraps it around that ``__call__``, outside its module hooks."""

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        return super().__call__(*args, **kwargs)


def test_the_packages_work_outside_a_layers_hooks_is_its_host_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A recomputed layer's checkpoint starts before the layer's hooks run: 30 ms of it
    # counts for the layers after the first, and for the first in the step's lead; the
    # layer's own forward (from its pre-hook) leaves it out.
    import cpu_offload._layer_runner as runner_module
    from cpu_offload.plan._probe import Clock, timed_step

    real = runner_module.recompute

    def slow(*args: object) -> object:
        time.sleep(0.03)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(runner_module, "recompute", slow)
    layers = [_OwnCall(8, 8) for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)

    def step() -> torch.Tensor:
        y = x
        for layer in layers:
            y = layer(y)
        return y.sum()

    with offload_layers(layers, offloaded=(), recomputed=range(3)):
        _, times = timed_step(layers, step, Clock(False))
    assert times.host_lead_ms >= 30.0
    assert min(times.host_forward[1:]) >= 30.0
    assert max(times.host_forward_own) < 30.0


class _Times:
    """Stand-in for a probed step's times: what the host took per layer."""

    def __init__(self, forward: list[float], backward: list[float], lead_ms: float = 0.0) -> None:
        self.host_forward, self.host_backward = forward, backward
        self.host_lead_ms = lead_ms


def test_offloadings_host_time_is_split_into_the_engines_share_and_the_layers() -> None:
    from cpu_offload.plan._rounds import offload_extras

    # 4 layers, the first 2 offloaded. Every layer under the engine takes 0.5 ms more to
    # enqueue its forward and 0.25 more its backward; the offloaded layers 2 more each
    # (forward), and their reloads 3 in all (backward, in layers 1 and 2's steps). The
    # engine's work for the first layer, 1 ms, runs before that layer's hooks, in the
    # step's lead (0.5 ms of the model's own without offloading): it is the offloaded
    # layers' too. The host runs 1.5 times slower in the second round, for both
    # configurations.
    def kept(speed: float) -> list[_Times]:
        return [_Times([speed] * 4, [2 * speed] * 4, lead_ms=0.5 * speed)] * 3

    def offload(speed: float) -> list[_Times]:
        fwd = [speed * v for v in (2.5, 3.5, 1.5, 1.5)]
        bwd = [speed * v for v in (2.25, 3.75, 3.75, 2.25)]
        return [_Times(fwd, bwd, lead_ms=1.5 * speed)] * 3

    speeds = (1.0, 1.5, 1.0)
    extras = offload_extras([offload(v) for v in speeds], [kept(v) for v in speeds], n=4, m=2)
    assert extras == {
        "engaged_forward_ms": 0.5,
        "offload_forward_ms": 2.5,
        "engaged_backward_ms": 0.25,
        "offload_backward_ms": 0.25 + 3 / 2,
    }


def test_what_a_choice_adds_comes_from_the_rounds_of_a_calm_host() -> None:
    from cpu_offload.plan._rounds import extra, picked, quiet_rounds

    # Recomputing adds 1 ms a layer on a calm host; in the second and third rounds the
    # host ran 1.5 times slower for the recomputed steps only, and the probes say so.
    def runs(extra: float, pace: float) -> list[_Times]:
        return [_Times([pace * (2.0 + extra)] * 4, [pace * 4.0] * 4)] * 3

    recomputed = [runs(1.0, p) for p in (1.0, 1.5, 1.5)]
    kept = [runs(0.0, 1.0)] * 3
    # Over every round the slow phase reads as cost.
    assert extra(recomputed, kept, "host_forward", 4) == pytest.approx(2.5)
    quiet = quiet_rounds(5.0, [5.0, 7.5, 7.5], [5.0, 5.0, 5.0])
    assert quiet == [0]
    assert extra(picked(recomputed, quiet), picked(kept, quiet), "host_forward", 4) == 1.0


def test_the_host_probe_reads_each_configuration_calm_or_slow() -> None:
    from cpu_offload.plan._probe import host_probe_ms
    from cpu_offload.plan._rounds import HOST_NOISE, calm, calm_reference, quiet_rounds

    assert host_probe_ms(ops=200) > 0
    # Five calm probes and three of a slow phase: the reference is the calm speed.
    probes = [5.0, 5.1, 5.2, 5.0, 10.0, 5.1, 7.5, 12.5]
    reference = calm_reference(probes)
    assert 5.0 <= reference <= 5.1
    assert calm(probes, reference) == [True, True, True, True, False, True, False, False]
    # The probe's own jitter on a calm host is not a phase.
    assert calm([(1 + HOST_NOISE) * 5.0], 5.0) == [True]
    assert calm([5.0, 50.0], float("nan")) == [True, True]
    assert math.isnan(calm_reference([float("nan"), 0.0]))
    assert calm_reference([7.0]) == 7.0
    # No round in which both configurations were calm: the calmest rounds count, not
    # every round (whose slow phases would read as cost).
    assert quiet_rounds(5.0, [5.0, 8.0, 9.0], [8.0, 6.0, 12.0]) == [0, 1]
    assert quiet_rounds(5.0, [float("nan")] * 2) == [0, 1]


def test_probed_gives_the_result_and_the_slower_probe(monkeypatch) -> None:
    from cpu_offload.plan import _probe

    readings = iter([4.0, 6.0, 9.0, 3.0])
    monkeypatch.setattr(_probe, "host_probe_ms", lambda: next(readings))
    ran: list[int] = []
    assert _probe.probed(lambda: ran.append(1) or "done") == ("done", 6.0)
    assert _probe.probed(lambda: 7) == (7, 9.0)  # the slower one, before or after
    assert ran == [1]


def test_profile_step_that_skips_layers() -> None:
    model = _encoder()
    x = _batches()[0]
    with pytest.raises(ValueError, match="did not run every layer"):
        profile_model(model, lambda: model.layers[0](x).sum(), steps=1, recompute=False)


@pytest.mark.parametrize("letters", ["OKRK", "RRKK", "KKKK"])
def test_compare_plan_variant_is_bit_identical(letters: str) -> None:
    from cpu_offload.compare._random import SameRandomState
    from cpu_offload.compare._step import Installed, one_step
    from cpu_offload.compare.variants import make_variant
    from cpu_offload.compare.workload import spec_workload
    from cpu_offload.models import ModelSpec
    from cpu_offload.plan.compare import plan_variant

    by_letter = {letter: c for c, letter in LETTERS.items()}
    plan = Plan(tuple(by_letter[c] for c in letters), 1, 0.0, 0)
    spec = ModelSpec(kind="encoder", hidden=32, heads=2, seq=16, batch=2, layers=4)
    workload = spec_workload(spec, "cpu")
    random_state = SameRandomState(cuda=False)

    def run(variant):  # type: ignore[no-untyped-def]
        installed = Installed(variant, workload, random_state)
        try:
            return one_step(installed, record=False, keep_grads=True)
        finally:
            installed.remove()

    ref = run(make_variant("none", 4, 0, MIN))
    variant = plan_variant(plan)(4, 0, MIN, HostTransport)
    assert variant.offloaded_layers == plan.offloaded
    assert variant.recomputed_layers == plan.recomputed
    got = run(variant)
    assert torch.equal(got.loss, ref.loss)
    assert all(torch.equal(a, b) for a, b in zip(got.grads, ref.grads, strict=True))
    assert (sum(t.bytes_offloaded for t in variant.transports) > 0) == ("O" in letters)


def test_plan_variant_rejects_a_plan_for_another_model() -> None:
    from cpu_offload.plan.compare import PlanVariant

    with pytest.raises(ValueError, match="made for 3 layers, but the model has 4"):
        PlanVariant(4, 0, MIN, plan=Plan((Choice.KEEP,) * 3, 1, 0.0, 0))
