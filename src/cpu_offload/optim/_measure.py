"""Timing one optimizer configuration on a model (benchmark and comparison-tool entry)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple

import torch

from .._args import check_count
from ._hybrid import HybridDeviceOptimizer
from ._split import check_offload_fraction

__all__ = [
    "OptimizerMeasurement",
    "StateBytes",
    "measure_host_optimizer_throughput",
    "measure_optimizer",
    "optimizer_device_state_bytes",
    "optimizer_state_bytes",
]


@dataclass(frozen=True)
class OptimizerMeasurement:
    """Timings and memory of one optimizer configuration (medians over the timed steps).

    Attributes:
        offload_fraction: The fraction measured (0.0 is the no-offload baseline).
        overlap: ``overlap_cpu_optimizer_d2h_h2d``.
        param_copy_dtype: ``"param"`` or ``"master"``, as the optimizer resolved it (see
            HybridDeviceOptimizer).
        steps: Number of timed steps.
        step_ms: Wall time of a whole training step (forward, backward, ``step()``,
            ``zero_grad()``, device synchronized at the end).
        forward_backward_ms: Forward and backward on the current stream (CUDA events).
        optimizer_ms: ``step_ms - forward_backward_ms``: what the optimizer adds.
        host_step_ms: Time inside the host sub-optimizers' ``step()``.
        host_numel: Elements stepped on the host.
        device_state_bytes: Device bytes held by the optimizer (master copies and state).
        peak_allocated_bytes: Peak device memory allocated during the timed steps.
        early_copies_reused: Gradient copies started in backward and reused, per step.
        device: Name of the device.
        state_bytes_device_side: Optimizer state on the device side of the split, by
            :func:`optimizer_state_bytes` (on a GPU, equal to ``device_state_bytes``).
        state_bytes_host_side: Optimizer state on the host side of the split.
        losses: The loss of every step, warm-up steps included, in order.
    """

    offload_fraction: float
    overlap: bool
    param_copy_dtype: str
    steps: int
    step_ms: float
    forward_backward_ms: float
    optimizer_ms: float
    host_step_ms: float
    host_numel: int
    device_state_bytes: int
    peak_allocated_bytes: int
    early_copies_reused: float
    device: str
    state_bytes_device_side: int = 0
    state_bytes_host_side: int = 0
    losses: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def optimizer_device_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of non-CPU tensors an optimizer holds in its ``state`` (each storage once).

    For :class:`HybridDeviceOptimizer` this covers the device sub-optimizer's state and
    the fp32 master copies (``master_param``), i.e. what offloading removes from the GPU.

    Args:
        optimizer: Any optimizer.

    Returns:
        The byte count (0 when everything is on the host).

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(4))
        >>> optimizer_device_state_bytes(torch.optim.SGD([p], lr=0.1))
        0
    """
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                storage = value.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


