"""CPU tests of ``stream_share``'s arguments and layout (its data path: test_optim_stream_cuda)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpu_offload.optim import HybridDeviceOptimizer
from cpu_offload.optim._entries import Entry, bucket_entries
from cpu_offload.optim._stream import check_stream_share, mark_streamed

STAND_IN: dict[str, Any] = {"is_device_param": lambda p: True}


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(4)]


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_share_outside_the_range_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match=r"stream_share must be in \[0.0, 1.0\]"):
        HybridDeviceOptimizer(_params(), offload_fraction=1.0, stream_share=value, **STAND_IN)


@pytest.mark.parametrize("value", ["half", True, None])
def test_share_that_is_not_a_number_is_refused(value: Any) -> None:
    with pytest.raises(TypeError, match="stream_share must be a float in"):
        HybridDeviceOptimizer(_params(), offload_fraction=1.0, stream_share=value, **STAND_IN)


def test_share_needs_a_streamable_host_class() -> None:
    with pytest.raises(ValueError, match=r"cpu_optimizer_cls.*got torch.optim.sgd.SGD"):
        HybridDeviceOptimizer(
            _params(),
            offload_fraction=1.0,
            cpu_optimizer_cls=torch.optim.SGD,
            stream_share=0.5,
            lr=0.1,
            **STAND_IN,
        )
    # Without streaming, any class.
    HybridDeviceOptimizer(
        _params(), offload_fraction=1.0, cpu_optimizer_cls=torch.optim.SGD, lr=0.1, **STAND_IN
    )
    assert check_stream_share(0, torch.optim.SGD) == 0.0


def test_share_needs_offloaded_cuda_parameters() -> None:
    with pytest.raises(
        ValueError, match="no offloaded parameter is a contiguous CUDA tensor with a fp32 host copy"
    ):
        HybridDeviceOptimizer(_params(), offload_fraction=1.0, stream_share=0.5, **STAND_IN)


def test_nothing_offloaded_streams_nothing() -> None:
    opt = HybridDeviceOptimizer(_params(), offload_fraction=0.0, stream_share=0.5, **STAND_IN)
    assert not any(e.streamed for e in opt._entries)
    assert opt._lane is None


def _entries(sizes: list[int], offloaded: list[bool]) -> list[Entry]:
    out = []
    for size, off in zip(sizes, offloaded, strict=True):
        p = torch.zeros(size)
        out.append(Entry(p, 0, True, off, p.clone() if off else p, False))
    return out


def test_streamed_entries_get_buckets_of_their_own() -> None:
    entries = _entries([4, 4, 4, 4], [True] * 4)
    entries[0].streamed = entries[1].streamed = True
    buckets = bucket_entries(entries, bucketed=False)
    assert [[e.streamed for e in b] for b in buckets] == [[True, True], [False, False]]


def test_mark_streamed_skips_host_tensors_and_raises_without_cuda() -> None:
    entries = _entries([4, 4], [True, False])
    assert mark_streamed(entries, 0.0) == []
    with pytest.raises(ValueError, match="stream_share=0.5"):
        mark_streamed(entries, 0.5)
    # Nothing offloaded: nothing to stream, no error.
    assert mark_streamed(_entries([4], [False]), 1.0) == []
