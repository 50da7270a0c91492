"""Argument checks of HybridDeviceOptimizer's constructor."""

from __future__ import annotations

import inspect
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
    if cls is torch.optim.Optimizer:
        raise TypeError(
            f"{name} must be a concrete optimizer class (e.g. torch.optim.AdamW), not the "
            "base class torch.optim.Optimizer"
        )
    try:
        closure = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step() without a signature (a C extension)
        closure = None
    if closure is not None and closure.default is inspect.Parameter.empty:
        # LBFGS re-evaluates the model inside step(); the sub-optimizers are stepped
        # with no closure, each over part of the parameters.
        raise TypeError(
            f"{name}={cls.__name__}: its step() needs a closure that re-evaluates the "
            "model, which HybridDeviceOptimizer cannot give a part of the parameters; use "
            "an optimizer whose step() takes no closure (AdamW, Adam, SGD, ...)"
        )
    return cls


def pop_flag(defaults: dict[str, Any], name: str, default: bool) -> bool:
    """Take the bool keyword ``name`` out of ``defaults``; TypeError if it is not a bool."""
    return check_bool(name, defaults.pop(name, default))


class _CheckedPredicate:
    """A user's predicate whose every answer must be a bool (a string would be truthy)."""

    def __init__(self, name: str, predicate: Callable[[torch.Tensor], bool]) -> None:
        self.name = name
        self.predicate = predicate

    def __call__(self, tensor: torch.Tensor) -> bool:
        answer = self.predicate(tensor)
        if not isinstance(answer, bool):
            raise TypeError(
                f"{self.name} must return a bool (True or False), got "
                f"{type(answer).__name__} {answer!r} for a tensor of shape "
                f"{tuple(tensor.shape)}"
            )
        return answer


def pop_predicate(defaults: dict[str, Any], name: str) -> Callable[[torch.Tensor], bool] | None:
    """Take the callable keyword ``name`` (or None) out of ``defaults``; its answers are
    checked to be bools when it is called."""
    value = defaults.pop(name, None)
    if value is None:
        return None
    if not callable(value):
        raise TypeError(
            f"{name} must be a callable taking a tensor and returning a bool, "
            f"or None, got {type(value).__name__}"
        )
    return _CheckedPredicate(name, value)


def _refuse_set(name: str, params: object) -> None:
    # As torch.optim does: the order of a set changes from run to run, and with it which
    # parameters are offloaded and the state_dict's indices.
    if isinstance(params, (set, frozenset)):
        raise TypeError(
            f"{name} is a set: its order changes from run to run, and with it which "
            "parameters are offloaded and the state_dict's indices; pass a list"
        )


def materialize(params: ParamsT) -> list[Any]:
    """``params`` as a list, group generators read into lists; errors for empty input."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or param-group dicts, got a single "
            f"{torch.typename(params)}"
        )
    _refuse_set("params", params)
    items = list(params)
    count = 0
    for i, item in enumerate(items):
        if isinstance(item, Mapping):
            group_params = item.get("params", [])
            _refuse_set(f"params[{i}]['params']", group_params)
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
