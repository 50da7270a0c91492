"""OffloadableLayerState on the CPU stand-in: the state machine, sizes, release and buffers."""

from __future__ import annotations

import weakref

import pytest
import torch

from cpu_offload import HostTransport
from cpu_offload.v2 import OffloadableLayerState

MIB = 1024 * 1024


def _state(**kwargs) -> OffloadableLayerState:
    return OffloadableLayerState(None, transport=HostTransport(), **kwargs)


def _tensors(seed: int = 0, shapes=((256, 1024), (64, 32), (8, 8, 8))) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen) for s in shapes]


def _to(state: OffloadableLayerState, phase: str) -> None:
    """Walk ``state`` (holding tensors) forward to ``phase``."""
    steps = {
        "not_offloaded": state.start_offload,
        "offload_started": state.release_activation_forward_gpu_memory,
        "offload_finished": state.start_reload,
    }
    while state.state != phase:
        steps[state.state]()


def test_round_trip_returns_equal_tensors():
    state = _state()
    tensors = _tensors()
    tensors.append(torch.randn(32, 16).t())  # dense, permuted strides
    ids = [state.push_tensor(t) for t in tensors]
    assert all(isinstance(i, int) for i in ids)
    assert len(set(ids)) == len(ids)
    assert state.has_tensors
    _to(state, "reload_started")
    for t, i in zip(tensors, ids, strict=True):
        out = state.pop_tensor(i)
        assert torch.equal(out, t)
        assert out.stride() == t.stride()
        assert out.data_ptr() != t.data_ptr()  # a copy came back, not the original
    nbytes = sum(t.nbytes for t in tensors)
    assert state.transport.bytes_offloaded == state.transport.bytes_reloaded == nbytes


def test_device_tensors_dropped_after_release():
    state = _state()
    t = torch.randn(64, 64)
    i = state.push_tensor(t)
    _to(state, "offload_finished")
    # The state keeps no reference to the device tensor any more.
    assert all(e.tensor is None for e in state._entries)
    _to(state, "reload_started")
    assert torch.equal(state.pop_tensor(i), t)


def test_pop_in_not_offloaded_returns_the_tensor_itself():
    state = _state()
    t = torch.randn(16, 16)
    i = state.push_tensor(t)
    assert state.pop_tensor(i) is t
    assert state.pop_tensor(t) is t  # a tensor (not an id) is given back as is


def test_policy_rejected_tensor_is_returned_as_is():
    state = OffloadableLayerState(
        None, transport=HostTransport(), policy=lambda t: t.numel() >= 100
    )
    small, big = torch.randn(9), torch.randn(10, 10)
    assert state.push_tensor(small) is small
    i = state.push_tensor(big)
    assert isinstance(i, int)
    _to(state, "reload_started")
    assert state.pop_tensor(small) is small
    assert torch.equal(state.pop_tensor(i), big)
    assert state.transport.bytes_offloaded == big.nbytes


_METHODS = {
    "push_tensor": (lambda s: s.push_tensor(torch.randn(4)), ["not_offloaded"]),
    "start_offload": (lambda s: s.start_offload(), ["not_offloaded"]),
    "release_activation_forward_gpu_memory": (
        lambda s: s.release_activation_forward_gpu_memory(),
        ["offload_started"],
    ),
    "start_reload": (lambda s: s.start_reload(), ["offload_finished"]),
    "pop_tensor": (lambda s: s.pop_tensor(0), ["not_offloaded", "reload_started"]),
}
_PHASES = ["not_offloaded", "offload_started", "offload_finished", "reload_started"]


@pytest.mark.parametrize(
    ("method", "phase"),
    [(m, p) for m, (_, allowed) in _METHODS.items() for p in _PHASES if p not in allowed],
)
def test_wrong_state_raises(method, phase):
    call, allowed = _METHODS[method]
    state = _state()
    state.push_tensor(torch.randn(8, 8))
    _to(state, phase)
    with pytest.raises(RuntimeError) as info:
        call(state)
    msg = str(info.value)
    assert f"{method}()" in msg, msg
    assert f"'{phase}'" in msg, msg
    assert "allowed in: " + ", ".join(allowed) in msg, msg
    assert state.state == phase  # a refused call changes nothing


