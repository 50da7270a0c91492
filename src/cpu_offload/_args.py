"""Argument checks shared by the public functions: errors name the argument."""

from __future__ import annotations

__all__ = ["check_bool", "check_int"]


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
