"""The package's logger, ``logging.getLogger("cpu_offload")``, and what it records.

Everything is logged at DEBUG, and the logger has a ``NullHandler``: nothing is printed
unless the application configures logging, for example::

    logging.basicConfig()
    logging.getLogger("cpu_offload").setLevel(logging.DEBUG)

The helpers return at once when DEBUG is off, so that the engine can call them for every
saved tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ._compat import is_fake_or_functional
from .engine.selection import _is_weight, is_marked_not_offload

__all__ = ["debug_enabled", "kept", "keep_reason", "logger", "moved", "offloaded", "policy_reason"]

logger = logging.getLogger("cpu_offload")
logger.addHandler(logging.NullHandler())


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')} on {tensor.device}"


def keep_reason(
    tensor: torch.Tensor, min_numel: int, on_device: Callable[[torch.Tensor], bool]
) -> str | None:
    """Why V2's activation policy keeps ``tensor`` on the device, or None if it does not.

    Returns:
        ``"not on the device"``, ``"parameter"`` (or a marked weight), ``"marked"``
        (``mark_not_offload``), ``"fake or functional"``, ``"small"`` (fewer than
        ``min_numel`` elements), or None.
    """
    if not on_device(tensor):
        return "not on the device"
    if tensor.layout is not torch.strided or tensor.is_nested:
        return "layout (sparse or nested)"
    if _is_weight(tensor):
        return "parameter"
    if is_marked_not_offload(tensor):
        return "marked"
    if is_fake_or_functional(tensor):
        return "fake or functional"
    if tensor.numel() < min_numel:
        return f"small (< {min_numel} elements)"
    return None


def debug_enabled() -> bool:
    """Whether DEBUG records of the package are wanted (cheap: cached by ``logging``)."""
    return logger.isEnabledFor(logging.DEBUG)


def policy_reason(policy: object, tensor: torch.Tensor) -> str:
    """Why a selection ``policy`` (V2's automatic one, or V1's marks) keeps ``tensor``."""
    min_numel = getattr(policy, "min_numel", None)
    on_device = getattr(policy, "on_device", None)
    if min_numel is not None and on_device is not None:
        return keep_reason(tensor, min_numel, on_device) or "not selected"
    return "not marked for offloading (V1 offloads marked tensors only)"


def kept(layer: str, tensor: torch.Tensor, reason: str) -> None:
    """A saved tensor of ``layer`` stays on the device, for ``reason``."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: kept %s: %s", layer, _describe(tensor), reason)


def offloaded(layer: str, tensor: torch.Tensor, nbytes: int) -> None:
    """A saved tensor of ``layer`` is copied to the host (``nbytes`` moved)."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: offloaded %s, %d bytes", layer, _describe(tensor), nbytes)


def moved(layer: str, direction: str, nbytes: int, count: int) -> None:
    """``layer`` queued ``count`` copies of ``nbytes`` in all, ``direction`` offload or reload."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: %s of %d tensors, %d bytes", layer, direction, count, nbytes)
