"""Hooks that time each layer of a training step, and count what it saves.

A probed step gives, per layer, the forward and backward time on the clock of the
device (CUDA events, or the wall clock on the CPU) and on the host's wall clock
(``time.perf_counter`` in the hooks: how long the host took to get through the layer's
Python, autograd and kernel launches, from the previous layer's end: NOTE [A layer's host
time runs from the previous layer's end]). Where the host bounds a step, the two agree; to
see the device's own time there, a probed step may first hold the compute stream back
(``torch.cuda._sleep``) before each layer, so that the host has enqueued the whole layer
before the stream reaches it (NOTE [Device time under a host-bound step]).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from .._compat import in_backward
from .._hold import cycles_per_ms
from ..compare._profile import SavedLog, saved_bytes
from ..engine.selection import ActivationPolicy

__all__ = [
    "Clock",
    "Probe",
    "StepTimes",
    "host_probe_ms",
    "median_times",
    "plain_step_ms",
    "probed",
    "scaled_times",
    "sleep_cycles",
    "timed_step",
]

_T = TypeVar("_T")

# NOTE [Memory peaks in a step of their own]
# A layer's temporary memory (the peak of its forward above what it leaves allocated, of
# its backward above what is allocated when it starts) and the head's are measured in a
# step that counts no saved tensors. The step that counts them runs every layer under
# saved-tensor hooks of ours, and in its backward the peaks came out higher than in a
# step without them: on Megatron-Core's GPT at h 2048 (workload D) 1,552 MiB a layer
# against 1,120 MiB, with the forward's 576 in both. The step's peak, and with it every
# plan's modelled peak, was then 0.45 GB above the measured one. Hooks that only read
# the allocator's counters leave the step's memory as training has it.

# NOTE [Device time under a host-bound step]
# CUDA events recorded around a layer measure when the stream reached them. If the host
# enqueues the layer's kernels more slowly than the GPU runs them, the stream waits for
# the host between kernels and the events measure the host. A probe that queues a
# ``torch.cuda._sleep`` of about the layer's host time (and a margin) just before the
# layer's start event lets the host enqueue the whole layer while the stream sleeps: the
# events then measure the kernels back to back, the device's time alone. The host never
# waits for the device in the step (no synchronization), so its time is measured in a
# step without the sleeps.


# NOTE [The probe's own host time]
# What the probe does in a layer's hooks lies inside the host time it measures for the
# layer. Recording a CUDA event is most of it: on an H100 host, layers that do nothing but
# return a view took 9.6 us each on the host without a probe, 57.5 us more with the
# probe's two events a layer, and 15.6 us more with the probe on the host's clock alone
# (5.3, 30.7 and 9.4 in a later run on a faster host; benchmarks/probe_cost.py). Where a
# layer's host time is close to its device time (compare's model: 0.6 against 0.73 ms),
# 50 us a layer reads as host time the step does not have. The profile's rounds, of which
# only the host's times are read, therefore run on the host's clock (``Clock(cuda,
# events=False)``): they synchronize before and after the step as the device's clock
# does, and record no event. The device's own times come from steps of their own (NOTE
# [Device time under a host-bound step]).


# NOTE [A layer's host time runs from the previous layer's end]
# A layer's forward on the host is timed from the end of the previous layer's forward
# (its forward hook) to the end of its own, not from its own forward pre-hook. The hooks
# run inside nn.Module.__call__, and what a layer costs the host around that call falls
# between them: the glue of the model's loop, and for a layer whose class defines its own
# __call__ (Megatron-Core's TransformerLayer, transformers' decoder layers), everything
# the package does for it, since such a layer is wrapped around its __call__ (NOTE
# [Layers that checkpoint themselves] in cpu_offload._layer_wrap): the recomputed layer's
# checkpoint, the offloaded layer's engine. On an H100 host, recomputing every layer of
# Megatron-Core's GPT (12 layers, h 1024) added 3.1 to 3.8 ms between the hooks of the
# step's forward (0.5 with every layer kept) and a transformers Llama 4.2 to 4.8 ms (0.3):
# about half of what recomputation adds to the forward, which pre-hook-to-hook times left
# out. The first layer's start stays its pre-hook, and the last layer's end its forward
# hook: what the package does for the first layer before the hook lies in the step's lead
# (``StepTimes.host_lead_ms``, from the step's start), which the totals of what a choice
# adds count (:func:`._rounds.extra` with ``lead=True``); what it does for the last layer
# after the hook lies in the head, which the model takes from steps with every layer
# kept, and is left out. What a layer runs by itself (a recomputation, the stream held
# for it) is timed from its own pre-hook (``host_forward_own``). The backward is timed
# from one layer's backward hook to the next already.


class Clock:
    """Timestamps on the compute stream (CUDA events) or the wall clock.

    Args:
        cuda: The step runs on CUDA: a timed step synchronizes before and after it.
        events: On CUDA, time on the stream with events; False: on the wall clock, for
            steps of which only the host's times are read (NOTE [The probe's own host
            time]).
    """

    def __init__(self, cuda: bool, events: bool = True) -> None:
        self.cuda = cuda
        self.events = cuda and events

    def now(self) -> object:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: object, end: object) -> float:
        if self.events:
            return float(start.elapsed_time(end))  # type: ignore[attr-defined]
        return (end - start) * 1e3  # type: ignore[operator]


def _first_tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return _first_tensor(list(value.values()))
    to_tuple = getattr(value, "to_tuple", None)  # Hugging Face ModelOutput
    return _first_tensor(to_tuple()) if callable(to_tuple) else None


class Probe:
    """Hooks on every layer: timestamps, and optionally saved tensors and memory peaks.

    Args:
        layers: The layers, in forward order.
        clock: The device's clock.
        policy: When given, count the bytes each layer saves.
        sleep: Per layer, GPU cycles to hold the stream back before the layer's forward
            and backward (NOTE [Device time under a host-bound step]); None for none.
        memory: Measure (on CUDA) each layer's temporary memory and the head's, in a
            step that counts no saved tensors (NOTE [Memory peaks in a step of their own]).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        clock: Clock,
        policy: ActivationPolicy | None = None,
        sleep: Sequence[int] | None = None,
        memory: bool = False,
    ) -> None:
        if memory and policy is not None:
            raise ValueError(
                "Probe: count saved tensors (policy) or measure memory peaks (memory), "
                "not both in one step (NOTE [Memory peaks in a step of their own])"
            )
        self.layers = layers
        self.clock = clock
        self.policy = policy
        self.sleep = sleep
        self.capture = policy is not None
        self.memory = memory and clock.cuda
        n = len(layers)
        self.fwd: list[list[object]] = [[] for _ in layers]  # start, end
        self.bwd: list[list[object]] = [[] for _ in layers]  # start, end
        self.host_fwd: list[list[float]] = [[] for _ in layers]
        #: Each layer's forward pre-hook on the host's clock.
        self.host_pre: list[float] = [0.0] * n
        #: When the step began on the host's clock (set by :func:`timed_step`).
        self.host_start = 0.0
        self.host_bwd: list[list[float]] = [[] for _ in layers]
        self.saved = [SavedLog() for _ in layers]
        #: (distinct bytes saved, bytes the engine would move, bytes it would release
        #: without moving them) per layer.
        self.saved_bytes = [(0, 0, 0)] * n
        self.input_bytes = [0] * n
        self.workspace = [0] * n
        #: Peak memory of the head and loss above what the layers hold (GPU only).
        self.head_bytes = 0
        self._head_from: int | None = None
        #: When the head began (the last layer's forward ended) and ended (its backward
        #: began), on the device's clock and the host's.
        self.head: list[object] = []
        self.host_head: list[float] = []
        self._saving: Any = None
        self._mem_at = 0
        self._bwd_open: int | None = None
        #: The last layer whose forward ended in this forward, and when (host's clock).
        self._ended: tuple[int, float] | None = None
        self.handles: list[Any] = []
        for j, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(j), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post(j), with_kwargs=True))

    def _hold(self, j: int) -> None:
        if self.sleep is not None and self.sleep[j] > 0:
            torch.cuda._sleep(self.sleep[j])

    def _memory_mark(self) -> int:
        if not self.memory:
            return 0
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    @staticmethod
    def _counts() -> bool:
        # A recomputation inside backward runs the layer again: not the step's forward.
        return torch.is_grad_enabled() and not in_backward()

    def _pre(self, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._counts():
                return
            now = time.perf_counter()
            # From the previous layer's end (NOTE [A layer's host time runs from the
            # previous layer's end]).
            ended = self._ended
            self.host_fwd[j] = [ended[1] if ended is not None and ended[0] == j - 1 else now]
            self.host_pre[j] = now
            self._hold(j)
            self.fwd[j] = [self.clock.now()]
            x = _first_tensor(args)
            x = x if x is not None else _first_tensor(kwargs)
            self.input_bytes[j] = 0 if x is None else x.numel() * x.element_size()
            self._mem_at = self._memory_mark()
            if self.capture:
                self.saved[j] = SavedLog()
                self._saving = torch.autograd.graph.saved_tensors_hooks(self.saved[j], lambda t: t)
                self._saving.__enter__()

        return hook

    def _post(self, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
            if not self._counts():
                return
            if self._saving is not None:
                self._saving.__exit__(None, None, None)
                self._saving = None
                # Counted now and let go: backward frees them as it would without us.
                assert self.policy is not None
                self.saved_bytes[j] = saved_bytes(self.saved[j], self.policy)
                self.saved[j] = SavedLog()
            if self.memory:
                # What the forward held at its peak beyond what it left allocated.
                peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
                self.workspace[j] = max(self.workspace[j], peak)
            if j == len(self.layers) - 1 and self.memory:
                self._head_from = self._memory_mark()
            self.fwd[j].append(self.clock.now())
            now = time.perf_counter()
            self.host_fwd[j].append(now)
            self._ended = (j, now)
            if j == len(self.layers) - 1:
                self.head, self.host_head = [self.fwd[j][1]], [self.host_fwd[j][1]]
            y = _first_tensor(out)
            if y is not None and y.grad_fn is not None:
                y.grad_fn.register_prehook(self._backward(j))

        return hook

    def _backward(self, j: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            if self._head_from is not None:
                # The last layer's backward begins: the head and the loss are done.
                self.head_bytes = torch.cuda.max_memory_allocated() - self._head_from
                self._head_from = None
            now = time.perf_counter()
            self.close_backward(now)
            if j == len(self.layers) - 1:
                self.head.append(self.clock.now())
                self.host_head.append(now)
            self.host_bwd[j] = [now]
            self._hold(j)
            self.bwd[j] = [self.clock.now()]
            self._bwd_open = j
            self._mem_at = self._memory_mark()

        return hook

    def close_backward(self, host_now: float) -> None:
        """End the backward of the layer whose backward runs now (at the next, or the end)."""
        j = self._bwd_open
        if j is None:
            return
        self.bwd[j].append(self.clock.now())
        self.host_bwd[j].append(host_now)
        if self.memory:
            peak = torch.cuda.max_memory_allocated() - self._mem_at
            self.workspace[j] = max(self.workspace[j], peak)
        self._bwd_open = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class StepTimes:
    """Per-layer times (ms) of one probed step, on the device's clock and the host's."""

    def __init__(self, probe: Probe, step_ms: float) -> None:
        clock = probe.clock
        self.step_ms = step_ms
        self.forward = [clock.ms(f[0], f[1]) for f in probe.fwd]
        self.backward = [clock.ms(b[0], b[1]) for b in probe.bwd]
        self.host_forward = [(h[1] - h[0]) * 1e3 for h in probe.host_fwd]
        #: Each layer's forward from its own pre-hook: the layer alone, without the host
        #: time before it (what a recomputation runs again, what the stream is held for).
        self.host_forward_own = [
            (h[1] - pre) * 1e3 for h, pre in zip(probe.host_fwd, probe.host_pre, strict=True)
        ]
        #: From the step's start to the first layer's forward: the model's own work before
        #: it, and the package's for the first layer where it runs outside the hooks.
        self.host_lead_ms = (probe.host_fwd[0][0] - probe.host_start) * 1e3
        self.host_backward = [(h[1] - h[0]) * 1e3 for h in probe.host_bwd]
        #: From the end of the last layer's forward to the start of its backward.
        self.head_ms = clock.ms(probe.head[0], probe.head[1])
        self.host_head_ms = (probe.host_head[1] - probe.host_head[0]) * 1e3


def timed_step(
    layers: Sequence[nn.Module],
    step: Callable[[], torch.Tensor],
    clock: Clock,
    policy: ActivationPolicy | None = None,
    sleep: Sequence[int] | None = None,
    memory: bool = False,
) -> tuple[Probe, StepTimes]:
    """One forward and backward under a :class:`Probe`: the probe and its times.

    Raises:
        TypeError: If the step does not return a tensor.
        ValueError: If the step did not run every layer's forward and backward once.
    """
    probe = Probe(layers, clock, policy, sleep, memory)
    try:
        if clock.cuda:
            torch.cuda.synchronize()
        start = clock.now()
        probe.host_start = time.perf_counter()
        loss = step()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                "profile_model: step() must run the model's forward and return the loss "
                f"as a tensor, got {type(loss).__name__}"
            )
        loss.backward()
        probe.close_backward(time.perf_counter())
        end = clock.now()
        if clock.cuda:
            torch.cuda.synchronize()
    finally:
        probe.remove()
    if (
        any(len(f) != 2 for f in probe.fwd)
        or any(len(b) != 2 for b in probe.bwd)
        or len(probe.head) != 2
    ):
        raise ValueError(
            "profile_model: the step did not run every layer's forward and backward once "
            "with grad enabled (step() must run the model's forward and return the loss)"
        )
    return probe, StepTimes(probe, clock.ms(start, end))


def median_times(runs: Sequence[StepTimes], field: str) -> list[float]:
    """The per-layer median of ``field`` over ``runs``."""
    columns = zip(*(getattr(r, field) for r in runs), strict=True)
    return [statistics.median(c) for c in columns]


def scaled_times(
    fwd: list[float], bwd: list[float], probed_ms: float, plain_ms: float
) -> tuple[list[float], list[float], float]:
    """Per-layer times scaled so that they and the rest of the step add up to ``plain_ms``.

    The hooks that time each layer add host time; where the host bounds the step, that
    lengthens the layers' times. Scaling them by ``plain_ms / probed_ms`` keeps their
    proportions and makes the model of keeping every layer the step measured without
    hooks.

    Returns:
        ``(forward ms, backward ms, other ms)``.

    Example:
        >>> scaled_times([2.0], [4.0], 10.0, 5.0)
        ([1.0], [2.0], 2.0)
    """
    scale = plain_ms / probed_ms if probed_ms > 0 else 1.0
    fwd = [f * scale for f in fwd]
    bwd = [b * scale for b in bwd]
    return fwd, bwd, max(plain_ms - sum(fwd) - sum(bwd), 0.0)


def plain_step_ms(step: Callable[[], torch.Tensor], clock: Clock, steps: int) -> float:
    """Median time of ``steps`` forward and backward passes, with no hooks of ours."""
    times = []
    for _ in range(steps):
        if clock.cuda:
            torch.cuda.synchronize()
        start = clock.now()
        step().backward()
        end = clock.now()
        if clock.cuda:
            torch.cuda.synchronize()
        times.append(clock.ms(start, end))
    return statistics.median(times)


def run_for(step: Callable[[], torch.Tensor], clock: Clock, seconds: float) -> None:
    """Untimed plain steps back to back until ``seconds`` have passed (none for 0)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        plain_step_ms(step, clock, 1)


def host_probe_ms(ops: int = 2000) -> float:
    """Time (ms) of a fixed piece of the host's work: ``ops`` additions of a tiny CPU
    tensor, through Python and PyTorch's dispatcher as a step's launches go, with no
    device work to wait for. A slow phase of the host stretches it as it stretches the
    host's part of a step (NOTE [The host's pace])."""
    value = torch.zeros(2)
    start = time.perf_counter()
    for _ in range(ops):
        value = value + 1.0
    return (time.perf_counter() - start) * 1e3


def probed(work: Callable[[], _T]) -> tuple[_T, float]:
    """Run ``work()``; its result, and the slower of :func:`host_probe_ms` just before
    and just after it: how fast the host ran while it did (NOTE [The host's pace])."""
    before = host_probe_ms()
    result = work()
    return result, max(before, host_probe_ms())


def sleep_cycles(host_ms: Sequence[float], margin_ms: float = 0.5) -> list[int]:
    """GPU cycles that hold the stream back longer than the host takes, per layer.

    Args:
        host_ms: Each layer's host time, ms.
        margin_ms: Added to one and a half times each layer's host time.

    Returns:
        Cycles of ``torch.cuda._sleep`` per layer, at the device's rate now.
    """
    per_ms = cycles_per_ms()
    return [int((1.5 * h + margin_ms) * per_ms) for h in host_ms]
