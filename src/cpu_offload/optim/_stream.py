"""Offloaded parameters stepped on the device, their host state streamed through it.

NOTE [Streaming host state through the device]

The host step of an offloaded parameter is bound by host memory bandwidth: per element a
fused AdamW reads the fp32 master, the gradient and two moments and writes three of them
back (28 bytes), and the gradient's copy in and the parameter's copy out add 8 more, all
through the same memory. Streaming the master and the moments to the device, stepping
them there and streaming them back moves 24 bytes per element through host memory and
none through the host's cores; the gradient never leaves the device. With
``stream_share``, the device steps that share of the offloaded elements this way while
the host steps the rest, and both lanes finish sooner than the host would alone: the
host lane is bound by host memory, the stream lane by PCIe (12 bytes each way per
element), and they share only the host memory. The state still lives in host memory
between steps; the device holds it only in a ring of ``RING`` chunk-sized buffers during
the step (the caching allocator keeps that memory reserved for the next step).

Per chunk of at most ``CHUNK_NUMEL`` elements of one parameter, through a ring slot:

1. ``copy_in`` waits until the slot's previous chunk has left (the slot's ``free``
   event) and copies the chunk's master and moments from host memory into the slot.
   The slots are allocated on ``copy_in``, their first writer, so that whatever the
   allocation queues (deterministic mode fills new memory with NaN) comes first.
2. ``compute`` waits for that copy (and once, before the first chunk, for everything
   queued before ``step()``: backward wrote the gradient and nothing may still read the
   parameter), widens the gradient chunk into the slot, steps the slot with
   ``cpu_optimizer_cls``'s fused CUDA kernel and writes the new values into the
   parameter chunk (narrowed to the parameter's dtype).
3. ``copy_out`` waits for the step and copies master and moments back to host memory;
   its event frees the slot.

A parameter holds its new value at the ``compute`` event after its last chunk: readers
wait for that (``Entry.h2d_event``). The host state is whole again at the last
``copy_out`` event (:attr:`StateStream.state_ready`): host readers and the next step's
copies in wait for it. The gradient is read on ``compute``; ``record_stream`` keeps its
memory until then, and a ``zero_grad(set_to_none=False)`` waits for ``compute``.

Each element is stepped by the same fused CUDA kernel, with the same hyperparameters and
step count, as if the parameter were stepped on the device: results are bit-identical to
that, whatever the chunking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._entries import IMPLEMENTATION_KEYS, Entry, Sub
from ._split import check_offload_fraction

__all__ = ["STREAMABLE_CLASSES", "StateStream", "check_stream_share", "mark_streamed"]

#: Host optimizer classes whose state can be streamed: elementwise, with a fused CUDA
#: kernel, and a state of a step count and tensors shaped like the parameter.
STREAMABLE_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)

#: The state tensors streamed per element (the step count stays on the host).
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

CHUNK_NUMEL = 1 << 23  # elements per chunk: 128 MiB of device buffers per ring slot (AdamW)
RING = 3  # slots: one copied in, one stepped, one copied out


def check_stream_share(value: Any, cpu_optimizer_cls: type[torch.optim.Optimizer]) -> float:
    """``value`` as a float in ``[0, 1]``; ValueError naming ``stream_share`` otherwise.

    A positive share also needs a host optimizer class from :data:`STREAMABLE_CLASSES`.
    """
    share = check_offload_fraction(value, "stream_share")
    if share > 0.0 and cpu_optimizer_cls not in STREAMABLE_CLASSES:
        allowed = ", ".join(f"torch.optim.{c.__name__}" for c in STREAMABLE_CLASSES)
        raise ValueError(
            f"stream_share={share} streams the host state through a fused CUDA kernel of "
            f"cpu_optimizer_cls, which must then be one of {allowed}; got "
            f"{cpu_optimizer_cls.__module__}.{cpu_optimizer_cls.__qualname__} "
            "(or set stream_share=0.0)"
        )
    return share


def mark_streamed(host_entries: Sequence[Entry], share: float) -> list[Entry]:
    """Mark the first ``share`` of the offloaded elements, in stepping order, as streamed.

    Walking ``host_entries`` in order, an offloaded contiguous CUDA parameter whose host
    copy is fp32 (a fp32 parameter, or a fp32 master) is streamed while the streamed
    elements are below ``share`` of all offloaded elements (the rule of
    ``offload_fraction``); the others stay with the host. The first ones in stepping
    order are the ones the next forward reads first: the stream lane starts at once (the
    gradients are on the device), the host lane only once its first gradient has
    crossed. A streamed entry's host copy is pinned (its copies are asynchronous); it
    gets none of the host lane's copy buffers (``EntryFactory.add_copy_buffers`` runs
    after this, for the others).

    Returns:
        The streamed entries.

    Raises:
        ValueError: If ``share`` is positive and offloaded parameters exist but none can
            be streamed.
    """
    offloaded = [e for e in host_entries if e.offloaded]
    for entry in host_entries:
        entry.streamed = False
    if share <= 0.0 or not offloaded:
        return []
    eligible = [
        e
        for e in offloaded
        if e.param.is_cuda and e.param.is_contiguous() and e.inner.dtype == torch.float32
    ]
    if not eligible:
        dtypes = sorted({str(e.inner.dtype) for e in offloaded})
        raise ValueError(
            f"stream_share={share} streams the fp32 state of offloaded CUDA parameters "
            "through their GPU, but no offloaded parameter is a contiguous CUDA tensor "
            f"with a fp32 host copy (host copies: {', '.join(dtypes)}; lower-precision "
            "parameters need param_update_in_fp32=True); set stream_share=0.0"
        )
    target = share * sum(e.param.numel() for e in offloaded)
    streamed: list[Entry] = []
    count = 0
    for entry in eligible:
        if count >= target:
            break
        entry.streamed = True
        if not entry.inner.is_pinned():
            # Before any sub-optimizer holds it: make_sub and install_state come after.
            entry.inner = entry.inner.pin_memory()
        streamed.append(entry)
        count += entry.param.numel()
    return streamed


@dataclass(eq=False)
class _Slot:
    """Device buffers of one chunk: master, fp32 gradient and one per moment."""

    master: torch.Tensor
    grad: torch.Tensor
    moments: dict[str, torch.Tensor]
    free: torch.cuda.Event | None = None
    # per chunk length: an optimizer over views of this slot, and its step count
    proxies: dict[int, tuple[torch.optim.Optimizer, torch.Tensor]] = field(default_factory=dict)


class StateStream:
    """The stream lane of one HybridDeviceOptimizer (NOTE [Streaming host state ...]).

    Args:
        optimizer_cls: The host optimizer class (one of :data:`STREAMABLE_CLASSES`).
        device: The CUDA device of the streamed parameters.
    """

    def __init__(self, optimizer_cls: type[torch.optim.Optimizer], device: torch.device) -> None:
        self.optimizer_cls = optimizer_cls
        self.device = device
        self.copy_in = torch.cuda.Stream(device)
        self.compute = torch.cuda.Stream(device)
        self.copy_out = torch.cuda.Stream(device)
        #: The last ``copy_out`` event: the host state is whole once it has passed.
        self.state_ready: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Block the host until the streamed state is back in host memory."""
        if self.state_ready is not None:
            self.state_ready.synchronize()
            self.state_ready = None

    def queue(self, subs: Sequence[Sub], before_step: torch.cuda.Event) -> int:
        """Queue the step of every streamed entry of ``subs``; return the elements queued.

        Each entry with a gradient gets ``h2d_event`` (its parameter holds the new value
        from there on) and has its parameter version noted.
        """
        for sub in subs:
            for entry in sub.entries:
                entry.h2d_event = None
        work = [
            (sub, group, entry)
            for sub in subs
            for group, entry in _entries_with_groups(sub)
            if entry.param.grad is not None
        ]
        if not work:
            return 0
        self.compute.wait_event(before_step)
        if self.state_ready is not None:
            # The last step's state must be back on the host before it is read again.
            self.copy_in.wait_event(self.state_ready)
        slots = self._slots(work)
        try:
            return self._queue_work(work, slots)
        finally:
            # Also after a failure part-way: what was queued is waited for by readers.
            self.state_ready = self.copy_out.record_event()
            for slot in slots:
                for buf in (slot.master, slot.grad, *slot.moments.values()):
                    # Freed when the last stream that uses it is done with it.
                    buf.record_stream(self.compute)
                    buf.record_stream(self.copy_out)

    def _queue_work(
        self, work: Sequence[tuple[Sub, dict[str, Any], Entry]], slots: list[_Slot]
    ) -> int:
        index = 0
        numel = 0
        for sub, group, entry in work:
            state = self._host_state(sub.optimizer, group, entry)
            keys = [k for k in slots[0].moments if k in state]
            step = float(state["step"])
            grad = entry.param.grad
            assert grad is not None
            grad.record_stream(self.compute)
            if not grad.is_contiguous():
                # On compute, after everything before step(): on the caller's stream the
                # copy would come after the point compute waits for.
                with torch.cuda.stream(self.compute):
                    grad = grad.contiguous()
            flat = {
                "param": entry.param.detach().view(-1),
                "grad": grad.detach().view(-1),
                "master": entry.inner.view(-1),
                **{k: state[k].view(-1) for k in keys},
            }
            total = entry.param.numel()
            for start in range(0, total, CHUNK_NUMEL):
                n = min(CHUNK_NUMEL, total - start)
                self._chunk(slots[index % RING], flat, keys, start, n, group, step)
                index += 1
            entry.h2d_event = self.compute.record_event()
            entry.note_param_written()
            state["step"].fill_(step + 1)
            numel += total
        return numel

    # ------------------------------------------------------------------ pieces

    def _slots(self, work: Sequence[tuple[Sub, dict[str, Any], Entry]]) -> list[_Slot]:
        longest = min(CHUNK_NUMEL, max(e.param.numel() for _, _, e in work))
        amsgrad = any(group.get("amsgrad", False) for _, group, _ in work)
        names = MOMENTS if amsgrad else MOMENTS[:2]
        # On the stream that writes them first: an allocation may queue work of its own
        # (deterministic mode fills new memory with NaN), which must come before the
        # first copy into the slot.
        with torch.cuda.stream(self.copy_in):
            return [
                _Slot(
                    master=torch.empty(longest, dtype=torch.float32, device=self.device),
                    grad=torch.empty(longest, dtype=torch.float32, device=self.device),
                    moments={
                        k: torch.empty(longest, dtype=torch.float32, device=self.device)
                        for k in names
                    },
                )
                for _ in range(RING)
            ]

    def _host_state(
        self, optimizer: torch.optim.Optimizer, group: dict[str, Any], entry: Entry
    ) -> dict[str, Any]:
        """The entry's host state, created as the host optimizer would, in pinned memory.

        Raises:
            RuntimeError: If the group asks for ``amsgrad`` but the state (made without
                it) has no ``max_exp_avg_sq``, as Adam itself would fail.
        """
        state = optimizer.state[entry.inner]
        names = list(MOMENTS if group["amsgrad"] else MOMENTS[:2])
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for name in names:
                state[name] = torch.zeros(entry.inner.shape, dtype=torch.float32, pin_memory=True)
        missing = [name for name in names if name not in state]
        if missing:
            raise RuntimeError(
                f"the optimizer state of a parameter of shape {tuple(entry.inner.shape)} has "
                f"no {', '.join(missing)}: amsgrad was turned on after its state was made"
            )
        for name in names:
            if not state[name].is_pinned():
                # Copies from pageable memory would be synchronous: pin once (a state
                # dict loaded from a checkpoint brings pageable tensors).
                state[name] = state[name].pin_memory()
        return state

    def _proxy(self, slot: _Slot, n: int, group: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        cached = slot.proxies.get(n)
        if cached is None:
            param = slot.master[:n]
            param.grad = slot.grad[:n]
            cls: Any = self.optimizer_cls  # Adam or AdamW: both take ``fused``
            proxy = cls([param], fused=True)
            step = torch.zeros((), dtype=torch.float32, device=self.device)
            proxy.state[param] = {"step": step, **{k: v[:n] for k, v in slot.moments.items()}}
            cached = slot.proxies[n] = (proxy, step)
        proxy, step = cached
        hyper = proxy.param_groups[0]
        for key, value in group.items():
            if key not in IMPLEMENTATION_KEYS:
                hyper[key] = value
        return proxy, step

    def _chunk(
        self,
        slot: _Slot,
        flat: dict[str, torch.Tensor],
        keys: list[str],
        start: int,
        n: int,
        group: dict[str, Any],
        step: float,
    ) -> None:
        end = start + n
        with torch.cuda.stream(self.copy_in):
            if slot.free is not None:
                self.copy_in.wait_event(slot.free)
            slot.master[:n].copy_(flat["master"][start:end], non_blocking=True)
            for key in keys:
                slot.moments[key][:n].copy_(flat[key][start:end], non_blocking=True)
            copied_in = self.copy_in.record_event()
        with torch.cuda.stream(self.compute):
            # Everything the lane allocates or fills on the device is on its own stream:
            # on the caller's, it would race with the lane (and its memory be reused).
            proxy, step_count = self._proxy(slot, n, group)
            self.compute.wait_event(copied_in)
            slot.grad[:n].copy_(flat["grad"][start:end])
            step_count.fill_(step)
            proxy.step()
            flat["param"][start:end].copy_(slot.master[:n])
            stepped = self.compute.record_event()
        with torch.cuda.stream(self.copy_out):
            self.copy_out.wait_event(stepped)
            flat["master"][start:end].copy_(slot.master[:n], non_blocking=True)
            for key in keys:
                flat[key][start:end].copy_(slot.moments[key][:n], non_blocking=True)
            slot.free = self.copy_out.record_event()


def _entries_with_groups(sub: Sub) -> list[tuple[dict[str, Any], Entry]]:
    by_inner = {id(e.inner): e for e in sub.entries}
    return [
        (group, by_inner[id(p)])
        for group in sub.optimizer.param_groups
        for p in group["params"]
        if id(p) in by_inner
    ]
