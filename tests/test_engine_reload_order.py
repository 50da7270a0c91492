"""Reloads in the order backward reads (NOTE in ``engine/reload_order.py``), on the CPU
stand-in: which copy goes first, what the order is learnt from, and that only the order
changes."""

from __future__ import annotations

import pytest
import torch
from helpers import ReloadOrderRecorder, assert_bit_equal, step

from cpu_offload import HostTransport, v2
from cpu_offload.compare import LayerProfile, simulate
from cpu_offload.engine.reload_order import backward_start, last_read_share
from cpu_offload.models import ModelSpec, build_layers
from cpu_offload.v2 import OffloadableLayerState


class _Logged(HostTransport):
    """The stand-in, logging the host buffer each reload copy reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reloads: list[int] = []

    def reload(self, src: torch.Tensor, dst: torch.Tensor) -> object:
        self.reloads.append(src.data_ptr())
        return super().reload(src, dst)


def _offloaded(state: OffloadableLayerState, tensors: list[torch.Tensor]) -> list[int]:
    ids = [state.push_tensor(t) for t in tensors]
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    return ids


def _host_ptrs(state: OffloadableLayerState) -> list[int]:
    """The host buffer of each moved unit, in the order the units were made (saves')."""
    assert state._plan is not None
    return [u.host_view.data_ptr() for u in state._plan.moved]


def _iteration(
    state: OffloadableLayerState, tensors: list[torch.Tensor], read: list[int]
) -> list[int]:
    """One forward and backward that reads the saved tensors in the order ``read``; the
    positions (in save order) in the order their copies back were queued."""
    transport = state.transport
    assert isinstance(transport, _Logged)
    ids = _offloaded(state, tensors)
    ptrs = _host_ptrs(state)
    transport.reloads.clear()
    state.start_reload()
    order = [ptrs.index(p) for p in transport.reloads]
    for i in read:
        assert torch.equal(state.pop_tensor(ids[i]), tensors[i])
    state.release_all_memory()
    return order


def _tensors(shapes=((64, 64), (32,), (16, 8), (128,))) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen) for s in shapes]


def test_the_first_reload_copies_the_latest_saved_first():
    state = OffloadableLayerState(None, transport=_Logged())
    assert _iteration(state, _tensors(), read=[3, 2, 1, 0]) == [3, 2, 1, 0]


def test_later_reloads_follow_the_order_the_last_backward_read():
    state = OffloadableLayerState(None, transport=_Logged())
    tensors = _tensors()
    _iteration(state, tensors, read=[1, 3, 0, 2])
    assert _iteration(state, tensors, read=[2, 0, 3, 1]) == [1, 3, 0, 2]
    assert _iteration(state, tensors, read=[3, 2, 1, 0]) == [2, 0, 3, 1]


def test_units_never_read_come_last_latest_saved_first():
    state = OffloadableLayerState(None, transport=_Logged())
    tensors = _tensors()
    _iteration(state, tensors, read=[1])
    assert _iteration(state, tensors, read=[]) == [1, 3, 2, 0]


def test_other_units_than_last_time_fall_back_to_latest_saved_first():
    state = OffloadableLayerState(None, transport=_Logged())
    _iteration(state, _tensors(), read=[0, 1, 2, 3])
    # Another shape: the order learnt from other units does not apply.
    assert _iteration(state, _tensors(((64, 64), (32,), (8, 16), (128,))), read=[]) == [
        3,
        2,
        1,
        0,
    ]


def test_a_tensor_read_twice_counts_once_at_its_first_read():
    state = OffloadableLayerState(None, transport=_Logged())
    tensors = _tensors()[:2]
    ids = _offloaded(state, tensors)
    state.start_reload()
    state.pop_tensor(ids[0])
    assert torch.equal(state.pop_tensor(ids[0]), tensors[0])  # copied back again
    state.pop_tensor(ids[1])
    state.release_all_memory()
    assert _iteration(state, tensors, read=[1, 0]) == [0, 1]


