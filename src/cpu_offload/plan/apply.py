"""Running a plan: its layers offloaded and recomputed through :func:`cpu_offload.offload_layers`."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from .._args import check_bool
from .._layer_stack import find_layers
from ..layers import OffloadedLayers, offload_layers
from ..v2.schedule import NoOverlapWarning
from .budget import BudgetCheck, CudaPeak
from .search import Plan

__all__ = ["apply_plan", "as_modelled", "check_plan_layers"]


def check_plan_layers(plan: Plan, num_layers: int, name: str = "plan") -> None:
    """Refuse a plan made for another number of layers.

    Args:
        plan: The plan.
        num_layers: The model's layers.
        name: What the message calls the plan (an argument or option name).

    Raises:
        TypeError: If ``plan`` is not a :class:`Plan`.
        ValueError: If the plan has another number of layers.

    Example:
        >>> from cpu_offload.plan.model import Choice
        >>> try:
        ...     check_plan_layers(Plan((Choice.KEEP,) * 3, 1, 0.0, 0), 4, "--plan")
        ... except ValueError as err:
        ...     print(str(err)[:51])
        --plan: the plan was made for 3 layers, but the mod
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"{name} must be a cpu_offload.plan.Plan, got {type(plan).__name__}")
    if len(plan.choices) != num_layers:
        raise ValueError(
            f"{name}: the plan was made for {len(plan.choices)} layers, but the model has "
            f"{num_layers}: make a plan for this model"
        )


@contextlib.contextmanager
def as_modelled() -> Iterator[None]:
    """Set up a plan's offloading without the warning about offloading ``n - 1`` layers.

    That warning (:class:`cpu_offload.v2.schedule.NoOverlapWarning`) advises offloading
    fewer layers so that copies overlap compute; a plan that offloads the first ``n - 1``
    layers (``OOOK``) chose them for its memory budget with the waiting already in its
    estimate, so the advice would contradict it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoOverlapWarning)
        yield


def apply_plan(
    model_or_layers: nn.Module | Iterable[nn.Module],
    plan: Plan,
    *,
    check_budget: bool = True,
    **context_kwargs: Any,
) -> OffloadedLayers:
    """Offload and recompute the layers of ``model_or_layers`` as ``plan`` says.

    Offloaded layers run under the offload context with the schedule the plan was
    modelled with; recomputed layers are recomputed in backward to the end of their
    forward, as :func:`cpu_offload.offload_layers` recomputes them; layers planned part by part get their parts' choices
    (``offload_layers(parts=...)``); layers kept with their casts rebuilt go through
    ``offload_layers(recast=...)``; kept layers run as they are. Results are bit-identical to the model
    without offloading.

    On a GPU the first training step's peak memory is checked against the plan's
    budget (:class:`cpu_offload.plan.budget.BudgetCheck`, at ``handle.watch``): over
    it, the plan is made again for the budget less the model's error and runs from the
    next step (with a warning), and that step is checked too; where no plan fits, the
    next forward raises :class:`cpu_offload.plan.PlanOverBudget`, saying by how much
    the plan is over. The check resets the CUDA peak-memory statistics when a step it
    watches begins. Under ``torch.distributed`` every rank decides from the largest peak
    of all ranks, so that ranks that run the same plan keep running the same plan; for
    other groups (one pipeline stage's ranks), install
    ``BudgetCheck(handle, plan, memory=CudaPeak(device, group))`` with
    ``check_budget=False`` and :meth:`cpu_offload.OffloadedLayers.watch_steps`.

    Args:
        model_or_layers: What :func:`cpu_offload.offload_layers` accepts.
        plan: A plan from :func:`cpu_offload.plan.search` or
            :func:`cpu_offload.plan.load_plan`.
        check_budget: Check the budget on the first steps (GPU only).
        **context_kwargs: Passed to :func:`cpu_offload.get_cpu_offload_context`
            (``transport``, ``min_tensor_size_to_offload``, ...).

    Returns:
        The :func:`cpu_offload.offload_layers` handle; ``handle.remove()`` restores the
        model.

    Raises:
        TypeError: If ``plan`` is not a :class:`Plan`, or ``check_budget`` not a bool.
        ValueError: If the plan was made for another number of layers, or
            ``memory_budget`` is among ``context_kwargs``; and whatever
            :func:`cpu_offload.offload_layers` raises.

    Example:
        >>> import torch
        >>> from cpu_offload.plan.model import Choice
        >>> layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        >>> plan = Plan((Choice.OFFLOAD, Choice.RECOMPUTE, Choice.KEEP), 1, 0.0, 0)
        >>> handle = apply_plan(layers, plan, min_tensor_size_to_offload=1)
        >>> layers(torch.randn(8, 64, requires_grad=True)).sum().backward()
        >>> handle.remove()
    """
    check_bool("check_budget", check_budget)
    layers = find_layers(model_or_layers)
    check_plan_layers(plan, len(layers))
    if "memory_budget" in context_kwargs:
        # Kept bytes start two steps in, after the budget check has passed the plan:
        # the step could then peak above the plan's budget unnoticed.
        raise ValueError(
            "apply_plan does not take memory_budget: the plan was searched for its own "
            f"budget ({plan.budget_bytes} bytes) and its check would not see bytes kept "
            "later; search again with a higher budget instead"
        )
    # offloaded=() (not None) so that a plan keeping every layer is a valid no-op.
    with as_modelled():
        handle = offload_layers(
            layers,
            offloaded=plan.offloaded,
            recomputed=plan.recomputed,
            parts=plan.parts,
            recast=plan.recast,
            **context_kwargs,
        )
    devices = {p.device for layer in layers for p in layer.parameters() if p.is_cuda}
    if check_budget and devices:
        device = min(devices, key=lambda d: d.index or 0)
        handle.watch_steps(BudgetCheck(handle, plan, memory=CudaPeak(device)))
    return handle
