"""Bytes that pay on a real GPU (NOTE [Bytes that pay]): V2's default schedule reads the
allocator's running peak, keeps q, k and v's projection and, by a byte budget, other
saved tensors on the device only where that raises no peak, and stays bit-exact.

Run with deterministic kernels:
``CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python3 -m pytest -m cuda``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from helpers import StepResult, assert_bit_equal, step

from cpu_offload import CudaTransport, v2
from cpu_offload.engine.peak_watch import ALLOCATOR_SLACK
from cpu_offload.models import ModelSpec, build_layers

pytestmark = pytest.mark.cuda

DEV = "cuda"
N, K = 6, 2
STEPS = 4  # iteration 1 is read, the choice holds from iteration 2 on


class _Blind(CudaTransport):
    """The CUDA transport without the peak reading: every view base moves."""

    def peak_allocated(self) -> None:
        return None


def _gpt(dtype):
    # Plain PyTorch SDPA blocks: q, k and v are strided views of one projection.
    spec = ModelSpec(kind="gpt", hidden=512, heads=8, seq=1024, batch=4, layers=N, dtype=dtype)
    layers = build_layers(spec, DEV)

    def make():
        return spec.make_input(DEV)

    return layers, make


class _Run:
    """Steps of one context: results, bytes moved and the requested-bytes peak of each."""

    def __init__(self, layers, make, transport, extra=None, defer: bool = True) -> None:
        ctx, sync = v2.get_cpu_offload_context(
            True, K, N, transport=transport, min_tensor_size_to_offload=1024
        )
        handles = [] if extra is None else extra(layers)
        # From an empty cache, equal steps get equal blocks: runs compare block for block.
        torch.cuda.empty_cache()
        self.results: list[StepResult] = []
        self.moved: list[int] = []
        #: Peaks of the bytes tensors asked for, without the allocator's rounding.
        self.requested: list[int] = []
        try:
            for _ in range(STEPS):
                before = transport.bytes_offloaded
                torch.cuda.synchronize()
                base = torch.cuda.memory_stats()["requested_bytes.all.current"]
                self.results.append(step(layers, make, ctx, sync))
                self.requested.append(torch.cuda.memory_stats()["requested_bytes.all.peak"] - base)
                self.moved.append(transport.bytes_offloaded - before)
                watch = ctx.offload_synchronizer.peak_watch
                if watch is not None:  # made at the end of the first step
                    watch.defer = defer
        finally:
            for h in handles:
                h.remove()
        self.sync = ctx.offload_synchronizer


def _set_allocator(settings: str) -> None:
    # PyTorch 2.11 deprecates torch.cuda.memory._set_allocator_settings for this one.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)(settings)


@contextlib.contextmanager
def _blocks_as_requested() -> Iterator[None]:
    """Run with expandable segments, where the allocator splits every block down to the
    request (rounded to 512 bytes).

    By default it hands out a cached block whole when at most 1 MiB would be left, so
    each live tensor's block can be up to 1 MiB over its request, by where earlier steps
    left free blocks. Two runs whose allocations differ then differ by some MiB of
    rounding that says nothing of the bytes they hold.
    """
    # Set by the environment already (and then left as it is), or set here and undone.
    # PyTorch reads PYTORCH_CUDA_ALLOC_CONF only where PYTORCH_ALLOC_CONF is unset.
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    ours = "expandable_segments:True" not in conf.replace(" ", "")
    torch.cuda.empty_cache()
    if ours:
        _set_allocator("expandable_segments:True")
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        if ours:
            _set_allocator("expandable_segments:False")


def _assert_no_higher(watched: _Run, blind: _Run, blocks_as_requested: bool) -> None:
    for i in range(STEPS):
        # What tensors ask for is never more, with any allocator.
        assert watched.requested[i] <= blind.requested[i], (i, watched.requested, blind.requested)
        if blocks_as_requested:  # then the allocated peak, as users read it, neither
            assert watched.results[i].peak_bytes <= blind.results[i].peak_bytes + ALLOCATOR_SLACK, (
                i,
                watched.results[i].peak_bytes,
                blind.results[i].peak_bytes,
            )


def _allocate(nbytes: int) -> None:
    torch.empty(nbytes, dtype=torch.uint8, device=DEV)  # allocated and freed at once


def _peak_after_windows(layers):
    # A large transient when layer 0's backward begins, after every reload: the step's peak.
    def hook(module, args, out):
        out.register_hook(lambda grad: _allocate(4 << 30))

    return [layers[0].register_forward_hook(hook)]


def _peak_inside_windows(layers):
    # A large transient at the end of the last forward, while both layers are offloaded.
    return [layers[N - 1].register_forward_hook(lambda m, a, o: _allocate(4 << 30))]


def _watched_beside_blind(
    dtype, extra=None, blocks_as_requested: bool = False
) -> tuple[_Run, _Run]:
    """The same steps watched and moving everything: exact, and never heavier."""
    with _blocks_as_requested() if blocks_as_requested else contextlib.nullcontext():
        layers, make = _gpt(dtype)
        ref = step(layers, make)
        watched = _Run(layers, make, CudaTransport(), extra)
        blind = _Run(layers, make, _Blind(), extra)
    for got in watched.results:
        assert_bit_equal(ref, got)
    _assert_no_higher(watched, blind, blocks_as_requested)
    return watched, blind


@pytest.mark.parametrize("blocks_as_requested", [False, True], ids=["cached", "expandable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_peak_never_raised_and_exact(dtype, blocks_as_requested, deterministic):
    # Whatever the watch keeps here (with expandable segments, often nothing): the
    # allocated peak with something kept is test_everything_stays_...'s.
    watched, _ = _watched_beside_blind(dtype, blocks_as_requested=blocks_as_requested)
    assert watched.sync.peak_watch is not None


def test_everything_stays_when_the_peak_falls_after_the_windows(deterministic):
    watched, blind = _watched_beside_blind(
        torch.bfloat16, _peak_after_windows, blocks_as_requested=True
    )
    sync = watched.sync
    states = [sync.layers[i] for i in range(K)]
    bases = sum(state.view_base_bytes for state in states)
    assert bases > 0 and sync.peak_watch.kept == set(range(K))
    # The bases, and by budget every other unit: a 4 GiB room holds both layers whole.
    assert sum(state.budget_kept_bytes for state in states) == blind.moved[2] - bases
    assert watched.moved[2:] == [0] * (STEPS - 2)


def test_bases_move_when_the_peak_falls_inside_the_windows(deterministic):
    layers, make = _gpt(torch.bfloat16)
    ref = step(layers, make)
    watched = _Run(layers, make, CudaTransport(), _peak_inside_windows)
    assert watched.sync.peak_watch.kept == set()
    assert watched.moved == [watched.moved[0]] * STEPS
    for got in watched.results:
        assert_bit_equal(ref, got)


def test_a_memory_budget_keeps_what_fits_under_it_and_holds(deterministic):
    """Above the step's own peak, a budget keeps part of the offloaded layers on the
    device: fewer bytes move, the step stays under the budget and bit-exact."""
    layers, make = _gpt(torch.bfloat16)
    ref = step(layers, make)

    def run(memory_budget):
        transport = CudaTransport()
        ctx, sync = v2.get_cpu_offload_context(
            True,
            K,
            N,
            transport=transport,
            min_tensor_size_to_offload=1024,
            memory_budget=memory_budget,
        )
        handles = _peak_inside_windows(layers)  # nothing pays under the step's own peak
        torch.cuda.empty_cache()
        moved, peaks = [], []
        try:
            for _ in range(STEPS):
                before = transport.bytes_offloaded
                got = step(layers, make, ctx, sync)
                # The step's absolute peak, as the budget counts it (ref's results stay
                # allocated; each step's own are dropped, so every step starts alike).
                peaks.append(torch.cuda.max_memory_allocated())
                assert_bit_equal(ref, got)
                del got
                moved.append(transport.bytes_offloaded - before)
        finally:
            for h in handles:
                h.remove()
        return moved, peaks, ctx.offload_synchronizer

    moved, peaks, sync = run(None)
    assert moved == [moved[0]] * STEPS and sync.peak_watch.kept == set()
    per_layer = moved[0] // K
    budget = max(peaks) + per_layer + per_layer // 2
    kept_moved, kept_peaks, sync = run(budget)
    assert kept_moved[0] == moved[0]  # the first steps move everything
    # The room of one and a half layers, less the margin and filled by whole tensors:
    # part of the offloaded bytes stays on the device, the rest still moves.
    assert 0 < kept_moved[-1] < moved[0]
    assert all(peak <= budget for peak in kept_peaks), (kept_peaks, budget)
    assert max(kept_peaks) > max(peaks)  # the room was used
    states = [sync.layers[i] for i in range(K)]
    assert (
        sum(s.budget_kept_bytes for s in states)
        + sum(s.view_base_bytes for s in states if s.keep_view_bases)
        == moved[0] - kept_moved[-1]
    )


def test_releases_deferred_into_a_window_s_first_interval_raise_no_peak(deterministic):
    """With the step's peak inside both windows (in the last layer's forward), layer 0's
    first interval (the forward of layer 4) still has room: its bytes are released one
    point late, at the same bytes moved, bit-exact, and no higher a peak than releasing
    them on time."""
    with _blocks_as_requested():
        layers, make = _gpt(torch.bfloat16)
        ref = step(layers, make)
        deferring = _Run(layers, make, CudaTransport(), _peak_inside_windows)
        on_time = _Run(layers, make, CudaTransport(), _peak_inside_windows, defer=False)
    first, second = deferring.sync.layers[0], deferring.sync.layers[1]
    assert first.deferred_bytes == first.moved_bytes > 0
    assert second.deferred_bytes == 0  # its first interval holds the peak
    assert on_time.sync.layers[0].deferred_bytes == 0
    assert deferring.moved == on_time.moved == [deferring.moved[0]] * STEPS
    for got in deferring.results:
        assert_bit_equal(ref, got)
    _assert_no_higher(deferring, on_time, blocks_as_requested=True)
