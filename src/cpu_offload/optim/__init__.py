"""Optimizer-state offloading: :class:`HybridDeviceOptimizer` and its measurement tools.

``HybridDeviceOptimizer`` has the constructor and contract of Megatron-LM's optimizer of
the same name (an ``offload_fraction`` of the parameters, counted in elements from the
first, is stepped on the host by ``cpu_optimizer_cls``, the rest on the GPU by
``gpu_optimizer_cls``; see ``docs/optimizer-offload.md``); :func:`compute_offload_split` is its split rule on a
plain parameter list; :func:`measure_optimizer` and
:func:`measure_host_optimizer_throughput` time one configuration on a given model (used
by ``benchmarks/optimizer_offload.py`` and the comparison tool).
"""

from ._hybrid import HybridDeviceOptimizer
from ._measure import (
    OptimizerMeasurement,
    StateBytes,
    measure_host_optimizer_throughput,
    measure_optimizer,
    optimizer_device_state_bytes,
    optimizer_state_bytes,
)
from ._sharded import ShardedHybridDeviceOptimizer, shard_parameters
from ._split import compute_offload_split

__all__ = [
    "HybridDeviceOptimizer",
    "OptimizerMeasurement",
    "ShardedHybridDeviceOptimizer",
    "StateBytes",
    "compute_offload_split",
    "measure_host_optimizer_throughput",
    "measure_optimizer",
    "optimizer_device_state_bytes",
    "optimizer_state_bytes",
    "shard_parameters",
]
