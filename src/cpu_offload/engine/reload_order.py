"""The order of a layer's copies back, and when its backward may start beside them.

NOTE [Reloads in the order backward reads]
A layer's backward reads its saved tensors roughly in the reverse of the order its
forward saved them: the last op's inputs first. Each reload copy records its own event
and each read waits only for its own unit's, so the backward can start as soon as the
first units it reads are back, if those are copied first, and run beside the rest of the
layer's copies. :meth:`~cpu_offload.engine.layer_state.OffloadableLayerState.start_reload`
therefore queues the copies in the order the previous backward of the layer first read
each unit, which ``pop_tensor`` records (:class:`ReadOrder`, over every unit of the layer,
kept ones included, so that a budget that keeps other units than last time still finds
it); where that order does not fit (the first iteration, or units of other layouts: the
layer saved other tensors), in the reverse of the order the units were saved
(:func:`latest_saved_first`). Only the order of the copies changes: each unit is read back
from its own host buffer into its own device tensor, and every read still waits for its
copy. A backward that reads all its saved tensors at once (one autograd node for the whole
layer, as a compiled region or a fused custom Function) waits for all of them whatever
the order.

The timeline models (the planner's and the comparison tool's) follow it with
:func:`backward_start`: the backward runs beside its copies, and only its last share,
which reads what the forward saved first (the layer's input, taken as that share of the
bytes moved: :func:`last_read_share`), waits for the last copy. The model assumes the
reads spread over the backward as the bytes do, and lets the backward start with the
copies (the first unit's own copy time is not counted). On Megatron-Core's GPT (16
layers, hidden 2048), in three pairs of runs alternating with copies in the order of the
saves, the step at 4 offloaded layers of 16 was 2.4 to 4.2 ms (about 2%) shorter; at 8
the pairs differed by +5.0 to -2.9 ms, no difference shown (docs/benchmarks.md,
2026-11-27). Where only parts of a layer are offloaded, the planner takes the share from
the parts' times instead: the backward of each part that saved only before what comes
back last waits for it, whatever its share of the bytes, and the part that reads it the
share of its own time that those bytes are (``_last_share`` in ``plan/usage.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from .layout import TensorLayout
from .tensor_group import GroupPlan, Unit

__all__ = ["ReadOrder", "backward_start", "last_read_share", "latest_saved_first"]


class _Saved(Protocol):
    ready_seq: int


def latest_saved_first(units: Sequence[_Saved], positions: Iterable[int]) -> list[int]:
    """``positions`` (into ``units``) ordered by when the unit was saved, latest first.

    Example:
        >>> from types import SimpleNamespace as U
        >>> latest_saved_first([U(ready_seq=1), U(ready_seq=3), U(ready_seq=2)], range(3))
        [1, 2, 0]
    """
    return sorted(positions, key=lambda i: units[i].ready_seq, reverse=True)


def last_read_share(input_bytes: int, moved_bytes: int) -> float:
    """The share of an offloaded layer's backward that waits for its last copy back: its
    input's share of the bytes moved, 1 where nothing is known to be moved.

    Example:
        >>> last_read_share(16, 1024), last_read_share(16, 0)
        (0.015625, 1.0)
    """
    if moved_bytes <= 0:
        return 1.0
    return min(max(input_bytes / moved_bytes, 0.0), 1.0)


def backward_start(
    reload_start: float, reload_end: float, backward_ms: float, last_share: float
) -> float:
    """The earliest start of a layer's backward of ``backward_ms`` whose copies back run
    from ``reload_start`` to ``reload_end``: not before they start, and late enough that
    its last share (``last_share`` of it) begins when the last copy ends.

    Example:
        >>> backward_start(10.0, 30.0, 8.0, 0.25)  # 6 ms run beside the copies
        24.0
        >>> backward_start(10.0, 12.0, 8.0, 0.25)  # shorter copies: start with them
        10.0
    """
    return max(reload_start, reload_end - backward_ms * (1.0 - last_share))


class ReadOrder:
    """The order one layer's backward first reads its units in, learnt for its next reload.

    ``reads`` collects the indices (into the plan's units) as the backward first reads
    each; :meth:`remember` keeps them at the layer's release, with the layouts of every
    unit; :meth:`moved_in_order` gives the next plan's moved units in that order where
    its units have the same layouts, else latest saved first.
    """

    __slots__ = ("_known", "reads")

    def __init__(self) -> None:
        self.reads: list[int] = []
        self._known: tuple[tuple[TensorLayout, ...], tuple[int, ...]] | None = None

    def remember(self, plan: GroupPlan) -> None:
        """Keep the reads of ``plan``'s backward (units never read last, latest saved
        first), and start collecting anew."""
        units = plan.units
        reads = self.reads
        if len(reads) < len(units):
            seen = set(reads)
            reads += latest_saved_first(units, (i for i in range(len(units)) if i not in seen))
        self._known = (tuple(u.layout for u in units), tuple(reads))
        self.reads = []

    def moved_in_order(self, plan: GroupPlan) -> list[Unit]:
        """``plan``'s moved units in the order their copies back are to be queued."""
        units = plan.units
        known = self._known
        if known is not None and len(known[1]) == len(units):
            if known[0] == tuple(u.layout for u in units):
                return [units[i] for i in known[1] if not units[i].kept]
        return [units[i] for i in latest_saved_first(units, range(len(units))) if not units[i].kept]
