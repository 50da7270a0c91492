"""Argument checks of HybridDeviceOptimizer's constructor."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from cpu_offload._args import check_bool

from ._entries import CopyDtype

__all__ = [
    "ParamsT",
    "check_copy_dtype",
    "check_optimizer_cls",
    "materialize",
    "pop_flag",
    "pop_predicate",
    "resolve_param_copy_dtype",
]

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def check_copy_dtype(name: str, value: Any) -> CopyDtype:
    """``value`` if it is ``"master"`` or ``"param"``; ValueError naming ``name`` otherwise."""
    if value not in ("master", "param"):
        raise ValueError(f"{name} must be 'master' or 'param', got {value!r}")
    return value  # type: ignore[no-any-return]


def resolve_param_copy_dtype(value: Any, stream_share: float) -> CopyDtype:
    """``param_copy_dtype``: ``"auto"`` resolved for ``stream_share``, else checked.

    ``"auto"`` is ``"param"`` with a stream lane and ``"master"`` without. With one, the
    step is bound by what crosses host-to-device (the lane's state, 12 bytes per
    element, and the host-stepped parameters): parameters narrowed on the host cross in
    half the bytes, and the host lane has time to spare for the narrowing. Without one,
    the host step bounds it, and narrowing on the device keeps host memory for it.

    Raises:
        ValueError: If ``value`` is not ``"auto"``, ``"master"`` or ``"param"``.
    """
    if value == "auto":
        return "param" if stream_share > 0.0 else "master"
    if value not in ("master", "param"):
        raise ValueError(f"param_copy_dtype must be 'auto', 'master' or 'param', got {value!r}")
    return value  # type: ignore[no-any-return]


def check_optimizer_cls(
    name: str, cls: type[torch.optim.Optimizer] | None
) -> type[torch.optim.Optimizer]:
    """``cls``, or AdamW for None; TypeError naming ``name`` if it is not an optimizer class."""
    if cls is None:
        return torch.optim.AdamW
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"{name} must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW) or "
            f"None, got {cls!r}"
        )
    return cls


def pop_flag(defaults: dict[str, Any], name: str, default: bool) -> bool:
    """Take the bool keyword ``name`` out of ``defaults``; TypeError if it is not a bool."""
    return check_bool(name, defaults.pop(name, default))


def pop_predicate(defaults: dict[str, Any], name: str) -> Callable[[torch.Tensor], bool] | None:
    """Take the callable keyword ``name`` (or None) out of ``defaults``."""
    value = defaults.pop(name, None)
    if value is not None and not callable(value):
        raise TypeError(
            f"{name} must be a callable taking a tensor and returning a bool, "
            f"or None, got {type(value).__name__}"
        )
    return value  # type: ignore[no-any-return]


def materialize(params: ParamsT) -> list[Any]:
    """``params`` as a list, group generators read into lists; errors for empty input."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or param-group dicts, got a single "
            f"{torch.typename(params)}"
        )
    items = list(params)
    count = 0
    for i, item in enumerate(items):
        if isinstance(item, Mapping):
            group_params = item.get("params", [])
            if not isinstance(group_params, torch.Tensor):
                # A generator (model.parameters()) can be read once: keep the list.
                group_params = list(group_params)
                items[i] = {**item, "params": group_params}
            count += 1 if isinstance(group_params, torch.Tensor) else len(group_params)
        else:
            count += 1
    if count == 0:
        raise ValueError(
            "params is empty: HybridDeviceOptimizer needs at least one parameter "
            "(pass model.parameters() or a list of param-group dicts)"
        )
    return items
