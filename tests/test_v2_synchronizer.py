"""V2's synchronizer on its own: what its forward step asks of the transport."""

from __future__ import annotations

import pytest

from cpu_offload import HostTransport, v2

N = 4


class _Capturing(HostTransport):
    """The CPU stand-in, reporting a CUDA graph capture on the current stream."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def capturing(self) -> bool:
        self.asked += 1
        return True


@pytest.mark.parametrize("supported", [False, True])
def test_a_capture_is_refused_only_where_pinned_memory_cannot_be_had(monkeypatch, supported):
    # Below PyTorch 2.11 a capture without retained buffers is refused at the layer's
    # forward; from 2.11 on it never is, and the forward does not query the stream.
    from cpu_offload import _compat
    from cpu_offload.v2 import synchronizer

    for module in (_compat, synchronizer):
        monkeypatch.setattr(
            module, "pinned_alloc_in_capture_supported", lambda version=None: supported
        )
    transport = _Capturing()
    sync = v2.DefaultOffloadSynchronizer(N, 1, transport=transport)
    if supported:
        assert sync.fwd_step() == 0 and transport.asked == 0
    else:
        with pytest.raises(RuntimeError, match="retain_pinned_cpu_buffers=True"):
            sync.fwd_step()
    retained = v2.DefaultOffloadSynchronizer(
        N, 1, retain_pinned_cpu_buffers=True, transport=_Capturing()
    )
    assert retained.fwd_step() == 0 and retained.transport.asked == 0
