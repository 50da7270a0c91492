"""Argument checks shared by the public functions: errors name the argument."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._warn import warn_at_caller

__all__ = [
    "activations_requested",
    "check_bool",
    "check_int",
    "check_memory_budget",
    "check_stream",
    "has_duplicates",
]


def has_duplicates(items: Iterable[object]) -> bool:
    """Whether an object is listed twice (by identity, as for modules and parameters)."""
    listed = list(items)
    return len({id(x) for x in listed}) != len(listed)


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool, else ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def check_int(name: str, value: object) -> int:
    """``value`` if it is an int (not a bool), else ``TypeError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def check_count(name: str, value: object, least: int = 1) -> int:
    """``value`` if it is an int (not a bool) >= ``least``, else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def check_seconds(name: str, value: object) -> float:
    """``value`` if it is a finite number (not a bool) >= 0, else ``ValueError`` naming
    ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value < float("inf")  # NaN fails too
    ):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return value


def check_min_tensor_size(value: object) -> int:
    """``min_tensor_size_to_offload`` if it is an int >= 0 (elements), else an error naming it."""
    size = check_int("min_tensor_size_to_offload", value)
    if size < 0:
        raise ValueError(
            f"min_tensor_size_to_offload must be >= 0 (a number of elements), got {size}"
        )
    return size


def check_memory_budget(value: object) -> int | None:
    """``memory_budget`` if it is None or an int >= 0 (bytes), else an error naming it."""
    if value is None:
        return None
    budget = check_int("memory_budget", value)
    if budget < 0:
        raise ValueError(
            f"memory_budget must be None or an int >= 0 (bytes the step may peak at), got {budget}"
        )
    return budget


def check_stream(name: str, value: object) -> None:
    """``TypeError`` naming ``name`` unless ``value`` is a ``torch.cuda.Stream`` or None."""
    if value is not None and not isinstance(value, torch.cuda.Stream):
        raise TypeError(f"{name} must be a torch.cuda.Stream or None, got {type(value).__name__}")


def activations_requested(offload_activations: bool, offload_weights: bool) -> bool:
    """Apply the legacy ``offload_activations`` / ``offload_weights`` flags (both backends).

    Returns:
        True if activations are to be offloaded; False if only weights were asked for,
        in which case the caller returns its disabled pair.

    Raises:
        ValueError: If neither is asked for: nothing to offload.
    """
    if offload_weights:
        warn_at_caller(
            "offload_weights=True is deprecated and has no effect: weights are never offloaded",
            DeprecationWarning,
        )
    if not offload_activations and not offload_weights:
        raise ValueError(
            "nothing to offload: offload_activations=False and offload_weights=False; "
            "set offload_activations=True (or enabled=False)"
        )
    return offload_activations
