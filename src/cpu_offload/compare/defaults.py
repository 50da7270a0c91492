"""The defaults of the model options, on a GPU and on the CPU: one place for
``cpu-offload compare``, ``cpu-offload plan`` and :func:`~cpu_offload.compare.compare_model`.

A plan saved by ``cpu-offload plan --save`` with the defaults is made for the model
that ``cpu-offload compare --plan`` builds with the defaults, because both read them
from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..v2.context import DEFAULT_MIN_TENSOR_SIZE

__all__ = ["CPU_DEFAULTS", "GPU_DEFAULTS", "ModelDefaults", "defaults_for"]


@dataclass(frozen=True)
class ModelDefaults:
    """The defaults of the model options on one kind of device.

    Attributes:
        hidden: Width of the built-in kinds.
        heads: Attention heads of the built-in kinds.
        seq: Sequence length (built-in kinds and ``hf:`` models).
        batch: Batch size (built-in kinds and ``hf:`` models).
        layers: Layers of the built-in kinds.
        dtype: The parameters' dtype, as ``--dtype`` names it (``"bf16"``).
        warmup: Untimed steps before the measured ones.
        builtin_min_tensor_size: Smallest tensor offloaded on the built-in kinds, in
            elements.
        user_min_tensor_size: The same on a model of the user's (``package.module:
            factory``, ``hf:``, :func:`~cpu_offload.compare.compare_model`).
    """

    hidden: int
    heads: int
    seq: int
    batch: int
    layers: int
    dtype: str
    warmup: int
    builtin_min_tensor_size: int
    user_min_tensor_size: int

    def min_tensor_size(self, builtin: bool) -> int:
        """The smallest tensor offloaded, in elements, on a built-in kind or another model.

        Example:
            >>> CPU_DEFAULTS.min_tensor_size(builtin=True), GPU_DEFAULTS.min_tensor_size(False)
            (8192, 262144)
        """
        return self.builtin_min_tensor_size if builtin else self.user_min_tensor_size


#: On a GPU: a model whose copies and compute are worth measuring.
GPU_DEFAULTS = ModelDefaults(
    hidden=2048,
    heads=16,
    seq=2048,
    batch=2,
    layers=8,
    dtype="bf16",
    warmup=2,
    builtin_min_tensor_size=DEFAULT_MIN_TENSOR_SIZE,
    user_min_tensor_size=DEFAULT_MIN_TENSOR_SIZE,
)

#: On the CPU stand-in: small enough to run in seconds, with tensors above the threshold.
CPU_DEFAULTS = ModelDefaults(
    hidden=128,
    heads=4,
    seq=128,
    batch=4,
    layers=6,
    dtype="fp32",
    warmup=1,
    builtin_min_tensor_size=8 * 1024,
    user_min_tensor_size=1024,
)


def defaults_for(device: str | torch.device) -> ModelDefaults:
    """The defaults on ``device``: :data:`GPU_DEFAULTS` on CUDA, else :data:`CPU_DEFAULTS`.

    Example:
        >>> defaults_for("cpu").layers == defaults_for("cuda").layers
        False
    """
    return GPU_DEFAULTS if torch.device(device).type == "cuda" else CPU_DEFAULTS
