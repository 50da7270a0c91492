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
from ._args import check_bool
from ._selection import mark_activation_offload, mark_not_offload
from ._state import is_cpu_offload_enabled, is_current_layer_offloaded
from ._switch import ENV_VAR, use_v1
from ._transport import CudaTransport, HostBufferPool, HostTransport, Transport
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
    "Transport",
    "__version__",
    "backend",
    "get_cpu_offload_context",
    "is_cpu_offload_enabled",
    "is_cpu_offload_layer",
    "is_current_layer_offloaded",
    "mark_activation_offload",
    "mark_not_offload",
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
) -> Any:
    """The offload context of the backend ``NVTE_CPU_OFFLOAD_V1`` selects.

    Same signature as :func:`cpu_offload.v2.get_cpu_offload_context` (Transformer
    Engine's positional order). Under V1, the V2-only arguments
    (``manual_synchronization``, ``retain_pinned_cpu_buffers``, ``offload_stream``,
    ``synchronization_dict``, ``min_tensor_size_to_offload``) must keep their defaults:
    V1 has no such feature, and ignoring a request silently would be wrong. ``duplex``
    is accepted by both (V1 always reloads on a stream of its own).

    Returns:
        What the selected backend returns.

    Raises:
        ValueError: If ``NVTE_CPU_OFFLOAD_V1`` is not understood, or a V2-only argument
            is given a non-default value under V1; and whatever the backend raises.

    Example:
        >>> ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
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
        )
    # V1 always reloads on a stream of its own: duplex asks for what it does already.
    check_bool("duplex", duplex)
    v2_only = {
        "manual_synchronization": (manual_synchronization, False),
        "retain_pinned_cpu_buffers": (retain_pinned_cpu_buffers, False),
        "offload_stream": (offload_stream, None),
        "synchronization_dict": (synchronization_dict, None),
        "min_tensor_size_to_offload": (min_tensor_size_to_offload, DEFAULT_MIN_TENSOR_SIZE),
    }
    given = [name for name, (value, default) in v2_only.items() if value != default]
    if given:
        raise ValueError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} V2-only, but "
            f"{ENV_VAR} selects the V1 backend: unset {ENV_VAR} (or set it to 0) to use "
            "V2, or leave these arguments at their defaults"
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
