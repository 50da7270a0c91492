"""Megatron-style offload configuration: the fields, rules and messages users know.

Megatron-LM configures its two offloading mechanisms through config fields: layer-level
activation offloading through ``TransformerConfig`` (``cpu_offloading``,
``cpu_offloading_num_layers``, ...; section ``model.`` in Megatron Bridge) and
optimizer-state offloading through ``OptimizerConfig`` (``optimizer_cpu_offload``,
``optimizer_offload_fraction``, ...; section ``optimizer.``). This package carries those
fields with Megatron's defaults and validation messages (word for word: users search for
them) and reads them from any config object (``_fields``), parses Megatron Bridge's
``key=value`` overrides (``_overrides``), and builds the package's activation-offload
context and optimizer from them (``_build``).
"""

from cpu_offload._megatron_core import MegatronCoreOffload, use_with_megatron_core

from ._build import build_optimizer, offload_context, optimizer_class
from ._fields import ActivationOffloadConfig, OptimizerOffloadConfig
from ._overrides import apply_overrides, parse_override

__all__ = [
    "ActivationOffloadConfig",
    "MegatronCoreOffload",
    "OptimizerOffloadConfig",
    "apply_overrides",
    "build_optimizer",
    "offload_context",
    "optimizer_class",
    "parse_override",
    "use_with_megatron_core",
]
