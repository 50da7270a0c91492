"""The tensors of one layer and the state machine that moves them."""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable

import torch

from .. import _log
from .._compat import autograd_clock
from .host_buffers import HostBufferPool, LayerHostBuffers
from .layout import TensorLayout
from .reload_order import ReadOrder
from .saved_checks import (
    check_saved_version,
    check_source_version,
    kept_again,
    let_go,
    log_offload,
    saved_original,
)
from .tensor_group import CastRef, GroupPlan, SavedEntry, TensorGroupProcessor, Unit
from .transport import Transport, resolve_transport

__all__ = ["LayerPhase", "OffloadableLayerState"]

_MIB = 1024 * 1024

# NOTE [A layer with nothing to move]
# A layer that saved nothing eligible (below the size threshold, weights, refused by the
# policy) still goes through every state at its points, but touches no stream: no reload
# call (which would make the copy stream wait for the compute stream), no stream query.
# A layer whose units all stay on the device (kept view bases, byte budgets) makes no
# reload call either. Hooks with nothing eligible then cost the device nothing.


class LayerPhase(str, enum.Enum):
    """States of :class:`OffloadableLayerState`, in the order a layer goes through them."""

    NOT_OFFLOADED = "not_offloaded"
    OFFLOAD_STARTED = "offload_started"
    OFFLOAD_FINISHED = "offload_finished"
    RELOAD_STARTED = "reload_started"