def test_total_size_mb():
    state = _state()
    assert state.get_offloaded_total_size_mb() == 0
    a, b = torch.randn(256, 1024), torch.randn(128, 1024, dtype=torch.float64)  # 1 + 1 MiB
    state.push_tensor(a)
    state.push_tensor(b)
    assert state.get_offloaded_total_size_mb() == 0  # nothing is on the host yet
    for phase in _PHASES[1:]:
        _to(state, phase)
        assert state.get_offloaded_total_size_mb() == pytest.approx(2.0)
    state.release_all_memory()
    assert state.get_offloaded_total_size_mb() == 0
    assert (a.nbytes + b.nbytes) / MIB == 2.0


@pytest.mark.parametrize("phase", _PHASES)
def test_release_all_memory_from_every_state(phase):
    transport = HostTransport()
    state = OffloadableLayerState(None, transport=transport)
    t = torch.randn(32, 32)
    i = state.push_tensor(t)
    _to(state, phase)
    state.release_all_memory()
    assert state.state == "not_offloaded"
    assert not state.has_tensors
    assert state.get_offloaded_total_size_mb() == 0
    assert state.reloaded_tensors() == []
    # Host buffers went back to the pool (one buffer, if the offload had started).
    free = sum(len(b) for b in transport.pool._free.values())
    assert free == transport.pool.allocations == (0 if phase == "not_offloaded" else 1)
    # The old id is gone...
    with pytest.raises(RuntimeError, match="holds no saved tensor 0"):
        state.pop_tensor(i)
    # ... and the state works again.
    state.release_all_memory()  # twice is fine
    j = state.push_tensor(t)
    _to(state, "reload_started")
    assert torch.equal(state.pop_tensor(j), t)


def _iteration(state: OffloadableLayerState, tensors: list[torch.Tensor]) -> None:
    ids = [state.push_tensor(t) for t in tensors]
    _to(state, "reload_started")
    for t, i in zip(tensors, ids, strict=True):
        assert torch.equal(state.pop_tensor(i), t)
    state.release_all_memory()


def test_pool_second_identical_iteration_allocates_nothing():
    transport = HostTransport()
    state = OffloadableLayerState(None, transport=transport)
    _iteration(state, _tensors(0))
    allocations, nbytes = transport.pool.allocations, transport.pool.allocated_bytes
    assert allocations == 3
    assert nbytes == sum(t.nbytes for t in _tensors(0))
    for seed in (1, 2, 3):
        _iteration(state, _tensors(seed))
    assert transport.pool.allocations == allocations
    assert transport.pool.allocated_bytes == nbytes
    # A new size does allocate.
    _iteration(state, [torch.randn(7, 7)])
    assert transport.pool.allocations == allocations + 1


def test_pool_shared_by_two_states():
    transport = HostTransport()
    a = OffloadableLayerState(None, transport=transport, name="a")
    b = OffloadableLayerState(None, transport=transport, name="b")
    _iteration(a, _tensors(0))
    _iteration(b, _tensors(1))  # same sizes: a's buffers are reused
    assert transport.pool.allocations == 3


