"""Which offloaded bytes pay (NOTE [Bytes that pay]): the peak watch on synthetic memory
profiles, checked against the profile it was read from, and V2's default schedule keeping
or moving view bases on the CPU stand-in as the running peak says, bit-exact throughout.
"""

from __future__ import annotations

import random
import warnings

import pytest
from helpers import assert_bit_equal, step

import cpu_offload
from cpu_offload import HostTransport, offload_layers, v2
from cpu_offload.engine.peak_watch import (
    BUDGET_MARGIN_MIN,
    BUDGET_MARGIN_SHARE,
    PeakWatch,
    Window,
)
from cpu_offload.models import ModelSpec, build_layers

# -- the watch alone -----------------------------------------------------------------------


class _Reads:
    """The running peak the watch reads: set by the test before each read."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


def _watch(windows: list[Window], points: int, budget: int = 0) -> tuple[PeakWatch, _Reads]:
    reads = _Reads()
    return PeakWatch(reads, windows, points, slack=0, budget=budget), reads


def _run(
    watch: PeakWatch,
    reads: _Reads,
    interval_peaks: list[int],
    candidates: dict[int, int],
    before: int = 0,
    after: int = 0,
    units: dict[int, tuple[int, int]] | None = None,
) -> set[int]:
    """One iteration whose interval ``t`` (ending at point ``t``) peaks at
    ``interval_peaks[t]``; ``before`` is the running peak when it begins, ``after`` the
    peak between its last point and the next iteration; ``units``: per layer, the bytes
    of other units its budget kept and moved."""
    reads.value = before
    watch.begin()
    for t, peak in enumerate(interval_peaks):
        reads.value = max(reads.value, peak)
        watch.mark(t)  # a point the watch does not want is not read
    reads.value = max(reads.value, after)
    return set(watch.end(candidates, units))


def test_peak_after_every_window_keeps_what_fits():
    # Windows (0, 3] and (1, 4]; the step peaks at 100 in interval 5, after both.
    watch, reads = _watch([Window(0, 0, 3), Window(1, 1, 4)], 6)
    kept = _run(watch, reads, [10, 50, 60, 70, 75, 100], {0: 20, 1: 20})
    # Room: 50, 40, 30, 25 in intervals 1..4; layer 0 takes 20 of 1..3, layer 1 needs 20
    # in 2..4 where 20, 10 and 25 are left: it does not fit.
    assert kept == {0}


def test_peak_inside_a_window_keeps_nothing_there():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    assert _run(watch, reads, [10, 20, 100, 30, 40], {0: 1}) == set()


def test_an_earlier_higher_peak_teaches_nothing():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    assert _run(watch, reads, [10, 20, 30, 40, 50], {0: 1}, before=500) == set()


def test_peak_between_iterations_counts_as_after_the_windows():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    assert _run(watch, reads, [10, 20, 30, 40, 50], {0: 30}, after=80) == {0}


def test_a_cut_short_iteration_changes_nothing():
    watch = PeakWatch(iter([0, 10, 100]).__next__, [Window(0, 0, 2)], 4, slack=0)
    watch.begin()
    watch.mark(1)  # point 2 is never reached
    assert watch.end({0: 1}) == set()


def test_kept_bytes_that_raise_the_peak_move_again_for_good():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    assert _run(watch, reads, [10, 20, 30, 40, 100], {0: 30}) == {0}
    # Next iteration the peak rises inside the window: layer 0 moves its bases again.
    assert _run(watch, reads, [10, 20, 130, 40, 100], {0: 30}, before=100) == set()
    assert watch.refused == {0}
    # Room again (a reset of the peak statistics): layer 0 is not chosen again.
    assert _run(watch, reads, [10, 20, 30, 40, 100], {0: 30}) == set()


def test_the_allocator_slack_is_left_as_margin():
    reads = _Reads()
    watch = PeakWatch(reads, [Window(0, 0, 3)], 5, slack=10)
    assert _run(watch, reads, [10, 20, 30, 40, 100], {0: 55}) == set()  # room 60 < 55 + 10
    assert _run(watch, reads, [10, 20, 30, 40, 100], {0: 50}) == {0}  # room 60 = 50 + 10
    # Peaks reset, the same step again, its peak in the window 5 over: within the slack.
    assert _run(watch, reads, [10, 20, 105, 40, 100], {0: 50}) == {0}
    # 11 over: raised.
    assert _run(watch, reads, [10, 20, 111, 40, 100], {0: 50}) == set()
    assert watch.refused == {0}


def test_a_peak_before_the_first_window_is_blamed_on_none():
    watch, reads = _watch([Window(0, 2, 4)], 6)
    assert _run(watch, reads, [10, 20, 30, 40, 50, 100], {0: 5}) == {0}
    # Peaks reset; the step now peaks in interval 1, before the window: nothing to undo.
    assert _run(watch, reads, [10, 200, 30, 40, 50, 60], {0: 5}) == {0}
    assert watch.refused == set()


def test_a_peak_in_the_last_interval_of_a_window_is_blamed_on_it():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    assert _run(watch, reads, [10, 20, 30, 40, 100], {0: 5}) == {0}
    assert _run(watch, reads, [10, 20, 30, 40, 200], {0: 5}) == {0}  # interval 4: after it
    assert _run(watch, reads, [10, 20, 30, 300, 40], {0: 5}) == set()  # interval 3: in it


def test_an_iteration_that_never_ends_its_backward_ends_the_keeping():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    assert _run(watch, reads, [10, 20, 30, 40, 100], {0: 5}) == {0}
    watch.begin()
    watch.mark(1)  # out of memory in the next layer, say: the next iteration begins
    watch.begin()
    assert watch.kept == set() and watch.refused == {0}


def test_a_missing_reading_leaves_the_iteration_unjudged():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    assert _run(watch, reads, [10, 20, 30, 40, 100], {0: 5}) == {0}
    reads.value = None  # an allocator that keeps no statistics
    watch.begin()
    for t in range(5):
        watch.mark(t)
    assert watch.end({0: 5}) == {0}
    watch.begin()
    assert watch.kept == {0}  # that iteration ended: nothing was cut short


def test_a_watch_with_nothing_to_judge_reads_nothing_until_bytes_move():
    reads: list[int] = []

    def read() -> int:
        reads.append(0)
        return 100

    watch = PeakWatch(read, [Window(0, 0, 2)], 4, slack=0)

    def iteration(candidates: dict[int, int], units: dict[int, tuple[int, int]]) -> int:
        reads.clear()
        watch.begin()
        for t in range(4):
            watch.mark(t)
        watch.end(candidates, units)
        return len(reads)

    # Read at begin, at points 0 to 2 and at the end; nothing moved: the next iteration
    # is not read.
    assert iteration({0: 0}, {0: (0, 0)}) == 5
    assert watch.idle
    assert iteration({0: 0}, {0: (0, 0)}) == 0
    # Bytes move again (a longer sequence, say): the iteration after is read again.
    assert iteration({0: 0}, {0: (0, 64)}) == 0
    assert not watch.idle
    assert iteration({0: 0}, {0: (0, 64)}) == 5


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="start before it ends"):
        Window(0, 3, 3)
    with pytest.raises(ValueError, match="windows is empty"):
        PeakWatch(lambda: 0, [], 4)
    with pytest.raises(ValueError, match="ends at point 4"):
        PeakWatch(lambda: 0, [Window(0, 1, 4)], 4)


def _random_windows(rng: random.Random) -> tuple[int, list[Window]]:
    """A random number of points, and one to four windows within them."""
    points = rng.randint(3, 12)
    windows = []
    for layer in range(rng.randint(1, 4)):
        start = rng.randint(0, points - 2)
        windows.append(Window(layer, start, rng.randint(start + 1, points - 1)))
    return points, windows


@pytest.mark.parametrize("seed", range(200))
def test_what_is_kept_never_raises_the_peak(seed):
    """On random profiles, keeping the chosen bytes leaves every interval within the peak."""
    rng = random.Random(seed)
    points, windows = _random_windows(rng)
    candidates = {w.layer: rng.randint(0, 40) for w in windows}
    peaks = [rng.randint(0, 100) for _ in range(points)]
    after = rng.choice([0, rng.randint(0, 150)])
    watch, reads = _watch(windows, points)
    kept = _run(watch, reads, peaks, candidates, after=after)
    step_peak = max(*peaks, after)

    def extra(t: int) -> int:
        return sum(candidates[w.layer] for w in windows if w.layer in kept and w.start < t <= w.end)

    for t in range(points):
        assert peaks[t] + extra(t) <= step_peak
    # And nothing more would fit under what the watch can know of each interval (the
    # running peak at its end): each candidate left out could raise the peak somewhere.
    running = [max(peaks[: t + 1]) for t in range(points)]
    for w in windows:
        if w.layer not in kept and candidates[w.layer] > 0:
            span = range(w.start + 1, w.end + 1)
            assert any(running[t] + extra(t) + candidates[w.layer] > step_peak for t in span)


# -- budgets: other units kept where the room allows ---------------------------------------

# Peaks of this size make the margin PEAK // BUDGET_MARGIN_SHARE (slack 0).
PEAK = 100 * BUDGET_MARGIN_SHARE * BUDGET_MARGIN_MIN
MARGIN = PEAK // BUDGET_MARGIN_SHARE


def test_budgets_take_the_room_left_innermost_first():
    # Nested windows: layer 1's (1, 3] inside layer 0's (0, 4]; the step peaks after both.
    watch, reads = _watch([Window(0, 0, 4), Window(1, 1, 3)], 6)
    m = MARGIN
    profile = [0, PEAK - 10 * m, PEAK - 7 * m, PEAK - 9 * m, PEAK - 6 * m, PEAK]
    _run(watch, reads, profile, {}, units={0: (0, PEAK), 1: (0, PEAK)})
    # Layer 1 first: room 7m in interval 2, 9m in 3, less the margin.
    assert watch.budgets[1] == 6 * m
    # Layer 0 gets what intervals 1 to 4 have left: interval 2 has m left, less the margin.
    assert watch.budgets[0] == 0


def test_a_budget_is_bounded_by_the_bytes_moved_and_grows_from_what_was_kept():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    m = MARGIN
    profile = [0, PEAK - 20 * m, PEAK - 20 * m, PEAK - 20 * m, PEAK]
    _run(watch, reads, profile, {}, units={0: (0, 3 * m)})
    assert watch.budgets == {0: 3 * m}  # all its units: less than the room
    # Its units filled 2m of it; the room read with those 2m on the device grows it.
    profile = [0, PEAK - 18 * m, PEAK - 18 * m, PEAK - 18 * m, PEAK]
    _run(watch, reads, profile, {}, units={0: (2 * m, 4 * m)})
    assert watch.budgets == {0: 2 * m + 4 * m}
    _run(watch, reads, profile, {}, units={0: (2 * m, 30 * m)})
    assert watch.budgets == {0: 2 * m + 18 * m - m}


def test_the_unfilled_part_of_a_budget_is_not_given_to_another_layer():
    # Nested windows: layer 1's (1, 3] inside layer 0's (0, 4].
    watch, reads = _watch([Window(0, 0, 4), Window(1, 1, 3)], 6)
    base = [0, PEAK - 50 * MARGIN, PEAK - 10 * MARGIN, PEAK - 10 * MARGIN, PEAK - 50 * MARGIN, PEAK]
    plenty = 10**18
    _run(watch, reads, base, {}, units={0: (0, plenty), 1: (0, plenty)})
    assert watch.budgets == {1: 9 * MARGIN, 0: 0}
    for kept in (6 * MARGIN, 6 * MARGIN, 9 * MARGIN):
        # Layer 1's units fill only part of its budget: the room read says so.
        profile = [p + (kept if t in (2, 3) else 0) for t, p in enumerate(base)]
        _run(watch, reads, profile, {}, units={0: (watch.budgets[0], plenty), 1: (kept, plenty)})
        for t in (2, 3):  # were both budgets filled, the intervals would stay under the peak
            assert base[t] + watch.budgets[0] + watch.budgets[1] <= PEAK - MARGIN
    assert watch.budgets[1] == 9 * MARGIN


def test_a_budget_that_raises_the_peak_is_cut_and_never_grows_again():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    _run(watch, reads, [0, 1000, 1000, 1000, PEAK], {}, units={0: (0, 2 * PEAK)})
    budget = watch.budgets[0]
    assert budget == PEAK - 1000 - MARGIN
    # The next iteration (peaks reset) peaks 500 higher, inside the window.
    _run(watch, reads, [0, 1000, PEAK + 500, 1000, PEAK], {}, units={0: (budget, 5000)})
    assert watch.budgets[0] == budget - 500 - (PEAK + 500) // BUDGET_MARGIN_SHARE
    assert watch.capped == {0}
    _run(watch, reads, [0, 10, 10, 10, PEAK], {}, units={0: (watch.budgets[0], 9000)})
    assert watch.budgets[0] == budget - 500 - (PEAK + 500) // BUDGET_MARGIN_SHARE


def test_an_iteration_cut_short_ends_the_budgets():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    _run(watch, reads, [0, 1000, 1000, 1000, PEAK], {}, units={0: (0, 20000)})
    assert watch.budgets[0] > 0
    watch.begin()
    watch.mark(1)  # out of memory in the next layer, say
    watch.begin()
    assert watch.budgets == {} and watch.capped == {0}


def test_without_unit_bytes_only_view_bases_are_kept():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    assert _run(watch, reads, [0, 10, 10, 10, PEAK], {0: 5}) == {0}
    assert watch.budgets == {}


def _random_profile(
    rng: random.Random, scale: int = 1
) -> tuple[int, list[Window], dict[int, int], dict[int, tuple[int, int]], list[int]]:
    """Random windows, view-base bytes and other units' bytes per layer (up to
    ``400 * scale`` and ``4000 * scale``), and interval peaks up to ``PEAK``."""
    points, windows = _random_windows(rng)
    candidates = {w.layer: rng.randint(0, 400 * scale) for w in windows}
    units = {w.layer: (0, rng.randint(0, 4000 * scale)) for w in windows}
    peaks = [rng.randint(0, PEAK) for _ in range(points)]
    return points, windows, candidates, units, peaks


def _assert_kept_within(
    watch: PeakWatch,
    windows: list[Window],
    peaks: list[int],
    kept: set[int],
    candidates: dict[int, int],
    ceiling: int,
) -> None:
    """Every interval's peak plus the bases and budgets kept over it stays within
    ``ceiling``, less the margin wherever a budget adds bytes."""
    margin = ceiling // BUDGET_MARGIN_SHARE

    def inside(w: Window, t: int) -> bool:
        return w.start < t <= w.end

    for t, peak in enumerate(peaks):
        bases = sum(candidates[w.layer] for w in windows if w.layer in kept and inside(w, t))
        budgets = sum(watch.budgets.get(w.layer, 0) for w in windows if inside(w, t))
        assert peak + bases + budgets <= ceiling - (margin if budgets else 0)


@pytest.mark.parametrize("seed", range(200))
def test_what_budgets_keep_never_raises_the_peak(seed):
    """On random profiles, bases and budgets together keep every interval within the
    peak, less the margin wherever a budget adds bytes."""
    rng = random.Random(seed)
    points, windows, candidates, units, peaks = _random_profile(rng)
    after = rng.choice([0, rng.randint(0, 2 * PEAK)])
    watch, reads = _watch(windows, points)
    kept = _run(watch, reads, peaks, candidates, after=after, units=units)
    _assert_kept_within(watch, windows, peaks, kept, candidates, max(*peaks, after))
    for w in windows:
        assert 0 <= watch.budgets.get(w.layer, 0) <= units[w.layer][1]


# -- a memory budget: the room read against the caller's ceiling --------------------------


def test_a_budget_above_the_peak_gives_its_room_to_the_windows():
    # The step peaks inside layer 0's window (0, 3]: without a budget nothing is kept.
    profile = [0, PEAK, PEAK, PEAK, PEAK - MARGIN]
    plain, reads = _watch([Window(0, 0, 3)], 5)
    assert _run(plain, reads, profile, {0: MARGIN}, units={0: (0, 50 * MARGIN)}) == set()
    assert plain.budgets == {0: 0}
    budget = PEAK + 30 * MARGIN
    watch, reads = _watch([Window(0, 0, 3)], 5, budget)
    # The base fits under the budget; the units' budget takes the rest of the room,
    # less the margin of the budget.
    assert _run(watch, reads, profile, {0: MARGIN}, units={0: (0, 50 * MARGIN)}) == {0}
    assert watch.budgets == {0: budget - PEAK - MARGIN - budget // BUDGET_MARGIN_SHARE}
    # A step that peaks at most at the budget is not a rise: nothing is cut.
    kept_peak = PEAK + MARGIN + watch.budgets[0]
    assert kept_peak <= budget
    profile = [0, kept_peak, kept_peak, kept_peak, PEAK - MARGIN]
    assert _run(watch, reads, profile, {0: MARGIN}, units={0: (watch.budgets[0], 0)}) == {0}
    assert watch.capped == set() and watch.refused == set()


def test_a_step_above_the_budget_cuts_what_the_budget_kept():
    budget = PEAK + 30 * MARGIN
    watch, reads = _watch([Window(0, 0, 3)], 5, budget)
    profile = [0, PEAK, PEAK, PEAK, PEAK - MARGIN]
    _run(watch, reads, profile, {0: MARGIN}, units={0: (0, 50 * MARGIN)})
    chosen = watch.budgets[0]
    over = budget + 5 * MARGIN  # the peak rose above the budget inside the window
    profile = [0, over, over, over, PEAK - MARGIN]
    _run(watch, reads, profile, {0: MARGIN}, units={0: (chosen, 0)}, before=PEAK)
    assert watch.refused == {0} and watch.kept == set()
    assert watch.capped == {0} and watch.budgets[0] < chosen


@pytest.mark.parametrize("seed", range(100))
def test_a_budget_below_the_peak_changes_nothing(seed):
    rng = random.Random(seed)
    points, windows, candidates, units, peaks = _random_profile(rng)
    plain, reads = _watch(windows, points)
    kept = _run(plain, reads, peaks, candidates, units=units)
    watch, reads = _watch(windows, points, rng.randint(0, min(peaks[-1], max(peaks))))
    assert _run(watch, reads, peaks, candidates, units=units) == kept
    assert watch.budgets == plain.budgets


@pytest.mark.parametrize("seed", range(100))
def test_what_a_budget_keeps_stays_under_it(seed):
    rng = random.Random(seed)
    points, windows, candidates, units, peaks = _random_profile(rng, scale=10)
    budget = rng.randint(0, 2 * PEAK)
    watch, reads = _watch(windows, points, budget)
    kept = _run(watch, reads, peaks, candidates, units=units)
    _assert_kept_within(watch, windows, peaks, kept, candidates, max(*peaks, budget))


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="budget must be >= 0"):
        PeakWatch(_Reads(), [Window(0, 0, 1)], 2, budget=-1)


@pytest.mark.parametrize("share", [2, 7, BUDGET_MARGIN_SHARE])
def test_the_margin_share_sets_the_room_left_unused(share):
    # A peak large enough that PEAK // share is above the floor for every share here.
    peak = 100 * BUDGET_MARGIN_SHARE * BUDGET_MARGIN_MIN
    reads = _Reads()
    watch = PeakWatch(reads, [Window(0, 0, 3)], 5, slack=0, margin_share=share)
    _run(watch, reads, [0, 1000, 1000, 1000, peak], {}, units={0: (0, 2 * peak)})
    assert watch.budgets[0] == peak - 1000 - peak // share


def test_the_margin_is_never_below_its_floor():
    peak = BUDGET_MARGIN_SHARE * BUDGET_MARGIN_MIN // 2  # 1/share of it is half the floor
    reads = _Reads()
    watch = PeakWatch(reads, [Window(0, 0, 3)], 5, slack=0)
    _run(watch, reads, [0, 1000, 1000, 1000, peak], {}, units={0: (0, 2 * peak)})
    assert watch.budgets[0] == peak - 1000 - BUDGET_MARGIN_MIN


@pytest.mark.parametrize("share", [0, -3])
def test_a_margin_share_below_one_is_refused(share):
    with pytest.raises(ValueError, match=f"margin_share must be >= 1, got {share}"):
        PeakWatch(_Reads(), [Window(0, 0, 1)], 2, margin_share=share)


# -- V2's default schedule on the CPU stand-in ---------------------------------------------

N, K = 4, 2  # windows: layer 0 from the forward of 2 to the backward of 1, layer 1 3..2


class _PeakTransport(HostTransport):
    """The CPU stand-in with a running peak the test raises where it wants the step's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def peak_allocated(self) -> int:
        return self.peak


