"""The duplex schedule on the CPU stand-in: reloads on their own lane, host buffers
written by an offload only after the reload that last read them, and the context option.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_bit_equal, step

import cpu_offload
from cpu_offload import HostTransport, v2
from cpu_offload.models import ModelSpec, build_layers
from cpu_offload.v2 import DefaultOffloadSynchronizer, OffloadableLayerState


class _Lanes(HostTransport):
    """The stand-in with a separate reload lane: every copy is logged with an event token.

    An offload logs the pending read it waits for (None when it may write at once).
    """

    duplex = True  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self._reloads = 0

    def offload(self, src: torch.Tensor, ready: object | None, dst: torch.Tensor) -> None:
        self.log.append(("offload", dst.data_ptr(), self.pending_host_read(dst)))
        return super().offload(src, ready, dst)

    def reload(self, src: torch.Tensor, dst: torch.Tensor) -> object:
        super().reload(src, dst)
        self._reloads += 1
        token = ("reload", self._reloads, src.data_ptr())
        self.log.append(token)
        return token


def _round_trip(state: OffloadableLayerState, tensors: list[torch.Tensor]) -> None:
    ids = [state.push_tensor(t) for t in tensors]
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    for i, t in zip(ids, tensors, strict=True):
        assert torch.equal(state.pop_tensor(i), t)
    state.release_all_memory()


def _offloads(log: list[tuple]) -> list[tuple]:
    return [entry for entry in log if entry[0] == "offload"]


def test_a_pooled_buffer_is_written_after_the_reload_that_read_it():
    # Layer a's buffer goes back to the shared pool while its reload may still run on
    # the reload lane; layer b's offload into the same buffer must wait for that read.
    transport = _Lanes()
    a = OffloadableLayerState(None, transport=transport, name="a")
    b = OffloadableLayerState(None, transport=transport, name="b")
    _round_trip(a, [torch.randn(64, 64)])
    (reload_a,) = [e for e in transport.log if e[0] == "reload"]
    _round_trip(b, [torch.randn(64, 64)])
    first, second = _offloads(transport.log)
    assert first[2] is None  # a fresh buffer: nothing to wait for
    assert second[1] == first[1] and second[2] == reload_a  # the same buffer, after a's read
    assert transport.pool.allocations == 1
    reload_b = [e for e in transport.log if e[0] == "reload"][-1]
    _round_trip(b, [torch.randn(64, 64)])
    assert _offloads(transport.log)[2][2] == reload_b  # waits for b's own last read
    # Each pending read is waited for once, then forgotten: only the last one is left.
    assert list(transport._read_until.values()) == [transport.log[-1]]


def test_a_retained_buffer_is_written_after_the_last_iterations_reload():
    transport = _Lanes()
    state = OffloadableLayerState(None, True, transport=transport)
    for _ in range(3):
        _round_trip(state, [torch.randn(32, 32), torch.randn(16)])
    offloads = _offloads(transport.log)
    reloads = [e for e in transport.log if e[0] == "reload"]
    assert [o[2] for o in offloads[:2]] == [None, None]
    # Iteration i's offload into each retained buffer waits for iteration i-1's reload
    # of that same buffer (the reloads run in the order backward reads, not the saves').
    for it in (1, 2):
        previous = {r[2]: r for r in reloads[2 * (it - 1) : 2 * it]}
        assert len(previous) == 2
        for offload in offloads[2 * it : 2 * it + 2]:
            assert offload[2] == previous[offload[1]]


def test_one_lane_keeps_no_pending_reads():
    transport = HostTransport()  # copies in queue order: nothing to wait for
    state = OffloadableLayerState(None, transport=transport)
    _round_trip(state, [torch.randn(64, 64)])
    assert not transport.duplex and transport._read_until == {}


def test_duplex_synchronizer_keeps_the_default_points():
    # The duplex option changes the streams, not the schedule: the phases seen at each
    # step are those of the default schedule.
    def phases(transport):
        sync = DefaultOffloadSynchronizer(6, 3, transport=transport, policy=lambda t: True)
        seen = []
        for layer in range(6):
            sync.fwd_step()
            sync.push_tensor(torch.randn(8) + layer)
            seen.append(tuple(s.state for s in sync.layers))
        for layer in reversed(range(6)):
            sync.bwd_step(layer)
            seen.append(tuple(s.state for s in sync.layers))
        sync.finish_part_of_bwd()
        return seen

    assert phases(_Lanes()) == phases(HostTransport())


N = 6


def _spec() -> ModelSpec:
    return ModelSpec(kind="gpt", hidden=64, heads=4, seq=64, batch=2, layers=N)


def test_duplex_context_is_bit_exact_on_the_stand_in():
    spec = _spec()
    layers = build_layers(spec, "cpu")

    def make():
        return spec.make_input("cpu", seed=1)

    ref = step(layers, make)
    ctx, sync = v2.get_cpu_offload_context(True, 2, N, duplex=True, min_tensor_size_to_offload=256)
    for _ in range(2):
        assert_bit_equal(ref, step(layers, make, ctx, sync))
    assert ctx.offload_synchronizer.transport.bytes_reloaded > 0


def test_duplex_arguments():
    with pytest.raises(TypeError, match="duplex"):
        v2.get_cpu_offload_context(True, 1, 4, duplex="yes")
    with pytest.raises(TypeError, match="duplex"):
        v2.get_cpu_offload_context(False, 1, 4, duplex=1)  # types checked when disabled
    with pytest.raises(ValueError, match="duplex=True and transport= exclude each other"):
        v2.get_cpu_offload_context(True, 1, 4, duplex=True, transport=HostTransport())


def test_duplex_accepted_under_v1(monkeypatch):
    # V1 always reloads on a stream of its own: duplex=True asks for what it does.
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx, commit = cpu_offload.get_cpu_offload_context(True, 1, 4, duplex=True)
    assert ctx.offload_handler is not None
    with pytest.raises(TypeError, match="duplex"):
        cpu_offload.get_cpu_offload_context(True, 1, 4, duplex=None)