def test_retained_buffers_keep_their_addresses():
    transport = HostTransport()
    state = OffloadableLayerState(None, retain_pinned_cpu_buffers=True, transport=transport)
    _iteration(state, _tensors(0))
    retained = list(state._buffers.retained)
    assert len(retained) == 3
    ptrs = [b.data_ptr() for b in retained]
    # Retained buffers stay with the layer: the pool does not get them back.
    assert sum(len(b) for b in transport.pool._free.values()) == 0
    for seed in (1, 2):
        tensors = _tensors(seed)
        ids = [state.push_tensor(t) for t in tensors]
        _to(state, "offload_finished")
        # The host copies of this iteration live in the very same buffers.
        assert all(u.host is r for u, r in zip(state._plan.units, retained, strict=True))
        assert [u.host.data_ptr() for u in state._plan.units] == ptrs
        _to(state, "reload_started")
        for t, i in zip(tensors, ids, strict=True):
            assert torch.equal(state.pop_tensor(i), t)  # this iteration's values
        state.release_all_memory()
        assert [b.data_ptr() for b in state._buffers.retained] == ptrs
    assert transport.pool.allocations == 3


def test_retained_buffers_shape_change_is_an_error():
    state = OffloadableLayerState(None, retain_pinned_cpu_buffers=True, transport=HostTransport())
    _iteration(state, _tensors(0))
    state.push_tensor(torch.randn(256, 1024))
    state.push_tensor(torch.randn(65, 32))  # was 64 x 32
    state.push_tensor(torch.randn(8, 8, 8))
    with pytest.raises(RuntimeError, match="retain_pinned_cpu_buffers") as info:
        state.start_offload()
    assert "same saved tensors every iteration" in str(info.value)
    assert state.state == "not_offloaded"
    state.release_all_memory()
    _iteration(state, _tensors(5))  # the original shapes still work


def test_retained_buffers_fewer_tensors_is_an_error():
    state = OffloadableLayerState(None, retain_pinned_cpu_buffers=True, transport=HostTransport())
    _iteration(state, _tensors(0))
    state.push_tensor(torch.randn(256, 1024))
    with pytest.raises(RuntimeError, match="retain_pinned_cpu_buffers"):
        state.start_offload()


def test_reloaded_tensor_dropped_after_last_pop():
    state = _state()
    t = torch.randn(16, 16)
    i = state.push_tensor(t)
    _to(state, "reload_started")
    assert state.reloaded_tensors()[0] is not None
    out = state.pop_tensor(i)
    assert state.reloaded_tensors() == [None]
    assert torch.equal(out, t)


class _StreamsTransport(HostTransport):
    """The stand-in with named streams: records which stream waited for which reload."""

    def __init__(self) -> None:
        super().__init__()
        self.stream = "main"
        self.waits: list[tuple[str, object]] = []
        self.shared: list[tuple[str, int]] = []

    def current_stream(self) -> str:
        return self.stream

    def reload(self, src: torch.Tensor, dst: torch.Tensor) -> object:
        super().reload(src, dst)
        return object()  # an event token, so that waits are made

    def wait(self, event: object | None, stream: object | None = None) -> None:
        if event is not None:
            self.waits.append((self.stream if stream is None else stream, event))

    def use_on_current_stream(self, tensor: torch.Tensor, stream: object | None = None) -> None:
        self.shared.append((self.stream if stream is None else stream, tensor.data_ptr()))


def test_each_stream_that_reads_a_reloaded_tensor_waits_for_its_copy():
    # Backward runs each node on the stream its forward ran on, so q, k and v of one
    # projection (one unit, one reload copy) can be read on two streams: each stream
    # must wait for the copy, and the allocator must learn of the second one.
    transport = _StreamsTransport()
    state = OffloadableLayerState(None, transport=transport)
    base = torch.randn(8, 3 * 64)
    q, k, v = base.split(64, dim=1)
    ids = [state.push_tensor(t) for t in (q, k, v)]
    _to(state, "reload_started")
    assert len(state._plan.units) == 1
    event = state._plan.units[0].restored

    assert torch.equal(state.pop_tensor(ids[0]), q)  # on "main", where it was allocated
    transport.stream = "side"
    assert torch.equal(state.pop_tensor(ids[1]), k)
    assert torch.equal(state.pop_tensor(ids[2]), v)  # "side" has waited already
    assert transport.waits == [("main", event), ("side", event)]
    # Both reads on "side" tell the allocator (recording a stream twice is harmless).
    assert [stream for stream, _ in transport.shared] == ["side", "side"]

    transport.stream = "main"
    state.wait_for_reloads()  # both streams have waited: nothing more to queue
    state.release_all_memory()
    assert transport.waits == [("main", event), ("side", event)]


