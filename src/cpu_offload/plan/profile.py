"""Measuring what the planner needs, in one short run of the user's own training step.

Hooks on the layers record, per layer: forward and backward time (CUDA events on a GPU,
the wall clock on the CPU), the bytes autograd saves (distinct storages, parameters
excluded) and the part of them the engine would offload (its own selection policy and
tensor grouping, at the same threshold), the layer's input, the temporary memory of its
forward and backward, and that of the output head and loss (GPU only). Steps without
hooks, keeping every layer and recomputing every layer, give the step time the hooks'
per-layer times are scaled to, and the total cost of recomputation, shared out by
forward time. The link is measured with pinned copies on streams (on the CPU stand-in:
copies between host tensors).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .._layer_stack import find_layers
from ..compare._profile import saved_bytes
from ..engine.selection import ActivationPolicy
from ..v2.context import DEFAULT_MIN_TENSOR_SIZE
from .model import LayerCost, Link, Profile

__all__ = ["measure_choices", "measure_host_link", "profile_model"]


class _Clock:
    """Timestamps on the compute stream (CUDA events) or the wall clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def now(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: object, end: object) -> float:
        if self.cuda:
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


class _Probe:
    """Hooks on every layer: timestamps, and optionally saved tensors and memory peaks."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        clock: _Clock,
        policy: ActivationPolicy | None = None,
    ) -> None:
        self.layers = layers
        self.clock = clock
        self.policy = policy
        self.capture = policy is not None
        self.fwd: list[list[object]] = [[] for _ in layers]  # start, end
        self.bwd_start: list[object | None] = [None] * len(layers)
        self.saved: list[list[torch.Tensor]] = [[] for _ in layers]
        #: (distinct bytes saved, bytes the engine would offload) per layer.
        self.saved_bytes = [(0, 0)] * len(layers)
        self.input_bytes = [0] * len(layers)
        self.workspace = [0] * len(layers)
        #: Peak memory of the head and loss above what the layers hold (GPU only).
        self.head_bytes = 0
        self._head_from: int | None = None
        self._saving: Any = None
        self._mem_at = 0
        self._bwd_open: int | None = None
        self.handles: list[Any] = []
        for j, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(j), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post(j), with_kwargs=True))

    def _memory_mark(self) -> int:
        if not (self.capture and self.clock.cuda):
            return 0
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def _pre(self, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not torch.is_grad_enabled():
                return
            self.fwd[j] = [self.clock.now()]
            x = _first_tensor(args)
            x = x if x is not None else _first_tensor(kwargs)
            self.input_bytes[j] = 0 if x is None else x.numel() * x.element_size()
            self._mem_at = self._memory_mark()
            if self.capture:
                into = self.saved[j]

                def pack(t: torch.Tensor) -> torch.Tensor:
                    into.append(t)
                    return t

                self._saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                self._saving.__enter__()

        return hook

    def _post(self, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
            if not torch.is_grad_enabled():
                return
            if self._saving is not None:
                self._saving.__exit__(None, None, None)
                self._saving = None
                # Counted now and let go: backward frees them as it would without us.
                assert self.policy is not None
                self.saved_bytes[j] = saved_bytes(self.saved[j], self.policy)
                self.saved[j] = []
            if self.capture and self.clock.cuda:
                # What the forward held at its peak beyond what it left allocated.
                peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
                self.workspace[j] = max(self.workspace[j], peak)
            if j == len(self.layers) - 1 and self.capture and self.clock.cuda:
                self._head_from = self._memory_mark()
            self.fwd[j].append(self.clock.now())
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
            self._close_backward()
            self.bwd_start[j] = self.clock.now()
            self._bwd_open = j
            self._mem_at = self._memory_mark()

        return hook

    def _close_backward(self) -> None:
        if self._bwd_open is not None and self.capture and self.clock.cuda:
            peak = torch.cuda.max_memory_allocated() - self._mem_at
            self.workspace[self._bwd_open] = max(self.workspace[self._bwd_open], peak)
        self._bwd_open = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _timed_step(
    layers: Sequence[nn.Module],
    step: Callable[[], torch.Tensor],
    clock: _Clock,
    policy: ActivationPolicy | None = None,
) -> tuple[_Probe, float, list[float], list[float]]:
    """One forward and backward: the probe, step ms, forward ms and backward ms per layer.

    With a ``policy`` the probe also counts saved bytes and (on CUDA) memory peaks.
    """
    probe = _Probe(layers, clock, policy)
    try:
        if clock.cuda:
            torch.cuda.synchronize()
        start = clock.now()
        loss = step()
        loss.backward()
        probe._close_backward()
        end = clock.now()
        if clock.cuda:
            torch.cuda.synchronize()
    finally:
        probe.remove()
    n = len(layers)
    if any(len(f) != 2 for f in probe.fwd) or any(b is None for b in probe.bwd_start):
        raise ValueError(
            "profile_model: the step did not run every layer's forward and backward once "
            "with grad enabled (step() must run the model's forward and return the loss)"
        )
    fwd = [clock.ms(f[0], f[1]) for f in probe.fwd]
    # Layer j's backward ends where layer j-1's starts; layer 0's with the step.
    ends = [probe.bwd_start[j - 1] if j > 0 else end for j in range(n)]
    bwd = [clock.ms(probe.bwd_start[j], ends[j]) for j in range(n)]
    return probe, clock.ms(start, end), fwd, bwd


def _scaled_times(
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
        >>> _scaled_times([2.0], [4.0], 10.0, 5.0)
        ([1.0], [2.0], 2.0)
    """
    scale = plain_ms / probed_ms if probed_ms > 0 else 1.0
    fwd = [f * scale for f in fwd]
    bwd = [b * scale for b in bwd]
    return fwd, bwd, max(plain_ms - sum(fwd) - sum(bwd), 0.0)


