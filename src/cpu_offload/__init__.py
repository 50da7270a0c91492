"""cpu-offload: move GPU memory of PyTorch training to pinned host memory and back.

Two backends behind one API: :mod:`cpu_offload.v2` (the default, automatic activation
detection) and :mod:`cpu_offload.v1` (the legacy path of tensors marked with
``activation_offloading``). ``NVTE_CPU_OFFLOAD_V1=1`` makes
:func:`get_cpu_offload_context` use V1; see :mod:`cpu_offload._switch`.
"""

from __future__ import annotations

from typing import Any

import torch

from . import v1, v2
from ._args import check_bool, check_int, check_memory_budget, check_stream
from ._switch import ENV_VAR, use_v1
from ._warn import warn_at_caller
from .engine.active import is_cpu_offload_enabled, is_current_layer_offloaded
from .engine.selection import mark_activation_offload, mark_not_offload
from .engine.transport import CudaTransport, HostBufferPool, HostTransport, Transport
from .layers import OffloadedLayers, StepWatch, offload_layers
from .pipeline import PipelineStageOffload, plan_pipeline_offload
from .v2 import (
    DefaultOffloadSynchronizer,
    ManualOffloadSynchronizer,
    OffloadableLayerState,
    OffloadSynchronizer,
    start_offload,
)
from .v2.context import DEFAULT_MIN_TENSOR_SIZE

__version__ = "0.1.0"

__all__ = [
    "CudaTransport",
    "DefaultOffloadSynchronizer",
    "HostBufferPool",
    "HostTransport",
    "ManualOffloadSynchronizer",
    "OffloadSynchronizer",
    "OffloadableLayerState",
    "OffloadedLayers",
    "PipelineStageOffload",
    "StepWatch",
    "Transport",
    "__version__",
    "backend",
    "get_cpu_offload_context",
    "is_cpu_offload_enabled",
    "is_cpu_offload_layer",
    "is_current_layer_offloaded",
    "mark_activation_offload",
    "mark_not_offload",
    "offload_layers",
    "plan_pipeline_offload",
    "start_offload",
    "v1",
    "v2",
]

#: The older name of :func:`is_current_layer_offloaded`.
is_cpu_offload_layer = is_current_layer_offloaded


def backend() -> str:
    """The backend :func:`get_cpu_offload_context` uses now: ``"v1"`` or ``"v2"``.

    Raises:
        ValueError: If ``NVTE_CPU_OFFLOAD_V1`` holds a value that is not understood.
    """
    return "v1" if use_v1() else "v2"


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int | None = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: torch.cuda.Stream | None = None,
    *,
    synchronization_dict: dict[int, tuple[bool, int, bool, int]] | None = None,
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE,
    transport: Transport | None = None,
    duplex: bool = False,
    memory_budget: int | None = None,
) -> Any:
    """The offload context of the backend ``NVTE_CPU_OFFLOAD_V1`` selects.

    Same signature as :func:`cpu_offload.v2.get_cpu_offload_context` (Transformer
    Engine's positional order), so that callers such as Megatron-Core, which pass
    ``retain_pinned_cpu_buffers=`` whatever the switch says, run under both backends.
    Under V1, the V2 arguments that only tune memory or copies
    (``retain_pinned_cpu_buffers``, ``min_tensor_size_to_offload``, ``offload_stream``,
    ``memory_budget``) are accepted with one ``UserWarning`` saying they have no effect; the ones that
    change the contract (``manual_synchronization=True``, which adds a return value, and
    ``synchronization_dict``, which changes the schedule) are an error. ``duplex`` is
    accepted by both (V1 always reloads on a stream of its own).

    Returns:
        What the selected backend returns.

    Raises:
        ValueError: If ``NVTE_CPU_OFFLOAD_V1`` is not understood, or
            ``manual_synchronization=True`` or a ``synchronization_dict`` is given under
            V1; and whatever the backend raises.
        TypeError: If a V2 tuning argument has the wrong type under V1.

    Example:
        >>> ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4)
    """
    if not use_v1():
        return v2.get_cpu_offload_context(
            enabled,
            num_layers,
            model_layers,
            offload_activations,
            offload_weights,
            double_buffering,
            manual_synchronization,
            retain_pinned_cpu_buffers,
            offload_stream,
            synchronization_dict=synchronization_dict,
            min_tensor_size_to_offload=min_tensor_size_to_offload,
            transport=transport,
            duplex=duplex,
            memory_budget=memory_budget,
        )
    # V1 always reloads on a stream of its own: duplex asks for what it does already.
    check_bool("duplex", duplex)
    _check_v2_arguments_under_v1(
        enabled,
        manual_synchronization=manual_synchronization,
        synchronization_dict=synchronization_dict,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        min_tensor_size_to_offload=min_tensor_size_to_offload,
        offload_stream=offload_stream,
        memory_budget=memory_budget,
    )
    if num_layers is None:
        raise TypeError("num_layers must be an int under the V1 backend, got None")
    return v1.get_cpu_offload_context(
        enabled,
        num_layers,
        model_layers,
        offload_activations,
        offload_weights,
        double_buffering,
        transport=transport,
    )


def _check_v2_arguments_under_v1(
    enabled: bool,
    *,
    manual_synchronization: bool,
    synchronization_dict: object,
    retain_pinned_cpu_buffers: bool,
    min_tensor_size_to_offload: int,
    offload_stream: object,
    memory_budget: object,
) -> None:
    """Apply the V1 rule for V2's arguments: tuning ones warn, contract ones raise."""
    contract = [
        name
        for name, given in (
            ("manual_synchronization", manual_synchronization is not False),
            ("synchronization_dict", synchronization_dict is not None),
        )
        if given
    ]
    if contract:
        raise ValueError(
            f"{' and '.join(contract)} {'is' if len(contract) == 1 else 'are'} V2-only "
            f"and change{'s' if len(contract) == 1 else ''} what the function returns or "
            f"its schedule, but {ENV_VAR} selects the V1 backend: unset {ENV_VAR} (or set "
            "it to 0) to use V2, or drop these arguments"
        )
    check_bool("retain_pinned_cpu_buffers", retain_pinned_cpu_buffers)
    check_int("min_tensor_size_to_offload", min_tensor_size_to_offload)
    check_stream("offload_stream", offload_stream)
    check_memory_budget(memory_budget)
    tuning = [
        name
        for name, given in (
            ("retain_pinned_cpu_buffers", retain_pinned_cpu_buffers),
            ("min_tensor_size_to_offload", min_tensor_size_to_offload != DEFAULT_MIN_TENSOR_SIZE),
            ("offload_stream", offload_stream is not None),
            ("memory_budget", memory_budget is not None),
        )
        if given
    ]
    if tuning and enabled:
        warn_at_caller(
            f"{', '.join(tuning)} only tune{'s' if len(tuning) == 1 else ''} the V2 backend "
            f"and {'has' if len(tuning) == 1 else 'have'} no effect under V1 ({ENV_VAR} "
            "is set): V1 offloads the tensors marked with mark_activation_offload, through "
            f"its own copies; unset {ENV_VAR} to use V2"
        )
