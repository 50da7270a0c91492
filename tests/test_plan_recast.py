"""The planner's and the compare tool's models of saved casts that offloading rebuilds
instead of moving (NOTE [Casts rebuilt from their source]), and the profiles that find
them on a real block."""

from __future__ import annotations

import time

import pytest
import torch
from test_engine_recast import HIDDEN, PROBS_BYTES, SoftmaxInFp32, _input, _layers

from cpu_offload.compare.simulate import LayerProfile, simulate
from cpu_offload.engine.kept_layer import KeptLayer
from cpu_offload.plan import profile_model
from cpu_offload.plan.model import (
    Choice,
    LayerCost,
    Link,
    PartCost,
    Parts,
    Profile,
    Storage,
    estimate,
)
from cpu_offload.plan.usage import use_of

K, OFF = Choice.KEEP, Choice.OFFLOAD

# 150 saved bytes: the scores' fp32 softmax (100), its cast (40, rebuilt from it) and
# the input (10). 1 byte per ms on the link, so that copy time is the bytes.
WHOLE = LayerCost(1.0, 2.0, saved_bytes=150, offload_bytes=110, input_bytes=10, recast_bytes=40)
MOVING = LayerCost(1.0, 2.0, saved_bytes=150, offload_bytes=150, input_bytes=10)


def test_an_offloaded_layer_releases_its_casts_without_moving_them() -> None:
    use = use_of(WHOLE, OFF, True)
    assert (use.resident, use.moved, use.recast) == (0, 110, 40)
    assert use_of(WHOLE, K, True).resident == 150  # kept: nothing rebuilt


def test_the_model_spends_no_link_time_on_casts_and_frees_them_all_the_same() -> None:
    link = Link(1e-6, 1e-6)  # 1 byte per ms each way
    rebuilt = estimate(Profile((WHOLE,) * 4, link), [OFF, OFF, K, K])
    moving = estimate(Profile((MOVING,) * 4, link), [OFF, OFF, K, K])
    # The casts go when the copies are queued, before the moved bytes' release.
    assert rebuilt.peak_bytes <= moving.peak_bytes
    assert rebuilt.step_ms < moving.step_ms
    # Kept, the casts count in full: nothing is rebuilt.
    assert estimate(Profile((WHOLE,) * 4, link), [K] * 4).peak_bytes == (
        estimate(Profile((MOVING,) * 4, link), [K] * 4).peak_bytes
    )


def _parts_layer() -> LayerCost:
    storages = (
        Storage(100, 100),  # 0: the fp32 softmax, saved by the core
        Storage(40, 40, recast_of=0),  # 1: its cast, saved by the core's last matmul
        Storage(10, 10),  # 2: the input, saved by the projection
    )
    parts = (
        PartCost("proj", 0.5, 0.1, saved=(2,), inputs=(2,)),
        PartCost("core", 0.5, 0.1, saved=(0, 1), inputs=(2,)),
    )
    return LayerCost(1.0, 2.0, 150, 110, 10, storages=storages, parts=parts, recast_bytes=40)


def test_a_part_rebuilds_a_cast_only_where_its_source_is_sent_too() -> None:
    layer = _parts_layer()
    core = use_of(layer, Parts((("proj", K), ("core", OFF))), True)
    assert (core.resident, core.moved, core.recast) == (10, 100, 40)
    # The cast without its source (another part keeps the source): moved.
    storages = (Storage(100, 100), Storage(40, 40, recast_of=0), Storage(10, 10))
    split = LayerCost(
        1.0,
        2.0,
        150,
        110,
        10,
        storages=storages,
        parts=(
            PartCost("softmax", 0.5, 0.1, saved=(0,), inputs=(2,)),
            PartCost("matmul", 0.5, 0.1, saved=(1,), inputs=(0,)),
        ),
        recast_bytes=40,
    )
    use = use_of(split, Parts((("softmax", K), ("matmul", OFF))), True)
    assert (use.resident, use.moved, use.recast) == (100, 40, 0)


