"""Which saved tensors are offloaded: the marks users set, the selection policies, and
which memory layouts can be copied whole and rebuilt exactly (:func:`is_dense`).

Marks are attributes on tensors, so that they travel with the tensor into autograd's
saved-tensor hooks:

* ``activation_offloading`` (V1's mark): the tensor is an activation to offload.
* ``_cpu_offload_skip``: the tensor must stay on the device (``mark_not_offload``).
* ``is_weight``: a weight that is not an ``nn.Parameter`` (never offloaded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._compat import is_fake_or_functional

__all__ = [
    "ActivationPolicy",
    "is_dense",
    "is_marked_for_offload",
    "is_marked_not_offload",
    "mark_activation_offload",
    "mark_not_offload",
]

_SKIP_ATTR = "_cpu_offload_skip"
_ACTIVATION_ATTR = "activation_offloading"


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    # Wrapper subclasses (Float8-style tensors) hold their data in inner tensors;
    # marks are set on those too so that whichever object autograd saves carries them.
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if type(tensor) is torch.Tensor or flatten is None:
        return []
    names, _ = flatten()
    return [getattr(tensor, name) for name in names]


def _set_mark(tensors: tuple[torch.Tensor | None, ...], attr: str, value: bool) -> None:
    for tensor in tensors:
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected tensors or None, got {type(tensor).__name__}")
        setattr(tensor, attr, value)
        _set_mark(tuple(_inner_tensors(tensor)), attr, value)


def mark_not_offload(*tensors: torch.Tensor | None) -> None:
    """Keep ``tensors`` on the device even when they are saved inside an offload context.

    Views of a marked tensor stay on the device too. ``None`` entries are skipped.

    Args:
        *tensors: Tensors to exclude from offloading.

    Raises:
        TypeError: If an entry is neither a tensor nor None.

    Example:
        >>> w = torch.randn(1024, 1024)
        >>> mark_not_offload(w)
    """
    _set_mark(tensors, _SKIP_ATTR, True)


def mark_activation_offload(*tensors: torch.Tensor | None, offload: bool = True) -> None:
    """Mark ``tensors`` as activations to offload (the V1 marker).

    V1 offloads only tensors carrying ``activation_offloading = True``. V2 detects
    activations itself, so there the mark is harmless. ``offload=False`` marks the
    tensors as never to be offloaded (the mark :func:`mark_not_offload` sets).
    Wrapper tensors are marked through their inner data tensors. ``None`` entries are
    skipped.

    Args:
        *tensors: Tensors to mark.
        offload: True to mark for offloading, False to exclude from offloading.

    Raises:
        TypeError: If an entry is neither a tensor nor None, or ``offload`` is not a bool.

    Example:
        >>> out = torch.randn(4, 4)
        >>> mark_activation_offload(out)
        >>> out.activation_offloading
        True
    """
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool, got {type(offload).__name__}")
    if offload:
        # Autograd often saves a different view of the same memory (nn.Linear saves its
        # 3-D input reshaped to 2-D, whose base is the root tensor, not the marked view):
        # the mark goes on the root too, so every view of the activation carries it.
        _set_mark(tensors, _ACTIVATION_ATTR, True)
        _set_mark(
            tuple(t._base for t in tensors if t is not None and t._base is not None),
            _ACTIVATION_ATTR,
            True,
        )
    else:
        _set_mark(tensors, _SKIP_ATTR, True)


def is_marked_not_offload(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or the base it is a view of) was excluded from offloading."""
    if getattr(tensor, _SKIP_ATTR, False):
        return True
    base = tensor._base
    return base is not None and bool(getattr(base, _SKIP_ATTR, False))


def _is_weight(tensor: torch.Tensor) -> bool:
    # Layers save views of their weights (Linear saves weight.t()): those are weights too.
    # ``isinstance(t, Parameter)`` goes through Parameter's metaclass (slow, and asked for
    # every saved tensor); the exact-type test answers for plain tensors first.
    for t in (tensor, tensor._base):
        if t is None:
            continue
        if type(t) is not torch.Tensor and isinstance(t, torch.nn.Parameter):
            return True
        if getattr(t, "is_weight", False):
            return True
    return False


def _never_offloaded(tensor: torch.Tensor) -> bool:
    return (
        # Sparse, quantized-sparse and nested tensors have no single storage to copy:
        # they stay on the device, as every other tensor the engine cannot move whole.
        tensor.layout is not torch.strided
        or tensor.is_nested
        or _is_weight(tensor)
        or is_marked_not_offload(tensor)
        or is_fake_or_functional(tensor)
    )


@dataclass(frozen=True)
class ActivationPolicy:
    """V2's automatic activation detection.

    A saved tensor is a candidate when it lives on the transport's device, has at least
    ``min_numel`` elements, has the strided layout (not sparse or nested), and is not a
    parameter, a marked weight, marked with :func:`mark_not_offload`, or a
    fake/functional tensor. Whether its memory layout can
    be restored is decided later, per layer, by the tensor-group processor.

    Args:
        min_numel: Smallest number of elements worth a copy.
        on_device: Predicate telling whether a tensor lives on the device.
    """

    min_numel: int
    on_device: Callable[[torch.Tensor], bool]

    def __call__(self, tensor: torch.Tensor) -> bool:
        # Cheapest test first: most tensors a layer saves are small.
        return (
            tensor.numel() >= self.min_numel
            and self.on_device(tensor)
            and not _never_offloaded(tensor)
        )


def is_marked_for_offload(tensor: torch.Tensor) -> bool:
    """V1's selection: the tensor carries ``activation_offloading = True``.

    Parameters, marked weights and tensors excluded with :func:`mark_not_offload` are
    never offloaded, marked or not.
    """
    # A view of a marked activation (Linear saves its 3-D input reshaped to 2-D) is one too.
    marked = getattr(tensor, _ACTIVATION_ATTR, False) or (
        tensor._base is not None and getattr(tensor._base, _ACTIVATION_ATTR, False)
    )
    return bool(marked) and not _never_offloaded(tensor)


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill a contiguous block of memory without overlap.

    True for contiguous tensors and for permutations of contiguous tensors (the layouts
    attention kernels allocate), so that a buffer with the same strides holds exactly
    ``numel`` elements and a straight memory copy moves it.
    """
    if tensor.is_contiguous():  # most saved tensors: skips sorting the strides
        return True
    expected = 1
    dims = sorted(
        ((st, sz) for st, sz in zip(tensor.stride(), tensor.shape, strict=True) if sz != 1),
    )
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True
