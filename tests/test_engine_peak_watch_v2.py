"""Which offloaded bytes pay (NOTE [Bytes that pay]) in V2's default schedule: view bases
and byte budgets kept or moved on the CPU stand-in as the running peak says, bit-exact
throughout, and the memory budget passed on by the public entry points. The watch alone
is in ``test_engine_peak_watch.py``.
"""

from __future__ import annotations

import warnings

import pytest
from helpers import assert_bit_equal, step
from peak_watch_helpers import PeakTransport, small_gpt

import cpu_offload
from cpu_offload import HostTransport, offload_layers, v2
from cpu_offload.engine.peak_watch import Window
from cpu_offload.models import ModelSpec, build_layers

N, K = 4, 2  # windows: layer 0 from the forward of 2 to the backward of 1, layer 1 3..2


def _context(transport):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may warn: bases are kept on purpose
        return v2.get_cpu_offload_context(
            True, K, N, transport=transport, min_tensor_size_to_offload=256
        )


def _moved_per_step(layers, make, ref, ctx, sync, steps):
    transport = ctx.offload_synchronizer.transport
    moved = []
    for _ in range(steps):
        before = transport.bytes_offloaded
        assert_bit_equal(ref, step(layers, make, ctx, sync))
        assert transport.bytes_reloaded == transport.bytes_offloaded
        moved.append(transport.bytes_offloaded - before)
    return moved


def _in_forward_of(layer, action):
    """Run ``action`` at the end of ``layer``'s forward: inside both windows."""
    return layer.register_forward_hook(lambda module, args, out: action())


def _in_backward_of(layer, action):
    """Run ``action`` when ``layer``'s backward begins: layer 0's is after both windows."""

    def hook(module, args, out):
        out.register_hook(lambda grad: action())

    return layer.register_forward_hook(hook)


def _moved_with_the_peak_raised_in_layer(layer, layers, make, ref, ctx, sync, steps=4):
    """Bytes moved per step while the forward of ``layer`` raises the stand-in's running
    peak by 1 GiB each step, and how many times it did."""
    transport = ctx.offload_synchronizer.transport
    raises = []

    def raise_peak():
        raises.append(1)
        transport.peak += 1 << 30

    handle = _in_forward_of(layers[layer], raise_peak)
    try:
        moved = _moved_per_step(layers, make, ref, ctx, sync, steps)
    finally:
        handle.remove()
    return moved, len(raises)


def _moved_with_the_peak_after_every_window(layers, make, ref):
    """Four steps whose peak rises by 1 GiB when layer 0's backward begins: bytes moved
    per step, and the synchronizer."""
    transport = PeakTransport()
    ctx, sync = _context(transport)

    def raise_peak():
        transport.peak += 1 << 30

    handle = _in_backward_of(layers[0], raise_peak)
    try:
        moved = _moved_per_step(layers, make, ref, ctx, sync, 4)
    finally:
        handle.remove()
    return moved, ctx.offload_synchronizer


def test_everything_stays_when_the_peak_falls_after_every_window():
    layers, make, ref = small_gpt(N)
    moved, synchronizer = _moved_with_the_peak_after_every_window(layers, make, ref)
    states = [synchronizer.layers[i] for i in range(K)]
    bases = sum(state.view_base_bytes for state in states)
    assert bases > 0
    # Made after iteration 0, the watch reads iteration 1 and chooses at its end: a room
    # of 1 GiB holds the bases and, by budget, every other unit as well.
    assert moved[0] == moved[1] > bases
    assert moved[2] == moved[3] == 0
    assert synchronizer.peak_watch.kept == set(range(K))
    assert all(state.keep_view_bases for state in states)
    assert sum(state.budget_kept_bytes for state in states) == moved[0] - bases


def test_bases_move_when_the_peak_falls_inside_the_windows():
    layers, make, ref = small_gpt(N)
    transport = PeakTransport()
    ctx, sync = _context(transport)
    moved, raises = _moved_with_the_peak_raised_in_layer(N - 1, layers, make, ref, ctx, sync)
    assert raises == 4
    assert moved == [moved[0]] * 4
    assert ctx.offload_synchronizer.peak_watch.kept == set()


def test_bases_that_raise_the_peak_move_again():
    layers, make, ref = small_gpt(N)
    transport = PeakTransport()
    ctx, sync = _context(transport)
    inside = [False]

    def raise_peak():
        transport.peak += 1 << 30

    after = _in_backward_of(layers[0], lambda: None if inside[0] else raise_peak())
    during = _in_forward_of(layers[N - 1], lambda: raise_peak() if inside[0] else None)
    try:
        moved = _moved_per_step(layers, make, ref, ctx, sync, 3)
        inside[0] = True  # from now on, the peak rises inside the windows
        moved += _moved_per_step(layers, make, ref, ctx, sync, 2)
    finally:
        after.remove()
        during.remove()
    watch = ctx.offload_synchronizer.peak_watch
    assert moved[2] < moved[0]  # kept in iteration 2
    assert moved[3] == moved[2]  # and in iteration 3, whose peak rose inside the windows
    assert moved[4] == moved[0]  # so iteration 4 moves them again
    assert watch.kept == set() and watch.refused == set(range(K))


