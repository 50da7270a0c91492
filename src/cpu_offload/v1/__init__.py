"""Legacy (V1) CPU offloading: group-commit autograd functions, tensors marked with
``activation_offloading``, synchronous and asynchronous double-buffered handlers.

Importable directly whatever ``NVTE_CPU_OFFLOAD_V1`` says.
"""

from ..engine.active import is_cpu_offload_enabled, is_current_layer_offloaded
from ..engine.selection import mark_activation_offload, mark_not_offload
from .context import (
    CpuOffloadHookWithOffloadHandler,
    CpuOffloadSavedTensorHook,
    GroupCommitFunction,
    get_cpu_offload_context,
    group_prefetch_offload_commit,
)
from .handlers import (
    AsyncDoubleBufferGroupOffloadHandler,
    OffloadHandler,
    SynchronizedGroupOffloadHandler,
    layer_windows,
)

#: The name the older V1 module used for :func:`is_current_layer_offloaded`.
is_cpu_offload_layer = is_current_layer_offloaded

__all__ = [
    "AsyncDoubleBufferGroupOffloadHandler",
    "CpuOffloadHookWithOffloadHandler",
    "CpuOffloadSavedTensorHook",
    "GroupCommitFunction",
    "OffloadHandler",
    "SynchronizedGroupOffloadHandler",
    "get_cpu_offload_context",
    "group_prefetch_offload_commit",
    "is_cpu_offload_enabled",
    "is_cpu_offload_layer",
    "is_current_layer_offloaded",
    "layer_windows",
    "mark_activation_offload",
    "mark_not_offload",
]
