"""Bytes released one point late (NOTE [Bytes that pay]): the peak watch's deferrals on
synthetic profiles, a layer state that releases its last copies later, and V2's default
schedule on the CPU stand-in deferring where the first interval of a window has room,
and nothing deferred in an iteration a CUDA graph captures.
"""

from __future__ import annotations

import random
import weakref

import pytest
import torch
from helpers import assert_bit_equal, step
from peak_watch_helpers import PeakTransport, Reads, random_windows, small_gpt

from cpu_offload import HostTransport, v2
from cpu_offload._compat import pinned_alloc_in_capture_supported
from cpu_offload.engine.peak_watch import BUDGET_MARGIN_MIN, BUDGET_MARGIN_SHARE, PeakWatch, Window
from cpu_offload.v2 import OffloadableLayerState

# Peaks of this size make the margin PEAK // BUDGET_MARGIN_SHARE (slack 0).
PEAK = 100 * BUDGET_MARGIN_SHARE * BUDGET_MARGIN_MIN
M = PEAK // BUDGET_MARGIN_SHARE


def _watch(windows: list[Window], points: int) -> tuple[PeakWatch, Reads]:
    reads = Reads()
    return PeakWatch(reads, windows, points, slack=0), reads


def _run(
    watch: PeakWatch,
    reads: Reads,
    interval_peaks: list[int],
    units: dict[int, tuple[int, int]],
    deferred: dict[int, int] | None = None,
    candidates: dict[int, int] | None = None,
) -> None:
    """One iteration whose interval ``t`` peaks at ``interval_peaks[t]``; ``units``: per
    layer, the bytes its budget kept and moved; ``deferred``: the bytes it deferred."""
    reads.value = 0
    watch.begin()
    for t, peak in enumerate(interval_peaks):
        reads.value = max(reads.value, peak)
        watch.mark(t)
    watch.end(candidates or {}, units, {} if deferred is None else deferred)


# -- the watch alone -----------------------------------------------------------------------


def test_a_deferral_takes_the_room_of_the_window_s_first_interval():
    # Window (0, 3]; the step peaks inside it, in intervals 2 and 3: no budget, but
    # interval 1 has a room of 20m.
    watch, reads = _watch([Window(0, 0, 3)], 5)
    _run(watch, reads, [0, PEAK - 20 * M, PEAK, PEAK, PEAK], {0: (0, 100 * M)})
    assert watch.budgets[0] == 0
    assert watch.deferrals == {0: 19 * M}  # the room less the margin


def test_budgets_come_first_and_a_deferral_takes_what_they_leave():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    _run(watch, reads, [0, PEAK - 20 * M, PEAK - 5 * M, PEAK - 5 * M, PEAK], {0: (0, 100 * M)})
    assert watch.budgets[0] == 4 * M
    assert watch.deferrals[0] == 20 * M - 4 * M - M


def test_a_deferral_is_bounded_by_the_bytes_moved_and_grows_from_what_was_deferred():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    profile = [0, PEAK - 20 * M, PEAK, PEAK, PEAK]
    _run(watch, reads, profile, {0: (0, 3 * M)})
    assert watch.deferrals == {0: 3 * M}
    # 2m were deferred and the room was read with them on the device.
    _run(watch, reads, [0, PEAK - 18 * M, PEAK, PEAK, PEAK], {0: (0, 40 * M)}, {0: 2 * M})
    assert watch.deferrals == {0: 2 * M + 18 * M - M}


def test_each_deferral_reads_its_own_first_interval():
    # Windows (0, 4] and (1, 3]: layer 0 defers into interval 1, layer 1 into interval 2.
    watch, reads = _watch([Window(0, 0, 4), Window(1, 1, 3)], 6)
    _run(
        watch,
        reads,
        [0, PEAK - 9 * M, PEAK - 4 * M, PEAK, PEAK, PEAK],
        {0: (0, PEAK), 1: (0, PEAK)},
    )
    assert watch.deferrals == {0: 8 * M, 1: 3 * M}