def test_windows_follow_the_schedule():
    ctx, _ = _context(PeakTransport())
    # The forward of 2 is point 2; the backward of 1 is point 2N - 1 - 1 = 6.
    assert ctx.offload_synchronizer._windows == [Window(0, 2, 6), Window(1, 3, 5)]
    ctx, _ = v2.get_cpu_offload_context(
        True,
        model_layers=N,
        transport=PeakTransport(),
        synchronization_dict={0: (True, 1, True, 3), 1: (True, 2, False, 1)},
    )
    assert ctx.offload_synchronizer._windows == [Window(0, 1, 3), Window(1, 2, 6)]


def test_no_watch_with_retained_buffers():
    layers, make, ref = small_gpt(N)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx, sync = v2.get_cpu_offload_context(
            True,
            K,
            N,
            transport=PeakTransport(),
            min_tensor_size_to_offload=256,
            retain_pinned_cpu_buffers=True,  # the same blocks every iteration
        )
    moved = _moved_per_step(layers, make, ref, ctx, sync, 3)
    assert moved == [moved[0]] * 3
    assert ctx.offload_synchronizer.peak_watch is None


def test_no_watch_without_a_peak_reading():
    layers, make, ref = small_gpt(N)
    ctx, sync = _context(HostTransport())
    moved = _moved_per_step(layers, make, ref, ctx, sync, 3)
    assert moved == [moved[0]] * 3
    assert ctx.offload_synchronizer.peak_watch is None


def test_without_view_bases_budgets_keep_what_lowers_no_peak():
    spec = ModelSpec(kind="mha", hidden=64, heads=4, seq=64, batch=2, layers=N)
    layers = build_layers(spec, "cpu")

    def make():
        return spec.make_input("cpu", seed=1)

    ref = step(layers, make)
    moved, synchronizer = _moved_with_the_peak_after_every_window(layers, make, ref)
    assert all(synchronizer.layers[i].view_base_bytes == 0 for i in range(K))
    assert moved[0] == moved[1] > 0
    assert moved[2] == moved[3] == 0
    assert synchronizer.peak_watch.kept == set()
    assert sorted(synchronizer.peak_watch.budgets) == list(range(K))


@pytest.mark.parametrize(("budget", "keeps"), [(None, False), (0, False), (1 << 40, True)])
def test_a_memory_budget_keeps_what_fits_under_it(budget, keeps):
    # The step peaks inside both windows, rising 1 GiB every step: nothing pays to keep
    # under the step's own peak, everything fits under a budget of 1 TiB.
    layers, make, ref = small_gpt(N)
    transport = PeakTransport()
    ctx, sync = v2.get_cpu_offload_context(
        True, K, N, transport=transport, min_tensor_size_to_offload=256, memory_budget=budget
    )
    moved, _ = _moved_with_the_peak_raised_in_layer(N - 1, layers, make, ref, ctx, sync)
    watch = ctx.offload_synchronizer.peak_watch
    if keeps:
        assert moved[0] == moved[1] > 0 and moved[2] == moved[3] == 0
        assert watch.kept == set(range(K)) and watch.refused == set()
    else:
        assert moved == [moved[0]] * 4
        assert watch.kept == set()


def _moved_through(make_context, steps=4):
    """Bytes moved per step of the small GPT with the peak rising inside both windows,
    under the offloading ``make_context(layers, transport)`` sets up: a ``(ctx, sync)``
    pair, or None where it wraps the layers itself."""
    layers, make, ref = small_gpt(N)
    transport = PeakTransport()
    made = make_context(layers, transport)
    ctx, sync = made if made is not None else (None, None)

    def raise_peak():
        transport.peak += 1 << 30

    handle = _in_forward_of(layers[N - 1], raise_peak)
    moved = []
    try:
        for _ in range(steps):
            before = transport.bytes_offloaded
            assert_bit_equal(ref, step(layers, make, ctx, sync))
            moved.append(transport.bytes_offloaded - before)
    finally:
        handle.remove()
    return moved


def test_the_top_level_function_passes_the_budget_on(monkeypatch):
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    moved = _moved_through(
        lambda layers, transport: cpu_offload.get_cpu_offload_context(
            True, K, N, transport=transport, min_tensor_size_to_offload=256, memory_budget=1 << 40
        )
    )
    assert moved[0] == moved[1] > 0 and moved[2] == moved[3] == 0


def test_offload_layers_passes_the_budget_on(monkeypatch):
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    handles = []

    def wrap(layers, transport):
        handles.append(
            offload_layers(
                layers,
                num_offloaded=K,
                transport=transport,
                min_tensor_size_to_offload=256,
                memory_budget=1 << 40,
            )
        )

    try:
        moved = _moved_through(wrap)
    finally:
        handles[0].remove()
    assert moved[0] == moved[1] > 0 and moved[2] == moved[3] == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"memory_budget": 1 << 30, "retain_pinned_cpu_buffers": True},
            ValueError,
            "memory_budget and retain_pinned_cpu_buffers=True exclude each other",
        ),
        ({"memory_budget": -1}, ValueError, "memory_budget must be None or an int >= 0"),
        ({"memory_budget": 2.5e9}, TypeError, "memory_budget must be an int"),
        ({"memory_budget": True}, TypeError, "memory_budget must be an int"),
        (
            {"memory_budget": 1 << 30, "manual_synchronization": True},
            ValueError,
            "memory_budget and manual_synchronization=True exclude each other",
        ),
    ],
)
def test_a_bad_memory_budget_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        v2.get_cpu_offload_context(True, K, N, transport=HostTransport(), **kwargs)