def test_compare_simulation_frees_casts_and_save_on_cpu_still_copies_them() -> None:
    rebuilt = LayerProfile(1.0, 2.0, saved_bytes=150, offload_bytes=110, input_bytes=10,
                           recast_bytes=40)  # fmt: skip
    moving = LayerProfile(1.0, 2.0, saved_bytes=150, offload_bytes=150, input_bytes=10)
    for variant in ("v2", "v1-sync", "v1-async"):
        a = simulate([rebuilt] * 4, variant, 2, 1e-6)
        b = simulate([moving] * 4, variant, 2, 1e-6)
        assert a.peak_bytes <= b.peak_bytes and a.step_ms < b.step_ms, variant
    a = simulate([rebuilt] * 4, "save_on_cpu", 2, 1e-6)
    b = simulate([moving] * 4, "save_on_cpu", 2, 1e-6)
    assert (a.peak_bytes, a.step_ms) == (b.peak_bytes, b.step_ms)


def _host_profile(layers: torch.nn.ModuleList) -> Profile:
    """A profile with the host's time apart (on the CPU), at a threshold the casts pass."""
    x = _input()
    return profile_model(
        layers,
        lambda: _run(layers, x),
        steps=1,
        warmup=0,
        host=True,
        recompute=False,
        min_tensor_size_to_offload=256,
    )


@pytest.mark.usefixtures("one_torch_thread")
def test_a_host_profile_times_the_layers_kept_with_their_casts_rebuilt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A recast layer's forward ends in KeptLayer.finish (the search for casts): made 20 ms
    # longer, the profile must read that on the host's clock, whatever the machine's load
    # does to the few microseconds it really takes.
    finish = KeptLayer.finish

    def slow_finish(self: KeptLayer) -> None:
        time.sleep(0.02)
        finish(self)

    monkeypatch.setattr(KeptLayer, "finish", slow_finish)
    profile = _host_profile(_layers(3))
    host = profile.layers[0].host
    assert host is not None
    assert host.recast_forward_ms is not None and host.recast_backward_ms is not None
    assert host.recast_forward_ms > 10.0, host
    # Layers without casts: no rounds for them, and no figure.
    plain = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    y = torch.randn(256, 64)
    other = profile_model(
        plain,
        lambda: plain(y).square().mean(),
        steps=1,
        warmup=0,
        host=True,
        min_tensor_size_to_offload=1024,
    )
    assert other.layers[0].host is not None and other.layers[0].host.recast_forward_ms is None


@pytest.mark.usefixtures("one_torch_thread")
def test_the_recast_round_takes_the_layers_with_casts_at_the_profiles_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cpu_offload.layers
    import cpu_offload.plan._timing as timing

    calls: list[dict] = []  # type: ignore[type-arg]
    real_offload, real_extra = cpu_offload.layers.offload_layers, timing.extra

    def offload_layers(layers, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        return real_offload(layers, **kwargs)

    per: dict[str, list[int]] = {}

    def extra(variant, kept, field, count, *args, **kwargs):  # type: ignore[no-untyped-def]
        per.setdefault(field, []).append(count)
        return real_extra(variant, kept, field, count, *args, **kwargs)

    monkeypatch.setattr(cpu_offload.layers, "offload_layers", offload_layers)
    monkeypatch.setattr(timing, "extra", extra)
    # Layers 0 and 2 save a cast; 1 and 3 (a linear layer and a GELU) do not.
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        [SoftmaxInFp32(), torch.nn.Linear(HIDDEN, HIDDEN), SoftmaxInFp32(), torch.nn.GELU()]
    ).to(torch.bfloat16)
    profile = _host_profile(layers)
    assert [c.recast_bytes > 0 for c in profile.layers] == [True, False, True, False]
    rounds = [kw for kw in calls if kw.get("recast")]
    assert rounds and all(kw["recast"] == (0, 2) for kw in rounds)
    # At the profile's threshold, as every plan applies it (the default would find no
    # cast this small and time nothing).
    assert all(kw.get("min_tensor_size_to_offload") == 256 for kw in rounds)
    # Shared out among the two recast layers, not the four.
    counts = [per[f][-1] for f in ("host_forward", "host_backward")]
    assert counts == [2, 2]


