"""The default synchronizer: each layer's tensors move at the points of a schedule.

:class:`DefaultOffloadSynchronizer` follows the default k-of-n rule, or a validated
``synchronization_dict``, keeps on the device the bytes that would lower no peak, and
releases a layer's last copies one point late where the room allows (NOTE [Bytes that
pay] in ``engine/peak_watch.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._args import check_int, check_memory_budget
from .._warn import warn_at_caller
from ..engine.layer_state import LayerPhase
from ..engine.peak_watch import PeakWatch, Window
from ..engine.transport import Transport
from .schedule import (
    Point,
    Schedule,
    SyncDict,
    default_synchronization_dict,
    validate_synchronization_dict,
)
from .synchronizer import OffloadSynchronizer

__all__ = ["DefaultOffloadSynchronizer"]

#: The work due at one point: deferred releases, releases, reloads (layer ids).
_Work = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class DefaultOffloadSynchronizer(OffloadSynchronizer):
    """The default schedule: offload the first k of n layers, overlapping compute.

    Careful: here ``num_layers`` is the number of *model* layers and
    ``num_offloaded_layers`` the k of the schedule, unlike ``get_cpu_offload_context``.

    Args:
        num_layers: Number of model layers (n).
        num_offloaded_layers: Layers to offload (k); ``num_layers - 1`` if None.
        retain_pinned_cpu_buffers: Keep each layer's host buffers across iterations.
        offload_stream: CUDA stream for the copies (a new one if None).
        synchronization_dict: A validated schedule that replaces the k-of-n rule.
        transport, policy: As for :class:`OffloadSynchronizer`.
        memory_budget: Bytes the step may peak at (allocated memory): offloaded layers
            keep on the device what fits under it (NOTE [Bytes that pay]). None: the
            peak the step reaches with every eligible byte moved.

    Raises:
        TypeError: If ``memory_budget`` is not an int or None.
        ValueError: If ``memory_budget`` is negative or given with
            ``retain_pinned_cpu_buffers=True``, or ``num_offloaded_layers`` is outside
            ``[0, num_layers - 1]``.
    """

    def __init__(
        self,
        num_layers: int,
        num_offloaded_layers: int | None = None,
        retain_pinned_cpu_buffers: bool = False,
        offload_stream: torch.cuda.Stream | None = None,
        *,
        synchronization_dict: SyncDict | None = None,
        transport: Transport | None = None,
        policy: Callable[[torch.Tensor], bool] | None = None,
        memory_budget: int | None = None,
    ) -> None:
        super().__init__(
            num_layers,
            retain_pinned_cpu_buffers,
            offload_stream,
            transport=transport,
            policy=policy,
        )
        self.memory_budget = check_memory_budget(memory_budget)
        if memory_budget is not None and retain_pinned_cpu_buffers:
            raise ValueError(
                "memory_budget and retain_pinned_cpu_buffers=True exclude each other: "
                "retained host buffers need the same tensors moved every iteration, so "
                "nothing can be kept under a budget; drop one of them"
            )
        if synchronization_dict is None:
            k = num_layers - 1 if num_offloaded_layers is None else num_offloaded_layers
            check_int("num_offloaded_layers", k)
            if not 0 <= k < num_layers:
                raise ValueError(
                    f"num_offloaded_layers must be in [0, num_layers - 1] = [0, {num_layers - 1}], "
                    f"got {k}"
                )
            synchronization_dict = default_synchronization_dict(k, num_layers)
        sync = validate_synchronization_dict(synchronization_dict, num_layers)
        self.schedule = Schedule(sync)
        # The work due at each point, indexed by layer: looked up twice per layer and
        # iteration, so plain lists rather than dictionaries keyed by Point objects.
        n = num_layers
        self._offloaded = [i in self.schedule.offloaded for i in range(n)]
        # A layer reloaded at the very point its memory is released is never off the
        # device: it has no window.
        spans = {
            layer: (Point(f, i).position(n), Point(r, j).position(n))
            for layer, (f, i, r, j) in sync.items()
        }
        self._windows = [
            Window(layer, start, end)
            for layer, (start, end) in sorted(spans.items())
            if start < end
        ]
        # A layer's deferred bytes go at the point after its release (NOTE [Bytes that
        # pay]), before any other work there: a reload may start at that very point.
        self._late_at: dict[Point, list[int]] = {}
        for w in self._windows:
            self._late_at.setdefault(Point.at(w.start + 1, n), []).append(w.layer)
        at_forward = [self._work_at(Point(True, i)) for i in range(n)]
        at_backward = [self._work_at(Point(False, i)) for i in range(n)]
        self._at_forward, self._at_backward = at_forward, at_backward
        #: Made at the end of the first iteration, if the allocator keeps a running peak.
        self.peak_watch: PeakWatch | None = None
        #: What the error for a wrong number of layer forwards says after "but ": a
        #: front-end that counts the layers itself (offload_layers) says it its way.
        self.forward_count_advice = (
            f"model_layers={num_layers}: pass the number of layers that run under the "
            "context in one iteration (or, if a forward was cut short by an exception "
            "outside the context, skip that batch's backward)"
        )

    def start_new_iteration(self) -> None:
        super().start_new_iteration()
        if self.peak_watch is not None:
            self.peak_watch.begin()  # may end keeping, after an iteration cut short
            self._keep(self.peak_watch)

    def finish_part_of_bwd(self) -> None:
        super().finish_part_of_bwd()
        self._choose_kept_bytes()

    def _choose_kept_bytes(self) -> None:
        # At the end of a backward, before the caller's next step resets anything: the
        # iteration's points were read; choose again which layers keep their view bases.
        if self.retain_pinned_cpu_buffers or self.transport.capturing():
            # Fixed host buffers (and a captured graph's copies) need the same saved
            # blocks every iteration: what is moved may not change.
            if self.peak_watch is not None:
                self.peak_watch.skip()
            return
        offloaded = [w.layer for w in self._windows]
        if self.peak_watch is None:
            # Made once a layer has a window; it watches the next iteration.
            if offloaded and self.transport.peak_allocated() is not None:
                self.peak_watch = PeakWatch(
                    self.transport.peak_allocated,
                    self._windows,
                    2 * self.num_layers,
                    budget=self.memory_budget or 0,
                )
            return
        layers = [self.layers[i] for i in offloaded]
        self.peak_watch.end(
            {i: layer.view_base_bytes for i, layer in zip(offloaded, layers, strict=True)},
            {
                i: (layer.budget_kept_bytes, layer.moved_bytes)
                for i, layer in zip(offloaded, layers, strict=True)
            },
            {i: layer.deferred_bytes for i, layer in zip(offloaded, layers, strict=True)},
        )
        self._keep(self.peak_watch)

    def _keep(self, watch: PeakWatch) -> None:
        # A captured graph is never judged (the watch skips it): it keeps nothing.
        capturing = self.transport.capturing()
        for window in self._windows:
            layer = self.layers[window.layer]
            layer.keep_view_bases = window.layer in watch.kept and not capturing
            layer.keep_budget = 0 if capturing else watch.budgets.get(window.layer, 0)
            layer.defer_budget = 0 if capturing else watch.deferrals.get(window.layer, 0)

    def _work_at(self, point: Point) -> _Work | None:
        late = tuple(self._late_at.get(point, ()))
        finish = tuple(self.schedule.finish_at.get(point, ()))
        reload = tuple(self.schedule.reload_at.get(point, ()))
        return (late, finish, reload) if late or finish or reload else None

    def _check_forward_count(self) -> None:
        if self._forwards == self.num_layers:
            self._check_something_offloaded()
            return
        ran = self._forwards
        self.start_new_iteration()
        raise ValueError(
            f"backward began after {ran} layer forwards under the CPU offload context, but "
            f"{self.forward_count_advice}"
        )

    def _check_something_offloaded(self) -> None:
        # A whole forward ran and no offloaded layer took a tensor: say so once, rather
        # than let the user believe memory was saved.
        if self._warned_nothing_offloaded or not self.schedule.offloaded:
            return
        if any(self.layers[i].has_tensors for i in self.schedule.offloaded):
            return
        self._warned_nothing_offloaded = True
        offloaded = sorted(self.schedule.offloaded)
        min_numel = getattr(self.policy, "min_numel", None)
        size = "" if min_numel is None else f" with at least {min_numel} elements"
        warn_at_caller(
            f"the V2 CPU offload context ran all {self.num_layers} layers of an iteration "
            f"and offloaded nothing, although layers {offloaded} are to be offloaded: no "
            f"tensor they saved for backward was on the transport's device{size} (and not "
            "a parameter or marked not to offload). Lower min_tensor_size_to_offload, or "
            "check that those layers run under the context, and not inside an activation "
            "checkpoint of the model's own, which keeps nothing of theirs to offload"
        )

    def _pushes_to(self, layer_id: int) -> bool:
        return self._offloaded[layer_id]

    def _run_point(self, work: _Work) -> None:
        late, finish, reload = work
        for layer in late:
            if self.layers[layer].phase is LayerPhase.OFFLOAD_FINISHED:
                self.layers[layer].release_deferred()
        for layer in finish:
            state = self.layers[layer]
            if state.phase is LayerPhase.NOT_OFFLOADED and state.has_tensors:
                state.start_offload()  # the layer's forward ended without a later fwd_step
            if state.phase is LayerPhase.OFFLOAD_STARTED:
                state.release_activation_forward_gpu_memory()
        for layer in reload:
            if self.layers[layer].phase is LayerPhase.OFFLOAD_FINISHED:
                self.layers[layer].start_reload()

    def _on_forward_start(self, layer_id: int) -> None:
        if self.peak_watch is not None:
            self.peak_watch.mark(layer_id)
        work = self._at_forward[layer_id]
        if work is not None:
            self._run_point(work)

    def _on_forward_end(self, layer_id: int) -> None:
        state = self.layers[layer_id]
        if not self._offloaded[layer_id]:
            return
        if state.phase is LayerPhase.NOT_OFFLOADED:
            state.start_offload()
        else:
            super()._on_forward_end(layer_id)  # queued early: its casts go now

    def start_offload_early(self) -> bool:
        """Queue the current layer's copies now, before its forward ends, when it will
        hand the engine nothing more in this forward: its last offloaded part has run
        (NOTE [Parts of a layer] in ``cpu_offload/_layer_parts.py``). Its device memory
        still goes at the schedule's point; only the copies start sooner, beside the
        rest of the layer.

        Returns:
            Whether the current layer's copies are queued (now or before): False for a
            layer not offloaded, outside a layer, or when it saved nothing to move.
        """
        layer = self.current_layer
        if layer is None or not self._offloaded[layer]:
            return False
        state = self.layers[layer]
        if state.phase is LayerPhase.NOT_OFFLOADED:
            if not state.has_tensors:
                return False
            # Its casts go at its forward's end: the rest of the layer may still change
            # one in place, which backward must then refuse (NOTE [Casts rebuilt from
            # their source] in engine/recast.py).
            state.start_offload(casts_go=False)
        return True

    def _on_backward_start(self, layer_id: int) -> None:
        if self.peak_watch is not None:
            self.peak_watch.mark(2 * self.num_layers - 1 - layer_id)
        work = self._at_backward[layer_id]
        if work is not None:
            self._run_point(work)
