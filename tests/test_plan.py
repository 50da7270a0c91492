"""The planner's model and search on synthetic profiles (hand-made times, bytes, links)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cpu_offload.compare.simulate import LayerProfile, simulate
from cpu_offload.plan.methods import best_single_methods, single_methods
from cpu_offload.plan.model import (
    Choice,
    HostCost,
    LayerCost,
    Link,
    Profile,
    _Copies,
    check_choices,
    estimate,
    offload_schedule,
)
from cpu_offload.plan.search import NoPlanFits, brute_force, search
from cpu_offload.v2.schedule import default_synchronization_dict


def _random_profile(rng: random.Random, n: int, *, same: bool = False) -> Profile:
    def layer() -> LayerCost:
        saved = rng.randint(1000, 5000)
        return LayerCost(
            forward_ms=rng.uniform(0.5, 3),
            backward_ms=rng.uniform(1, 6),
            saved_bytes=saved,
            offload_bytes=rng.randint(saved // 2, saved),
            input_bytes=rng.randint(0, 300),
            recompute_ms=rng.choice([None, rng.uniform(0.5, 3)]),
            workspace_bytes=rng.randint(0, 500),
        )

    first = layer()
    link = Link(
        d2h_gbps=rng.uniform(0.0005, 0.005),
        h2d_gbps=rng.uniform(0.0005, 0.005),
        duplex_gbps=rng.choice([None, 0.004]),
        two_streams=rng.random() < 0.5,
    )
    layers = tuple(first if same else layer() for _ in range(n))
    return Profile(layers, link, static_bytes=rng.randint(0, 1000), other_ms=rng.uniform(0, 2))


# -- the model ---------------------------------------------------------------------------


@pytest.mark.parametrize("two_streams", [False, True])
def test_model_matches_the_default_schedule_simulation(two_streams: bool) -> None:
    # The first k layers offloaded is the default schedule: the same step and peak as the
    # comparison tool's timeline model of it, with one copy stream or one per direction.
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(2, 8)
        k = rng.randint(0, n - 1)
        profile = _random_profile(rng, n)
        link = Link(profile.link.d2h_gbps, profile.link.h2d_gbps, two_streams=two_streams)
        profile = Profile(tuple(LayerCost(*astuple5(c)) for c in profile.layers), link)
        sim = simulate(
            [LayerProfile(*astuple5(c)) for c in profile.layers],
            "v2",
            k,
            link.d2h_gbps,
            link.h2d_gbps,
            duplex=two_streams,
        )
        est = estimate(profile, ["offload"] * k + ["keep"] * (n - k))
        assert est.step_ms == pytest.approx(sim.step_ms, rel=1e-9)
        assert est.peak_bytes == sim.peak_bytes


def astuple5(c: LayerCost) -> tuple[float, float, int, int, int]:
    return (c.forward_ms, c.backward_ms, c.saved_bytes, c.offload_bytes, c.input_bytes)


def test_schedule_generalizes_the_default() -> None:
    for n in range(1, 7):
        for k in range(n):
            choices = [Choice.OFFLOAD] * k + [Choice.KEEP] * (n - k)
            assert offload_schedule(choices) == default_synchronization_dict(k, n)
    plan = [Choice.KEEP, Choice.OFFLOAD, Choice.RECOMPUTE, Choice.OFFLOAD, Choice.KEEP]
    assert offload_schedule(plan) == {1: (True, 3, False, 2), 3: (True, 4, False, 3)}


def test_keep_and_recompute_by_hand() -> None:
    layer = LayerCost(1.0, 2.0, saved_bytes=1000, offload_bytes=900, input_bytes=100)
    profile = Profile((layer,) * 3, Link(1.0, 1.0), static_bytes=7, other_ms=0.5)
    keep = estimate(profile, ["keep"] * 3)
    assert (keep.step_ms, keep.peak_bytes, keep.stall_ms) == (9.5, 3007, 0.0)
    # Recomputing layer 0: one more forward, and only its input kept until its backward;
    # the recomputation allocates the saved tensors but the input again.
    rec = estimate(profile, ["recompute", "keep", "keep"])
    assert rec.step_ms == 10.5
    assert rec.peak_bytes == 7 + 100 + 2000


def test_the_host_bounds_a_step_whose_kernels_are_shorter_than_their_launches() -> None:
    # Device 1 ms forward, 2 ms backward; the host takes 3 ms to enqueue either.
    host = HostCost(
        forward_ms=3.0,
        backward_ms=3.0,
        offload_forward_ms=0.5,
        offload_backward_ms=0.25,
        recompute_forward_ms=0.5,
        recompute_backward_ms=2.0,
    )
    layer = LayerCost(1.0, 2.0, saved_bytes=100, offload_bytes=100, input_bytes=10, host=host)
    profile = Profile((layer,) * 3, Link(1.0, 1.0), other_ms=0.5)
    # Kept: six host-bound phases of 3 ms; the device ends with the host.
    assert estimate(profile, ["keep"] * 3).step_ms == 6 * 3.0 + 0.5
    # Offloading adds its host time in full (the copies hide behind the 1 ms forwards).
    assert estimate(profile, ["offload", "keep", "keep"]).step_ms == 18.5 + 0.5 + 0.25
    # Recomputing: 0.5 more to enqueue the forward, 2 ms more for the backward's.
    assert estimate(profile, ["recompute", "keep", "keep"]).step_ms == 18.5 + 0.5 + 2.0
    # Without the host's time the same layers give the device-bound model.
    bare = Profile((replace(layer, host=None),) * 3, Link(1.0, 1.0), other_ms=0.5)
    assert estimate(bare, ["keep"] * 3).step_ms == 9.5
    # Where the device is slower than the host, the host's time is hidden.
    slow = replace(host, forward_ms=0.5, backward_ms=0.5, offload_forward_ms=0.1)
    fast_host = Profile((replace(layer, host=slow),) * 3, Link(1.0, 1.0), other_ms=0.5)
    assert estimate(fast_host, ["keep"] * 3).step_ms == 9.5
    assert estimate(fast_host, ["offload", "keep", "keep"]).step_ms == 9.5
    # A head that is the device's work (2 ms, 0.5 ms to enqueue) lets the host get ahead:
    # the backward's first layers spend that lead. Kept: forward 9, head ends at 11 with
    # the host at 9.5; the backwards end at 13, 15.5 and 18.5.
    headed = replace(profile, head_ms=2.0, head_host_ms=0.5)
    assert estimate(headed, ["keep"] * 3).step_ms == 18.5 + 0.5


def test_a_host_bound_layers_copies_start_once_the_host_has_queued_them() -> None:
    # The engine queues an offloaded layer's copies at the next layer's start, so on a
    # host-bound forward (device 1 ms, host 3 ms a layer) they cannot start with the
    # layer's kernels: layer 0's 8 ms copy runs from 3 to 11 ms (from 0 to 8 if it
    # started with them). The default schedule releases its memory before layer 2's
    # forward, which the host reaches at 6 ms: compute waits 5 ms there (2 ms if the
    # copy had started at 0).
    host = HostCost(forward_ms=3.0, backward_ms=0.5)
    layer = LayerCost(1.0, 2.0, saved_bytes=800, offload_bytes=800, input_bytes=200, host=host)
    profile = Profile((layer,) * 3, Link(1e-4, 1e-4))  # 100 bytes a ms
    assert estimate(profile, ["keep"] * 3).step_ms == 3 * 3.0 + 3 * 2.0
    offloaded = estimate(profile, ["offload", "keep", "keep"])
    # Layer 2 then runs from 11 to 12 ms; the backwards of layers 2 and 1 end at 14 and
    # 16 ms while the reload, started at layer 1's backward (14 ms), runs to 22 ms.
    # Layer 0's backward runs beside it but for its last quarter (the input's share of
    # the bytes), which starts when the copy ends: it starts at 20.5, ends at 22.5 ms.
    assert offloaded.step_ms == 22.5
    assert offloaded.stall_ms == 5.0 + 4.5


def test_host_cost_per_choice_is_never_negative() -> None:
    host = HostCost(1.0, 2.0, offload_forward_ms=0.5, recompute_backward_ms=1.5)
    # keep, offload, recompute, recast (the context's share: none measured here)
    assert [host.forward(c) for c in Choice] == [1.0, 1.5, 1.0, 1.0]
    assert [host.backward(c) for c in Choice] == [2.0, 2.0, 3.5, 2.0]


def test_the_engine_adds_its_host_time_to_every_layer_once_one_is_offloaded() -> None:
    host = HostCost(
        1.0,
        2.0,
        offload_forward_ms=0.5,
        recompute_backward_ms=1.5,
        engaged_forward_ms=0.25,
        engaged_backward_ms=0.125,
    )
    # Kept and recomputed layers pay the engine's share only when engaged; an offloaded
    # layer's extra already holds it; a recast layer runs its own hooks, engaged or not.
    assert [host.forward(c, engaged=True) for c in Choice] == [1.25, 1.5, 1.25, 1.25]
    assert [host.backward(c, engaged=True) for c in Choice] == [2.125, 2.0, 3.625, 2.125]
    assert [host.forward(c) for c in Choice] == [1.0, 1.5, 1.0, 1.25]
    # On a host-bound step (device 0.1 ms a phase), a plan that offloads one layer adds
    # the engine's share to the two others, and a plan without one adds nothing.
    layer = LayerCost(0.1, 0.1, saved_bytes=100, offload_bytes=100, input_bytes=10, host=host)
    profile = Profile((layer,) * 3, Link(1.0, 1.0))
    kept = estimate(profile, ["keep"] * 3).step_ms
    assert kept == 3 * (1.0 + 2.0)
    assert estimate(profile, ["offload", "keep", "keep"]).step_ms == kept + 0.5 + 2 * 0.375
    assert estimate(profile, ["recompute", "keep", "keep"]).step_ms == kept + 1.5


def test_the_head_adds_to_what_the_layers_hold_at_the_end_of_the_forward() -> None:
    layer = LayerCost(1.0, 2.0, saved_bytes=1000, offload_bytes=900, input_bytes=100)
    profile = Profile((layer,) * 3, Link(1e-3, 1e-3), static_bytes=7, head_bytes=500)
    # Kept: all three layers' activations are on the device while the head runs.
    assert estimate(profile, ["keep"] * 3).peak_bytes == 7 + 3000 + 500
    # Recomputed: only the inputs are, and the recomputation's own peak comes later.
    rec = estimate(profile, ["recompute"] * 3)
    assert rec.peak_bytes == 7 + max(3 * 100 + 500, 2 * 100 + 1000)
    # Offloaded: the offload has released its bytes when the head runs.
    off = estimate(profile, ["offload", "keep", "keep"])
    assert off.peak_bytes == 7 + 100 + 2000 + 500


def test_copies_that_do_not_fit_stall_compute() -> None:
    # 1000 bytes at 500 bytes/ms: 2 ms per copy against 1 ms of forward.
    layer = LayerCost(1.0, 2.0, saved_bytes=1000, offload_bytes=1000, input_bytes=500)
    slow = Profile((layer,) * 2, Link(0.0005, 0.0005))
    est = estimate(slow, ["offload", "keep"])
    # Layer 0's offload ends at 2 ms but must end before the forward of layer 1 (at
    # 1 ms): a 1 ms stall. With one layer of two offloaded its reload starts with its
    # own backward (the schedule's n-k+i-1 = 0): the backward runs beside the 2 ms copy
    # but for its last half (the input's share of the bytes), which waits for its end.
    assert est.stall_ms == pytest.approx(1.0 + 1.0)
    assert est.step_ms == pytest.approx(6.0 + 2.0)


@pytest.mark.parametrize(
    ("link", "ends"),
    [
        # One stream: the reload waits for the offload queued before it.
        (Link(0.001, 0.001), (1.0, 2.0)),
        # One stream per direction, full duplex: both at full speed.
        (Link(0.001, 0.001, two_streams=True), (1.0, 1.0)),
        # One stream per direction, the link moves 1000 bytes/ms in all: half speed each.
        (Link(0.001, 0.001, duplex_gbps=0.001, two_streams=True), (2.0, 2.0)),
    ],
)
def test_copy_lanes_share_the_link(link: Link, ends: tuple[float, float]) -> None:
    # The schedule finishes every offload before backward, so both directions never
    # overlap in a plan; the copy model itself shares the link's duplex bandwidth.
    copies = _Copies(link)
    offload = copies.queue("d2h", 0.0, 1000, 0.0)
    reload = copies.queue("h2d", 0.0, 1000, 0.0)
    assert copies.end_of(offload) == pytest.approx(ends[0])
    assert copies.end_of(reload) == pytest.approx(ends[1])


def test_check_choices_errors() -> None:
    with pytest.raises(ValueError, match="choices has 1 entries for 2 layers"):
        check_choices(["keep"], 2)
    with pytest.raises(ValueError, match=r"choices\[1\] must be one of"):
        check_choices(["keep", "discard"], 2)
    with pytest.raises(ValueError, match="last layer cannot be offloaded"):
        check_choices(["keep", "offload"], 2)
    with pytest.raises(TypeError, match="choices must be a sequence"):
        check_choices("keep", 1)


@pytest.mark.parametrize("field", ["d2h_gbps", "h2d_gbps", "duplex_gbps"])
def test_link_rejects_non_positive_bandwidth(field: str) -> None:
    kwargs = {"d2h_gbps": 1.0, "h2d_gbps": 1.0, field: 0.0}
    with pytest.raises(ValueError, match=f"Link.{field} must be a positive number"):
        Link(**kwargs)


# -- the search --------------------------------------------------------------------------


def test_known_optima_by_hand() -> None:
    # 5 equal layers: forward 1 ms, backward 2 ms, 1000 bytes saved (100 of them the
    # input), a copy takes 2 ms.
    layer = LayerCost(1.0, 2.0, saved_bytes=1000, offload_bytes=1000, input_bytes=100)
    profile = Profile((layer,) * 5, Link(0.0005, 0.0005))
    # Two layers' copies hide under the later layers: free 2000 bytes at no cost.
    plan = search(profile, 3000)
    assert plan.describe() == "OOKKK"
    assert (plan.step_ms, plan.peak_bytes) == (15.0, 3000)
    # Below that, offloading more stalls on the link: recomputing four layers is cheaper
    # (4 ms) than offloading them (12 ms of stalls).
    plan = search(profile, 1500)
    assert plan.describe() == "RRRRK"
    assert plan.step_ms == 19.0


@pytest.mark.parametrize("seed", range(12))
def test_search_equals_brute_force_on_small_stacks(seed: int) -> None:
    rng = random.Random(seed)
    profile = _random_profile(rng, rng.randint(2, 6), same=seed % 2 == 0)
    keep_peak = estimate(profile, ["keep"] * profile.num_layers).peak_bytes
    for fraction in (1.0, 0.8, 0.6, 0.45, 0.3):
        budget = int(keep_peak * fraction)
        try:
            expected = brute_force(profile, budget)
        except NoPlanFits:
            with pytest.raises(NoPlanFits):
                search(profile, budget)
            continue
        plan = search(profile, budget)
        assert plan == expected
        assert plan.peak_bytes <= budget
        # The plan's figures are the model's.
        est = estimate(profile, plan.choices)
        assert (est.step_ms, est.peak_bytes) == (plan.step_ms, plan.peak_bytes)


@pytest.mark.parametrize("seed", range(6))
def test_heuristic_search_fits_and_nears_the_optimum(seed: int) -> None:
    # The search used above the exhaustive limit: never over budget, and on these cases
    # within 1% of the optimum.
    rng = random.Random(100 + seed)
    profile = _random_profile(rng, 6, same=seed % 2 == 0)
    keep_peak = estimate(profile, ["keep"] * 6).peak_bytes
    for fraction in (0.8, 0.6, 0.45):
        budget = int(keep_peak * fraction)
        try:
            expected = brute_force(profile, budget)
        except NoPlanFits:
            continue
        plan = search(profile, budget, exact_max_layers=0)
        assert plan.peak_bytes <= budget
        assert plan.step_ms <= expected.step_ms * 1.01


def test_large_stack_stays_within_budget() -> None:
    layer = LayerCost(2.6, 5.2, 1028 << 20, 1028 << 20, 16 << 20, workspace_bytes=64 << 20)
    profile = Profile((layer,) * 12, Link(53.0, 53.0, 82.0), static_bytes=1 << 30)
    keep = estimate(profile, ["keep"] * 12)
    for fraction in (0.75, 0.5, 0.3):
        budget = int(keep.peak_bytes * fraction)
        plan = search(profile, budget)
        assert plan.peak_bytes <= budget
        best = best_single_methods(profile, plan.peak_bytes)
        assert best is None or plan.step_ms <= best[1].step_ms


def test_keep_everything_when_it_fits() -> None:
    rng = random.Random(3)
    profile = _random_profile(rng, 10)
    keep = estimate(profile, ["keep"] * 10)
    plan = search(profile, keep.peak_bytes)
    assert plan.choices == (Choice.KEEP,) * 10
    assert plan.offloaded == plan.recomputed == ()


def test_no_plan_fits_is_a_clear_error() -> None:
    layer = LayerCost(1.0, 2.0, saved_bytes=1000, offload_bytes=1000, input_bytes=100)
    profile = Profile((layer,) * 3, Link(1.0, 1.0), static_bytes=5000)
    with pytest.raises(NoPlanFits, match=r"no plan fits a budget of 5,500 bytes.*lowest"):
        search(profile, 5500)
    with pytest.raises(NoPlanFits):
        search(profile, 5500, exact_max_layers=0)


@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [(0, ValueError, "budget_bytes must be > 0"), (1.5, TypeError, "budget_bytes must be an int")],
)
def test_bad_budget(budget: object, error: type, match: str) -> None:
    layer = LayerCost(1.0, 2.0, 10, 10, 1)
    with pytest.raises(error, match=match):
        search(Profile((layer,), Link(1.0, 1.0)), budget)  # type: ignore[arg-type]


def test_single_methods() -> None:
    methods = single_methods(3)
    assert set(methods) == {
        "offload k=1",
        "offload k=2",
        "recompute k=1",
        "recompute k=2",
        "recompute all",
    }
    assert methods["offload k=2"] == (Choice.OFFLOAD, Choice.OFFLOAD, Choice.KEEP)