@pytest.mark.usefixtures("one_torch_thread")
def test_profiles_find_the_casts_of_a_real_block() -> None:
    layers = _layers(3)

    def step() -> torch.Tensor:
        x = _input()
        for layer in layers:
            x = layer(x)
        return x.float().square().mean()

    profile = profile_model(layers, step, min_tensor_size_to_offload=256, parts=True, steps=1)
    for cost in profile.layers:
        assert cost.recast_bytes == PROBS_BYTES
        casts = [s for s in cost.storages if s.recast_of is not None]
        assert [s.nbytes for s in casts] == [PROBS_BYTES]
        source = cost.storages[casts[0].recast_of]
        assert source.nbytes == 2 * PROBS_BYTES  # the fp32 softmax


# -- kept layers with their casts rebuilt (Choice.RECAST) -----------------------------

C, R = Choice.RECAST, Choice.RECOMPUTE
# The cast takes 0.25 ms to rebuild; offloading would cost the link 110 ms.
CAST = LayerCost(
    1.0, 2.0, saved_bytes=150, offload_bytes=110, input_bytes=10, recast_bytes=40, recast_ms=0.25
)


def test_a_recast_layer_frees_its_casts_for_the_time_of_casting_them() -> None:
    use = use_of(CAST, C, False)
    assert (use.resident, use.moved, use.recast, use.rerun_ms) == (110, 0, 40, 0.25)
    assert not use.offloaded
    profile = Profile((CAST,) * 4, Link(1e-6, 1e-6))
    keep, recast = estimate(profile, [K] * 4), estimate(profile, [C, C, C, K])
    # Three layers let 40 bytes each go at their forward's end; each comes back for its
    # own backward only, after the kept last layer's bytes went.
    assert keep.peak_bytes - recast.peak_bytes == 3 * 40
    assert recast.step_ms == pytest.approx(keep.step_ms + 3 * 0.25)
    assert recast.stall_ms == 0


def test_a_recast_layer_costs_the_host_what_the_profile_timed_for_it() -> None:
    from dataclasses import replace

    from cpu_offload.plan.model import HostCost

    # Host-bound: the host takes 4 ms a layer where the device takes 3.
    engaged = HostCost(2.0, 2.0, engaged_forward_ms=0.25, engaged_backward_ms=0.25)
    timed = replace(engaged, recast_forward_ms=1.0, recast_backward_ms=0.5)
    for host, added in ((engaged, 0.5), (timed, 1.5)):
        cost = replace(CAST, host=host)
        both = host.forward(C) + host.backward(C) - host.forward(K) - host.backward(K)
        assert both == pytest.approx(added)
        profile = Profile((cost,) * 4, Link(1e-6, 1e-6))
        keep, recast = estimate(profile, [K] * 4), estimate(profile, [C, C, C, K])
        # Three layers add their host time; the casts' device time hides under it.
        assert recast.step_ms - keep.step_ms == pytest.approx(3 * added)
    # An offloaded layer elsewhere does not add the engaged share to a recast layer: its
    # own hooks are the ones that run.
    assert timed.forward(C, engaged=True) == timed.forward(C) == 3.0
    assert timed.forward(K, engaged=True) == 2.25


def test_search_rebuilds_casts_where_that_is_cheapest_and_only_when_finer() -> None:
    from cpu_offload.plan import NoPlanFits, search
    from cpu_offload.plan.search import brute_force

    profile = Profile((CAST,) * 4, Link(1e-6, 1e-6))
    budget = estimate(profile, [K] * 4).peak_bytes - 60
    plan = search(profile, budget)
    assert set(plan.choices) <= {K, C} and plan.describe().count("C") >= 2
    assert plan.recast == tuple(j for j, c in enumerate(plan.choices) if c is C)
    assert plan.step_ms == pytest.approx(brute_force(profile, budget).step_ms)
    # Whole layers only: keep, offload or recompute (recomputation is cheaper than the link).
    whole = search(profile, budget, parts=False)
    assert C not in whole.choices and R in whole.choices
    assert whole.step_ms > plan.step_ms
    with pytest.raises(NoPlanFits):
        search(Profile((CAST,) * 4, Link(1e-6, 1e-6)), 100)


