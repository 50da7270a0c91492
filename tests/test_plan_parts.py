"""Part by part plans on synthetic profiles: what a choice keeps, moves and recomputes, the
model, and the search against brute force."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cpu_offload.plan.model import (
    Choice,
    HostCost,
    LayerCost,
    Link,
    PartCost,
    Parts,
    Profile,
    Storage,
    check_choices,
    estimate,
)
from cpu_offload.plan.search import Plan, brute_force, layer_options, search
from cpu_offload.plan.usage import use_of

K, OFF, R = Choice.KEEP, Choice.OFFLOAD, Choice.RECOMPUTE

# A layer of 215 saved bytes: its input x (10), the attention core's scores (100, taken
# from q = a view of the projection's output, 20), the MLP's hidden activation (80), and
# 5 bytes below the engine's threshold that the layer saves outside its parts.
STORAGES = (
    Storage(10, 10),  # 0: x, saved by the projection
    Storage(20, 20),  # 1: the projection's output, saved by the core
    Storage(100, 100),  # 2: the core's scores
    Storage(80, 80),  # 3: the MLP's hidden activation
    Storage(5, 0, outside=True),  # 4: saved outside any part, not movable
)
PARTS = (
    PartCost("proj", 1.0, 0.5, saved=(0,), inputs=(0,)),
    PartCost("core", 0.5, 0.25, saved=(1, 2), inputs=(1,)),
    PartCost("mlp", 2.0, 0.5, saved=(3,), inputs=(4,)),
)
LAYER = LayerCost(
    forward_ms=3.5,
    backward_ms=7.0,
    saved_bytes=215,
    offload_bytes=210,
    input_bytes=10,
    storages=STORAGES,
    parts=PARTS,
)


def _parts(proj: Choice = K, core: Choice = K, mlp: Choice = K) -> Parts:
    return Parts((("proj", proj), ("core", core), ("mlp", mlp)))


def test_what_a_part_by_part_choice_keeps_moves_and_recomputes() -> None:
    keep = use_of(LAYER, _parts(), False)
    assert (keep.resident, keep.moved, keep.rerun_bytes, keep.offloaded) == (215, 0, 0, False)
    # Recomputing the core keeps its input (the projection's output) and frees its scores.
    core = use_of(LAYER, _parts(core=R), False)
    assert (core.resident, core.moved, core.rerun_bytes, core.rerun_ms) == (115, 0, 100, 0.5)
    assert core.forward_extra == 100 and not core.offloaded
    # Offloading the core moves both of its storages; the layer counts as offloaded.
    moved = use_of(LAYER, _parts(core=OFF), False)
    assert (moved.resident, moved.moved, moved.offloaded) == (95, 120, True)
    # The core recomputed and the MLP offloaded: the core's input stays, its scores go.
    mixed = use_of(LAYER, _parts(core=R, mlp=OFF), False)
    assert (mixed.resident, mixed.moved, mixed.rerun_bytes) == (35, 80, 100)
    # The projection offloaded but the core recomputed: the projection's input is not the
    # core's; the core's input (storage 1) is kept although the core saves it.
    both = use_of(LAYER, _parts(proj=OFF, core=R), False)
    assert (both.resident, both.moved, both.rerun_bytes) == (105, 10, 100)


def test_a_storage_kept_by_one_part_is_not_moved_by_another() -> None:
    # The MLP's input (storage 4, the layer's unmovable rest) and a storage two parts save.
    storages = (Storage(40, 40), Storage(8, 8))
    parts = (
        PartCost("a", 1.0, 0.0, saved=(0,), inputs=()),
        PartCost("b", 1.0, 0.0, saved=(0, 1), inputs=()),
    )
    layer = LayerCost(2.0, 4.0, 48, 48, 0, storages=storages, parts=parts)
    use = use_of(layer, Parts((("a", K), ("b", OFF))), False)
    # The engine still copies storage 0 (b saves it), which frees nothing: it comes back
    # as a second device copy.
    assert (use.resident, use.moved, use.copied) == (40, 8, 40)
    use = use_of(layer, Parts((("a", R), ("b", OFF))), False)
    # a's recomputation makes storage 0 again in backward although b moved it.
    assert (use.resident, use.moved, use.copied, use.rerun_bytes) == (0, 48, 0, 40)


def test_a_recomputed_part_makes_again_what_the_layer_keeps_too() -> None:
    # The part saves storage 0, which the layer also saves outside it, and storage 1.
    storages = (Storage(40, 40, outside=True), Storage(8, 8))
    parts = (PartCost("a", 1.0, 0.0, saved=(0, 1), inputs=()),)
    layer = LayerCost(2.0, 4.0, 48, 48, 0, storages=storages, parts=parts)
    use = use_of(layer, Parts((("a", R),)), False)
    assert (use.resident, use.forward_extra, use.rerun_bytes) == (40, 8, 48)


def test_all_parts_kept_is_keeping_the_layer() -> None:
    profile = Profile((LAYER,) * 3, Link(1e-4, 1e-4), static_bytes=1000)
    keep = estimate(profile, [K, K, K])
    assert estimate(profile, [_parts(), _parts(), K]) == keep
    # A part offloaded makes the layer offloaded for the schedule: memory drops.
    offloaded = estimate(profile, [_parts(core=OFF), K, K])
    assert offloaded.peak_bytes < keep.peak_bytes


def test_a_backward_runs_until_it_needs_what_a_part_offloaded() -> None:
    # The parts run proj, core, mlp (3.5 ms of forward): the backward runs the MLP's and
    # the core's first (5 of its 7 ms) before it needs what the projection saved.
    assert use_of(LAYER, _parts(proj=OFF), True).ahead_ms == pytest.approx(5.0)
    assert use_of(LAYER, _parts(core=OFF), True).ahead_ms == pytest.approx(4.0)
    assert use_of(LAYER, _parts(mlp=OFF), True).ahead_ms == 0.0
    assert use_of(LAYER, OFF, True).ahead_ms == 0.0
    # The projection's 10 bytes come back in 2 ms, or 8 ms (1.25e-6 GB/s): a stall of
    # the 3 ms the backward ahead of them does not cover, none with 2 ms.
    keep = estimate(Profile((LAYER,) * 2, Link(1e-4, 5e-6)), [K, K])
    for h2d_gbps, stall in ((5e-6, 0.0), (1.25e-6, 3.0)):
        profile = Profile((LAYER,) * 2, Link(1e-4, h2d_gbps))
        est = estimate(profile, [_parts(proj=OFF), K])
        assert est.stall_ms == pytest.approx(stall)
        assert est.step_ms == pytest.approx(keep.step_ms + stall)


def test_a_backward_runs_beside_the_copies_of_an_offloaded_part() -> None:
    # The core offloaded: its 120 bytes come back in 12 ms (1e-5 GB/s), from the start of
    # the layer's backward, the first saved (the projection's output, 20 bytes) last.
    # The backward runs the MLP's 4 ms first, then the core's 1 ms and the projection's
    # 2 ms (their shares of the forward) beside the copies. The part of the core's that
    # reads the projection's output (its share of the core's bytes, a sixth) waits for the
    # last copy, and the projection's after it: 2 1/6 of the 3 ms start at 12 ms, the
    # rest, 5/6 ms, starts at 11 1/6 ms, a stall of 7 1/6 ms (8 if the whole reload came
    # first, 5.5 if the reads spread over the 3 ms as the bytes do).
    keep = estimate(Profile((LAYER,) * 2, Link(1e-4, 1e-5)), [K, K])
    share = (0.5 / 6 + 1.0) / 1.5
    assert use_of(LAYER, _parts(core=OFF), True).last_share == pytest.approx(share)
    est = estimate(Profile((LAYER,) * 2, Link(1e-4, 1e-5)), [_parts(core=OFF), K])
    assert est.stall_ms == pytest.approx(7 + 1 / 6)
    assert est.step_ms == pytest.approx(keep.step_ms + 7 + 1 / 6)
    # The MLP offloaded: it sends one storage, which its backward reads, and the core's and
    # the projection's come after it: the whole backward waits for that copy.
    assert use_of(LAYER, _parts(mlp=OFF), True).last_share == 1.0


def test_a_recomputed_part_costs_the_host_its_share_of_the_layer() -> None:
    # The layer's forward takes the host 2 ms; recomputing it whole adds 0.8 ms to its
    # forward (the checkpoint's hooks) and 2.4 ms to its backward. The core's forward
    # takes the host 0.25 ms of the 2: an eighth of each.
    host = HostCost(
        forward_ms=2.0, backward_ms=3.0, recompute_forward_ms=0.8, recompute_backward_ms=2.4
    )
    layer = replace(LAYER, host=host)
    use = use_of(layer, _parts(core=R), False)
    assert use.host_forward_ms == pytest.approx(2.0 + 0.8 / 8)
    assert use.host_backward_ms == pytest.approx(3.0 + 2.4 / 8)
    whole = use_of(layer, R, False)
    assert whole.host_forward_ms == pytest.approx(2.8)
    # Parts whose host times are unknown (0) take their share of the device's forward:
    # the core's 0.5 ms of the layer's 3.5.
    untimed = tuple(replace(p, host_ms=0.0) for p in PARTS)
    use = use_of(replace(layer, parts=untimed), _parts(core=R), False)
    assert use.host_forward_ms == pytest.approx(2.0 + 0.8 / 7)
    # Of the 2 ms, 0.4 ran before the layer's own start (the model's code between
    # layers): the core's share is 0.25 of the layer's own 1.6 ms.
    own = replace(layer, host=replace(host, own_forward_ms=1.6))
    use = use_of(own, _parts(core=R), False)
    assert use.host_forward_ms == pytest.approx(2.0 + 0.8 * 0.25 / 1.6)


def test_part_choices_are_checked_against_the_profiled_parts() -> None:
    layers = (LAYER, LAYER)
    plan = check_choices([{"core": "recompute"}, "keep"], 2, layers)
    assert plan == (_parts(core=R), K)
    with pytest.raises(ValueError, match=r"the parts must be those profiled for layer 0 \(proj"):
        check_choices([{"attn": "offload"}, "keep"], 2, layers)
    with pytest.raises(ValueError, match=r"choices\[0\]\['core'\] must be one of"):
        check_choices([{"core": "drop"}, "keep"], 2, layers)
    with pytest.raises(ValueError, match="last layer cannot be offloaded, whole or a part"):
        check_choices(["keep", {"mlp": "offload"}], 2, layers)
    plain = LayerCost(1.0, 2.0, 100, 100, 10)
    with pytest.raises(ValueError, match="layer 1 has no profiled parts"):
        check_choices(["keep", {"mlp": "recompute"}], 2, (LAYER, plain))


def test_a_plan_names_its_parts_for_offload_layers() -> None:
    plan = Plan((_parts(core=R, mlp=OFF), OFF, R, K), 1, 0.0, 0)
    assert plan.describe() == "PORK"
    assert plan.parts == {0: {"core": "recompute", "mlp": "offload"}}
    assert plan.offloaded == (1,) and plan.recomputed == (2,)
    assert _parts(core=R, mlp=OFF).describe() == "core:R,mlp:O"


def test_layer_options_leave_out_what_another_option_beats() -> None:
    options = layer_options(LAYER, Link(1e-4, 1e-4))
    assert options[:3] == [K, OFF, R]
    parts = [o for o in options if isinstance(o, Parts)]
    # Recomputing the projection keeps its input, the only storage it saves: 1 ms more
    # to free nothing, beaten by keeping it.
    assert _parts(proj=R) not in parts
    assert _parts(core=R) in parts and _parts(core=R, mlp=OFF) in parts
    assert len(layer_options(LAYER, limit=2)) == 5
    with pytest.raises(ValueError, match="limit must be an int >= 0"):
        layer_options(LAYER, limit=-1)
    # The last layer offloads nothing, whole or in part.
    last = layer_options(LAYER, last=True)
    assert OFF not in last and not any(isinstance(o, Parts) and o.offloads for o in last)


def test_an_offloaded_layer_is_not_the_same_option_as_a_kept_one() -> None:
    # Offloading the part moves nothing (the layer keeps its storage outside it), and
    # copies its bytes: as a plan, it is an offloaded layer, which moves the others'
    # schedule; it is compared with offloaded options only.
    storages = (Storage(40, 0, outside=True), Storage(60, 60))
    parts = (PartCost("a", 1.0, 0.0, saved=(0,), inputs=()),)
    layer = LayerCost(2.0, 4.0, 100, 60, 0, storages=storages, parts=parts)
    options = layer_options(layer)
    assert Parts((("a", OFF),)) in options


def _random_layer(rng: random.Random) -> LayerCost:
    storages = tuple(
        Storage(n, rng.choice([n, n, 0])) for n in (rng.randint(10, 400) for _ in range(4))
    )
    parts = (
        PartCost("a", rng.uniform(0.1, 2), rng.uniform(0, 1), saved=(1, 2), inputs=(0,)),
        PartCost("b", rng.uniform(0.1, 2), rng.uniform(0, 1), saved=(3,), inputs=(2,)),
    )
    saved = sum(s.nbytes for s in storages)
    return LayerCost(
        forward_ms=rng.uniform(1, 3),
        backward_ms=rng.uniform(2, 6),
        saved_bytes=saved,
        offload_bytes=sum(s.offload_bytes for s in storages),
        input_bytes=storages[0].nbytes,
        workspace_bytes=rng.randint(0, 100),
        storages=storages,
        parts=parts,
    )


def _random_profile(rng: random.Random, n: int) -> Profile:
    link = Link(rng.uniform(0.0002, 0.002), rng.uniform(0.0002, 0.002))
    return Profile(tuple(_random_layer(rng) for _ in range(n)), link, static_bytes=100)


@pytest.mark.parametrize("seed", range(4))
def test_search_with_parts_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = 3 if seed % 2 else 4  # 4 layers of 11 options: past the exhaustive search
    profile = _random_profile(rng, n)
    keep_peak = estimate(profile, [K] * n).peak_bytes
    found_parts = False
    for fraction in (0.8, 0.6, 0.45):
        budget = int(keep_peak * fraction)
        try:
            expected = brute_force(profile, budget)
        except Exception:
            with pytest.raises(Exception, match="no plan fits"):
                search(profile, budget)
            continue
        plan = search(profile, budget)
        assert plan.peak_bytes <= budget
        assert estimate(profile, plan.choices).peak_bytes == plan.peak_bytes
        assert plan.step_ms <= expected.step_ms * 1.01
        found_parts |= any(isinstance(c, Parts) for c in plan.choices)
        # Without parts the search is the whole-layer one, never faster than with them.
        try:
            whole = search(profile, budget, parts=False)
        except Exception:
            continue
        assert all(not isinstance(c, Parts) for c in whole.choices)
        assert plan.step_ms <= whole.step_ms + 1e-9
    if seed == 0:
        assert found_parts, "the brute-force case should choose some part by part plan"


def test_a_layers_copies_queue_after_its_last_offloaded_part() -> None:
    # The engine queues the copies once the last offloaded part has run (NOTE [Parts of a
    # layer]): after the projection, 1 of the forward's 3.5 device ms and 0.5 of the
    # parts' 1.25 host ms; after the core, 1.5 ms and 0.75 ms; a whole layer at its end.
    assert use_of(LAYER, _parts(proj=OFF), True).queued_share == pytest.approx(1 / 3.5)
    assert use_of(LAYER, _parts(proj=OFF), True).queued_host_share == pytest.approx(0.4)
    core = use_of(LAYER, _parts(proj=OFF, core=OFF), True)
    assert (core.queued_share, core.queued_host_share) == pytest.approx((1.5 / 3.5, 0.6))
    assert use_of(LAYER, _parts(mlp=OFF), True).queued_share == 1.0
    assert use_of(LAYER, OFF, True).queued_share == 1.0
    # A host-bound layer (10 ms to enqueue) whose next layer's forward waits for its
    # copies: the projection's 10 bytes at 2 bytes a ms, queued at 4 ms, are done at 9,
    # before the next layer starts at 10; the MLP's 80 bytes, queued at 10, end at 50.
    layer = replace(LAYER, host=HostCost(10.0, 10.0))
    profile = Profile((layer,) * 2, Link(2e-6, 1.0))
    assert estimate(profile, [_parts(proj=OFF), K]).stall_ms == 0.0
    assert estimate(profile, [_parts(mlp=OFF), K]).stall_ms == pytest.approx(40.0, abs=1e-3)


def test_which_parts_wait_for_the_last_copy_back() -> None:
    storages = tuple(Storage(10, 10) for _ in range(6))

    def last_share(parts: tuple[PartCost, ...], choices: tuple[Choice, ...]) -> float:
        layer = LayerCost(3.0, 6.0, 60, 60, 10, storages=storages, parts=parts)
        plan = Parts(tuple((p.name, c) for p, c in zip(parts, choices, strict=True)))
        return use_of(layer, plan, True).last_share

    # A parallel residual: the norm's output (1) taken by the attention (offloaded) and the
    # MLP (kept, its device copy read): only the attention's tenth that reads storage 1
    # and the norm's backward after it wait, not the MLP's.
    parallel = (
        PartCost("norm", 0.1, 0.0, saved=(0,), inputs=(0,)),
        PartCost("attn", 1.0, 0.0, saved=(1, 2), inputs=(1,)),
        PartCost("mlp", 2.0, 0.0, saved=(1, 3), inputs=(1,)),
    )
    assert last_share(parallel, (K, OFF, K)) == pytest.approx((0.1 + 1.0 * 10 / 20) / 3.1)
    # Two offloaded parts save it (q and k of one input): the one the forward ran last
    # reads it first in backward and waits its bytes' share, the other wholly.
    siblings = (
        PartCost("q", 1.0, 0.0, saved=(0, 1), inputs=(0,)),
        PartCost("k", 1.0, 0.0, saved=(0, 2), inputs=(0,)),
        PartCost("core", 1.0, 0.0, saved=(3,), inputs=(1, 2)),
    )
    assert last_share(siblings, (OFF, OFF, K)) == pytest.approx((1.0 + 10 / 20) / 2.0)
    # A kept part that saved the layer's input and a later storage ran later: beside.
    straddling = (
        PartCost("q", 1.0, 0.0, saved=(1, 2), inputs=()),
        PartCost("p", 1.0, 0.0, saved=(0, 5), inputs=()),
        PartCost("r", 1.0, 0.0, saved=(3, 4), inputs=()),
    )
    assert last_share(straddling, (OFF, K, K)) == pytest.approx(0.5 / 2.0)
