"""Where a step's memory peaks, and which offloaded bytes therefore pay for their copies.

NOTE [Bytes that pay]
A tensor moved to the host costs link time twice, out and back; the move pays only if
the tensor is off the device when the step's memory peaks. An offloaded layer's tensors
are off the device from the schedule point where its memory is released to the point
where its reload begins: the layer's *window*. Keeping ``b`` of its bytes on the device
raises the memory of every moment inside the window by ``b``, and of no other moment.

Two kinds of bytes stay on the device that way, chosen in this order:

* Bytes moved only for the sake of others: a base that strided views of it (q, k and v
  sliced from one projection) were saved from is copied whole, because the views cannot
  be copied and rebuilt on their own. A layer keeps its bases on the device
  (``OffloadableLayerState.keep_view_bases``: the base becomes a unit that is never
  copied, and the views are rebuilt from it) when its window can hold them without
  raising the step's peak, and moves them otherwise.
* Any other units of the layer, up to a byte budget
  (``OffloadableLayerState.keep_budget``): the room its window has left, less a margin
  (``ALLOCATOR_SLACK`` plus ``1/margin_share`` of the peak, by default
  ``1/BUDGET_MARGIN_SHARE``, at least ``BUDGET_MARGIN_MIN``). Only a unit that owns its
  whole storage is kept: keeping a slice would keep the rest of its storage alive too,
  after the window as well. The innermost windows (the layers released last and
  reloaded first) are served first: their bytes are off the device for the shortest
  time, so each byte of room spares the most link. A budget grows while room is left;
  the margin stops it short of filling the room.

Room left after both, in the first interval of a window, goes to a *deferral*
(``OffloadableLayerState.defer_budget``): the last units the layer copies out, whose
device memory it releases at the point after its own (``release_deferred``) instead of
at it. They are still copied both ways; only the release waits. At the release point
the compute stream then waits for fewer copies, and the copy stream goes on while the
next layer computes: where copies out bound the step (many layers offloaded, the last
ones released just before the backward), the forward no longer stalls for bytes whose
memory the peak does not need yet. Deferred bytes raise only that one interval, so they
need room only there, less the same margin. As for budgets, only units that own their whole
storage are deferred, and never part of the units one tensor is rebuilt from: what is
deferred is what the device holds longer. A layer whose budget or deferral was cut is
capped for both.

Where the peak falls is read, not modelled: the allocator keeps a running maximum of
allocated memory. Read at each schedule point ``t``, it bounds the peak of the interval
that ends there: ``r[t] >= peak of (t - 1, t]``. With ``P`` the running maximum at the
end of the iteration's backward, ``P - r[t]`` is a lower bound of the room left in
interval ``t``: exact up to the interval where the running maximum reached ``P``, and
zero after it. (What the caller allocates after the backward, an optimizer's state say,
could only add room: leaving it out errs on the safe side.) A layer keeps its bases when
they fit in the room of every interval of its window, after the layers chosen before it.

A caller who can afford a higher peak than the step reaches with every byte moved gives a
budget (``memory_budget`` of ``get_cpu_offload_context``): the room is then read against
``max(P, budget)`` instead of ``P``, so that offloaded layers keep on the device what fits
under the budget, and move the rest. A budget below ``P`` changes nothing: keeping less
than nothing cannot lower the peak.

The running maximum belongs to the caller and is never reset here. When an earlier step
peaked higher, every ``r[t]`` equals ``P`` and nothing is kept: the choice is made in an
iteration that sets a new peak (the first ones of a process, or any iteration after the
caller resets the peak statistics, as benchmarks do). If a later iteration's peak rises
inside the window of a layer that keeps its bases, above the peak it was chosen under,
that layer moves them again from the next iteration on, and is not chosen again; a layer
whose budget (or deferral, for a rise in its window's first interval) was in force there
has it cut by the rise plus the margin, and it never grows again. Allocated bytes count
whole allocator blocks, so both tests leave a margin for rounding (``ALLOCATOR_SLACK``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ALLOCATOR_SLACK", "BUDGET_MARGIN_MIN", "BUDGET_MARGIN_SHARE", "PeakWatch", "Window"]

#: Allocated bytes count whole allocator blocks: a cached block up to 1 MiB larger than
#: asked for is handed out whole, and keeping tensors changes which blocks later
#: allocations get. Peaks that differ by less than this are not told apart.
ALLOCATOR_SLACK = 2 << 20

#: By default a budget leaves this share of the step's peak unused (plus
#: ``ALLOCATOR_SLACK``, and at least ``BUDGET_MARGIN_MIN``): kept tensors change which
#: cached blocks later allocations get, and a peak read in one iteration is not the next
#: one's to the byte. The peak is the process's allocated bytes, weights included. On
#: workload D, with five models' weights in one process, a share of 1/128 left 122 to 172
#: MiB of the last offloaded layer's room unused that 1/1024 filled, at the same measured
#: peak: 1.7 to 2.4% off the step at k=8 and 2.7 to 4.0% at k=4 (docs/benchmarks.md,
#: "twenty-first"). With one model the margin falls from about 95 and 124 MiB to 16.
BUDGET_MARGIN_SHARE = 1024
BUDGET_MARGIN_MIN = 16 << 20


@dataclass(frozen=True)
class Window:
    """Where layer ``layer``'s offloaded tensors are off the device.

    Positions count the schedule points of one iteration in the order they run: the
    memory is released at point ``start`` and the reload begins at point ``end``, so the
    intervals ending at points ``start + 1`` to ``end`` are the window's.

    Raises:
        ValueError: If ``start`` is negative or not before ``end``.

    Example:
        >>> Window(layer=0, start=1, end=4)
        Window(layer=0, start=1, end=4)
    """

    layer: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(
                f"a window must start before it ends (0 <= start < end), got layer "
                f"{self.layer}: start={self.start}, end={self.end}"
            )


class PeakWatch:
    """Reads the running peak at an iteration's schedule points and chooses what each
    offloaded layer keeps on the device: its view bases, a byte budget of its other
    units, and the bytes whose release waits one point (NOTE [Bytes that pay]).

    Args:
        read_peak: The allocator's running peak of allocated bytes; None where the
            allocator keeps no statistics (an iteration with such a reading is not judged).
        windows: The offloaded layers' windows.
        points: The number of schedule points in one iteration.
        slack: Bytes of the allocator's rounding: room must exceed the kept bytes by as
            much, and a peak must rise by more to count as raised by them.
        budget: Bytes the step may peak at: room is read against the larger of it and
            the step's own peak (0: the step's own peak).
        margin_share: A budget leaves ``1/margin_share`` of the peak unused (at least
            ``BUDGET_MARGIN_MIN``), plus ``slack``.
        defer: Give layers deferrals (releases one point late) where room is left.

    Raises:
        ValueError: If ``windows`` is empty or one ends at or after ``points``,
            ``budget`` is negative, or ``margin_share`` is below 1.

    Example:
        >>> peaks = iter([10, 20, 40, 60, 100])  # at begin, at points 0 to 2, at the end
        >>> watch = PeakWatch(lambda: next(peaks), [Window(0, 0, 2)], points=3, slack=0)
        >>> watch.begin(); watch.mark(0); watch.mark(1); watch.mark(2)
        >>> sorted(watch.end({0: 30}))  # the peak fell after the window: room of 60, 40
        [0]
    """

    def __init__(
        self,
        read_peak: Callable[[], int | None],
        windows: Sequence[Window],
        points: int,
        slack: int = ALLOCATOR_SLACK,
        budget: int = 0,
        margin_share: int = BUDGET_MARGIN_SHARE,
        defer: bool = True,
    ) -> None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0 (bytes), got {budget}")
        if margin_share < 1:
            raise ValueError(f"margin_share must be >= 1, got {margin_share}")
        if not windows:
            raise ValueError("windows is empty: a watch needs at least one offloaded layer")
        for w in windows:
            if w.end >= points:
                raise ValueError(
                    f"layer {w.layer}'s window ends at point {w.end}, but an iteration has "
                    f"points 0 to {points - 1}"
                )
        self._read = read_peak
        self.windows = {w.layer: w for w in windows}
        first = min(w.start for w in windows)
        last = max(w.end for w in windows)
        #: Only points that end an interval of some window are read, and the one before
        #: the first window: a peak before it then falls in no window.
        self._wanted = [first <= p <= last for p in range(points)]
        self._marks: list[int | None] = [None] * points
        self._start: int | None = None  # the running peak when the iteration began
        #: Layers that keep their view bases on the device.
        self.kept: set[int] = set()
        #: Layers whose kept bases raised the peak once: they move them for good.
        self.refused: set[int] = set()
        self.slack = slack
        self.budget = budget
        self.margin_share = margin_share
        self._chosen_peak = 0  # the peak of the iterations the kept layers were chosen in
        #: Per layer, the bytes of units other than view bases it keeps on the device.
        self.budgets: dict[int, int] = {}
        #: Layers whose budget raised the peak once: it is cut and never grows again.
        self.capped: set[int] = set()
        #: Per layer, the bytes of moved units whose release waits one point.
        self.deferrals: dict[int, int] = {}
        self.defer = defer
        #: The last iteration had nothing to judge (no layer kept or moved a byte): the
        #: next one reads nothing, since each read costs the host microseconds.
        self.idle = False

    def begin(self) -> None:
        """Start watching an iteration (before its first point).

        An iteration that began and never reached the end of its backward (an error in
        it, out of memory say) ends the kept layers' keeping for good: the memory they
        held may have been what was missing.
        """
        if self._start is not None and (
            self.kept or any(self.budgets.values()) or any(self.deferrals.values())
        ):
            self.refused |= self.kept
            self.kept = set()
            self.capped |= set(self.budgets) | set(self.deferrals)
            self.budgets = {}
            self.deferrals = {}
        if self.idle:
            self._start = None
            return
        self._start = self._read()
        self._marks = [None] * len(self._marks)

    def skip(self) -> None:
        """Leave the iteration begun unjudged (a CUDA graph captured it, say)."""
        self._start = None

    def mark(self, position: int) -> None:
        """Read the running peak at the point ``position`` (before the point's work)."""
        if self._start is not None and self._wanted[position]:
            self._marks[position] = self._read()

    def end(
        self,
        candidate_bytes: Mapping[int, int],
        unit_bytes: Mapping[int, tuple[int, int]] | None = None,
        deferred_bytes: Mapping[int, int] | None = None,
    ) -> set[int]:
        """End the iteration (at the end of its backward) and choose again.

        Args:
            candidate_bytes: Per offloaded layer, the bytes of its view bases in this
                iteration, kept or moved.
            unit_bytes: Per offloaded layer, the bytes of its other units in this
                iteration: those its budget kept, and those moved. None: no budgets.
            deferred_bytes: Per offloaded layer, the bytes whose release waited one
                point in this iteration. None: no deferrals (needs ``unit_bytes``).

        Returns:
            The layers that keep their view bases from the next iteration on (their
            budgets are :attr:`budgets`). An iteration cut short (a point never read)
            changes nothing. Where no layer kept or moved a byte, the next iteration is
            not read (:attr:`idle`).
        """
        start, self._start = self._start, None
        self.idle = not (
            self.kept
            or any(self.budgets.values())
            or any(self.deferrals.values())
            or any(candidate_bytes.values())
            or (unit_bytes is not None and any(k or m for k, m in unit_bytes.values()))
        )
        marks = self._marks
        if start is None or any(m is None for m, w in zip(marks, self._wanted, strict=True) if w):
            return self.kept
        peak = self._read()
        if peak is None:
            return self.kept
        # The peak the choice may fill up to (NOTE [Bytes that pay]).
        ceiling = max(peak, self.budget)
        budgeted = {layer for layer, nbytes in self.budgets.items() if nbytes > 0}
        deferring = {layer for layer, nbytes in self.deferrals.items() if nbytes > 0}
        if (
            (self.kept or budgeted or deferring)
            and peak > start
            and peak > self._chosen_peak + self.slack
        ):
            # A new peak, above the one the choice was made under: where did it fall?
            at = next((p for p, m in enumerate(marks) if m is not None and m >= peak), None)

            def inside(layer: int) -> bool:
                return at is not None and self.windows[layer].start < at <= self.windows[layer].end

            harmed = {layer for layer in self.kept if inside(layer)}
            cut = {layer for layer in budgeted if inside(layer)}
            late = {layer for layer in deferring if at == self.windows[layer].start + 1}
            if harmed or cut or late:
                self.kept -= harmed
                self.refused |= harmed
                rise = peak - self._chosen_peak + self._margin(peak)
                for layer in cut:
                    self.budgets[layer] = max(0, self.budgets[layer] - rise)
                for layer in late:
                    self.deferrals[layer] = max(0, self.deferrals[layer] - rise)
                self.capped |= cut | late
                return self.kept
        used = [0] * len(marks)
        if deferred_bytes:
            # Deferred bytes come after bases and budgets: read the room as if they were
            # released on time (a lower bound still: they stayed the whole interval), and
            # hold what capped layers still defer.
            marks = list(marks)
            for layer, nbytes in deferred_bytes.items():
                window = self.windows.get(layer)
                if window is not None and nbytes > 0:
                    marks[window.start + 1] -= nbytes  # type: ignore[operator]
            for layer in self.capped:
                if layer in self.windows:
                    used[self.windows[layer].start + 1] += self.deferrals.get(layer, 0)
        for layer in sorted(candidate_bytes):
            nbytes = candidate_bytes[layer]
            if nbytes <= 0 or layer in self.kept or layer in self.refused:
                continue
            window = self.windows.get(layer)
            if window is None:
                continue
            span = range(window.start + 1, window.end + 1)
            if all(ceiling - marks[p] - used[p] >= nbytes + self.slack for p in span):  # type: ignore[operator]
                for p in span:
                    used[p] += nbytes
                self.kept.add(layer)
                self._chosen_peak = max(self._chosen_peak, ceiling)
        if unit_bytes is not None:
            self._grow_budgets(ceiling, marks, used, unit_bytes)  # type: ignore[arg-type]
            if deferred_bytes is not None and self.defer:
                self._grow_deferrals(ceiling, marks, used, unit_bytes)  # type: ignore[arg-type]
        return self.kept

    def _margin(self, peak: int) -> int:
        return self.slack + max(peak // self.margin_share, BUDGET_MARGIN_MIN)

    def _grow_budgets(
        self,
        peak: int,
        marks: Sequence[int],
        used: list[int],
        unit_bytes: Mapping[int, tuple[int, int]],
    ) -> None:
        """Give each layer's budget the room its window has left, innermost windows first.

        A layer's new budget is what its budget kept in this iteration plus that room:
        the room was read with those bytes on the device. The part of a budget that its
        units did not fill (they come in whole tensors) may be filled in a later
        iteration, so it is reserved in the window before the next layer's turn, for a
        capped layer too.
        """
        margin = self._margin(peak)
        by_span = sorted(self.windows.values(), key=lambda w: (w.end - w.start, -w.layer))
        for window in by_span:
            layer = window.layer
            kept, moved = unit_bytes.get(layer, (0, 0))
            span = range(window.start + 1, window.end + 1)
            budget = self.budgets.get(layer, 0)
            if layer not in self.capped:
                room = min(peak - marks[p] - used[p] for p in span) - margin
                grown = kept + max(min(room, moved), 0)
                if grown > budget:
                    self._chosen_peak = max(self._chosen_peak, peak)
                budget = grown
                self.budgets[layer] = budget
            unfilled = budget - kept
            if unfilled > 0:
                for p in span:
                    used[p] += unfilled

    def _grow_deferrals(
        self,
        peak: int,
        marks: Sequence[int],
        used: list[int],
        unit_bytes: Mapping[int, tuple[int, int]],
    ) -> None:
        """Give each layer's deferral the room left, after bases and budgets, in the one
        interval its deferred bytes stay for: the first of its window, at most the bytes
        moved. ``marks`` were read as if nothing had been deferred."""
        margin = self._margin(peak)
        for window in self.windows.values():
            layer = window.layer
            if layer in self.capped:
                continue  # held in ``used`` already
            p = window.start + 1
            moved = unit_bytes.get(layer, (0, 0))[1]
            grown = min(max(peak - marks[p] - used[p] - margin, 0), moved)
            if grown > self.deferrals.get(layer, 0):
                self._chosen_peak = max(self._chosen_peak, peak)
            self.deferrals[layer] = grown
            used[p] += grown
