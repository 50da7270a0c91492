"""The step of HybridDeviceOptimizer: the data path that moves and steps gradients.

Gradient copies to the host started in backward (from a post-accumulate-grad hook) and
checked in ``step()``, the gradients' way to the host optimizers, the device step queued
while the host works, and the host buckets stepped and copied back.
:class:`HybridStepper` holds these methods; ``HybridDeviceOptimizer`` (``_hybrid``) and
its layout (``_build``) set up the attributes they read.
"""

from __future__ import annotations

import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from cpu_offload._compat import OnCudaStream, is_current_stream_capturing

from ._copies import send_grad, step_host_subs
from ._entries import EarlyCopy, Entry, Sub
from ._fingerprint import EarlyCopyChecks, fingerprint
from ._forward_overlap import ForwardOverlap
from ._stream import StateStream

__all__ = ["HybridStepper", "device_step_pieces"]

# Optimizers stepped in pieces (NOTE below): exactly these classes, not subclasses, whose
# step() may do more.
_PIECEWISE_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

# NOTE [Casting device gradients beside the device step]
# With param_update_in_fp32, the device optimizer steps fp32 masters, so each device
# gradient is first cast to fp32: one memory-bound kernel per parameter, about a quarter
# of the device step's time (4.1 of 17 ms on workload C at fraction 0). The casts need
# nothing but the gradients, and the step of one parameter needs only its own cast, so
# the two can overlap: the masters are cut into a few pieces (device_step_pieces), every
# cast is queued on a side stream, and the device optimizer steps piece by piece on the
# current stream, each piece after an event recorded behind its casts. A piece's step
# runs while the casts of the next ones do.
#
# Memory: every fp32 gradient is allocated on the current stream, before the side stream
# waits for it, so that a block the allocator hands out again (last used by work still
# queued on the current stream) is written only after that work. The gradients are read
# on the side stream and freed on the current one after the step that waited for their
# event, so no block is reused before its cast is done; after a failure part-way, the
# current stream waits for the side stream before anything is freed. The peak is at most
# the one call's: the same fp32 gradients exist at once, and each piece's are freed as
# it is stepped.
#
# Values: a piece's step is ``optimizer.step()`` with only that piece's masters holding
# gradients (the optimizer skips parameters whose grad is None), and each parameter is
# stepped exactly once per step(), by the same kernel: bit-identical to one call. That
# holds for optimizers whose step updates each parameter from its own gradient and state
# alone: PyTorch's Adam, AdamW and SGD (step counts and momenta are per parameter),
# without step hooks of their own (they would run once per piece). Another class may
# keep state per group (Transformer Engine's FusedAdam counts steps in the group) or
# need every gradient at once (LBFGS, LAMB's global norm): it steps in one call. So do
# the first step (one call creates all the state before any kernel runs, so a step that
# runs out of memory leaves nothing stepped), a device optimizer with a parameter
# stepped in place (no master: every piece's call would step it), and a CUDA graph
# capture.


