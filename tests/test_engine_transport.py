"""The transport's group calls and host-buffer views (CPU stand-in)."""

from __future__ import annotations

import pytest
import torch

from cpu_offload import HostBufferPool, HostTransport
from cpu_offload.engine.layout import TensorLayout


class _FailingTransport(HostTransport):
    """The stand-in whose copies return event tokens and whose third copy fails."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[object] = []
        self.copies = 0

    def wait(self, event: object | None, stream: object | None = None) -> None:
        self.waited.append(event)

    def offload(self, src: torch.Tensor, ready: object | None, dst: torch.Tensor) -> object:
        self.copies += 1
        if self.copies == 3:
            raise RuntimeError("copy failed")
        super().offload(src, ready, dst)
        return ("offload", self.copies)

    def reload(self, src: torch.Tensor, dst: torch.Tensor) -> object:
        self.copies += 1
        if self.copies == 3:
            raise RuntimeError("copy failed")
        super().reload(src, dst)
        return ("reload", self.copies)


def test_offload_all_returns_one_event_per_copy():
    transport = HostTransport()
    src = [torch.randn(4, 4) for _ in range(3)]
    dst = [torch.empty(4, 4) for _ in range(3)]
    events = transport.offload_all([(s, None, d) for s, d in zip(src, dst, strict=True)])
    assert events == [None, None, None]
    assert all(torch.equal(s, d) for s, d in zip(src, dst, strict=True))
    assert transport.bytes_offloaded == 3 * 16 * 4


@pytest.mark.parametrize("direction", ["offload", "reload"])
def test_group_failure_waits_for_the_copies_already_queued(direction):
    # Memory must never be reused under a running copy: when queuing fails part-way,
    # the compute stream waits for what was queued before the error propagates.
    transport = _FailingTransport()
    pairs = [(torch.randn(4), torch.empty(4)) for _ in range(4)]
    with pytest.raises(RuntimeError, match="copy failed"):
        if direction == "offload":
            transport.offload_all([(s, None, d) for s, d in pairs])
        else:
            transport.reload_all(pairs)
    assert transport.waited == [(direction, 1), (direction, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
def test_view_of_a_pool_buffer_has_the_layout(dtype):
    pool = HostBufferPool(pin_memory=False)
    t = torch.randn(6, 5, 7).to(dtype).permute(2, 0, 1)  # dense, permuted
    layout = TensorLayout.of(t)
    buf = pool.acquire(layout.nbytes)
    view = HostBufferPool.view(buf, layout)
    view.copy_(t)
    assert view.stride() == t.stride() and view.shape == t.shape and torch.equal(view, t)
    assert view.data_ptr() == buf.data_ptr()


def test_view_of_a_buffer_of_odd_size():
    # A buffer not from the pool, whose size is not a multiple of the item size.
    layout = TensorLayout((3,), (1,), torch.float32)
    buf = torch.zeros(13, dtype=torch.uint8)
    view = HostBufferPool.view(buf, layout)
    assert view.shape == (3,) and view.dtype == torch.float32
