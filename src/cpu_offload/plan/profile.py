"""Measuring what the planner needs, in one short run of the user's own training step.

Hooks on the layers (:mod:`._probe`) record, per layer: forward and backward time, the
bytes autograd saves (distinct storages, parameters excluded) and the part of them the
engine would offload (its own selection policy and tensor grouping, at the same
threshold), the layer's input, the temporary memory of its forward and backward, and
that of the output head and loss (GPU only). The link is measured with pinned copies on
streams (on the CPU stand-in: copies between host tensors).

Times are measured one of two ways (:mod:`._timing`):

* *Host and device apart* (the default on CUDA): the host's time per layer (hooks on the
  wall clock) and the device's (CUDA events, the stream held back until the host has
  enqueued the layer), for kept layers, for every layer recomputed, for half the layers
  offloaded, and, where layers save casts, for those layers kept with their casts
  rebuilt: what recomputing, offloading and rebuilding casts add on each side. The device's
  times are scaled to its pace in plain steps back to back, which a GPU at its power
  limit runs slower than steps after a pause, and, where the device bounds the
  recomputation, its cost to what plain steps with every layer recomputed take back to
  back (:mod:`._clock`).
* *Together* (the CPU stand-in, or ``host=False``): one time per layer, scaled to a step
  run without hooks; recomputation's cost from a step with every layer recomputed,
  shared out by forward time; offloading adds no compute time.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .._args import check_bool, check_count, check_min_tensor_size, check_seconds
from .._layer_stack import find_layers
from .._link import measure_link
from ..engine.selection import ActivationPolicy
from ..v2.context import DEFAULT_MIN_TENSOR_SIZE
from ._clock import parts_at_pace
from ._parts_probe import PartsSpec, check_parts_spec, with_parts
from ._probe import (
    Clock,
    plain_step_ms,
    run_for,
    timed_step,
)
from ._timing import HostAndDevice, Together
from .model import LayerCost, Link, Profile

__all__ = ["cast_ms_of", "measure_choices", "measure_host_link", "profile_model"]


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
    host: bool | None = None,
    parts: PartsSpec = False,
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
        host: Measure the host's time apart from the device's (:class:`HostCost` on
            every layer), with runs of every layer recomputed and of half the layers
            offloaded; None: on CUDA only. On the CPU stand-in both clocks are the wall
            clock, and what offloading adds includes its copies.
        parts: Also profile parts of each layer, so that a plan may keep, offload or
            recompute them on their own (``LayerCost.parts``): True chooses them (the
            layer's children that save anything, an attention block split into its
            projections and its core where the core saves most of its bytes), a list of
            submodule names names them for every layer, a dict per layer index.

    Returns:
        The profile.

    Raises:
        ValueError: If ``steps < 1``, ``warmup < 0`` or ``min_tensor_size_to_offload < 0``,
            a step does not run every layer once, or a part is not a submodule of its
            layer or lies inside another.
        TypeError: If ``host`` is not a bool or None, ``recompute`` not a bool, ``link``
            not a :class:`Link` or None, ``min_tensor_size_to_offload`` not an int,
            ``parts`` not one of the forms above, or ``step`` does not return a tensor.

    Example:
        >>> layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        >>> x = torch.randn(512, 64)
        >>> profile = profile_model(layers, lambda: layers(x).square().mean(), steps=1)
        >>> profile.num_layers, profile.layers[1].input_bytes
        (3, 131072)
    """
    check_count("steps", steps)
    check_count("warmup", warmup, least=0)
    if host is not None and not isinstance(host, bool):
        raise TypeError(f"host must be a bool or None, got {type(host).__name__}")
    check_min_tensor_size(min_tensor_size_to_offload)
    check_bool("recompute", recompute)
    if link is not None and not isinstance(link, Link):
        raise TypeError(
            f"link must be a Link (a profile's .link) or None to measure it, got "
            f"{type(link).__name__}"
        )
    layers = find_layers(model_or_layers)
    check_parts_spec(parts, layers)
    params = _with_grads(model_or_layers, layers)
    device = params[0].device if params else torch.device("cpu")
    cuda = device.type == "cuda"
    clock = Clock(cuda)
    for _ in range(warmup):
        timed_step(layers, step, clock)
    runs = [timed_step(layers, step, clock)[1] for _ in range(steps)]
    plain_ms = plain_step_ms(step, clock, steps)

    static = torch.cuda.memory_allocated() if cuda else 0
    # The engine's own selection at the same threshold: what offloading would move.
    policy = ActivationPolicy(min_tensor_size_to_offload, lambda t: t.device.type == device.type)
    probe, _ = timed_step(layers, step, clock, policy)
    # See NOTE [Memory peaks in a step of their own].
    peaks, _ = timed_step(layers, step, clock, memory=True)
    saved = probe.saved_bytes
    cast_ms = {b: cast_ms_of(b, device, clock) for b in {s[2] for s in saved}}
    costs = [
        LayerCost(
            forward_ms=0.0,
            backward_ms=0.0,
            saved_bytes=saved[j][0],
            offload_bytes=saved[j][1],
            recast_bytes=saved[j][2],
            recast_ms=cast_ms[saved[j][2]],
            input_bytes=probe.input_bytes[j],
            workspace_bytes=peaks.workspace[j],
        )
        for j in range(len(layers))
    ]
    if link is None:
        link = _cuda_link() if cuda else measure_host_link()
    profile = Profile(
        (),
        link,
        static_bytes=static,
        device=torch.cuda.get_device_name(device) if cuda else "cpu (CPU stand-in)",
        head_bytes=peaks.head_bytes,
    )
    timing = HostAndDevice if (cuda if host is None else host) else Together
    measured = timing(layers, step, clock, steps, runs, plain_ms, min_tensor_size_to_offload)
    profile = measured.profile(profile, costs, recompute)
    if parts is not False:
        profile = with_parts(profile, layers, step, clock, policy, parts, steps)
        if isinstance(measured, HostAndDevice):
            profile = parts_at_pace(profile, measured.pace_factor)
            profile = measured.part_host(profile)
    if isinstance(measured, HostAndDevice):
        profile = measured.at_steady_pace(profile)
    return profile


