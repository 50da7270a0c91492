"""Which offloaded bytes pay (NOTE [Bytes that pay]): the peak watch on synthetic memory
profiles, checked against the profile it was read from. V2's default schedule driven by
the watch is in ``test_engine_peak_watch_v2.py``.
"""

from __future__ import annotations

import random

import pytest
from peak_watch_helpers import Reads, random_windows

from cpu_offload.engine.peak_watch import (
    BUDGET_MARGIN_MIN,
    BUDGET_MARGIN_SHARE,
    PeakWatch,
    Window,
)

# -- the watch alone -----------------------------------------------------------------------


def _watch(windows: list[Window], points: int, budget: int = 0) -> tuple[PeakWatch, Reads]:
    reads = Reads()
    return PeakWatch(reads, windows, points, slack=0, budget=budget), reads


def _run(
    watch: PeakWatch,
    reads: Reads,
    interval_peaks: list[int],
    candidates: dict[int, int],
    before: int = 0,
    after: int = 0,
    units: dict[int, tuple[int, int]] | None = None,
    deferred: dict[int, int] | None = None,
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
    return set(watch.end(candidates, units, deferred))


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
    reads = Reads()
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


@pytest.mark.parametrize("seed", range(200))
def test_what_is_kept_never_raises_the_peak(seed):
    """On random profiles, keeping the chosen bytes leaves every interval within the peak."""
    rng = random.Random(seed)
    points, windows = random_windows(rng)
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


def test_an_iteration_cut_short_ends_the_budgets_and_deferrals():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    profile = [0, 1000, PEAK - 10 * MARGIN, PEAK - 10 * MARGIN, PEAK]
    _run(watch, reads, profile, {}, units={0: (0, 20 * MARGIN)}, deferred={0: 0})
    assert watch.budgets[0] > 0 and watch.deferrals[0] > 0
    watch.begin()
    watch.mark(1)  # out of memory in the next layer, say
    watch.begin()
    assert watch.budgets == {} and watch.deferrals == {} and watch.capped == {0}


def test_without_unit_bytes_only_view_bases_are_kept():
    watch, reads = _watch([Window(0, 0, 3)], 5)
    assert _run(watch, reads, [0, 10, 10, 10, PEAK], {0: 5}) == {0}
    assert watch.budgets == {}


def _random_profile(
    rng: random.Random, scale: int = 1
) -> tuple[int, list[Window], dict[int, int], dict[int, tuple[int, int]], list[int]]:
    """Random windows, view-base bytes and other units' bytes per layer (up to
    ``400 * scale`` and ``4000 * scale``), and interval peaks up to ``PEAK``."""
    points, windows = random_windows(rng)
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
        PeakWatch(Reads(), [Window(0, 0, 1)], 2, budget=-1)


@pytest.mark.parametrize("share", [2, 7, BUDGET_MARGIN_SHARE])
def test_the_margin_share_sets_the_room_left_unused(share):
    # A peak large enough that PEAK // share is above the floor for every share here.
    peak = 100 * BUDGET_MARGIN_SHARE * BUDGET_MARGIN_MIN
    reads = Reads()
    watch = PeakWatch(reads, [Window(0, 0, 3)], 5, slack=0, margin_share=share)
    _run(watch, reads, [0, 1000, 1000, 1000, peak], {}, units={0: (0, 2 * peak)})
    assert watch.budgets[0] == peak - 1000 - peak // share


def test_a_budget_cut_leaves_the_watch_s_own_margin():
    share = 7
    peak = 100 * BUDGET_MARGIN_SHARE * BUDGET_MARGIN_MIN
    reads = Reads()
    watch = PeakWatch(reads, [Window(0, 0, 3)], 5, slack=0, margin_share=share)
    _run(watch, reads, [0, 1000, 1000, 1000, peak], {}, units={0: (0, 2 * peak)})
    budget = watch.budgets[0]
    # The next iteration peaks 500 higher, inside the window: cut by the rise and the margin.
    _run(watch, reads, [0, 1000, peak + 500, 1000, peak], {}, units={0: (budget, 5000)})
    assert watch.budgets[0] == budget - 500 - (peak + 500) // share
    assert watch.capped == {0}


def test_the_margin_is_never_below_its_floor():
    peak = BUDGET_MARGIN_SHARE * BUDGET_MARGIN_MIN // 2  # 1/share of it is half the floor
    reads = Reads()
    watch = PeakWatch(reads, [Window(0, 0, 3)], 5, slack=0)
    _run(watch, reads, [0, 1000, 1000, 1000, peak], {}, units={0: (0, 2 * peak)})
    assert watch.budgets[0] == peak - 1000 - BUDGET_MARGIN_MIN


@pytest.mark.parametrize("share", [0, -3])
def test_a_margin_share_below_one_is_refused(share):
    with pytest.raises(ValueError, match=f"margin_share must be >= 1, got {share}"):
        PeakWatch(Reads(), [Window(0, 0, 1)], 2, margin_share=share)