def test_a_layer_without_casts_is_never_recast() -> None:
    from cpu_offload.plan import search

    profile = Profile((MOVING,) * 4, Link(1e-6, 1e-6))
    budget = estimate(profile, [K] * 4).peak_bytes - 60
    assert C not in search(profile, budget).choices
    with pytest.raises(ValueError, match="must be one of 'keep', 'offload', 'recompute'; got"):
        estimate(Profile((_parts_layer(),), Link(1.0, 1.0)), [{"core": "recast"}])


def test_plan_files_keep_recast_choices_and_times(tmp_path) -> None:
    from cpu_offload.plan import Plan, load_plan, save_plan

    profile = Profile((CAST,) * 3, Link(1.0, 1.0))
    plan = Plan((C, OFF, K), 10_000, 1.0, 100, profile)
    save_plan(plan, tmp_path / "p.json")
    loaded = load_plan(tmp_path / "p.json")
    assert loaded.choices == (C, OFF, K) and loaded.describe() == "COK"
    assert loaded.profile is not None and loaded.profile.layers[0].recast_ms == 0.25
    from dataclasses import replace

    from cpu_offload.plan.model import HostCost

    # The host's time of a recast layer, where measured, and None where not.
    for timed in (None, 0.75):
        host = HostCost(1.0, 1.0, recast_forward_ms=timed, recast_backward_ms=timed)
        plan = Plan((C, K), 10_000, 1.0, 100, Profile((replace(CAST, host=host),) * 2, Link(1, 1)))
        save_plan(plan, tmp_path / "h.json")
        got = load_plan(tmp_path / "h.json").profile
        assert got is not None and got.layers[0].host == host


def test_a_recast_plan_applies_bit_identical_on_a_real_block() -> None:
    from helpers import assert_bit_equal, step

    from cpu_offload.plan import Plan, apply_plan

    layers = _layers()
    want = step(layers, _input)
    x = _input()
    profile = profile_model(
        layers, lambda: _run(layers, x), steps=1, warmup=0, min_tensor_size_to_offload=1024
    )
    assert [c.recast_bytes for c in profile.layers] == [PROBS_BYTES] * 3
    assert all(c.recast_ms > 0 for c in profile.layers)
    assert all(c.host is None for c in profile.layers)  # no host lane on the CPU
    plan = Plan((C, C, K), 1 << 40, 0.0, 0, profile)
    with apply_plan(layers, plan, min_tensor_size_to_offload=1024) as handle:
        assert handle.recast == (0, 1)
        kept = list(handle._runner.recast.values())

        def casts_let_go() -> None:
            assert [k.recast_bytes for k in kept] == [PROBS_BYTES] * 2

        assert_bit_equal(step(layers, _input, between=casts_let_go), want)


def _run(layers: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x.float().square().mean()


def test_a_tighter_plan_from_the_budget_check_keeps_its_recast_layers() -> None:
    import warnings

    from helpers import step

    from cpu_offload import offload_layers
    from cpu_offload.plan import BudgetCheck, search

    profile = Profile((CAST,) * 3, Link(1e-6, 1e-6))
    keep_peak = estimate(profile, [K] * 3).peak_bytes
    plan = search(profile, keep_peak)  # every layer kept

    class Over:  # the first step measured 80 bytes over the budget
        def reset(self) -> None:
            pass

        def peak(self) -> int:
            return keep_peak + 80

    layers = _layers(3)
    with offload_layers(layers, offloaded=[], min_tensor_size_to_offload=1024) as handle:
        watch = BudgetCheck(handle, plan, slack=0.0, memory=Over())
        handle.watch_steps(watch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(layers, _input)
            step(layers, _input)  # the tighter plan runs from here
        assert C in watch.plan.choices
        assert handle.recast == watch.plan.recast
