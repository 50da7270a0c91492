"""The transport: moves bytes between device memory and host memory.

A transport knows about streams, events and host buffers, and nothing about layers
or schedules. Two implementations share one interface:

* :class:`CudaTransport` copies CUDA tensors to pinned host buffers on a dedicated copy
  stream, ordered by CUDA events, and back.
* :class:`HostTransport` is the CPU stand-in: the "device" tensors are CPU tensors and
  the copies are plain synchronous copies into separate host buffers. It lets the
  scheduling, selection and grouping logic run (and be tested) on a machine without a
  GPU. It never accepts CUDA tensors, so it cannot be used for them by mistake.

Host buffers come from a :class:`~cpu_offload.engine.host_buffers.HostBufferPool` that
is reused across training steps, so that a steady-state step allocates no new pinned
memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

from .._args import check_stream
from .._compat import OnCudaStream, current_cuda_stream
from .host_buffers import HostBufferPool
from .layout import TensorLayout

__all__ = [
    "CudaTransport",
    "HostBufferPool",
    "HostTransport",
    "TimedSpan",
    "Transport",
]


@dataclass(frozen=True)
class TimedSpan:
    """A span of GPU time between two CUDA events (a copy, or a compute-stream stall)."""

    kind: str  # "offload", "reload" or "stall"
    nbytes: int
    start: torch.cuda.Event
    end: torch.cuda.Event


# NOTE [Recycled save events]
# Each tensor an offloaded layer saves gets an event at its save (Transport.record), so
# that its copy waits only for the kernels that made it. Making a CUDA event costs the
# host a Python object and a cudaEventCreate (and a cudaEventDestroy later), for each
# of a layer's saves, on the host's path through the forward. A layer's start_offload
# queues every wait on its save events (the copy stream's wait_event) before it
# returns; a wait takes the event's state when it is queued, so from then on nothing
# reads those events, and the layer gives them back (Transport.recycle) for the next
# records. An event is given back once (saves marked ready together share one), never
# while a CUDA graph is captured (its events belong to the graph), and the free list is
# bounded.

#: Events the CUDA transport keeps for reuse (NOTE [Recycled save events]).
_MAX_FREE_EVENTS = 1024


class Transport(ABC):
    """Moves tensors between the device and host buffers, in order.

    Events returned by the transport are opaque tokens: ``None`` means "already done".
    """

    #: True when times and memory are not those of a GPU (the CPU stand-in).
    simulated: bool = False

    def __init__(self, pool: HostBufferPool) -> None:
        self.pool = pool
        #: Bytes copied to the host and back since creation (for tests and reports).
        self.bytes_offloaded = 0
        self.bytes_reloaded = 0
        #: When a list, each copy and each compute-stream wait is recorded in it with
        #: timing events (for the comparison tool's bandwidth, stall and timeline).
        self.timeline: list[TimedSpan] | None = None
        #: Host buffer address -> the event of the last reload copy that read it.
        self._read_until: dict[int, object] = {}

    @abstractmethod
    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on the device this transport moves data from."""

    @abstractmethod
    def record(self) -> object | None:
        """Mark the current point of the compute stream."""

    @abstractmethod
    def wait(self, event: object | None, stream: Hashable | None = None) -> None:
        """Make ``stream`` (from :meth:`current_stream`; the current one if None) wait for
        ``event``."""

    @abstractmethod
    def current_stream(self) -> Hashable:
        """The stream work is queued on now, as a key (backward may run on several)."""

    @abstractmethod
    def use_on_current_stream(self, tensor: torch.Tensor, stream: Hashable | None = None) -> None:
        """Keep ``tensor``'s memory from reuse until the current stream's queued work ran.

        For a tensor allocated on another stream (``Tensor.record_stream``); ``stream`` is
        the current stream if the caller has it (from :meth:`current_stream`).
        """

    @abstractmethod
    def offload(self, src: torch.Tensor, ready: object | None, dst: torch.Tensor) -> object | None:
        """Copy device tensor ``src`` into host tensor ``dst`` once ``ready`` has passed.

        The caller keeps ``src`` alive until it has waited for the returned event.
        """

    @abstractmethod
    def allocate(self, layout: TensorLayout, device: torch.device) -> torch.Tensor:
        """A new device tensor of ``layout``, allocated on the compute stream."""

    @abstractmethod
    def reload(self, src: torch.Tensor, dst: torch.Tensor) -> object | None:
        """Copy host tensor ``src`` into device tensor ``dst`` (from :meth:`allocate`)."""

    def capturing(self) -> bool:
        """Whether a CUDA graph is being captured on the current stream."""
        return False

    def recycle(self, events: Iterable[object | None]) -> None:
        """Take back events from :meth:`record` that nothing will wait for any more.

        Only events whose every wait is queued already (NOTE [Recycled save events]);
        a later :meth:`record` may record them again. The stand-in has nothing to keep.
        """
        del events  # events that are None or opaque tokens: nothing to reuse

    def peak_allocated(self) -> int | None:
        """The device allocator's running peak of allocated bytes, or None if unknown.

        The peak is read, never reset: it belongs to the caller (NOTE [Bytes that pay]
        in ``peak_watch.py``).

        Returns:
            Bytes, or None where the allocator keeps no statistics (the host stand-in,
            a pluggable CUDA allocator); the schedule then moves every candidate.
        """
        return None

    @property
    def duplex(self) -> bool:
        """Whether reloads run on a stream of their own (both directions copy at once)."""
        return False

    def host_read_until(self, buffer: torch.Tensor, event: object | None) -> None:
        """Record that a reload copy reads host ``buffer`` until ``event``.

        Called when the buffer is given back (to the pool, or kept for the next
        iteration): with a separate reload stream, a later offload that writes into it
        must not overtake that read (:meth:`pending_host_read`). Nothing is kept where
        both directions share one stream, whose copies run in the order queued, nor
        while a CUDA graph is captured (its events belong to the graph, which joins
        every stream back at its end).
        """
        if self.duplex and event is not None and not self.capturing():
            self._read_until[buffer.data_ptr()] = event

    def pending_host_read(self, dst: torch.Tensor) -> object | None:
        """The event an offload into ``dst`` must wait for first, once (then forgotten)."""
        if not self._read_until:
            return None
        return self._read_until.pop(dst.data_ptr(), None)

    def offload_all(
        self, copies: Sequence[tuple[torch.Tensor, object | None, torch.Tensor]]
    ) -> list[object | None]:
        """Queue the offload copies of one layer: ``(src, ready, dst)`` as for :meth:`offload`.

        Returns one event per copy; copies queued together may share one event (the
        caller waits for each distinct event once). If queuing fails part-way, the
        compute stream waits for the copies already queued before the error propagates,
        so that no memory is reused under a running copy.
        """
        events: list[object | None] = []
        try:
            for src, ready, dst in copies:
                events.append(self.offload(src, ready, dst))
        except BaseException:
            for event in events:
                self.wait(event)
            raise
        return events

    def reload_all(
        self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[object | None]:
        """Queue the reload copies of one layer: ``(src, dst)`` as for :meth:`reload`.

        Returns one event per copy, so that each tensor's first use waits only for its own
        copy. Fails as :meth:`offload_all` does.
        """
        events: list[object | None] = []
        try:
            for src, dst in copies:
                events.append(self.reload(src, dst))
        except BaseException:
            for event in events:
                self.wait(event)
            raise
        return events


class CudaTransport(Transport):
    """Copies on a dedicated CUDA stream, ordered by CUDA events.

    Args:
        stream: The copy stream; a new one is created on the current device if None.
        pool: Host buffer pool; a new pinned pool if None.
        reload_stream: A separate stream for host-to-device copies, so that both
            directions run at once (the duplex schedule); the same stream as
            ``stream`` if None. A host buffer is then written by an offload only after
            the reload that last read it has finished.

    Raises:
        RuntimeError: If CUDA is not available.
        TypeError: If ``stream`` is not a ``torch.cuda.Stream``.
    """

    def __init__(
        self,
        stream: torch.cuda.Stream | None = None,
        pool: HostBufferPool | None = None,
        reload_stream: torch.cuda.Stream | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaTransport needs CUDA, which is not available; use HostTransport to "
                "run the offloading logic on CPU tensors"
            )
        check_stream("offload_stream", stream)
        check_stream("reload_stream", reload_stream)
        super().__init__(pool if pool is not None else HostBufferPool(pin_memory=True))
        self.stream = stream if stream is not None else torch.cuda.Stream()
        self.reload_stream = reload_stream if reload_stream is not None else self.stream
        self._free_events: list[torch.cuda.Event] = []  # NOTE [Recycled save events]

    @property
    def duplex(self) -> bool:
        return self.reload_stream is not self.stream

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def peak_allocated(self) -> int | None:
        # The nested statistics skip memory_stats' flattening of every counter in Python:
        # read at each schedule point, this must cost microseconds. A pluggable allocator
        # (RMM, say) keeps none and raises.
        try:
            stats = torch.cuda.memory_stats_as_nested_dict(self.stream.device)
        except RuntimeError:
            return None
        return int(stats["allocated_bytes"]["all"]["peak"]) if stats else None

    # The stream calls below avoid torch.cuda's Python wrappers: see
    # NOTE [Host cost of CUDA stream calls].

    def record(self) -> torch.cuda.Event:
        free = self._free_events
        event = free.pop() if free else torch.cuda.Event()
        event.record(current_cuda_stream())
        return event

    def recycle(self, events: Iterable[object | None]) -> None:
        if self.capturing():
            return  # recorded into the graph being captured: they belong to it
        free = self._free_events
        seen = {id(e) for e in free}
        for event in events:
            # Saves marked ready together share one event: it must go back once.
            if event is None or id(event) in seen or len(free) >= _MAX_FREE_EVENTS:
                continue
            assert isinstance(event, torch.cuda.Event)
            seen.add(id(event))
            free.append(event)

    def wait(self, event: object | None, stream: Hashable | None = None) -> None:
        if event is None:
            return
        assert isinstance(event, torch.cuda.Event)
        if stream is None:
            stream = current_cuda_stream()
        assert isinstance(stream, torch.cuda.Stream)
        if self.timeline is None:
            stream.wait_event(event)
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        stream.wait_event(event)
        end.record(stream)
        self.timeline.append(TimedSpan("stall", 0, start, end))

    def current_stream(self) -> torch.cuda.Stream:
        return current_cuda_stream()

    def use_on_current_stream(self, tensor: torch.Tensor, stream: Hashable | None = None) -> None:
        if stream is None:
            stream = current_cuda_stream()
        assert isinstance(stream, torch.cuda.Stream)
        tensor.record_stream(stream)

    def _copy(self, kind: str, stream: torch.cuda.Stream, src: torch.Tensor, dst: torch.Tensor):
        nbytes = dst.numel() * dst.element_size()
        with OnCudaStream(stream):
            if self.timeline is not None:
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(enable_timing=self.timeline is not None)
            done.record(stream)
        if self.timeline is not None:
            self.timeline.append(TimedSpan(kind, nbytes, start, done))
        return done, nbytes

    def _wait_for_host_reads(self, dst: torch.Tensor) -> None:
        # With a separate reload stream, a host buffer given back while its reload copy
        # still ran could be written by this offload first: wait for that read.
        read = self.pending_host_read(dst)
        if read is not None:
            assert isinstance(read, torch.cuda.Event)
            self.stream.wait_event(read)

    def offload(
        self, src: torch.Tensor, ready: object | None, dst: torch.Tensor
    ) -> torch.cuda.Event:
        if ready is not None:
            assert isinstance(ready, torch.cuda.Event)
            self.stream.wait_event(ready)
        self._wait_for_host_reads(dst)
        done, nbytes = self._copy("offload", self.stream, src, dst)
        self.bytes_offloaded += nbytes
        return done

    def allocate(self, layout: TensorLayout, device: torch.device) -> torch.Tensor:
        return torch.empty_strided(layout.size, layout.stride, dtype=layout.dtype, device=device)

    def reload(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event:
        # dst was allocated on the compute stream: its memory may have been used by
        # compute work queued before the allocation, so the copy waits for that point.
        self.reload_stream.wait_stream(current_cuda_stream())
        done, nbytes = self._copy("reload", self.reload_stream, src, dst)
        self.bytes_reloaded += nbytes
        return done

    def offload_all(
        self, copies: Sequence[tuple[torch.Tensor, object | None, torch.Tensor]]
    ) -> list[object | None]:
        if self.timeline is not None:  # per-copy timing events: one copy at a time
            return super().offload_all(copies)
        # One stream switch and one completion event for the layer: a layer's memory is
        # released only once all its copies are done, so per-copy events would only
        # cost host time. Each copy still waits for the point its tensor was saved at.
        stream = self.stream
        done = torch.cuda.Event()
        waited: object | None = None
        try:
            with OnCudaStream(stream):
                for src, ready, dst in copies:
                    if ready is not None and ready is not waited:
                        stream.wait_event(ready)  # type: ignore[arg-type]
                        waited = ready
                    self._wait_for_host_reads(dst)
                    dst.copy_(src, non_blocking=True)
                    self.bytes_offloaded += dst.nbytes
        except BaseException:
            done.record(stream)
            current_cuda_stream().wait_event(done)
            raise
        done.record(stream)
        return [done] * len(copies)

    def reload_all(
        self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[object | None]:
        if self.timeline is not None:
            return super().reload_all(copies)
        stream = self.reload_stream
        # The buffers were allocated on the compute stream (see reload): one wait for all.
        stream.wait_stream(current_cuda_stream())
        events: list[object | None] = []
        try:
            with OnCudaStream(stream):
                for src, dst in copies:
                    dst.copy_(src, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                    events.append(event)
                    self.bytes_reloaded += dst.nbytes
        except BaseException:
            current_cuda_stream().wait_stream(stream)
            raise
        return events


class HostTransport(Transport):
    """CPU stand-in for :class:`CudaTransport`: CPU tensors play the device's part.

    Copies are synchronous, so every event is ``None``. Numerics, scheduling and
    grouping behave as on the GPU; times and memory do not. It refuses CUDA tensors.

    Args:
        pool: Host buffer pool; a new unpinned pool if None.
    """

    simulated = True

    def __init__(self, pool: HostBufferPool | None = None) -> None:
        super().__init__(pool if pool is not None else HostBufferPool(pin_memory=False))

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def record(self) -> None:
        return None

    def wait(self, event: object | None, stream: Hashable | None = None) -> None:
        return None

    def current_stream(self) -> Hashable:
        return None  # one stream: CPU operations run in order

    def use_on_current_stream(self, tensor: torch.Tensor, stream: Hashable | None = None) -> None:
        return None

    def offload(self, src: torch.Tensor, ready: object | None, dst: torch.Tensor) -> None:
        dst.copy_(src)
        self.bytes_offloaded += dst.numel() * dst.element_size()
        return None

    def allocate(self, layout: TensorLayout, device: torch.device) -> torch.Tensor:
        return torch.empty_strided(layout.size, layout.stride, dtype=layout.dtype, device=device)

    def reload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src)
        self.bytes_reloaded += dst.numel() * dst.element_size()
        return None


def resolve_transport(
    transport: object, offload_stream: torch.cuda.Stream | None = None, duplex: bool = False
) -> Transport:
    """``transport`` checked, or the default one (see :func:`default_transport`) when None.

    Raises:
        TypeError: If ``transport`` is neither None nor a :class:`Transport`.
    """
    if transport is None:
        return default_transport(offload_stream, duplex)
    if not isinstance(transport, Transport):
        raise TypeError(
            "transport must be a cpu_offload Transport (CudaTransport or HostTransport) or "
            f"None, got {type(transport).__name__} {transport!r}"
        )
    return transport


def default_transport(
    offload_stream: torch.cuda.Stream | None = None, duplex: bool = False
) -> Transport:
    """The transport used when the caller names none.

    :class:`CudaTransport` when CUDA is available, with a separate reload stream if
    ``duplex``. Without CUDA there are no CUDA tensors to offload, and the CPU stand-in
    runs the same logic on CPU tensors so that programs written for the GPU still run
    (and can be tested) on a CPU-only machine; its copies are synchronous, so ``duplex``
    changes nothing there.
    """
    if torch.cuda.is_available():
        return CudaTransport(offload_stream, reload_stream=torch.cuda.Stream() if duplex else None)
    if offload_stream is not None:
        raise TypeError("offload_stream was given but CUDA is not available")
    return HostTransport()
