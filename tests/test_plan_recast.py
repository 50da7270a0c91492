"""The planner's and the compare tool's models of saved casts that offloading rebuilds
instead of moving (NOTE [Casts rebuilt from their source]), and the profiles that find
them on a real block."""

from __future__ import annotations

import pytest
import torch
from test_engine_recast import PROBS_BYTES, _input, _layers

from cpu_offload.compare.simulate import LayerProfile, simulate
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