class OffloadableLayerState:
    """The tensors one layer saved for backward, and their trip to the host and back.

    States: ``not_offloaded`` -> ``offload_started`` -> ``offload_finished`` ->
    ``reload_started``, and back to ``not_offloaded`` by :meth:`release_all_memory`.
    A method called in the wrong state raises ``RuntimeError`` naming the method, the
    state and the allowed states.

    Args:
        offload_stream: CUDA stream for the copies (a new one if None). Ignored when
            ``transport`` is given.
        retain_pinned_cpu_buffers: Keep this layer's host buffers at fixed addresses
            across iterations (needed for CUDA graphs before PyTorch 2.11). The tensors
            saved must then have the same shapes every iteration.
        transport: What moves the bytes; by default :class:`~cpu_offload.CudaTransport`
            when CUDA is available, else the CPU stand-in.
        policy: Which pushed tensors are candidates; every tensor the transport accepts
            when None.
        processor: Tensor-group processor (shared by the layers of one synchronizer).

    Example:
        >>> from cpu_offload import HostTransport
        >>> state = OffloadableLayerState(None, transport=HostTransport())
        >>> x = torch.randn(1024, 1024)
        >>> tid = state.push_tensor(x)
        >>> state.start_offload(); state.release_activation_forward_gpu_memory()
        >>> state.start_reload(); torch.equal(state.pop_tensor(tid), x)
        True
    """

    def __init__(
        self,
        offload_stream: torch.cuda.Stream | None = None,
        retain_pinned_cpu_buffers: bool = False,
        *,
        transport: Transport | None = None,
        policy: Callable[[torch.Tensor], bool] | None = None,
        processor: TensorGroupProcessor | None = None,
        name: str = "layer",
    ) -> None:
        self.transport = resolve_transport(transport, offload_stream)
        self.retain_pinned_cpu_buffers = retain_pinned_cpu_buffers
        self.policy = policy if policy is not None else self.transport.accepts
        self.processor = processor if processor is not None else TensorGroupProcessor()
        self.name = name
        self.phase = LayerPhase.NOT_OFFLOADED
        self._entries: list[SavedEntry] = []
        self._plan: GroupPlan | None = None
        self._buffers = LayerHostBuffers(retain_pinned_cpu_buffers, name)
        self._seq = 0
        #: The order backward reads the units in (NOTE [Reloads in the order backward
        #: reads] in ``reload_order.py``).
        self._read_order = ReadOrder()
        #: Keep on the device the bases copied only for the sake of strided views
        #: (NOTE [Bytes that pay] in ``peak_watch.py``); read at each :meth:`start_offload`.
        self.keep_view_bases = False
        #: Bytes of such bases in the last offload, kept or moved (0 before the first).
        self.view_base_bytes = 0
        #: Bytes of the last offload's saved casts, rebuilt from their sources instead
        #: of moved (NOTE [Casts rebuilt from their source] in ``recast.py``).
        self.recast_bytes = 0
        #: Bytes of its other units the layer keeps on the device (NOTE [Bytes that
        #: pay]); read at each :meth:`start_offload`.
        self.keep_budget = 0
        #: In the last offload: bytes the budget kept, and bytes moved.
        self.budget_kept_bytes = 0
        self.moved_bytes = 0
        #: Bytes of its moved units, the last ones copied, whose device memory the layer
        #: releases one schedule point late, at :meth:`release_deferred` (NOTE [Bytes
        #: that pay]); read at each :meth:`start_offload`.
        self.defer_budget = 0
        #: In the last offload: bytes whose release was deferred.
        self.deferred_bytes = 0
        #: Indices (into the plan's units) of the deferred units not yet released.
        self._late: list[int] = []

    # -- bookkeeping -----------------------------------------------------------------

    @property
    def state(self) -> str:
        """The current state's name (``"not_offloaded"``, ...)."""
        return self.phase.value

    def _expect(self, method: str, *allowed: LayerPhase) -> None:
        if self.phase not in allowed:
            names = ", ".join(p.value for p in allowed)
            raise RuntimeError(
                f"{type(self).__name__}.{method}() called on {self.name} in state "
                f"'{self.phase.value}'; allowed in: {names}"
            )

    @property
    def has_tensors(self) -> bool:
        """Whether any tensor was pushed since the last release."""
        return bool(self._entries)

    # -- forward ---------------------------------------------------------------------

    def push_tensor(self, tensor: torch.Tensor, *, force_base: bool = False) -> int | torch.Tensor:
        """Take a tensor saved for backward (the saved-tensor pack hook's work).

        Args:
            tensor: The tensor autograd saves.
            force_base: Offload the base tensor this one is a view of, as one unit, and
                never keep that base on the device (``offload_base_tensor=True``).

        Returns:
            An int id if the tensor is a candidate for offloading, else the tensor itself.

        Raises:
            RuntimeError: If the layer is not collecting tensors (its offload started).
        """
        if self.phase is not LayerPhase.NOT_OFFLOADED:
            self._expect("push_tensor", LayerPhase.NOT_OFFLOADED)
        if not self.policy(tensor):
            if _log.debug_enabled():
                _log.kept(self.name, tensor, _log.policy_reason(self.policy, tensor))
            return tensor
        self._seq += 1
        entries = self._entries
        entries.append(
            SavedEntry(
                tensor,
                self.transport.record(),
                self._seq,
                force_base,
                tensor._version,
                clock=autograd_clock(),
            )
        )
        return len(entries) - 1

    def mark_ready(self, tensors: Iterable[torch.Tensor], offload_base_tensor: bool) -> None:
        """Record that ``tensors`` are complete now (see :func:`cpu_offload.start_offload`).

        Raises:
            RuntimeError: If the layer's copies, which may read one of them unfinished, are
                queued already (NOTE [Parts of a layer] in ``cpu_offload/_layer_parts.py``).
        """
        keys = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape) for t in tensors}
        event = None
        for entry in self._entries:
            t = saved_original(entry)
            if (
                t is not None
                and (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape) in keys
            ):
                if self.phase is not LayerPhase.NOT_OFFLOADED:
                    raise RuntimeError(
                        f"start_offload() on a tensor {self.name} saved, after the layer's "
                        f"copies were queued (state '{self.phase.value}'; allowed in: "
                        "not_offloaded), which may have read it unfinished: mark it before, "
                        "inside the part that saves it where parts of the layer are offloaded"
                    )
                if event is None:
                    event = self.transport.record()
                    self._seq += 1
                entry.ready, entry.seq = event, self._seq
                entry.force_base |= offload_base_tensor
                # Finished after it was saved, maybe behind the version counter: never
                # a cast's source, nor a cast (NOTE [Casts rebuilt from their source]).
                entry.clock = -1

    def start_offload(self, casts_go: bool = True) -> None:
        """Group the pushed tensors and queue their copies to the host.

        Each copy waits for the event recorded when its tensor was saved, so it may run
        while the layer's later kernels still compute.

        Args:
            casts_go: Let the saved casts go now (:meth:`let_casts_go`); False while the
                layer's forward still runs (NOTE [Parts of a layer] in
                ``cpu_offload/_layer_parts.py``).

        Raises:
            RuntimeError: In the wrong state, or when retained buffers no longer fit.
        """
        self._expect("start_offload", LayerPhase.NOT_OFFLOADED)
        if not self._entries:  # nothing saved: nothing to group, buffer or copy
            self._plan = GroupPlan()
            self.view_base_bytes = self.budget_kept_bytes = self.moved_bytes = 0
            self.recast_bytes = 0
            self.deferred_bytes = 0
            self.phase = LayerPhase.OFFLOAD_STARTED
            return
        for entry in self._entries:
            # Modified in place since it was saved: backward must fail as without offloading.
            entry.keep = entry.tensor._version != entry.version
        plan = self.processor.process(self._entries, self.keep_view_bases)
        self.view_base_bytes = plan.view_base_bytes
        self.recast_bytes = plan.recast_bytes
        self.budget_kept_bytes = plan.keep_units(self.keep_budget)
        moved = plan.moved
        self.moved_bytes = sum(u.nbytes for u in moved)
        buffers = self._buffers.acquire(
            self.transport.pool, [u.nbytes for u in moved], self.transport.capturing()
        )
        # Known before any copy is queued, so that a failure part-way through is cleaned
        # up by release_all_memory (which waits for the copies already queued).
        self._plan = plan
        self.phase = LayerPhase.OFFLOAD_STARTED
        for unit in plan.units:
            if unit.kept:
                unit.reloaded = unit.tensor  # served from the device tensor itself
        copies = []
        for unit, buf in zip(moved, buffers, strict=True):
            unit.host = buf
            unit.host_view = HostBufferPool.view(buf, unit.layout)  # made once, used twice
            assert unit.tensor is not None
            copies.append((unit.tensor, unit.ready, unit.host_view))
        split = plan.late_tail(moved, self.defer_budget) if self.defer_budget > 0 else len(moved)
        self.deferred_bytes = sum(u.nbytes for u in moved[split:])
        late = {id(u) for u in moved[split:]}
        self._late = [i for i, u in enumerate(plan.units) if id(u) in late]
        # All copies of the layer in one call: one stream switch, not one per tensor. A
        # deferred tail gets a call (and a completion event) of its own, so that the
        # release at the layer's point waits only for the copies before it.
        # Each part's events are known before the next is queued: release_all_memory
        # waits for them if queuing the tail fails.
        for part in (slice(0, split), slice(split, None)):
            if copies[part]:
                events = self.transport.offload_all(copies[part])
                for unit, event in zip(moved[part], events, strict=True):
                    unit.copied = event
        # Every wait on the save events is queued: NOTE [Recycled save events].
        for unit in plan.units:
            unit.ready = None
        ready = []
        for entry in self._entries:
            ready.append(entry.ready)
            entry.ready = None
        self.transport.recycle(ready)
        if _log.debug_enabled():
            log_offload(self.name, plan, self._entries)
        if casts_go:
            self.let_casts_go()

    def let_casts_go(self) -> None:
        """Drop the saved casts, rebuilt from their sources' reloads: no copy reads them,
        so their device memory goes now (NOTE [Casts rebuilt from their source] in
        ``recast.py``). One changed in place since its save stays, so that backward
        fails as without offloading."""
        refs = self._plan.refs if self._plan is not None else []
        for entry, ref in zip(self._entries, refs, strict=False):
            t = entry.tensor
            if isinstance(ref, CastRef) and t is not None and t._version == entry.version:
                let_go(entry)

    def release_activation_forward_gpu_memory(self) -> None:
        """Make the current stream wait for the offload copies, then drop the device tensors
        (but the deferred ones: :meth:`release_deferred`).

        Raises:
            RuntimeError: Unless called in state ``offload_started``.
        """
        self._expect("release_activation_forward_gpu_memory", LayerPhase.OFFLOAD_STARTED)
        plan = self._plan
        assert plan is not None
        if not self._late:
            self._drop(range(len(plan.units)), range(len(self._entries)))
        else:
            late = set(self._late)
            early = [i for i in range(len(plan.units)) if i not in late]
            self._drop(early, self._entries_using(late, False))
        self.phase = LayerPhase.OFFLOAD_FINISHED

    def release_deferred(self) -> None:
        """Release the device memory whose release :meth:`release_activation_forward_gpu_memory`
        deferred (``defer_budget``): the current stream waits for those copies first.

        Does nothing where nothing is deferred. Called one schedule point after the
        layer's release, and by :meth:`start_reload` if not called before.

        Raises:
            RuntimeError: Where something is deferred, unless called in state
                ``offload_finished``.
        """
        if not self._late:
            return
        self._expect("release_deferred", LayerPhase.OFFLOAD_FINISHED)
        self._drop(self._late, self._entries_using(set(self._late), True))
        self._late = []

    def _entries_using(self, units: set[int], using: bool) -> list[int]:
        """The pushed entries rebuilt from any of ``units`` (``using``), or from none."""
        plan = self._plan
        assert plan is not None
        return [
            i for i, ref in enumerate(plan.refs) if units.isdisjoint(plan.unit_ids(ref)) != using
        ]

    def _drop(self, units: Iterable[int], entries: Iterable[int]) -> None:
        """Wait for the copies of ``units`` and drop their device tensors, and those of
        the pushed ``entries`` (indices)."""
        plan = self._plan
        assert plan is not None
        waited: object | None = None
        for u in units:
            unit = plan.units[u]
            if unit.copied is not waited:  # copies queued together share one event
                self.transport.wait(unit.copied)
                waited = unit.copied
            unit.tensor = None
        # The pushed entries are the last references to the offloaded device memory.
        for i in entries:
            entry = self._entries[i]
            if entry.tensor is None:  # a saved cast, let go already (let_casts_go)
                continue
            if entry.tensor._version != entry.version:
                # Changed in place while its copy ran: keep it, so backward fails as
                # it would without offloading instead of using either version.
                plan.keep(i, entry.tensor)
                continue
            let_go(entry)

    # -- backward --------------------------------------------------------------------

    def start_reload(self, device_buffers: list[torch.Tensor] | None = None) -> None:
        """Allocate device memory on the compute stream and queue the copies back.

        Args:
            device_buffers: Preallocated device tensors to reload into, by unit order
                (V1's double buffering); a buffer whose layout differs is not used.

        Raises:
            RuntimeError: Unless called in state ``offload_finished``.
        """
        self._expect("start_reload", LayerPhase.OFFLOAD_FINISHED)
        self.release_deferred()  # a reload reads what the copies out wrote
        plan = self._plan
        assert plan is not None
        # Kept units never left; the moved ones go back in the order backward reads them
        # (NOTE [Reloads in the order backward reads] in ``reload_order.py``).
        units = self._read_order.moved_in_order(plan)
        if _log.debug_enabled():
            _log.moved(self.name, "reload", sum(u.nbytes for u in units), len(units))
        buffers: list[torch.Tensor | None] = [None] * len(units)
        if device_buffers:  # given by unit, in the order of plan.moved
            position = {id(u): i for i, u in enumerate(plan.moved)}
            for j, unit in enumerate(units):
                i = position[id(unit)]
                buffers[j] = device_buffers[i] if i < len(device_buffers) else None
        self._reload_units(units, buffers)
        self.phase = LayerPhase.RELOAD_STARTED

    def _reload_units(self, units: list[Unit], buffers: list[torch.Tensor | None]) -> None:
        # Every buffer is allocated before any copy is queued (an allocation that fails
        # leaves no copy running), then the copies go in one call. Nothing to reload
        # touches no stream (NOTE [A layer with nothing to move]).
        if not units:
            return
        transport = self.transport
        copies = []
        for unit, buffer in zip(units, buffers, strict=True):
            assert unit.host is not None
            if buffer is not None and TensorLayout.of(buffer) == unit.layout:
                unit.reloaded = buffer
            else:
                unit.reloaded = transport.allocate(unit.layout, unit.device)
            assert unit.host_view is not None
            copies.append((unit.host_view, unit.reloaded))
        events = transport.reload_all(copies)
        home = transport.current_stream()
        for unit, event in zip(units, events, strict=True):
            unit.restored = event
            unit.home = home
            unit.waited = set()

    def _join_reload(self, unit: Unit, stream: Hashable, *, reads: bool = False) -> None:
        """Make ``stream`` (the current one) wait for ``unit``'s reload copy, once.

        ``reads``: the current stream is about to read the reloaded tensor.
        """
        if unit.restored is None:
            return
        if stream not in unit.waited:
            self.transport.wait(unit.restored, stream)
            unit.waited.add(stream)
        if reads and stream != unit.home and unit.reloaded is not None:
            # Read on a stream other than the one it was allocated on: the allocator
            # must not hand its memory out before this stream's reads have run.
            self.transport.use_on_current_stream(unit.reloaded, stream)

    def pop_tensor(self, tensor_or_id: int | torch.Tensor) -> torch.Tensor:
        """Give back a tensor pushed earlier, waiting for its own reload if needed.

        Raises:
            RuntimeError: Unless called in state ``not_offloaded`` or ``reload_started``,
                or if the id is unknown (its iteration was released).
        """
        if isinstance(tensor_or_id, torch.Tensor):
            return tensor_or_id
        phase = self.phase
        if phase is not LayerPhase.RELOAD_STARTED and phase is not LayerPhase.NOT_OFFLOADED:
            self._expect("pop_tensor", LayerPhase.NOT_OFFLOADED, LayerPhase.RELOAD_STARTED)
        if not 0 <= tensor_or_id < len(self._entries):
            raise RuntimeError(
                f"{self.name} holds no saved tensor {tensor_or_id}: its memory was released "
                "(a new iteration started, or backward ran twice over the same graph)"
            )
        check_saved_version(self._entries[tensor_or_id], self.name)
        if phase is LayerPhase.NOT_OFFLOADED:
            return self._entries[tensor_or_id].tensor
        plan = self._plan
        assert plan is not None
        ref = plan.refs[tensor_or_id]
        if isinstance(ref, CastRef):
            for k in ref.source_entries:
                check_source_version(self._entries[k], self.name)
        unit_ids = plan.unit_ids(ref)
        stream = self.transport.current_stream() if unit_ids else None
        for u in unit_ids:
            unit = plan.units[u]
            if not unit.read:
                unit.read = True
                self._read_order.reads.append(u)
            if unit.reloaded is None:
                # Read more often than it was saved (a custom Function reading
                # ctx.saved_tensors twice): copy the host copy again, or find the kept
                # memory through a tensor rebuilt from it that autograd still holds.
                if unit.kept:
                    unit.reloaded = kept_again(unit, self.name)
                else:
                    self._reload_units([unit], [None])
                unit.pending_pops += 1
            self._join_reload(unit, stream, reads=True)
        out = self.processor.restore(plan, ref, stream)
        for u in unit_ids:
            unit = plan.units[u]
            unit.pending_pops -= 1
            if unit.pending_pops <= 0:
                # Autograd now holds the only references it needs: drop ours so the
                # memory goes as soon as the layer's backward is done with it.
                unit.reloaded = None
        return out

    def saved_tensor(self, index: int) -> torch.Tensor | None:
        """Pushed tensor ``index`` itself, version-checked, while the layer still holds
        it on the device after its copies were queued (None once it let it go).

        Raises:
            RuntimeError: If it was changed in place since it was saved.
        """
        self._expect("saved_tensor", LayerPhase.OFFLOAD_STARTED)
        entry = self._entries[index]
        check_saved_version(entry, self.name)
        return entry.tensor

    def wait_for_reloads(self) -> None:
        """Make the current stream wait for every reload copy still outstanding.

        Joins the copy stream back into the compute stream (required at the end of a
        CUDA graph capture), and makes dropping reload buffers safe.
        """
        if self._plan is None or not self._plan.units:  # NOTE [A layer with nothing to move]
            return
        stream = self.transport.current_stream()
        for unit in self._plan.units:
            self._join_reload(unit, stream)

    def release_all_memory(self) -> None:
        """Drop every tensor of this layer; host buffers go back to the pool unless retained.

        Allowed in any state. Copies still in flight are waited for first (on the
        stream, not the host), so memory is never reused under a running copy.
        """
        if self._plan is not None and self._plan.units:  # NOTE [A layer with nothing to move]
            if self._read_order.reads:
                self._read_order.remember(self._plan)
            stream = self.transport.current_stream()
            waited: object | None = None
            for unit in self._plan.units:
                if unit.tensor is not None and unit.copied is not waited:
                    self.transport.wait(unit.copied, stream)
                    waited = unit.copied
                self._join_reload(unit, stream)
                if unit.host is not None and unit.restored is not None:
                    self.transport.host_read_until(unit.host, unit.restored)
                if unit.host is not None and self._buffers.returns_to_pool(unit.host):
                    self.transport.pool.release(unit.host)
                unit.host = unit.host_view = unit.tensor = unit.reloaded = None
                unit.returned.clear()
        self._plan = None
        self._entries = []
        self._late = []
        self.phase = LayerPhase.NOT_OFFLOADED

    # -- reporting -------------------------------------------------------------------

    def reloaded_tensors(self) -> list[torch.Tensor | None]:
        """The device tensors of the current reload, in the order :meth:`start_reload`
        takes buffers: moved units only (None where released)."""
        return [] if self._plan is None else [u.reloaded for u in self._plan.moved]

    def get_offloaded_total_size_mb(self) -> float:
        """MiB held in host copies of this layer's tensors."""
        if self._plan is None or self.phase is LayerPhase.NOT_OFFLOADED:
            return 0.0
        return sum(u.nbytes for u in self._plan.moved) / _MIB
