"""Memory layouts: what a dense block of a tensor looks like, so that it can be rebuilt.

A :class:`TensorLayout` is the size, strides and dtype of a tensor whose elements fill
one block of memory (see :func:`cpu_offload.engine.selection.is_dense`): a host buffer
seen with the same layout holds exactly its bytes, and a device tensor allocated with it
is the same tensor again after a straight copy back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TensorLayout"]


class TensorLayout(NamedTuple):
    """Size, strides and dtype of a dense (non-overlapping) tensor.

    A named tuple (immutable, compared and hashed by value): one is made for each tensor
    a layer offloads, on the host's path through the forward, and a named tuple costs
    less to make than a frozen dataclass.

    Example:
        >>> import torch
        >>> TensorLayout.of(torch.empty(2, 3).t())
        TensorLayout(size=(3, 2), stride=(1, 3), dtype=torch.float32)
        >>> TensorLayout.of(torch.empty(2, 3)).nbytes
        24
    """

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorLayout:
        return cls(tuple(tensor.shape), tensor.stride(), tensor.dtype)

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