class HybridStepper(torch.optim.Optimizer):
    """Base class of :class:`~cpu_offload.optim.HybridDeviceOptimizer`: its step.

    The attributes below are set by ``HybridDeviceOptimizer.__init__`` and ``_build``.
    """

    pin_cpu_grads: bool
    overlap_cpu_optimizer_d2h_h2d: bool
    early_grad_copy: bool
    _early_auto: bool  # early_grad_copy was "auto"
    last_step_timings: dict[str, float]
    _executor: ThreadPoolExecutor | None
    _generation: int
    _entries: list[Entry]
    _host_subs: list[Sub]
    _device_sub: Sub | None
    _cuda_device: torch.device | None
    _d2h_stream: torch.cuda.Stream | None
    _h2d_stream: torch.cuda.Stream | None
    _overlap: ForwardOverlap | None
    _lane: StateStream | None
    _cast_stream: torch.cuda.Stream | None

    # NOTE [Casting device gradients beside the device step]: at most this many pieces,
    # of at least this many elements each.
    _cast_pieces = 4
    _cast_piece_min_numel = 1 << 24

    # Gradients smaller than this are copied in step(), not from backward: checking an
    # early copy costs a few kernel launches, more than copying a small gradient again.
    _early_min_numel = 1 << 19

    # ------------------------------------------------------------------ early copies

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            # One thread: widening tasks of one entry must run in submission order.
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="cpu_offload_hdo")
            weakref.finalize(self, self._executor.shutdown, wait=False)
        return self._executor

    def _on_grad_ready(self, entry: Entry, generation: int) -> None:
        """Start an offloaded gradient's copy from backward (post-accumulate-grad hook)."""
        if generation != self._generation:
            return
        if self._overlap is not None:
            self._overlap.check_read(entry)
        if entry.streamed:
            return  # its gradient stays on the device
        if self._overlap is not None:
            if not (self.overlap_cpu_optimizer_d2h_h2d and self._copies_early(entry)):
                return
        grad = entry.param.grad
        if grad is None or grad.is_sparse:
            return
        if grad.numel() < self._early_min_numel or is_current_stream_capturing():
            return
        # Taken on the stream that produced the gradient, so that it describes the
        # gradient as backward left it: a change queued later (clipping on this stream)
        # may race with the copy below, but then step() sees another fingerprint.
        taken = fingerprint(grad)
        stream = self._d2h_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(grad.device))
        event, widened = send_grad(entry, grad, stream, self.pin_cpu_grads, self._worker())
        entry.early = EarlyCopy(weakref.ref(grad), grad._version, event, taken, widened)

    def _copies_early(self, entry: Entry) -> bool:
        """With ``overlap_host_step_with_forward``: whether ``entry``'s gradient is copied early.

        The host steps in forward order, so its first bucket needs the gradients that
        backward produces last. ``"auto"`` copies early only the gradients of parameters
        the forward reads after a parameter stepped on the device (the offloaded last
        layers of ``offload_last_layers``, the host lane's buckets behind the streamed
        ones of ``stream_share``): backward produces them while the earlier layers'
        backward still runs, so their copies finish behind it and the host can start at
        once, and the link is left to the stream lane during the step. Where every
        earlier parameter is offloaded too, an early copy would not let the host start
        any sooner, and its checks would cost backward time.
        """
        if not self._early_auto:
            return self.early_grad_copy
        assert self._overlap is not None
        return self._overlap.read_after_device_param(entry)

    # ------------------------------------------------------------------ the step

    def _step_all(self) -> None:
        t_start = time.perf_counter()
        current = (
            torch.cuda.current_stream(self._cuda_device) if self._cuda_device is not None else None
        )
        # Side streams in the overlapped mode, the current stream otherwise.
        d2h = self._d2h_stream if self._d2h_stream is not None else current
        h2d = self._h2d_stream if self._h2d_stream is not None else current
        # Everything queued before step() (backward, clipping, ...): the gradient copies
        # must come after it, and the copies back must not overwrite parameters it may
        # still read. Recorded before the device step so that the copies back do not
        # also wait for the device optimizer.
        before_step = current.record_event() if current is not None else None

        # Buckets of streamed entries are stepped by the stream lane, the rest by the host.
        host_subs = [s for s in self._host_subs if not s.entries[0].streamed]
        lane_subs = [s for s in self._host_subs if s.entries[0].streamed]

        # 1. Which early copies still hold the gradient: checks queued first, one per
        #    host bucket in stepping order ...
        checks = EarlyCopyChecks([sub.entries for sub in host_subs])

        # 2. ... while the device part is queued, to run on the device as the host works.
        #    Gradient copies on the current stream that need no check are queued before
        #    it: behind it, the host would wait for the device step as well as for
        #    backward before it could start stepping.
        copies_first = self._d2h_stream is None and checks.candidates == 0
        if copies_first:
            self._take_grads(d2h, [e for sub in host_subs for e in sub.entries])
        if self._device_sub is not None:
            self._step_device()

        # 3. Gradients to the host, in host-stepping order; on the side stream, after
        #    everything before step(). Entries with an early copy to check are taken as
        #    their bucket's check is decided (step 4).
        if self._d2h_stream is not None and before_step is not None:
            self._d2h_stream.wait_event(before_step)
        if not copies_first:
            unchecked = [e for sub in host_subs for e in sub.entries if e.early is None]
            self._take_grads(d2h, unchecked)

        # 4. Host buckets: wait for their gradients, step, copy back (pipelined).
        if self._h2d_stream is not None and before_step is not None:
            self._h2d_stream.wait_event(before_step)
        now, later = host_subs, []
        streamed_numel = 0
        if self._overlap is None and lane_subs:
            # Queued before the host steps (which run here, in step()), to run beside them.
            assert self._lane is not None and before_step is not None and current is not None
            try:
                streamed_numel = self._lane.queue(lane_subs, before_step)
            finally:
                # Whatever the caller queues next on the current stream sees the new values.
                current.wait_stream(self._lane.compute)
        if self._overlap is not None:
            # Buckets of offloaded parameters are stepped after step() returns; the
            # caller's host parameters (whose .grad the host optimizer reads) now.
            later = [s for s in now if all(e.offloaded for e in s.entries)]
            now = [s for s in now if s not in later]
        if later:
            self._take_grads(d2h, checks.settle_all())
            host_timings = step_host_subs(now, h2d)
            assert self._overlap is not None
            self._overlap.submit(later, h2d)
        if self._overlap is not None and lane_subs:
            # Queued after the host lane has its work: the queueing takes host time
            # (queued first, it delayed the host lane: 325.1 against 296.8 ms at
            # fraction 1.0 with a 0.375 share on workload C, docs/benchmarks.md).
            assert self._lane is not None and before_step is not None
            streamed = [e for sub in lane_subs for e in sub.entries]
            try:
                streamed_numel = self._lane.queue(lane_subs, before_step)
            except BaseException as failed:
                # Readers wait for whatever was queued, also after a failure part-way;
                # the lane's error is the one the caller gets.
                _mark_after_failure(self._overlap, streamed, failed)
                raise
            self._overlap.mark_queued(streamed)
        if not later:

            def settle(index: int) -> None:
                self._take_grads(d2h, checks.settle(index))

            host_timings = step_host_subs(now, h2d, before=settle)
            if self._h2d_stream is not None and current is not None:
                # Whatever the caller queues next on the current stream sees the new values.
                current.wait_stream(self._h2d_stream)
            if self._overlap is None and self._lane is not None:
                # The host state whole when step() returns, as the host lane's is.
                self._lane.wait()
        self.last_step_timings = {
            "step_s": time.perf_counter() - t_start,
            **host_timings,
            "host_numel": float(
                sum(e.param.numel() for e in self._entries if e.host and not e.streamed)
            ),
            "streamed_numel": float(streamed_numel),
            "early_copies": float(checks.made),
            "early_copies_reused": float(checks.kept),
        }

    def _take_grads(self, stream: torch.cuda.Stream | None, entries: list[Entry]) -> None:
        for entry in entries:
            self._take_grad(entry, stream)

    def _take_grad(self, entry: Entry, stream: torch.cuda.Stream | None) -> None:
        """Start the gradient's way to the host optimizer (a copy unless early or host)."""
        entry.widened = False
        entry.d2h_event = None
        grad = entry.param.grad
        entry.has_grad = grad is not None
        if not entry.offloaded:
            # A host parameter: stepped in place, or through a host fp32 master.
            if entry.master:
                entry.inner.grad = None if grad is None else grad.to(entry.inner.dtype)
            return
        if grad is None:
            entry.inner.grad = None
            entry.early = None
            return
        if entry.early is not None:
            entry.d2h_event = entry.early.copy_event
            entry.widened = entry.early.widened
            entry.early = None
            return
        entry.d2h_event, _ = send_grad(entry, grad, stream, self.pin_cpu_grads)

    def _step_device(self) -> None:
        sub = self._device_sub
        assert sub is not None
        pieces = self._device_pieces(sub)
        if pieces is None:
            for entry in sub.entries:
                if entry.master:
                    grad = entry.param.grad
                    entry.inner.grad = None if grad is None else grad.to(entry.inner.dtype)
            sub.optimizer.step()
            _write_masters(sub.entries)
            return
        # NOTE [Casting device gradients beside the device step]
        device = pieces[0][0].param.device
        current = torch.cuda.current_stream(device)
        _drop_master_grads(sub.entries)  # only the piece being stepped holds gradients
        fp32_grads = [
            [torch.empty_like(_grad_of(e), dtype=e.inner.dtype) for e in piece] for piece in pieces
        ]
        if self._cast_stream is None or self._cast_stream.device != device:
            self._cast_stream = torch.cuda.Stream(device)
        cast = self._cast_stream
        cast.wait_stream(current)  # after the allocations above, and after backward
        try:
            events = []
            with OnCudaStream(cast):
                for piece, wides in zip(pieces, fp32_grads, strict=True):
                    for entry, wide in zip(piece, wides, strict=True):
                        wide.copy_(_grad_of(entry))
                    events.append(cast.record_event())
            for piece, event in zip(pieces, events, strict=True):
                current.wait_event(event)
                for entry, wide in zip(piece, fp32_grads.pop(0), strict=True):
                    entry.inner.grad = wide
                sub.optimizer.step()
                _write_masters(piece)  # frees the piece's fp32 gradients
        finally:
            # After a failure part-way too: nothing the casts read or write is freed
            # before them, and no master keeps a gradient a later step would apply.
            current.wait_stream(cast)
            _drop_master_grads(sub.entries)

    def _device_pieces(self, sub: Sub) -> list[list[Entry]] | None:
        """The pieces of the device step, or None for one call.

        See NOTE [Casting device gradients beside the device step]: pieces only for
        PyTorch's Adam, AdamW and SGD without step hooks of their own, once every
        stepped master has its state (so that a first step that runs out of memory
        leaves nothing stepped, as one call does), on one CUDA device that is not
        capturing a graph.
        """
        optimizer = sub.optimizer
        if type(optimizer) not in _PIECEWISE_CLASSES or _has_step_hooks(optimizer):
            return None
        pieces = device_step_pieces(sub.entries, self._cast_pieces, self._cast_piece_min_numel)
        if pieces is None:
            return None
        stepped = [e for piece in pieces for e in piece]
        device = _one_cuda_device(stepped)
        if device is None or not all(optimizer.state.get(e.inner) for e in stepped):
            return None
        with torch.cuda.device(device):
            if is_current_stream_capturing():
                return None
        return pieces


