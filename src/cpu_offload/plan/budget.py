"""A plan's budget, checked on the GPU by the first steps it runs.

The model behind a plan is measured, not exact: a layer may allocate more than it saves,
a head larger than profiled, a batch longer than the one profiled. :func:`apply_plan`
therefore watches the first training steps of the plan it applies
(:class:`BudgetCheck`): where a step's peak device memory exceeds the budget, the plan is
made again for a budget lowered by the model's error, and applied before the next
forward; where no plan fits, the next forward raises :class:`PlanOverBudget` with the
figures. A plan never exceeds its budget silently.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from .._compat import queue_backward_callback
from .._log import logger
from .._warn import warn_at_caller
from ..compare.report import format_bytes as _size
from ..layers import OffloadedLayers, sync_first
from .costs import offload_layers_arguments
from .search import NoPlanFits, Plan, search

__all__ = ["BudgetCheck", "CudaPeak", "PeakMemory", "PlanOverBudget"]


class PeakMemory(Protocol):
    """Where a step's peak comes from: ``reset()`` opens the window, ``peak()`` reads it."""

    def reset(self) -> None: ...

    def peak(self) -> int: ...


class CudaPeak:
    """A CUDA device's peak allocated memory (``torch.cuda.max_memory_allocated``).

    Under ``torch.distributed`` the peak read is the largest of the process group's
    ranks, so that every rank that runs the plan decides the same: ranks whose layers
    run collectives (tensor parallelism) must run the same plan, or their collectives
    pair up wrongly.

    Args:
        device: The device the plan's layers run on.
        group: The ranks that decide together: the default process group when
            ``torch.distributed`` is initialized (None), or the one given (under
            pipeline parallelism, the ranks of one stage). ``False``: this rank alone.
    """

    def __init__(self, device: torch.device | int | None = None, group: Any = None) -> None:
        self.device = device
        self.group = group

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        peak = int(torch.cuda.max_memory_allocated(self.device))
        dist = torch.distributed
        if self.group is False or not (dist.is_available() and dist.is_initialized()):
            return peak
        group = self.group if self.group is not None else dist.group.WORLD
        backend = dist.get_backend(group)
        on = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        value = torch.tensor([peak], dtype=torch.int64, device=on)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return int(value.item())


class PlanOverBudget(NoPlanFits):
    """A plan's measured peak exceeds its budget, and no tighter plan is left to try."""