def test_preallocated_buffers_go_to_their_own_units_in_any_order():
    # V1's double buffering hands buffers by unit: each must receive its own unit's
    # bytes although the copies are queued latest saved first.
    state = OffloadableLayerState(None, transport=_Logged())
    tensors = _tensors(((64, 64), (32,), (16, 8)))
    ids = _offloaded(state, tensors)
    buffers = [torch.empty_like(t) for t in tensors]
    state.start_reload(buffers)
    assert state.transport.reloads == [_host_ptrs(state)[i] for i in (2, 1, 0)]
    for i, buffer in zip(ids, buffers, strict=True):
        out = state.pop_tensor(i)
        assert out.data_ptr() == buffer.data_ptr()
        assert torch.equal(out, tensors[i])
    state.release_all_memory()


def test_last_read_share_and_backward_start_refuse_nothing_and_stay_in_range():
    assert last_read_share(0, 100) == 0.0
    assert last_read_share(200, 100) == 1.0
    assert last_read_share(5, -1) == 1.0
    # With the whole backward waiting (share 1) it starts when the copies end.
    assert backward_start(0.0, 7.0, 3.0, 1.0) == 7.0
    # It never starts before the copies do.
    assert backward_start(4.0, 5.0, 10.0, 0.0) == 4.0


def test_the_simulated_backward_runs_beside_its_copies():
    # One layer of two offloaded, 1000 bytes at 500 bytes/ms: its reload starts with its
    # own backward and takes 2 ms. A layer whose input is all it saves waits for the
    # whole copy; with half of it, the last 1.5 ms of its 3 ms backward start when the
    # copy ends (0.5 ms of waiting); with a tenth, it never waits.
    def step(input_bytes: int) -> float:
        layer = LayerProfile(1.0, 3.0, 1000, 1000, input_bytes)
        return simulate([layer, layer], "v2", 1, 0.0005, 0.0005).step_ms

    assert step(1000) - step(500) == pytest.approx(2.0 - 0.5)
    assert step(1000) - step(100) == pytest.approx(2.0)


def test_kept_units_keep_the_learnt_order_of_the_rest():
    # A budget that keeps a unit on the device this iteration (and not last) leaves the
    # order learnt for the others in force, and a kept unit read first takes no place.
    state = OffloadableLayerState(None, transport=_Logged())
    tensors = _tensors()
    _iteration(state, tensors, read=[1, 3, 0, 2])
    state.keep_budget = 64 * 64 * 4  # the first tensor, the largest
    ids = _offloaded(state, tensors)
    assert state.budget_kept_bytes == 64 * 64 * 4
    ptrs = {
        p: i
        for i, p in (
            (i, u.host_view.data_ptr()) for i, u in enumerate(state._plan.units) if not u.kept
        )
    }
    state.transport.reloads.clear()
    state.start_reload()
    assert [ptrs[p] for p in state.transport.reloads] == [1, 3, 2]
    for i in (0, 2, 1, 3):
        assert torch.equal(state.pop_tensor(ids[i]), tensors[i])
    state.release_all_memory()
    state.keep_budget = 0
    assert _iteration(state, tensors, read=[3, 2, 1, 0]) == [0, 2, 1, 3]


@pytest.mark.parametrize("kind", ["gpt", "encoder", "mha"])
def test_real_backwards_read_in_the_order_the_copies_came_back(kind, monkeypatch):
    # Real autograd on the CPU stand-in (SDPA with q, k, v views of one projection,
    # nn.TransformerEncoderLayer, nn.MultiheadAttention): from the second iteration every
    # layer's copies back are queued in the order its backward reads them, and the
    # results stay bit-identical to no offloading.
    spec = ModelSpec(kind=kind, hidden=64, heads=4, seq=32, batch=2, layers=4)
    layers = build_layers(spec, "cpu")
    ref = step(layers, lambda: spec.make_input("cpu"))
    recorder = ReloadOrderRecorder(monkeypatch)
    ctx, sync = v2.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=4, min_tensor_size_to_offload=1
    )
    for iteration in range(3):
        recorder.clear()
        assert_bit_equal(ref, step(layers, lambda: spec.make_input("cpu"), ctx, sync))
        if iteration > 0:
            recorder.assert_queued_in_read_order()