def test_wait_for_reloads_joins_a_stream_that_read_nothing():
    transport = _StreamsTransport()
    state = OffloadableLayerState(None, transport=transport)
    i = state.push_tensor(torch.randn(64, 64))
    _to(state, "reload_started")
    event = state._plan.units[0].restored
    transport.stream = "graph-capture"
    state.wait_for_reloads()
    state.wait_for_reloads()
    assert transport.waits == [("graph-capture", event)]
    transport.stream = "main"
    state.pop_tensor(i)
    assert transport.waits == [("graph-capture", event), ("main", event)]
    assert transport.shared == []  # read on the stream it was allocated on


# -- view bases kept on the device (NOTE [Bytes that pay]) ----------------------------


def _qkv_views() -> tuple[torch.Tensor, list[torch.Tensor]]:
    qkv = torch.randn(2, 16, 3, 4, 8)
    return qkv, list(qkv.permute(2, 0, 3, 1, 4).unbind(0))  # strided views, covering it


def _kept_state(views, *, force_base: bool = False) -> tuple[OffloadableLayerState, list[int]]:
    state = _state()
    state.keep_view_bases = True
    ids = [state.push_tensor(v) for v in views]
    if force_base:
        state.mark_ready(views, offload_base_tensor=True)
    _to(state, "reload_started")
    return state, ids


def test_kept_view_bases_move_nothing_and_come_back_as_themselves():
    qkv, views = _qkv_views()
    state, ids = _kept_state(views)
    assert state.transport.bytes_offloaded == 0 and state.view_base_bytes == qkv.nbytes
    for i, v in zip(ids, views, strict=True):
        got = state.pop_tensor(i)
        assert torch.equal(got, v) and got.data_ptr() == v.data_ptr()  # the same memory


def test_kept_view_bases_still_refuse_an_in_place_change():
    qkv, views = _qkv_views()
    state, ids = _kept_state(views)
    with torch.no_grad():
        qkv.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        state.pop_tensor(ids[0])


def test_offload_base_tensor_true_moves_a_base_that_would_be_kept():
    qkv, views = _qkv_views()
    state, _ = _kept_state(views, force_base=True)
    assert state.transport.bytes_offloaded == qkv.nbytes


def test_a_base_saved_itself_moves_with_its_views():
    qkv, views = _qkv_views()
    state, _ = _kept_state([qkv, *views])
    assert state.transport.bytes_offloaded == qkv.nbytes and state.view_base_bytes == 0


def test_a_kept_base_goes_at_its_last_read():
    qkv, views = _qkv_views()
    gone = weakref.ref(qkv)
    state, ids = _kept_state(views)
    del qkv, views
    got = [state.pop_tensor(i) for i in ids]
    assert gone() is not None  # autograd holds what it read
    del got
    assert gone() is None  # and nothing else: the memory goes with it


def test_a_kept_base_read_again_while_held_or_after():
    _, views = _qkv_views()
    state, ids = _kept_state(views)
    got = [state.pop_tensor(i) for i in ids]
    assert torch.equal(state.pop_tensor(ids[0]), views[0])  # what was read is still held
    del got, views
    with pytest.raises(RuntimeError, match="read again after every tensor"):
        state.pop_tensor(ids[1])


# -- a byte budget: other units kept on the device (NOTE [Bytes that pay]) ----------------


def _budget_state(
    budget: int, tensors: list[torch.Tensor]
) -> tuple[OffloadableLayerState, list[int]]:
    state = _state()
    state.keep_budget = budget
    ids = [state.push_tensor(t) for t in tensors]
    _to(state, "reload_started")
    return state, ids