def test_a_deferral_that_raises_the_peak_is_cut_and_never_grows_again():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    _run(watch, reads, [0, 1000, PEAK, PEAK, PEAK], {0: (0, 2 * PEAK)})
    deferral = watch.deferrals[0]
    assert deferral == PEAK - 1000 - M
    # The next iteration peaks 500 higher in interval 1, where the deferred bytes stay.
    _run(watch, reads, [0, PEAK + 500, PEAK, PEAK, PEAK], {0: (0, 2 * PEAK)}, {0: deferral})
    assert watch.deferrals[0] == deferral - 500 - (PEAK + 500) // BUDGET_MARGIN_SHARE
    assert watch.capped == {0}
    _run(watch, reads, [0, 10, PEAK, PEAK, PEAK], {0: (0, 2 * PEAK)}, {0: watch.deferrals[0]})
    assert watch.deferrals[0] == deferral - 500 - (PEAK + 500) // BUDGET_MARGIN_SHARE


def test_a_rise_later_in_the_window_leaves_the_deferral():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    _run(watch, reads, [0, 1000, PEAK, PEAK, PEAK], {0: (0, 2 * PEAK)})
    deferral = watch.deferrals[0]
    # The peak rises in interval 2, where no deferred byte is on the device: the
    # deferral stays, and grows by the rise (less the margin's growth).
    profile = [0, 1000 + deferral, PEAK + 500, PEAK, PEAK]
    _run(watch, reads, profile, {0: (0, 2 * PEAK)}, {0: deferral})
    assert watch.capped == set()
    assert watch.deferrals[0] == PEAK + 500 - 1000 - (PEAK + 500) // BUDGET_MARGIN_SHARE


def test_without_deferred_bytes_nothing_is_deferred():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    reads.value = 0
    watch.begin()
    for t, peak in enumerate([0, 1000, PEAK, PEAK, PEAK]):
        reads.value = max(reads.value, peak)
        watch.mark(t)
    watch.end({}, {0: (0, 2 * PEAK)})
    assert watch.deferrals == {}


@pytest.mark.parametrize("seed", range(200))
def test_what_is_kept_or_deferred_never_raises_the_peak(seed):
    """On random profiles, with bytes already deferred in them, bases, budgets and the
    new deferrals keep every interval within the peak, less the watch's margin wherever
    a budget or a deferral adds bytes."""
    rng = random.Random(seed)
    points, windows = random_windows(rng)
    candidates = {w.layer: rng.randint(0, 400) for w in windows}
    units = {w.layer: (0, rng.randint(0, 40 * M)) for w in windows}
    deferred = {w.layer: rng.randint(0, units[w.layer][1]) for w in windows}
    bare = [rng.randint(0, PEAK) for _ in range(points)]  # without the deferred bytes
    peaks = [
        b + sum(deferred[w.layer] for w in windows if w.start + 1 == t) for t, b in enumerate(bare)
    ]
    watch, reads = _watch(windows, points)
    _run(watch, reads, peaks, units, deferred, candidates)
    ceiling = max(peaks)
    margin = max(ceiling // BUDGET_MARGIN_SHARE, BUDGET_MARGIN_MIN)
    for t, b in enumerate(bare):
        inside = [w for w in windows if w.start < t <= w.end]
        bases = sum(candidates[w.layer] for w in inside if w.layer in watch.kept)
        added = sum(watch.budgets.get(w.layer, 0) for w in inside)
        added += sum(watch.deferrals.get(w.layer, 0) for w in windows if w.start + 1 == t)
        assert b + bases + added <= ceiling - (margin if added else 0)
    for w in windows:
        assert 0 <= watch.deferrals.get(w.layer, 0) <= units[w.layer][1]


# -- a layer state releasing its last copies one point late --------------------------------


def _state(defer: int, tensors: list[torch.Tensor]) -> tuple[OffloadableLayerState, list[int]]:
    state = OffloadableLayerState(None, transport=HostTransport())
    state.defer_budget = defer
    ids = [state.push_tensor(t) for t in tensors]
    return state, ids


def _four() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, 256, generator=gen) for n in (64, 32, 16, 8)]


def test_the_last_units_copied_within_the_budget_are_released_late():
    tensors = _four()
    sizes = [t.nbytes for t in tensors]
    # Room for the last two and a byte less than the second: whole units from the end.
    state, ids = _state(sizes[1] + sizes[2] + sizes[3] - 1, tensors)
    alive = [weakref.ref(t) for t in tensors]
    want = [t.clone() for t in tensors]
    del tensors
    state.start_offload()
    assert state.deferred_bytes == sizes[2] + sizes[3]
    assert state.moved_bytes == sum(sizes)  # deferred bytes are moved all the same
    state.release_activation_forward_gpu_memory()
    assert [r() is not None for r in alive] == [False, False, True, True]
    state.release_deferred()
    assert all(r() is None for r in alive)
    state.release_deferred()  # nothing left: does nothing
    state.start_reload()
    for i, w in zip(ids, want, strict=True):
        assert torch.equal(state.pop_tensor(i), w)


