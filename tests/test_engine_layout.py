"""engine.layout: the size, strides and dtype of a block that is copied whole."""

from __future__ import annotations

import pytest
import torch

from cpu_offload.engine.layout import TensorLayout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64])
def test_layout_of_a_permuted_tensor(dtype):
    t = torch.zeros(3, 4, 5, dtype=dtype).permute(1, 2, 0)
    layout = TensorLayout.of(t)
    assert layout.size == (4, 5, 3) and layout.stride == t.stride() and layout.dtype == dtype
    assert layout.numel == 60 and layout.nbytes == 60 * t.element_size()
    rebuilt = torch.empty_strided(layout.size, layout.stride, dtype=layout.dtype)
    assert rebuilt.stride() == t.stride()


def test_layouts_compare_by_value():
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert TensorLayout.of(a) == TensorLayout.of(b)
    assert TensorLayout.of(a) != TensorLayout.of(a.t())
    assert TensorLayout((), (), torch.float32).numel == 1  # a scalar