def _mark_after_failure(
    overlap: ForwardOverlap, entries: list[Entry], failed: BaseException
) -> None:
    """:meth:`ForwardOverlap.mark_queued` after ``failed`` ended the lane's queueing: an
    error of the marking is added to ``failed`` as a note (a warning before Python
    3.11), never raised in its place."""
    try:
        overlap.mark_queued(entries)
    except Exception as also:
        text = f"marking the streamed parameters for their readers also failed: {also!r}"
        if hasattr(failed, "add_note"):
            failed.add_note(text)
        else:
            warnings.warn(text, RuntimeWarning, stacklevel=3)


def _one_cuda_device(entries: list[Entry]) -> torch.device | None:
    """The CUDA device of all ``entries``' parameters; None if they are not on one."""
    devices = {e.param.device for e in entries}
    device = devices.pop() if len(devices) == 1 else None
    return device if device is not None and device.type == "cuda" else None


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    # Hooks of this optimizer would run once per piece instead of once per step.
    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
    )


def _grad_of(entry: Entry) -> torch.Tensor:
    grad = entry.param.grad
    assert grad is not None  # device_step_pieces keeps only entries with a gradient
    return grad


def _drop_master_grads(entries: list[Entry]) -> None:
    for entry in entries:
        if entry.master:
            entry.inner.grad = None