class StateBytes(NamedTuple):
    """Bytes of optimizer state on each side of an optimizer's split.

    Attributes:
        device: State of parameters stepped on the device.
        host: State of parameters stepped on the host (offloaded or host parameters).
    """

    device: int
    host: int


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> StateBytes:
    """Bytes of an optimizer's ``state`` on the device and host sides, by its split.

    A state tensor (each storage counted once) is on the device side when its parameter
    is a device parameter that is not offloaded, and the tensor is on the parameter's
    device. For :class:`HybridDeviceOptimizer` "device parameter" is the optimizer's
    own notion, so a subclass that treats CPU tensors as device tensors (a CPU stand-in
    for tests and ``cpu-offload compare``) gets the bytes that would stay on a GPU. For
    other optimizers it is any parameter that is not on the CPU. On a GPU the device
    side equals :func:`optimizer_device_state_bytes`.

    Args:
        optimizer: Any optimizer.

    Returns:
        A :class:`StateBytes` ``(device, host)``.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(4))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.ones(4)
        >>> opt.step()
        >>> optimizer_state_bytes(opt)
        StateBytes(device=0, host=16)
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if isinstance(optimizer, HybridDeviceOptimizer):
        mask = optimizer.offload_mask
        on_device = [
            not offloaded and optimizer.is_device_param(p)
            for p, offloaded in zip(params, mask, strict=True)
        ]
    else:
        on_device = [p.device.type != "cpu" for p in params]
    seen: set[int] = set()
    device = host = 0
    for p, device_side in zip(params, on_device, strict=True):
        for value in optimizer.state.get(p, {}).values():
            if not isinstance(value, torch.Tensor):
                continue
            storage = value.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            if device_side and value.device == p.device:
                device += storage.nbytes()
            else:
                host += storage.nbytes()
    return StateBytes(device, host)


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise ValueError("model has no parameters")


def measure_optimizer(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    *,
    offload_fraction: float = 0.5,
    overlap_cpu_optimizer_d2h_h2d: bool = True,
    param_update_in_fp32: bool = True,
    param_copy_dtype: Literal["auto", "master", "param"] = "auto",
    steps: int = 5,
    warmup: int = 2,
    cpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
    gpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
    hybrid_cls: type[HybridDeviceOptimizer] = HybridDeviceOptimizer,
    on_finish: Callable[[HybridDeviceOptimizer], None] | None = None,
    **defaults: Any,
) -> OptimizerMeasurement:
    """Train ``model`` for a few steps with one HybridDeviceOptimizer configuration.

    ``offload_fraction=0.0`` is the no-offload baseline (everything stepped on the
    device, through fp32 master copies with ``param_update_in_fp32``). The model's
    parameters are updated (it trains), so pass a model whose values do not matter, or
    a copy. The optimizer is discarded afterwards.

    Args:
        model: The model, on the device.
        loss_fn: Runs the forward pass on ``model`` and returns a scalar loss; this
            function calls ``backward()`` on it.
        offload_fraction: Fraction of the parameters' optimizer state on the host.
        overlap_cpu_optimizer_d2h_h2d: Overlapped (pipelined) mode.
        param_update_in_fp32: fp32 master copies for lower-precision parameters.
        param_copy_dtype: ``"auto"``, ``"master"`` or ``"param"``: dtype of the copies
            back (as for :class:`HybridDeviceOptimizer`, whose default ``"auto"`` depends
            on ``stream_share``; ``grad_copy_dtype`` goes in ``**defaults``).
        steps: Timed steps (>= 1).
        warmup: Untimed steps first (>= 0; state allocation, pinned buffers).
        cpu_optimizer_cls: Host optimizer class (AdamW when None).
        gpu_optimizer_cls: Device optimizer class (AdamW when None).
        hybrid_cls: The optimizer class to build: :class:`HybridDeviceOptimizer` or a
            subclass (such as a CPU stand-in that treats CPU tensors as device tensors).
        on_finish: Called with the optimizer after the last step, before it is
            discarded (to read its state, e.g. the fp32 master copies).
        **defaults: Hyperparameters for both sides (lr, weight_decay, ...) and further
            keyword arguments of ``hybrid_cls`` (``pin_cpu_grads``, ...).

    Returns:
        An :class:`OptimizerMeasurement` with medians over the timed steps.

    Raises:
        ValueError: If ``steps < 1``, ``warmup < 0`` or the fraction is out of range.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(8, 8)
        >>> m = measure_optimizer(model, lambda m: m(torch.randn(4, 8)).square().mean(),
        ...                       offload_fraction=0.0, steps=1, warmup=0)
        >>> m.steps
        1
    """
    fraction = check_offload_fraction(offload_fraction)
    check_count("steps", steps)
    check_count("warmup", warmup, least=0)
    device = _model_device(model)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    model.zero_grad(set_to_none=True)
    optimizer = hybrid_cls(
        model.parameters(),
        offload_fraction=fraction,
        cpu_optimizer_cls=cpu_optimizer_cls,
        gpu_optimizer_cls=gpu_optimizer_cls,
        param_update_in_fp32=param_update_in_fp32,
        overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
        param_copy_dtype=param_copy_dtype,
        **defaults,
    )
    step_ms: list[float] = []
    fb_ms: list[float] = []
    host_ms: list[float] = []
    reused: list[float] = []
    losses: list[torch.Tensor] = []
    try:
        for i in range(warmup + steps):
            timed = i >= warmup
            if timed and i == warmup and cuda:
                torch.cuda.reset_peak_memory_stats(device)
            sync()
            t0 = time.perf_counter()
            if cuda:
                start, after_backward = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
            loss = loss_fn(model)
            loss.backward()
            losses.append(loss.detach())
            if cuda:
                after_backward.record()
            t1 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            t2 = time.perf_counter()
            if timed:
                step_ms.append((t2 - t0) * 1e3)
                fb_ms.append(start.elapsed_time(after_backward) if cuda else (t1 - t0) * 1e3)
                host_ms.append(optimizer.last_step_timings.get("host_step_s", 0.0) * 1e3)
                reused.append(optimizer.last_step_timings.get("early_copies_reused", 0.0))
        # A host step still running under overlap_host_step_with_forward: done first,
        # so that the state and the parameters read below are the last step's.
        optimizer.synchronize()
        state_bytes = optimizer_device_state_bytes(optimizer)
        sides = optimizer_state_bytes(optimizer)
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        host_numel = int(optimizer.last_step_timings.get("host_numel", 0.0))
        resolved_copy_dtype = optimizer.param_copy_dtype
        if on_finish is not None:
            on_finish(optimizer)
    finally:
        del optimizer
        if cuda:
            torch.cuda.empty_cache()
    step_med = statistics.median(step_ms)
    fb_med = statistics.median(fb_ms)
    return OptimizerMeasurement(
        offload_fraction=fraction,
        overlap=overlap_cpu_optimizer_d2h_h2d,
        param_copy_dtype=resolved_copy_dtype,
        steps=steps,
        step_ms=step_med,
        forward_backward_ms=fb_med,
        optimizer_ms=step_med - fb_med,
        host_step_ms=statistics.median(host_ms),
        host_numel=host_numel,
        device_state_bytes=state_bytes,
        peak_allocated_bytes=peak,
        early_copies_reused=statistics.median(reused),
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        state_bytes_device_side=sides.device,
        state_bytes_host_side=sides.host,
        losses=tuple(float(v) for v in losses),
    )


def measure_host_optimizer_throughput(
    numel: int,
    *,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    implementation: Literal["fused", "foreach", "forloop"] = "fused",
    tensor_numel: int = 1 << 24,
    steps: int = 3,
    warmup: int = 1,
    **defaults: Any,
) -> float:
    """Parameters per second of a host optimizer stepping fp32 tensors alone.

    The reference for the host side of :class:`HybridDeviceOptimizer`: its host step
    should run at this rate (fused AdamW steps about 4.4 to 5 G fp32 parameters/s on the
    16 host cores of an H100 machine).

    Args:
        numel: Total elements (split into tensors of ``tensor_numel``).
        optimizer_cls: The optimizer class.
        implementation: ``"fused"``, ``"foreach"`` or ``"forloop"`` (``foreach=False``).
        tensor_numel: Elements per tensor.
        steps: Timed steps (>= 1).
        warmup: Untimed steps (creates the state).
        **defaults: Hyperparameters.

    Returns:
        Elements updated per second (median step).

    Raises:
        ValueError: If ``numel`` or ``steps`` is below 1 or the implementation is unknown.

    Example:
        >>> rate = measure_host_optimizer_throughput(1 << 16, steps=1, warmup=0)
        >>> rate > 0
        True
    """
    if numel < 1 or tensor_numel < 1 or steps < 1:
        raise ValueError("numel, tensor_numel and steps must be >= 1")
    kwargs: dict[str, Any] = dict(defaults)
    if implementation == "fused":
        kwargs["fused"] = True
    elif implementation == "foreach":
        kwargs["foreach"] = True
    elif implementation == "forloop":
        kwargs["foreach"] = False
    else:
        raise ValueError(
            f"implementation must be 'fused', 'foreach' or 'forloop', got {implementation!r}"
        )
    sizes = [tensor_numel] * (numel // tensor_numel)
    if numel % tensor_numel:
        sizes.append(numel % tensor_numel)
    params = [torch.zeros(n) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = optimizer_cls(params, **kwargs)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return numel / statistics.median(times)
