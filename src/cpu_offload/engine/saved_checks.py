"""What a layer's state checks and logs of the tensors it was given: their versions when
backward reads them, a kept tensor read again, and what an offload moved or kept.

NOTE [Kept tensors keep their version check]
Without saved-tensor hooks, autograd records each saved tensor's version and refuses, in
backward, one that was changed in place since ("one of the variables needed for
gradient computation has been modified by an inplace operation"). With hooks it checks
nothing: what the pack hook returns comes back from the unpack hook as it is. So a
tensor that one of our pack hooks keeps where it is (below the size threshold, a
weight, refused by the policy) goes to autograd as a :class:`KeptAsSaved`, with its
version at the save, and the unpack hook raises as autograd would when the version
moved. Without it, ``z = x.exp(); z.mul_(2)`` in an offloaded layer gave a wrong
gradient where PyTorch without the package raises.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .. import _log
from .tensor_group import CastRef, GroupPlan, SavedEntry, Unit

__all__ = [
    "KeptAsSaved",
    "check_saved_version",
    "check_source_version",
    "inplace_error",
    "kept_again",
    "let_go",
    "log_offload",
    "saved_original",
    "source_changed_error",
]


def inplace_error(tensor: torch.Tensor, version: int, layer: str) -> RuntimeError:
    """The error PyTorch raises without hooks for a saved tensor changed in place."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by "
        f"an inplace operation: a tensor of shape {tuple(tensor.shape)} saved for "
        f"backward in {layer} is at version {tensor._version}; expected version "
        f"{version} instead (PyTorch raises this without offloading too)"
    )


def source_changed_error(tensor: torch.Tensor, version: int, layer: str) -> RuntimeError:
    """The error for a saved cast's source changed in place after it was saved."""
    return RuntimeError(
        f"a saved tensor of shape {tuple(tensor.shape)} in {layer} was modified "
        f"by an inplace operation after it was saved (version {tensor._version}; "
        f"expected {version}), and backward rebuilds a saved cast of it from it "
        "(NOTE [Casts rebuilt from their source] in cpu_offload/engine/recast.py). "
        "Leave it unchanged until backward, or mark_not_offload(tensor) before saving"
    )


class KeptAsSaved:
    """What a pack hook gives autograd for a tensor it keeps where it is: the tensor,
    detached unless a leaf that requires grad (NOTE [Kept tensors are detached] in
    ``cpu_offload/v2/synchronizer.py``), and its version at the save (NOTE [Kept tensors
    keep their version check]).

    Args:
        tensor: The tensor autograd saves.
        layer: The layer's name in the message of a failed check.

    Example:
        >>> x = torch.ones(3)
        >>> kept = KeptAsSaved(x, "layer 0")
        >>> torch.equal(kept.unpack(), x)
        True
        >>> x.add_(1)
        tensor([2., 2., 2.])
        >>> kept.unpack()
        Traceback (most recent call last):
        ...
        RuntimeError: one of the variables needed for gradient computation has been modified by an inplace operation: a tensor of shape (3,) saved for backward in layer 0 is at version 1; expected version 0 instead (PyTorch raises this without offloading too)
    """

    __slots__ = ("layer", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, layer: str) -> None:
        self.tensor = tensor if tensor.is_leaf and tensor.requires_grad else tensor.detach()
        self.version = tensor._version
        self.layer = layer

    def unpack(self) -> torch.Tensor:
        """The tensor, if it is still at the version it was saved at.

        Raises:
            RuntimeError: As PyTorch does without hooks, if it was changed in place since.
        """
        tensor = self.tensor
        if tensor._version != self.version:
            raise inplace_error(tensor, self.version, self.layer)
        return tensor


def saved_original(entry: SavedEntry) -> torch.Tensor | None:
    """The tensor autograd saved, while the entry or anything else holds it; else None."""
    if entry.tensor is not None:
        return entry.tensor
    return None if entry.weak is None else entry.weak()


def let_go(entry: SavedEntry) -> None:
    """Hold the entry's tensor weakly from now on, its version still checked while
    anything else holds it: its device memory goes with its last other holder."""
    entry.weak = weakref.ref(entry.tensor)
    entry.tensor = None  # type: ignore[assignment]


def _changed(entry: SavedEntry) -> torch.Tensor | None:
    """The tensor autograd saved, if anything still holds it and it was changed in place
    since it was saved; else None."""
    original = saved_original(entry)
    return original if original is not None and original._version != entry.version else None


def check_saved_version(entry: SavedEntry, layer: str) -> None:
    """Raise as PyTorch does without offloading if ``entry``'s tensor was changed in
    place after it was saved."""
    original = _changed(entry)
    if original is not None:
        raise inplace_error(original, entry.version, layer)


def check_source_version(entry: SavedEntry, layer: str) -> None:
    """Raise if the source of a saved cast (``entry``) changed after it was saved: the
    cast rebuilt from it would have other values (NOTE [Casts rebuilt from their source]
    in ``recast.py``)."""
    original = _changed(entry)
    if original is not None:
        raise source_changed_error(original, entry.version, layer)


def kept_again(unit: Unit, layer: str) -> torch.Tensor:
    """A kept unit read more often than it was saved: its memory, found through a tensor
    rebuilt from it that autograd still holds."""
    alive = next((t for t in (r() for r in unit.returned) if t is not None), None)
    if alive is None:
        raise RuntimeError(
            f"{layer}: a saved tensor kept on the device was read again after "
            "every tensor autograd made from it was freed. Read ctx.saved_tensors once "
            "per backward, or keep the first result while reading it again"
        )
    layout = unit.layout
    return alive.as_strided(layout.size, layout.stride, unit.storage_offset)


def log_offload(layer: str, plan: GroupPlan, entries: Sequence[SavedEntry]) -> None:
    """At DEBUG: what the layer's offload moves, keeps and rebuilds, tensor by tensor."""
    for unit in plan.units:
        assert unit.tensor is not None
        if unit.kept:
            _log.kept(layer, unit.tensor, "lowers no peak off the device")
        else:
            _log.offloaded(layer, unit.tensor, unit.nbytes)
    for entry, ref in zip(entries, plan.refs, strict=True):
        if isinstance(ref, CastRef):
            _log.kept(layer, entry.tensor, "not moved: cast again from its source")
        elif not plan.unit_ids(ref):
            why = "changed in place" if entry.keep else "layout cannot be restored"
            _log.kept(layer, entry.tensor, why)
    moved = plan.moved
    _log.moved(layer, "offload", sum(u.nbytes for u in moved), len(moved))