def test_a_reload_releases_what_was_deferred_first():
    tensors = _four()
    state, ids = _state(tensors[3].nbytes, tensors)
    last = weakref.ref(tensors[3])
    want = tensors[3].clone()
    del tensors
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    assert last() is not None
    state.start_reload()
    assert last() is None
    assert torch.equal(state.pop_tensor(ids[3]), want)


def test_releasing_all_memory_drops_what_was_deferred():
    tensors = _four()
    state, _ = _state(1 << 30, tensors)
    alive = [weakref.ref(t) for t in tensors]
    del tensors
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    assert all(r() is not None for r in alive)  # everything deferred
    state.release_all_memory()
    assert all(r() is None for r in alive)
    assert state.state == "not_offloaded"


def test_a_deferred_release_before_the_layer_s_release_is_refused():
    state, _ = _state(1 << 30, _four())
    state.start_offload()
    with pytest.raises(
        RuntimeError,
        match=r"release_deferred\(\) called on layer in state 'offload_started'; allowed in: offload_finished",
    ):
        state.release_deferred()
    state.release_activation_forward_gpu_memory()  # the state is unharmed
    state.release_deferred()


def test_a_deferred_tensor_changed_in_place_still_fails_in_backward():
    tensors = _four()
    state, ids = _state(tensors[3].nbytes, tensors)
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    with torch.no_grad():
        tensors[3].add_(1)  # after its copy, before its late release
    state.start_reload()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        state.pop_tensor(ids[3])
    assert torch.equal(state.pop_tensor(ids[0]), tensors[0])


# -- V2's default schedule on the CPU stand-in ---------------------------------------------

N, K = 4, 2  # windows: layer 0 (2, 6] (forward of 2 to backward of 1), layer 1 (3, 5]


def test_v2_defers_where_only_a_window_s_first_interval_has_room():
    layers, make, ref = small_gpt(N)
    transport = PeakTransport()
    ctx, sync = v2.get_cpu_offload_context(
        True, K, N, transport=transport, min_tensor_size_to_offload=256
    )
    states = ctx.offload_synchronizer.layers
    seen = []

    def raise_peak(grad):
        # Before layer 2's backward point: in interval 5, inside both windows.
        transport.peak += 1 << 30

    def at_forward(layer):
        def hook(module, args):
            seen.append((layer, [(states[i].state, bool(states[i]._late)) for i in range(K)]))

        return hook

    def in_backward(module, args, out):
        out.register_hook(raise_peak)

    hooks = [layers[2].register_forward_hook(in_backward)]
    hooks += [layers[i].register_forward_pre_hook(at_forward(i)) for i in (2, 3)]
    moved = []
    try:
        for _ in range(4):
            before = transport.bytes_offloaded
            assert_bit_equal(ref, step(layers, make, ctx, sync))
            assert transport.bytes_reloaded == transport.bytes_offloaded
            moved.append(transport.bytes_offloaded - before)
    finally:
        for h in hooks:
            h.remove()
    watch = ctx.offload_synchronizer.peak_watch
    # Interval 5 holds the peak: no room in it, so nothing is kept, and every byte still
    # moves; intervals 3 and 4 (the windows' first) have room for all of them.
    assert moved == [moved[0]] * 4 and moved[0] > 0
    assert watch.kept == set() and not any(watch.budgets.values())
    assert all(states[i].deferred_bytes == states[i].moved_bytes > 0 for i in range(K))
    # The last step: at layer 2's forward layer 0 (released there) still holds its
    # deferred bytes; at layer 3's they are gone, and layer 1 (released there) holds its.
    done = "offload_finished"
    assert seen[-2:] == [
        (2, [(done, True), ("offload_started", True)]),
        (3, [(done, False), (done, True)]),
    ]


class _Capturing(PeakTransport):
    """The stand-in, reporting a CUDA graph capture while ``capture`` is set."""

    capture = False

    def capturing(self) -> bool:
        return self.capture