def _plain_step_ms(step: Callable[[], torch.Tensor], clock: _Clock, steps: int) -> float:
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


def _with_grads(
    model_or_layers: nn.Module | Iterable[nn.Module], layers: Sequence[nn.Module]
) -> list[nn.Parameter]:
    """The trainable parameters, each given a zero gradient if it has none.

    Gradients then exist when a step starts, as in steady training, so that they count
    as static memory and not as the step's.
    """
    modules = [model_or_layers] if isinstance(model_or_layers, nn.Module) else layers
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return params


def measure_host_link(nbytes: int = 16 << 20, repeats: int = 3) -> Link:
    """The CPU stand-in's link: copies between host tensors, each way and both at once.

    Args:
        nbytes: Bytes per copy.
        repeats: Copies timed (the median is kept).

    Returns:
        The link (one stream: the stand-in copies in order).

    Example:
        >>> measure_host_link(1 << 20, 1).d2h_gbps > 0
        True
    """
    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    c, d = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

    def timed(fn: Callable[[], object], moved: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return moved / max(statistics.median(times), 1e-9) / 1e9

    def both() -> None:
        worker = threading.Thread(target=lambda: d.copy_(c))
        worker.start()
        b.copy_(a)
        worker.join()

    return Link(
        d2h_gbps=timed(lambda: b.copy_(a), nbytes),
        h2d_gbps=timed(lambda: a.copy_(b), nbytes),
        duplex_gbps=timed(both, 2 * nbytes),
    )


def _cuda_link() -> Link:
    from ..compare.runner import measure_link

    d2h, h2d, both = measure_link()
    # offload_layers' transport copies both directions on one stream.
    return Link(d2h, h2d, both, two_streams=False)


def profile_model(
    model_or_layers: nn.Module | Iterable[nn.Module],
    step: Callable[[], torch.Tensor],
    *,
    steps: int = 3,
    warmup: int = 1,
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE,
    recompute: bool = True,
    link: Link | None = None,
) -> Profile:
    """Measure the layers of a model in a few training steps, for the planner.

    ``step()`` runs the model's forward and returns the loss; this function runs its
    backward. Parameters get zeroed gradients before the measured steps, so that the
    static memory (parameters, gradients, the batch) is allocated when each step begins,
    as it is in steady training.

    Args:
        model_or_layers: A model whose layer stack :func:`cpu_offload.offload_layers`
            finds, or the layers themselves.
        step: Runs the forward and returns a scalar loss.
        steps: Timed steps (medians are kept).
        warmup: Untimed steps first.
        min_tensor_size_to_offload: The engine's threshold, in elements.
        recompute: Also time a run with every layer recomputed (else recomputation is
            taken to cost one forward).
        link: The link's figures, if already known (measured otherwise).

    Returns:
        The profile.

    Raises:
        ValueError: If ``steps < 1`` or ``warmup < 0``, or a step does not run every
            layer once.

    Example:
        >>> layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        >>> x = torch.randn(512, 64)
        >>> profile = profile_model(layers, lambda: layers(x).square().mean(), steps=1)
        >>> profile.num_layers, profile.layers[1].input_bytes
        (3, 131072)
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    layers = find_layers(model_or_layers)
    params = _with_grads(model_or_layers, layers)
    device = params[0].device if params else torch.device("cpu")
    cuda = device.type == "cuda"
    clock = _Clock(cuda)
    for _ in range(warmup):
        _timed_step(layers, step, clock)
    runs = [_timed_step(layers, step, clock) for _ in range(steps)]
    fwd = [statistics.median(r[2][j] for r in runs) for j in range(len(layers))]
    bwd = [statistics.median(r[3][j] for r in runs) for j in range(len(layers))]
    # The hooks' own time is not the model's: scale the per-layer times to a step run
    # without them (see _scaled_times).
    plain_ms = _plain_step_ms(step, clock, steps)
    fwd, bwd, other_ms = _scaled_times(fwd, bwd, statistics.median(r[1] for r in runs), plain_ms)

    static = torch.cuda.memory_allocated() if cuda else 0
    # The engine's own selection at the same threshold: what offloading would move.
    policy = ActivationPolicy(min_tensor_size_to_offload, lambda t: t.device.type == device.type)
    probe, *_ = _timed_step(layers, step, clock, policy)
    saved = probe.saved_bytes

    rerun: list[float | None] = [None] * len(layers)
    if recompute:
        from ..layers import offload_layers

        with offload_layers(layers, offloaded=(), recomputed=range(len(layers))):
            _plain_step_ms(step, clock, 1)
            recompute_all_ms = _plain_step_ms(step, clock, steps)
        # Recomputation's cost measured as a whole (its per-layer share is too small to
        # time alone), shared out by forward time.
        extra = max(recompute_all_ms - plain_ms, 0.0)
        total_fwd = sum(fwd) or 1.0
        rerun = [extra * f / total_fwd for f in fwd]
    costs = tuple(
        LayerCost(
            forward_ms=fwd[j],
            backward_ms=bwd[j],
            saved_bytes=saved[j][0],
            offload_bytes=saved[j][1],
            input_bytes=probe.input_bytes[j],
            recompute_ms=rerun[j],
            workspace_bytes=probe.workspace[j],
        )
        for j in range(len(layers))
    )
    if link is None:
        link = _cuda_link() if cuda else measure_host_link()
    name = torch.cuda.get_device_name(device) if cuda else "cpu (CPU stand-in)"
    return Profile(
        costs,
        link,
        static_bytes=static,
        other_ms=other_ms,
        device=name,
        head_bytes=probe.head_bytes,
    )


def measure_choices(
    model_or_layers: nn.Module | Iterable[nn.Module],
    step: Callable[[], torch.Tensor],
    choices: Sequence[object],
    *,
    steps: int = 3,
    warmup: int = 1,
    **context_kwargs: Any,
) -> tuple[float, int | None]:
    """Run ``choices`` for a few steps: median step ms and peak device memory.

    Args:
        model_or_layers: The model or its layers.
        step: Runs the forward and returns the loss (its backward is run here).
        choices: Keep, offload or recompute per layer.
        steps: Timed steps.
        warmup: Untimed steps first.
        **context_kwargs: Passed to :func:`cpu_offload.offload_layers`.

    Returns:
        ``(step_ms, peak_bytes)``: the peak is ``torch.cuda.max_memory_allocated`` over
        the timed steps on CUDA (static memory included), None on the CPU.

    Raises:
        ValueError: On invalid choices (see :func:`cpu_offload.plan.model.check_choices`).

    Example:
        >>> layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        >>> x = torch.randn(512, 64)
        >>> ms, peak = measure_choices(layers, lambda: layers(x).sum(), ["recompute"] * 3)
        >>> peak is None
        True
    """
    from ..layers import offload_layers
    from .model import Choice, check_choices

    layers = find_layers(model_or_layers)
    plan = check_choices(choices, len(layers))
    offloaded = [j for j, c in enumerate(plan) if c is Choice.OFFLOAD]
    recomputed = [j for j, c in enumerate(plan) if c is Choice.RECOMPUTE]
    params = _with_grads(model_or_layers, layers)
    cuda = any(p.is_cuda for p in params)
    clock = _Clock(cuda)
    times = []
    with offload_layers(layers, offloaded=offloaded, recomputed=recomputed, **context_kwargs):
        for i in range(warmup + steps):
            if i == warmup and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if cuda:
                torch.cuda.synchronize()
            start = clock.now()
            step().backward()
            end = clock.now()
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(clock.ms(start, end))
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return statistics.median(times), peak
