"""The fraction split of :class:`~cpu_offload.optim.HybridDeviceOptimizer`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._warn import warn_at_caller

__all__ = [
    "check_offload_fraction",
    "compute_offload_split",
    "is_device_tensor",
    "warn_if_nothing_can_be_offloaded",
]


def is_device_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on an accelerator (any device that is not the host CPU).

    Args:
        tensor: Any tensor.

    Returns:
        True for CUDA (or other non-CPU) tensors, False for host tensors.
    """
    return tensor.device.type != "cpu"


def warn_if_nothing_can_be_offloaded(
    params: list[torch.Tensor], fraction: float, is_device: Callable[[torch.Tensor], bool]
) -> None:
    """Warn when ``fraction`` asks for offloading but no parameter is a device parameter.

    Only device parameters are offloaded; host ones are stepped in place by the host
    optimizer whatever the fraction. A model left on the CPU (no GPU, or a forgotten
    ``model.cuda()``) would otherwise offload nothing without a word.

    Args:
        params: The optimizer's parameters.
        fraction: The checked ``offload_fraction``.
        is_device: The optimizer's ``is_device_param``.
    """
    if fraction == 0.0 or any(is_device(p) for p in params):
        return
    devices = sorted({str(p.device) for p in params})
    warn_at_caller(
        f"HybridDeviceOptimizer: offload_fraction={fraction} offloads nothing: none of the "
        f"{len(params)} parameters is a device parameter (they are on {', '.join(devices)}), "
        "and host parameters are stepped in place by the host optimizer. Move the model to "
        "the GPU before making the optimizer (model.cuda()); to run the offloading logic "
        "on CPU tensors (a test without a GPU), pass is_device_param=lambda p: True"
    )


def check_offload_fraction(offload_fraction: Any, name: str = "offload_fraction") -> float:
    """Validate an offload fraction and return it as a float.

    Args:
        offload_fraction: The value to check: a real number in ``[0.0, 1.0]``.
        name: The argument name used in error messages.

    Returns:
        ``float(offload_fraction)``.

    Raises:
        TypeError: If it is not a real number (``bool`` is refused).
        ValueError: If it is NaN or outside ``[0.0, 1.0]``.

    Example:
        >>> check_offload_fraction(1)
        1.0
    """
    # numbers.Real: NumPy scalars too (np.float32 is no Python float).
    if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, numbers.Real):
        raise TypeError(
            f"{name} must be a float in [0.0, 1.0], got {type(offload_fraction).__name__} "
            f"{offload_fraction!r}"
        )
    value = float(offload_fraction)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0.0, 1.0], got {offload_fraction!r}")
    return value


def _flatten(params: Iterable[torch.Tensor] | Iterable[Mapping[str, Any]]) -> list[torch.Tensor]:
    flat: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, torch.Tensor):
            flat.append(item)
        elif isinstance(item, Mapping):
            group_params = item["params"]
            if isinstance(group_params, torch.Tensor):
                flat.append(group_params)
            else:
                flat.extend(group_params)
        else:
            raise TypeError(
                "params must be an iterable of tensors or of param-group dicts with a "
                f"'params' entry, got an element of type {type(item).__name__}"
            )
    return flat


def compute_offload_split(
    params: Iterable[torch.Tensor] | Iterable[Mapping[str, Any]],
    offload_fraction: float,
    *,
    is_device: Callable[[torch.Tensor], bool] | None = None,
    from_end: bool = False,
) -> list[bool]:
    """Decide which parameters get their optimizer state offloaded to the host.

    This is Megatron-LM's rule: walking the parameters in param-group order, a device
    parameter is offloaded while the number of elements offloaded so far is below
    ``offload_fraction`` times the element count of all device parameters. So ``0.0``
    offloads nothing, ``1.0`` everything, and a fraction in between offloads a prefix of
    the device parameters that reaches the fraction with its last parameter (the split
    is parameter-granular, never inside a tensor). Host parameters are never "offloaded"
    (they are already on the host).

    Args:
        params: Tensors, or param-group dicts (``{"params": [...], ...}``), in order.
        offload_fraction: Fraction of the device elements to offload, in ``[0.0, 1.0]``.
        is_device: Predicate telling device parameters from host ones; by default any
            tensor not on the CPU counts as a device tensor.
        from_end: Walk the parameters from the last one instead: offload a suffix (the
            layers a forward reads last) with the same rule.

    Returns:
        One bool per parameter, in the flattened param-group order: True when its
        optimizer state goes to the host.

    Raises:
        TypeError: If ``offload_fraction`` is not a number or ``params`` holds other objects.
        ValueError: If ``offload_fraction`` is outside ``[0.0, 1.0]``.

    Example:
        >>> import torch
        >>> ps = [torch.empty(10), torch.empty(30), torch.empty(60)]
        >>> compute_offload_split(ps, 0.5, is_device=lambda p: True)
        [True, True, True]
        >>> compute_offload_split(ps, 0.3, is_device=lambda p: True)
        [True, True, False]
        >>> compute_offload_split(ps, 0.3, is_device=lambda p: True, from_end=True)
        [False, False, True]
    """
    fraction = check_offload_fraction(offload_fraction)
    predicate = is_device_tensor if is_device is None else is_device
    flat = _flatten(params)
    if from_end:
        return compute_offload_split(flat[::-1], fraction, is_device=predicate)[::-1]
    on_device = [bool(predicate(p)) for p in flat]
    threshold = fraction * sum(p.numel() for p, dev in zip(flat, on_device, strict=True) if dev)
    offloaded_numel = 0
    split: list[bool] = []
    for p, dev in zip(flat, on_device, strict=True):
        # Strict "<" as in Megatron: the parameter that reaches the threshold is the last.
        if dev and offloaded_numel < threshold:
            split.append(True)
            offloaded_numel += p.numel()
        else:
            split.append(False)
    return split
