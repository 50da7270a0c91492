"""Memory layouts: what a dense block of a tensor looks like, so that it can be rebuilt.

A :class:`TensorLayout` is the size, strides and dtype of a tensor whose elements fill
one block of memory (see :func:`cpu_offload.engine.selection.is_dense`): a host buffer
seen with the same layout holds exactly its bytes, and a device tensor allocated with it
is the same tensor again after a straight copy back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TensorLayout"]


@dataclass(frozen=True)
class TensorLayout:
    """Size, strides and dtype of a dense (non-overlapping) tensor."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorLayout:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
