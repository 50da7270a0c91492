"""Offloading for pipeline stages: the plans for GPipe and 1F1B, and a stage run by hand.

The multi-process runs through ``torch.distributed.pipelining`` are in
``test_distributed_cpu.py``; here one process plays a stage's actions in the plan's
order, which checks the same bookkeeping in milliseconds.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cpu_offload import HostTransport
from cpu_offload.pipeline import (
    PipelineAction,
    PipelineOffloadPlan,
    PipelineStageOffload,
    plan_pipeline_offload,
    stage_order,
)

GRID = [(s, i, m) for s in (2, 3, 4) for i in range(s) for m in (4, 5, 8)]


def names(order):
    return " ".join(map(str, order))


def test_orders_of_gpipe_and_1f1b():
    assert names(stage_order("gpipe", 3, 1, 4)) == "F0 F1 F2 F3 B0 B1 B2 B3"
    assert names(stage_order("1f1b", 4, 0, 6)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert names(stage_order("1f1b", 4, 2, 6)) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5"
    assert names(stage_order("1F1B", 4, 3, 4)) == "F0 B0 F1 B1 F2 B2 F3 B3"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "stage", "micro"), GRID)
def test_plan_frees_and_reloads_as_stated(schedule, stages, stage, micro):
    for lag, prefetch in ((0, 1), (0, 0), (1, 1)):
        plan = plan_pipeline_offload(
            schedule, stages, stage, micro, release_lag=lag, prefetch=prefetch
        )
        order = plan.order
        fwd = {a.microbatch: t for t, a in enumerate(order) if a.forward}
        bwd = {a.microbatch: t for t, a in enumerate(order) if not a.forward}
        without = min(micro, stages - stage) if schedule == "1f1b" else micro
        assert plan.peak_resident_without_offload == without
        # The bound: the running micro-batch, those still copying out, those reloading.
        assert plan.peak_resident == min(1 + lag + prefetch, without)
        for m in range(micro):
            freed = [t for t, ms in plan.release_at.items() if m in ms]
            reloaded = [t for t, ms in plan.reload_at.items() if m in ms]
            if m not in plan.offloaded:
                assert freed == reloaded == []
                assert all(m in plan.resident[t] for t in range(fwd[m], bwd[m] + 1))
                continue
            assert freed == [fwd[m] + 1 + lag] and reloaded == [bwd[m] - prefetch]
            for t in range(len(order)):
                on = fwd[m] <= t <= bwd[m] and not freed[0] <= t < reloaded[0]
                assert (m in plan.resident[t]) == on
        if plan.peak_resident == without:
            assert not plan.offloaded  # offloading would lower nothing: nothing moves


def test_gpipe_offloads_every_microbatch_but_the_first():
    plan = plan_pipeline_offload("gpipe", 2, 0, 8)
    # F0 stays while F1 runs (its backward comes first, reloading it would be at once).
    assert plan.offloaded == frozenset(range(1, 8))
    assert plan.release_at[2] == (1,) and plan.reload_at[8] == (1,)
    assert "free 1" in plan.describe().splitlines()[2]


def test_last_1f1b_stage_offloads_nothing():
    plan = plan_pipeline_offload("1f1b", 4, 3, 8)
    assert not plan.offloaded and plan.peak_resident == 1


def test_two_stage_1f1b_needs_reload_without_prefetch():
    assert not plan_pipeline_offload("1f1b", 2, 0, 4).offloaded
    plan = plan_pipeline_offload("1f1b", 2, 0, 4, prefetch=0)
    assert plan.offloaded == frozenset(range(4)) and plan.peak_resident == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"schedule": "zb"}, ValueError, "schedule must be one of 'gpipe', '1f1b'"),
        ({"num_stages": 0}, ValueError, "num_stages must be >= 1"),
        ({"stage_index": 2}, ValueError, r"stage_index must be in \[0, 1\]"),
        ({"num_microbatches": 0}, ValueError, "num_microbatches must be >= 1"),
        ({"num_microbatches": 2.0}, TypeError, "num_microbatches"),
        ({"release_lag": -1}, ValueError, "release_lag and prefetch must be >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    args = {"schedule": "1f1b", "num_stages": 2, "stage_index": 0, "num_microbatches": 4}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        plan_pipeline_offload(**args)


def test_bad_orders_are_refused():
    f0, f1, b0, b1 = (PipelineAction(f, m) for f, m in ((1, 0), (1, 1), (0, 0), (0, 1)))
    with pytest.raises(ValueError, match="one forward and one backward"):
        PipelineOffloadPlan.from_order([f0, f1, b0])
    with pytest.raises(ValueError, match="backward of micro-batch 1 comes before"):
        PipelineOffloadPlan.from_order([f0, b1, b0, f1])
    with pytest.raises(TypeError, match="PipelineAction"):
        PipelineOffloadPlan.from_order(["F0", "B0"])


def blocks(n: int = 2, width: int = 32) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True) for _ in range(n)
    ]


def run_stage(module, order, inputs, grads):
    """Play ``order`` on ``module``: forward of inputs[m], backward with grads[m]."""
    outs = {}
    for action in order:
        m = action.microbatch
        if action.forward:
            outs[m] = module(inputs[m])
        else:
            outs.pop(m).backward(grads[m])
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize(("schedule", "prefetch"), [("gpipe", 1), ("1f1b", 1), ("1f1b", 0)])
def test_stage_is_bit_identical_and_holds_what_the_plan_says(schedule, prefetch):
    layers = blocks()
    plain = nn.Sequential(*copy.deepcopy(layers))
    plan = plan_pipeline_offload(schedule, 3, 0, 5, prefetch=prefetch)
    assert plan.offloaded
    transport = HostTransport()
    stage = PipelineStageOffload(layers, plan, transport=transport, min_tensor_size_to_offload=0)
    for step in range(2):
        torch.manual_seed(step)
        inputs = [torch.randn(2, 8, 32, requires_grad=True) for _ in range(5)]
        grads = [torch.randn(2, 8, 32) for _ in range(5)]
        plain.zero_grad()
        stage.zero_grad()
        expected = run_stage(plain, plan.order, [x.detach() for x in inputs], grads)
        got = run_stage(stage, plan.order, [x.detach() for x in inputs], grads)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
        assert stage.observed_resident == list(plan.resident)
    assert transport.bytes_offloaded > 0
    assert transport.bytes_offloaded == transport.bytes_reloaded
    assert all(s.get_offloaded_total_size_mb() == 0 for s in stage.synchronizers)


def test_stage_refuses_an_order_other_than_the_plan():
    plan = plan_pipeline_offload("gpipe", 2, 0, 2)
    stage = PipelineStageOffload(blocks(1), plan, transport=HostTransport())
    out = stage(torch.randn(2, 8, 32))
    with pytest.raises(RuntimeError, match="the backward of micro-batch 0 where the offload plan"):
        out.sum().backward()
    stage.reset()
    assert stage(torch.randn(2, 8, 32)).requires_grad  # a fresh step starts cleanly


def test_stage_without_grad_runs_plainly():
    plan = plan_pipeline_offload("gpipe", 2, 0, 2)
    layers = blocks(1)
    stage = PipelineStageOffload(layers, plan, transport=HostTransport()).eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        assert torch.equal(stage(x), layers[0](x))
    assert stage._next == 0


def test_stage_arguments_are_checked():
    plan = plan_pipeline_offload("gpipe", 2, 0, 2)
    with pytest.raises(TypeError, match="plan must be a PipelineOffloadPlan"):
        PipelineStageOffload(blocks(1), {"F0": 1})
    with pytest.raises(ValueError, match="at least one module"):
        PipelineStageOffload([], plan)
    with pytest.raises(TypeError, match="layers must be nn.Modules"):
        PipelineStageOffload([torch.relu], plan)


def test_attach_needs_a_stage_holding_the_module():
    plan = plan_pipeline_offload("gpipe", 2, 0, 2)
    module = PipelineStageOffload(blocks(1), plan, transport=HostTransport())

    class Stage:
        def __init__(self, submod):
            self.submod = submod

        def forward_one_chunk(self, fwd_chunk_id, x):
            return self.submod(x)

    with pytest.raises(TypeError, match="must be a pipelining stage"):
        module.attach(object())
    with pytest.raises(TypeError, match="does not contain this PipelineStageOffload"):
        module.attach(Stage(nn.Linear(2, 2)))
    stage = Stage(module)
    module.attach(stage)
    x = torch.randn(2, 8, 32)
    module(x)  # outside the schedule's forward (shape inference): not an action
    assert module._next == 0
    stage.forward_one_chunk(0, x)
    assert module._next == 1
    with pytest.raises(
        RuntimeError, match="ran a forward of micro-batch 2 where the offload plan expects F1"
    ):
        stage.forward_one_chunk(2, x)
