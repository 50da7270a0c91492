"""Marking what plain PyTorch layers compute, for the V1 backend.

V1 offloads only tensors marked ``activation_offloading`` (Transformer Engine's and
Megatron-Core's modules mark their own). Plain PyTorch and Hugging Face layers mark
nothing, so code that runs them under V1 marks whatever they compute.
"""

from __future__ import annotations

import torch

from .engine.selection import mark_activation_offload

__all__ = ["MarkOutputs"]


class MarkOutputs(torch.overrides.TorchFunctionMode):
    """Marks every tensor computed inside as an activation (what V1 offloads)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if torch.compiler.is_compiling():
            # Traced by torch.compile (this module is left traceable for it): what a
            # compiled graph computes is made at run time and carries no mark.
            return out
        if isinstance(out, torch.Tensor):
            mark_activation_offload(out)
        elif isinstance(out, (tuple, list)):
            mark_activation_offload(*[o for o in out if isinstance(o, torch.Tensor)])
        return out