def test_a_budget_keeps_the_largest_units_that_fit():
    tensors = _tensors(shapes=((256, 1024), (128, 1024), (64, 1024), (8, 8)))
    sizes = [t.nbytes for t in tensors]  # 1 MiB, 512 KiB, 256 KiB, 256 B
    state, ids = _budget_state(sizes[1] + sizes[2] + sizes[3], tensors)
    # The 1 MiB unit does not fit; the next ones do, largest first.
    assert state.budget_kept_bytes == sizes[1] + sizes[2] + sizes[3]
    assert state.moved_bytes == sizes[0] == state.transport.bytes_offloaded
    for i, t in zip(ids, tensors, strict=True):
        got = state.pop_tensor(i)
        assert torch.equal(got, t) and got.stride() == t.stride()
        assert (got.data_ptr() == t.data_ptr()) == (t is not tensors[0])  # kept: itself


def test_a_budget_of_zero_or_below_every_unit_moves_everything():
    tensors = _tensors()
    for budget in (0, tensors[2].nbytes - 1):
        state, _ = _budget_state(budget, tensors)
        assert state.budget_kept_bytes == 0
        assert state.transport.bytes_offloaded == sum(t.nbytes for t in tensors)


class _ReloadCalls(HostTransport):
    """The stand-in, counting reload_all calls (on CUDA each makes the copy stream wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.reload_calls = 0

    def reload_all(self, copies):
        self.reload_calls += 1
        return super().reload_all(copies)


@pytest.mark.parametrize("keep_all", [True, False])
def test_a_layer_whose_units_all_stay_makes_no_reload_call(keep_all):
    # NOTE [A layer with nothing to move]: with every unit kept by the budget, there is
    # nothing to copy back and no call to make; with one moved, there is one call.
    tensors = _tensors()
    transport = _ReloadCalls()
    state = OffloadableLayerState(None, transport=transport)
    state.keep_budget = sum(t.nbytes for t in tensors) - (0 if keep_all else 1)
    ids = [state.push_tensor(t) for t in tensors]
    _to(state, "reload_started")
    assert transport.reload_calls == (0 if keep_all else 1)
    for i, t in zip(ids, tensors, strict=True):
        assert torch.equal(state.pop_tensor(i), t)
    state.release_all_memory()


def test_units_kept_by_budget_still_refuse_an_in_place_change():
    tensors = _tensors()
    state, ids = _budget_state(sum(t.nbytes for t in tensors), tensors)
    assert state.transport.bytes_offloaded == 0
    with torch.no_grad():
        tensors[1].add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        state.pop_tensor(ids[1])
    assert torch.equal(state.pop_tensor(ids[0]), tensors[0])


def test_a_unit_kept_by_budget_goes_at_its_last_read():
    t = torch.randn(64, 64)
    gone = weakref.ref(t)
    state, ids = _budget_state(t.nbytes, [t])
    del t
    got = state.pop_tensor(ids[0])
    del got
    assert gone() is None


def test_a_budget_never_keeps_a_slice_of_a_larger_storage():
    # Kept, the slice would keep its whole storage alive; moved, only the slice comes back.
    big = torch.randn(128, 64)
    state, ids = _budget_state(1 << 30, [big[:64]])
    assert state.budget_kept_bytes == 0
    assert state.transport.bytes_offloaded == big[:64].nbytes
    assert torch.equal(state.pop_tensor(ids[0]), big[:64])


def test_a_wrapper_subclass_kept_by_budget_is_read_again_while_held():
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    state, ids = _budget_state(1 << 30, [TwoTensor(a, b)])
    assert state.budget_kept_bytes == a.nbytes + b.nbytes
    first = state.pop_tensor(ids[0])
    second = state.pop_tensor(ids[0])  # the first is still held: its memory is found
    for got in (first, second):
        assert torch.equal(got.a, a) and torch.equal(got.b, b)
