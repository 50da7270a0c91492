"""``compare_model``: every variant on a model of your own, from Python."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .defaults import defaults_for
from .overrides import default_offloaded
from .runner import CompareConfig, CompareReport, run_compare
from .variants import VARIANTS
from .workload import user_workload

if TYPE_CHECKING:
    from ..plan.search import Plan

__all__ = ["DEFAULT_VARIANTS", "compare_model", "default_offloaded"]

#: The variants compared by default (no offloading always runs first).
DEFAULT_VARIANTS: tuple[str, ...] = ("v1-sync", "v1-async", "v2", "checkpoint", "save_on_cpu")


def compare_model(
    model: nn.Module | Sequence[nn.Module],
    make_batch: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    num_offloaded: int | None = None,
    layers: Sequence[nn.Module] | None = None,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    steps: int | None = None,
    warmup: int | None = None,
    min_tensor_size_to_offload: int | None = None,
    deterministic: bool = True,
    plan: Plan | str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] = lambda msg: None,
) -> CompareReport:
    """Run no offloading, V1, V2, checkpointing and ``save_on_cpu`` on your model.

    Each variant wraps the same layers of the model (found as :func:`cpu_offload.
    offload_layers` finds them, or given as ``layers``) and trains the model on the same
    batch; the report holds the largest difference of the loss and of every gradient
    against no offloading, the peak memory, the step time with its spread, the copy
    bandwidth, the stalls and a timeline (on a GPU, measured; on the CPU, the numerics
    are real and times and memory simulated). Format it with
    :func:`~cpu_offload.compare.report.format_table`.

    Args:
        model: The model, on its device and in its dtype, or a list of layers run one
            after the other.
        make_batch: Makes one batch (a tensor, or a tuple, list or dict of them). It is
            called once; every step of every variant trains on that batch.
        loss_fn: ``loss_fn(model, batch)`` returns the loss; by default the output's
            ``.loss`` when it has one, else the mean square of its first tensor.
        num_offloaded: Layers offloaded (or checkpointed), from the first; by default
            2, or fewer on a stack of less than 4 layers.
        layers: The layer stack, when it cannot be found in ``model``.
        variants: Names from :data:`~cpu_offload.compare.VARIANTS`.
        steps: Measured steps per variant; by default about one second of steps (10 to
            50) on a GPU, 2 on the CPU.
        warmup: Untimed steps before them (2 on a GPU, 1 on the CPU by default).
        min_tensor_size_to_offload: Smallest tensor to offload, in elements (262144 on a
            GPU, 1024 on the CPU by default).
        deterministic: Run with ``torch.use_deterministic_algorithms(True)`` (restored
            afterwards); on a GPU, ``CUBLAS_WORKSPACE_CONFIG`` must be set before CUDA
            starts.
        plan: A per-layer plan (:class:`cpu_offload.plan.Plan`, or the path of one
            saved by :func:`cpu_offload.plan.save_plan` or ``cpu-offload plan --save``),
            run as one more row, ``plan``, through :func:`cpu_offload.plan.apply_plan`'s
            runner. It must be made for this model's number of layers.
        progress: Called with a line of text as each phase starts.

    Returns:
        The :class:`~cpu_offload.compare.CompareReport`.

    Raises:
        TypeError: If ``make_batch`` or ``loss_fn`` is not callable, or ``plan`` is
            neither a plan nor a path.
        ValueError: On an unknown variant, ``num_offloaded`` outside
            ``[0, layers - 1]``, a model whose layer stack cannot be found, or a plan
            made for another number of layers (or a plan file that cannot be read:
            :class:`cpu_offload.plan.PlanFileError`).
        OSError: If the plan file cannot be read.

    Example:
        >>> from cpu_offload.compare import compare_model, format_table
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> report = compare_model(model, lambda: torch.randn(32, 64), steps=1, warmup=0)
        >>> report.result("v2").max_grad_diff
        0.0
    """
    workload = user_workload(model, make_batch, loss_fn, layers=layers)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(
            f"variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}"
        )
    n = len(workload.layers)
    k = default_offloaded(n) if num_offloaded is None else num_offloaded
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
        raise ValueError(f"num_offloaded must be an int in [0, {n - 1}] for {n} layers, got {k!r}")
    checked_plan = None if plan is None else _plan(plan, n)
    cuda = workload.device.type == "cuda"
    defaults = defaults_for(workload.device)
    min_numel = min_tensor_size_to_offload
    config = CompareConfig(
        spec=None,
        num_offloaded=k,
        variants=list(variants),
        steps=steps,
        warmup=defaults.warmup if warmup is None else warmup,
        min_numel=defaults.min_tensor_size(builtin=False) if min_numel is None else min_numel,
        device="cuda" if cuda else "cpu",
        deterministic=deterministic,
        workload=workload,
        plan=checked_plan,
    )
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        return run_compare(config, progress)
    finally:
        torch.use_deterministic_algorithms(previous)


def _plan(plan: object, num_layers: int) -> Plan:
    """``plan``, loaded when it is a path, and checked against the model's layers."""
    from ..plan.apply import check_plan_layers
    from ..plan.io import load_plan
    from ..plan.search import Plan

    if isinstance(plan, (str, os.PathLike)):
        plan = load_plan(plan)
    elif not isinstance(plan, Plan):
        raise TypeError(
            f"plan must be a cpu_offload.plan.Plan or the path of a saved plan, got "
            f"{type(plan).__name__}"
        )
    check_plan_layers(plan, num_layers)
    return plan
