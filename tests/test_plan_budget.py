"""The budget check of an applied plan: a step over budget tightens the plan or stops.

CPU stand-in: the layers run on the CPU and the peaks come from a stand-in memory
source, so that the decisions are tested here; ``test_plan_cuda.py`` measures real ones.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from cpu_offload import HostTransport, offload_layers
from cpu_offload.plan import (
    BudgetCheck,
    Choice,
    Plan,
    PlanOverBudget,
    apply_plan,
    estimate,
    profile_model,
    search,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS = 6
MIN = 64


class Peaks:
    """A memory source that reports the given peaks, one per measured step."""

    def __init__(self, *peaks: int) -> None:
        self.peaks = list(peaks)
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1

    def peak(self) -> int:
        return self.peaks.pop(0)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(LAYERS)])


def _x() -> torch.Tensor:
    return torch.randn(128, 32, generator=torch.Generator().manual_seed(1))


def _train(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(_x()).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _plan(model: nn.Module, fraction: float = 0.9) -> Plan:
    x = _x()
    profile = profile_model(
        model, lambda: model(x).square().mean(), steps=1, min_tensor_size_to_offload=MIN
    )
    keep = estimate(profile, [Choice.KEEP] * LAYERS).peak_bytes
    return search(profile, int(fraction * keep))


def _apply(model: nn.Module, plan: Plan, peaks: Peaks) -> tuple[object, BudgetCheck]:
    handle = apply_plan(model, plan, min_tensor_size_to_offload=MIN, transport=HostTransport())
    assert handle.watch is None  # CPU: apply_plan checks nothing by itself
    check = BudgetCheck(handle, plan, memory=peaks)
    handle.watch_steps(check)
    return handle, check


def test_a_step_within_budget_ends_the_check() -> None:
    model = _model()
    plan = _plan(model)
    peaks = Peaks(plan.budget_bytes)
    handle, check = _apply(model, plan, peaks)
    for _ in range(3):
        _train(model)
    assert check.done and check.measured_peak_bytes == plan.budget_bytes
    assert peaks.resets == 1  # only the first step was measured
    handle.remove()


def test_a_step_over_budget_tightens_the_plan_from_the_next_step() -> None:
    model = _model()
    want = [_train(model) for _ in range(3)]
    plan = _plan(model)
    over = plan.budget_bytes + (plan.budget_bytes - plan.peak_bytes) + plan.budget_bytes // 5
    handle, check = _apply(model, plan, Peaks(over, plan.budget_bytes))
    got = []
    with pytest.warns(UserWarning, match=f"the plan {plan.describe()} peaked at"):
        got.append(_train(model))
    assert check.plan is plan and not check.done  # the next forward applies the new one
    got.append(_train(model))
    tighter = check.plan
    assert tighter.choices != plan.choices and check.tightened == 1
    assert tighter.peak_bytes < plan.peak_bytes
    assert handle.offloaded == tighter.offloaded and handle.recomputed == tighter.recomputed
    assert check.done
    got.append(_train(model))
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, ref_loss)
        for g, r in zip(grads, ref_grads, strict=True):
            assert torch.equal(g, r)
    handle.remove()


def test_no_tighter_plan_stops_the_next_forward_with_the_figures() -> None:
    model = _model()
    plan = _plan(model)
    bare = Plan(plan.choices, plan.budget_bytes, plan.step_ms, plan.peak_bytes)  # no profile
    handle, check = _apply(model, bare, Peaks(2 * plan.budget_bytes))
    _train(model)
    with pytest.raises(
        PlanOverBudget, match="over its budget of .* by .*, and the plan has no profile"
    ):
        model(_x())
    # Told once: training that goes on runs the plan as it is, unchecked.
    _train(model)
    assert check.done
    handle.remove()


def test_tightening_gives_up_after_max_tightenings() -> None:
    model = _model()
    plan = _plan(model, 0.95)
    over = int(1.3 * plan.budget_bytes)
    handle = apply_plan(model, plan, min_tensor_size_to_offload=MIN, transport=HostTransport())
    check = BudgetCheck(handle, plan, memory=Peaks(over, over), max_tightenings=1)
    handle.watch_steps(check)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model)
        _train(model)
    with pytest.raises(PlanOverBudget, match="1 tighter plans did not bring it within"):
        _train(model)
    handle.remove()


def test_apply_plan_checks_its_flag() -> None:
    model = _model()
    plan = Plan((Choice.KEEP,) * LAYERS, 1, 0.0, 0)
    with pytest.raises(TypeError, match="check_budget must be a bool"):
        apply_plan(model, plan, check_budget="yes")


def test_reassign_changes_the_layers_between_steps_and_refuses_bad_sets() -> None:
    model = _model()
    want = _train(model)
    handle = offload_layers(model, 2, min_tensor_size_to_offload=MIN, transport=HostTransport())
    handle.reassign(offloaded=[1, 3], recomputed=[0, 5])
    assert handle.offloaded == (1, 3) and handle.recomputed == (0, 5)
    got = _train(model)
    assert torch.equal(got[0], want[0])
    for g, r in zip(got[1], want[1], strict=True):
        assert torch.equal(g, r)
    with pytest.raises(ValueError, match="both offloaded and recomputed"):
        handle.reassign(offloaded=[1], recomputed=[1])
    handle.reassign()  # keep every layer
    assert handle.offloaded == () and handle.backend is None
    handle.remove()
    with pytest.raises(RuntimeError, match="reassign\\(\\) after remove\\(\\)"):
        handle.reassign(offloaded=[0])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"slack": "1%"}, ValueError, "slack must be a finite number >= 0"),
        ({"slack": -0.5}, ValueError, "slack must be a finite number >= 0"),
        ({"max_tightenings": -1}, ValueError, "max_tightenings must be >= 0"),
        ({"max_tightenings": 1.5}, TypeError, "max_tightenings must be an int"),
    ],
)
def test_budget_check_arguments_are_checked(kwargs: dict, error: type, match: str) -> None:
    model = _model()
    plan = Plan((Choice.KEEP,) * LAYERS, 1, 0.0, 0)
    with offload_layers(model, recomputed=[0]) as handle:
        with pytest.raises(error, match=match):
            BudgetCheck(handle, plan, **kwargs)
        with pytest.raises(ValueError, match="made for 2 layers, but the handle wraps 6"):
            BudgetCheck(handle, Plan((Choice.KEEP,) * 2, 1, 0.0, 0))
        with pytest.raises(TypeError, match="handle must be what offload_layers returns"):
            BudgetCheck(model, plan)  # type: ignore[arg-type]