def _gpt():
    # Its attention saves q, k and v as strided views of one projection: view bases.
    spec = ModelSpec(kind="gpt", hidden=64, heads=4, seq=64, batch=2, layers=N)
    layers = build_layers(spec, "cpu")

    def make():
        return spec.make_input("cpu", seed=1)

    return layers, make, step(layers, make)


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


def _moved_with_the_peak_after_every_window(layers, make, ref):
    """Four steps whose peak rises by 1 GiB when layer 0's backward begins: bytes moved
    per step, and the synchronizer."""
    transport = _PeakTransport()
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
    layers, make, ref = _gpt()
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
    layers, make, ref = _gpt()
    transport = _PeakTransport()
    ctx, sync = _context(transport)
    raises = []

    def raise_peak():
        raises.append(1)
        transport.peak += 1 << 30

    handle = _in_forward_of(layers[N - 1], raise_peak)
    try:
        moved = _moved_per_step(layers, make, ref, ctx, sync, 4)
    finally:
        handle.remove()
    assert len(raises) == 4
    assert moved == [moved[0]] * 4
    assert ctx.offload_synchronizer.peak_watch.kept == set()


def test_bases_that_raise_the_peak_move_again():
    layers, make, ref = _gpt()
    transport = _PeakTransport()
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
    ctx, _ = _context(_PeakTransport())
    # The forward of 2 is point 2; the backward of 1 is point 2N - 1 - 1 = 6.
    assert ctx.offload_synchronizer._windows == [Window(0, 2, 6), Window(1, 3, 5)]
    ctx, _ = v2.get_cpu_offload_context(
        True,
        model_layers=N,
        transport=_PeakTransport(),
        synchronization_dict={0: (True, 1, True, 3), 1: (True, 2, False, 1)},
    )
    assert ctx.offload_synchronizer._windows == [Window(0, 1, 3), Window(1, 2, 6)]