def cast_ms_of(nbytes: int, device: torch.device, clock: Clock, repeats: int = 5) -> float:
    """The device's time to cast ``nbytes`` of saved casts again in backward (NOTE [Casts
    rebuilt from their source] in ``cpu_offload/engine/recast.py``), timed as the cast
    attention saves: bf16 from fp32. The median of ``repeats`` after one untimed.

    Example:
        >>> from cpu_offload.plan._probe import Clock
        >>> cast_ms_of(0, torch.device("cpu"), Clock(False))
        0.0
        >>> cast_ms_of(1 << 20, torch.device("cpu"), Clock(False)) > 0
        True
    """
    if nbytes <= 0:
        return 0.0
    source = torch.empty(nbytes // 2, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):
        if clock.cuda:
            torch.cuda.synchronize()
        start = clock.now()
        source.to(torch.bfloat16)
        end = clock.now()
        if clock.cuda:
            torch.cuda.synchronize()
        times.append(clock.ms(start, end))
    return statistics.median(times[1:])


def measure_choices(
    model_or_layers: nn.Module | Iterable[nn.Module],
    step: Callable[[], torch.Tensor],
    choices: Sequence[object],
    *,
    steps: int = 3,
    warmup: int = 1,
    warmup_s: float = 0.0,
    **context_kwargs: Any,
) -> tuple[float, int | None]:
    """Run ``choices`` for a few steps: median step ms and peak device memory.

    Args:
        model_or_layers: The model or its layers.
        step: Runs the forward and returns the loss (its backward is run here).
        choices: Keep, offload or recompute per layer.
        steps: Timed steps.
        warmup: Untimed steps first.
        warmup_s: Then more untimed steps, back to back, until this many seconds have
            passed: a GPU at its power limit runs slower in steady training than right
            after a pause (NOTE [A GPU at its power limit] in ``plan/_clock.py``).
        **context_kwargs: Passed to :func:`cpu_offload.offload_layers`.

    Returns:
        ``(step_ms, peak_bytes)``: the peak is ``torch.cuda.max_memory_allocated`` over
        the timed steps on CUDA (static memory included), None on the CPU.

    Raises:
        ValueError: On invalid choices (see :func:`cpu_offload.plan.model.check_choices`),
            or ``warmup_s`` not a number >= 0.

    Example:
        >>> layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        >>> x = torch.randn(512, 64)
        >>> ms, peak = measure_choices(layers, lambda: layers(x).sum(), ["recompute"] * 3)
        >>> peak is None
        True
    """
    from ..layers import offload_layers
    from .costs import offload_layers_arguments
    from .model import check_choices

    check_seconds("warmup_s", warmup_s)
    layers = find_layers(model_or_layers)
    plan = check_choices(choices, len(layers))
    params = _with_grads(model_or_layers, layers)
    cuda = any(p.is_cuda for p in params)
    clock = Clock(cuda)
    with offload_layers(layers, **offload_layers_arguments(plan), **context_kwargs):
        for _ in range(warmup):
            plain_step_ms(step, clock, 1)
        run_for(step, clock, warmup_s)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = [plain_step_ms(step, clock, 1) for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return statistics.median(times), peak
