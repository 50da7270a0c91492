"""Refactored (V2) CPU offloading: automatic activation detection, default scheduling,
manual synchronization for pipelines, tensor-group processing and CUDA graphs.

Importable directly whatever ``NVTE_CPU_OFFLOAD_V1`` says.
"""

from ..engine.active import is_cpu_offload_enabled, is_current_layer_offloaded
from ..engine.layer_state import OffloadableLayerState
from ..engine.selection import mark_activation_offload, mark_not_offload
from .context import OffloadContext, SyncFunction, get_cpu_offload_context, start_offload
from .default import DefaultOffloadSynchronizer
from .manual import ManualOffloadSynchronizer
from .schedule import default_synchronization_dict, validate_synchronization_dict
from .synchronizer import OffloadSynchronizer

__all__ = [
    "DefaultOffloadSynchronizer",
    "ManualOffloadSynchronizer",
    "OffloadContext",
    "OffloadSynchronizer",
    "OffloadableLayerState",
    "SyncFunction",
    "default_synchronization_dict",
    "get_cpu_offload_context",
    "is_cpu_offload_enabled",
    "is_current_layer_offloaded",
    "mark_activation_offload",
    "mark_not_offload",
    "start_offload",
    "validate_synchronization_dict",
]