def _write_masters(entries: list[Entry]) -> None:
    """Write the stepped fp32 masters of ``entries`` into their parameters."""
    for entry in entries:
        if entry.master and entry.inner.grad is not None:
            entry.param.copy_(entry.inner)
            entry.note_param_written()
            # The fp32 gradient is transient: freeing it keeps the device state at
            # master + moments (12 bytes per parameter for AdamW).
            entry.inner.grad = None


def device_step_pieces(
    entries: list[Entry], pieces: int, min_numel: int
) -> list[list[Entry]] | None:
    """The device optimizer's masters cut into pieces stepped one after another.

    See NOTE [Casting device gradients beside the device step]. Entries keep their order
    and stay whole. The pieces hold about equal numbers of elements: at most ``pieces``
    of them, each of at least ``min_numel`` elements (a short remainder joins the piece
    before it).

    Returns:
        The pieces of the entries whose parameters have a gradient, or None where one
        piece would do (too few elements) or pieces are not allowed (a parameter with a
        gradient and no master, or a gradient that is not a dense tensor).
    """
    stepped = []
    for entry in entries:
        grad = entry.param.grad
        if grad is None:
            continue
        if not entry.master or grad.layout != torch.strided:
            return None
        stepped.append(entry)
    total = sum(e.param.numel() for e in stepped)
    count = min(pieces, total // max(min_numel, 1))
    if count < 2:
        return None
    share = total / count  # at least min_numel
    out: list[list[Entry]] = [[]]
    numel = 0  # elements in out[-1]
    for entry in stepped:
        if numel >= share:
            out.append([])
            numel = 0
        out[-1].append(entry)
        numel += entry.param.numel()
    if len(out) > 1 and numel < min_numel:
        out[-2].extend(out.pop())
    return out if len(out) > 1 else None