def test_an_iteration_captured_in_a_graph_defers_nothing():
    # A captured graph replays the same copies and releases every time: the deferrals
    # chosen before the capture must not be built into it. After it, they come back.
    if not pinned_alloc_in_capture_supported():
        pytest.skip("this PyTorch refuses a capture without retained buffers")
    layers, make, ref = small_gpt(N)
    transport = _Capturing()
    ctx, sync = v2.get_cpu_offload_context(
        True, K, N, transport=transport, min_tensor_size_to_offload=256
    )
    states = ctx.offload_synchronizer.layers

    def raise_peak(grad):  # the step's peak in a backward interval, as in the test above
        transport.peak += 1 << 30

    def in_backward(module, args, out):
        out.register_hook(raise_peak)

    hook = layers[2].register_forward_hook(in_backward)
    deferred = []
    try:
        for capture in (False, False, False, True, False):
            transport.capture = capture
            assert_bit_equal(ref, step(layers, make, ctx, sync))
            deferred.append([s.deferred_bytes > 0 for s in states[:K]])
    finally:
        hook.remove()
    watch = ctx.offload_synchronizer.peak_watch
    assert all(watch.deferrals.get(i, 0) > 0 for i in range(K))  # chosen, and kept
    assert deferred[2] == [True] * K and deferred[4] == [True] * K
    assert deferred[3] == [False] * K
    assert all(s.defer_budget > 0 for s in states[:K])


def test_a_slice_of_a_larger_storage_is_never_deferred():
    big = torch.randn(256, 256)
    tensors = [torch.randn(64, 256), big[:64]]
    state, _ = _state(1 << 30, tensors)
    state.start_offload()
    assert state.deferred_bytes == 0  # the slice is last: the tail stops at once


def test_a_tensor_rebuilt_from_units_on_both_sides_is_not_split():
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(64, 256), torch.randn(64, 256)
    state, ids = _state(b.nbytes, [TwoTensor(a, b)])
    state.start_offload()
    assert state.deferred_bytes == 0  # deferring b would hold a until the late release
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    got = state.pop_tensor(ids[0])
    assert torch.equal(got.a, a) and torch.equal(got.b, b)


class _Tokens(HostTransport):
    """Each ``offload_all`` call's copies share one token (as a CUDA event); waits logged."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []  # copies per call
        self.waited: list[object] = []

    def offload_all(self, copies):
        super().offload_all(copies)
        self.calls.append(len(copies))
        return [("event", len(self.calls))] * len(copies)

    def wait(self, event, stream=None):
        self.waited.append(event)


class _FailingSecondCall(_Tokens):
    """Queues the first call's copies and fails on the second."""

    def offload_all(self, copies):
        if len(self.calls) == 1:
            raise RuntimeError("queue failed")
        return super().offload_all(copies)


def test_the_layer_s_release_waits_only_for_the_copies_before_the_tail():
    # One offload_all call for the whole layer would give the tail's event to every
    # unit: the release at the layer's point would then wait for the deferred copies too.
    transport = _Tokens()
    state = OffloadableLayerState(None, transport=transport)
    tensors = _four()
    state.defer_budget = tensors[2].nbytes + tensors[3].nbytes
    for t in tensors:
        state.push_tensor(t)
    state.start_offload()
    assert transport.calls == [2, 2]
    state.release_activation_forward_gpu_memory()
    assert transport.waited == [("event", 1)]
    state.release_deferred()
    assert transport.waited == [("event", 1), ("event", 2)]
    state.release_all_memory()


def test_nothing_deferred_is_one_call_and_one_wait():
    transport = _Tokens()
    state = OffloadableLayerState(None, transport=transport)
    for t in _four():
        state.push_tensor(t)
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    assert transport.calls == [4] and transport.waited == [("event", 1)]
    state.release_all_memory()


def test_a_failure_queuing_the_tail_still_waits_for_the_copies_before_it():
    transport = _FailingSecondCall()
    state = OffloadableLayerState(None, transport=transport)
    tensors = _four()
    state.defer_budget = tensors[3].nbytes
    for t in tensors:
        state.push_tensor(t)
    with pytest.raises(RuntimeError, match="queue failed"):
        state.start_offload()
    state.release_all_memory()
    assert ("event", 1) in transport.waited