class BudgetCheck:
    """Measures the peak of a plan's first training step; tightens the plan if it is over.

    Installed by :func:`cpu_offload.plan.apply_plan` on CUDA through
    :meth:`cpu_offload.OffloadedLayers.watch_steps`. The measured window runs from the
    first layer's forward to the end of the backward; ``torch.cuda.reset_peak_memory_stats``
    opens it, so the caller's own peak statistics restart there.

    Args:
        handle: The applied plan's layers.
        plan: The plan.
        slack: Fraction of the budget a peak may exceed it by and still count as within.
        max_tightenings: Tighter plans tried before giving up.
        memory: Where peaks are read (:class:`CudaPeak` by default: the current
            device, and under ``torch.distributed`` the largest peak of all ranks).

    Attributes:
        plan: The plan applied now (a tightened one after a step over budget).
        budget_bytes: The budget, the one the first plan was made for.
        measured_peak_bytes: The peak of the last step measured, or None before one.
        tightened: How many times the plan was made again.
        done: True once a step stayed within the budget (no more steps are watched).
    """

    def __init__(
        self,
        handle: OffloadedLayers,
        plan: Plan,
        *,
        slack: float = 0.01,
        max_tightenings: int = 3,
        memory: PeakMemory | None = None,
    ) -> None:
        if not isinstance(handle, OffloadedLayers):
            raise TypeError(
                f"handle must be what offload_layers returns, got {type(handle).__name__}"
            )
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a cpu_offload.plan.Plan, got {type(plan).__name__}")
        if len(plan.choices) != handle.num_layers:
            raise ValueError(
                f"plan: the plan was made for {len(plan.choices)} layers, but the handle "
                f"wraps {handle.num_layers}"
            )
        if (
            isinstance(slack, bool)
            or not isinstance(slack, (int, float))
            or not math.isfinite(slack)
            or slack < 0
        ):
            raise ValueError(f"slack must be a finite number >= 0 (0.01: 1%), got {slack!r}")
        if isinstance(max_tightenings, bool) or not isinstance(max_tightenings, int):
            raise TypeError(f"max_tightenings must be an int, got {max_tightenings!r}")
        if max_tightenings < 0:
            raise ValueError(f"max_tightenings must be >= 0, got {max_tightenings}")
        self.handle = handle
        self.memory = memory if memory is not None else CudaPeak()
        self.plan = plan
        self.budget_bytes = plan.budget_bytes
        self.slack = slack
        self.max_tightenings = max_tightenings
        self.measured_peak_bytes: int | None = None
        self.tightened = 0
        self.done = False
        self._measuring = False
        self._pending: Plan | None = None
        self._error: PlanOverBudget | None = None

    # --- StepWatch -------------------------------------------------------------------

    def forward_started(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self.done = True
            raise error
        if self._pending is not None:
            from .apply import as_modelled  # apply imports this module

            plan, self._pending = self._pending, None
            with as_modelled():
                self.handle.reassign(**offload_layers_arguments(plan.choices))
            self.plan = plan
        if self.done:
            return
        self.memory.reset()
        self._measuring = True

    def forward_ended(self, output: Any) -> None:
        if not self._measuring:
            return
        self._measuring = False
        sync_first(output, self._hook_backward, self.handle.num_layers - 1)

    # --- the measurement -------------------------------------------------------------

    def _hook_backward(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.grad_fn is not None:
            tensor.grad_fn.register_prehook(self._backward_started)
        return tensor

    def _backward_started(self, grad_outputs: Any) -> None:
        queue_backward_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        peak = self.memory.peak()
        self.measured_peak_bytes = peak
        limit = self.budget_bytes * (1 + self.slack)
        plan = self.plan
        if peak <= limit:
            self.done = True
            logger.debug(
                "plan %s: measured peak %s within its budget %s",
                plan.describe(),
                _size(peak),
                _size(self.budget_bytes),
            )
            return
        over = peak - self.budget_bytes
        reason = self._tighten(peak)
        if reason is None:
            assert self._pending is not None
            warn_at_caller(
                f"the plan {plan.describe()} peaked at {_size(peak)}, over its budget "
                f"of {_size(self.budget_bytes)} by {_size(over)} (the model said "
                f"{_size(plan.peak_bytes)}): it runs as {self._pending.describe()} from "
                "the next step, whose peak is checked again"
            )
            return
        self._error = PlanOverBudget(
            f"the plan {plan.describe()} peaked at {_size(peak)} in a training step, "
            f"over its budget of {_size(self.budget_bytes)} by {_size(over)}, "
            f"and {reason}. Raise the budget by at least {_size(over)}, or shrink the "
            "batch or the sequence, then make the plan again"
        )

    def _tighten(self, peak: int) -> str | None:
        """Make the plan again for the budget less the model's error; why not, or None."""
        plan = self.plan
        if plan.profile is None:
            return "the plan has no profile to make a tighter one from"
        if self.tightened >= self.max_tightenings:
            return f"{self.tightened} tighter plans did not bring it within the budget"
        error = peak - plan.peak_bytes
        target = self.budget_bytes - max(error, 0)
        if target <= 0:
            return "the model's error exceeds the whole budget"
        try:
            tighter = search(plan.profile, target)
        except NoPlanFits:
            return f"no plan's modelled peak fits {_size(target)}, the budget less the error"
        if tighter.choices == plan.choices:
            return "no tighter plan exists"
        self._pending = Plan(
            tighter.choices, self.budget_bytes, tighter.step_ms, tighter.peak_bytes, plan.profile
        )
        self.tightened += 1
        return None