def test_no_watch_with_retained_buffers():
    layers, make, ref = _gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx, sync = v2.get_cpu_offload_context(
            True,
            K,
            N,
            transport=_PeakTransport(),
            min_tensor_size_to_offload=256,
            retain_pinned_cpu_buffers=True,  # the same blocks every iteration
        )
    moved = _moved_per_step(layers, make, ref, ctx, sync, 3)
    assert moved == [moved[0]] * 3
    assert ctx.offload_synchronizer.peak_watch is None


def test_no_watch_without_a_peak_reading():
    layers, make, ref = _gpt()
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
    layers, make, ref = _gpt()
    transport = _PeakTransport()
    ctx, sync = v2.get_cpu_offload_context(
        True, K, N, transport=transport, min_tensor_size_to_offload=256, memory_budget=budget
    )

    def raise_peak():
        transport.peak += 1 << 30

    handle = _in_forward_of(layers[N - 1], raise_peak)
    try:
        moved = _moved_per_step(layers, make, ref, ctx, sync, 4)
    finally:
        handle.remove()
    watch = ctx.offload_synchronizer.peak_watch
    if keeps:
        assert moved[0] == moved[1] > 0 and moved[2] == moved[3] == 0
        assert watch.kept == set(range(K)) and watch.refused == set()
    else:
        assert moved == [moved[0]] * 4
        assert watch.kept == set()


def _moved_through(make_context, steps=4):
    """Bytes moved per step of ``_gpt`` with the peak rising inside both windows,
    under the offloading ``make_context(layers, transport)`` sets up: a ``(ctx, sync)``
    pair, or None where it wraps the layers itself."""
    layers, make, ref = _gpt()
    transport = _PeakTransport()
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
