"""When each offloaded layer finishes its offload and starts its reload.

A schedule is a ``synchronization_dict``: layer id -> ``(offload_fwd, offload_num,
reload_fwd, reload_num)``. Layer ``i`` is offloaded iff it is a key. It finishes its
offload (and its device memory is released) when layer ``offload_num`` begins its
forward (``offload_fwd=True``) or backward (``False``); it starts its reload when layer
``reload_num`` begins its forward or backward (``reload_fwd``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .._args import check_int
from .._warn import warn_at_caller

__all__ = [
    "NoOverlapWarning",
    "Point",
    "Schedule",
    "default_synchronization_dict",
    "validate_synchronization_dict",
]

SyncDict = dict[int, tuple[bool, int, bool, int]]


class NoOverlapWarning(UserWarning):
    """The default schedule offloads ``model_layers - 1`` layers: compute waits for every copy.

    Its own category, so that a caller who chose that schedule knowingly (a plan whose
    estimate already charges the waiting) can leave it out by category.
    """


@dataclass(frozen=True, order=True)
class Point:
    """A moment of the iteration: the start of layer ``layer``'s forward or backward."""

    forward: bool
    layer: int

    def position(self, num_layers: int) -> int:
        """Order in a plain iteration: forwards 0..n-1, then backwards n-1..0."""
        return self.layer if self.forward else num_layers + (num_layers - 1 - self.layer)

    @classmethod
    def at(cls, position: int, num_layers: int) -> Point:
        """The point at ``position`` (the inverse of :meth:`position`).

        Raises:
            ValueError: If ``position`` is outside ``[0, 2 * num_layers - 1]``.
        """
        if not 0 <= position < 2 * num_layers:
            raise ValueError(
                f"position must be in [0, 2 * num_layers - 1] = [0, {2 * num_layers - 1}] for "
                f"{num_layers} layers (forwards, then backwards), got {position}"
            )
        if position < num_layers:
            return cls(True, position)
        return cls(False, 2 * num_layers - 1 - position)

    def __str__(self) -> str:
        return f"{'forward' if self.forward else 'backward'} of layer {self.layer}"


def default_synchronization_dict(num_offloaded: int, num_layers: int) -> SyncDict:
    """The default schedule: the first ``k`` of ``n`` layers.

    Layer ``i < k`` finishes its offload before the forward of layer ``n-k+i`` and starts
    its reload when the backward of layer ``n-k+i-1`` starts (after the backward of layer
    ``n-k+i``), so at most ``n-k`` layers' activations are on the device at once.
    """
    n, k = num_layers, num_offloaded
    return {i: (True, n - k + i, False, n - k + i - 1) for i in range(k)}


def validate_synchronization_dict(sync: object, num_layers: int) -> SyncDict:
    """Check a ``synchronization_dict`` against ``num_layers`` (the model's layers).

    Args:
        sync: The dictionary the caller passed.
        num_layers: ``model_layers``.

    Returns:
        A normalized copy (tuples of ``(bool, int, bool, int)``).

    Raises:
        TypeError: If it is not a dict of int -> 4-tuple of (bool, int, bool, int).
        ValueError: If a layer id is out of range, the offload would finish before the
            layer's own forward ended, the reload would start before the offload
            finished, or after the layer's own backward began.
    """
    if not isinstance(sync, Mapping):
        raise TypeError(
            f"synchronization_dict must be a dict mapping layer id -> (offload_fwd, "
            f"offload_num, reload_fwd, reload_num), got {type(sync).__name__}"
        )
    out: SyncDict = {}
    n = num_layers
    for layer, value in sync.items():
        layer = check_int("synchronization_dict keys (layer ids)", layer)
        if not 0 <= layer < n:
            raise ValueError(
                f"synchronization_dict: layer id {layer} is out of range [0, {n - 1}] "
                f"for model_layers={n}"
            )
        if not isinstance(value, (tuple, list)) or len(value) != 4:
            raise TypeError(
                f"synchronization_dict[{layer}] must be a tuple (offload_fwd: bool, "
                f"offload_num: int, reload_fwd: bool, reload_num: int), got {value!r}"
            )
        offload_fwd, offload_num, reload_fwd, reload_num = value
        for name, flag in (("offload_fwd", offload_fwd), ("reload_fwd", reload_fwd)):
            if not isinstance(flag, bool):
                raise TypeError(
                    f"synchronization_dict[{layer}]: {name} must be a bool, got {flag!r}"
                )
        for name, num in (("offload_num", offload_num), ("reload_num", reload_num)):
            check_int(f"synchronization_dict[{layer}]: {name}", num)
            if not 0 <= num < n:
                raise ValueError(
                    f"synchronization_dict[{layer}]: {name}={num} is out of range [0, {n - 1}]"
                )
        finish = Point(offload_fwd, offload_num)
        reload = Point(reload_fwd, reload_num)
        own_fwd, own_bwd = Point(True, layer), Point(False, layer)
        if finish.position(n) <= own_fwd.position(n):
            raise ValueError(
                f"synchronization_dict[{layer}]: the offload must finish after layer "
                f"{layer}'s own forward, but it finishes at the {finish}"
            )
        if reload.position(n) < finish.position(n):
            raise ValueError(
                f"synchronization_dict[{layer}]: the reload starts at the {reload}, "
                f"before the offload finishes at the {finish}"
            )
        if reload.position(n) > own_bwd.position(n):
            raise ValueError(
                f"synchronization_dict[{layer}]: the reload starts at the {reload}, "
                f"after layer {layer}'s own backward has begun"
            )
        out[layer] = (offload_fwd, offload_num, reload_fwd, reload_num)
    return out


class Schedule:
    """A validated synchronization dict, indexed by the points at which work happens."""

    def __init__(self, sync: SyncDict) -> None:
        self.offloaded = frozenset(sync)
        self.finish_at: dict[Point, list[int]] = {}
        self.reload_at: dict[Point, list[int]] = {}
        for layer in sorted(sync):
            offload_fwd, offload_num, reload_fwd, reload_num = sync[layer]
            self.finish_at.setdefault(Point(offload_fwd, offload_num), []).append(layer)
            # Reloads run in reverse layer order: the layer needed first goes first.
            self.reload_at.setdefault(Point(reload_fwd, reload_num), []).insert(0, layer)


def check_layer_counts(num_layers: object, model_layers: object) -> tuple[int, int]:
    """Validate the default schedule's k of n; warn when k == n-1.

    Raises:
        TypeError: If either is not an int.
        ValueError: If ``model_layers < 1`` or ``num_layers`` is not in [0, model_layers-1].
    """
    k = check_int("num_layers", num_layers)
    n = check_int("model_layers", model_layers)
    if n < 1:
        raise ValueError(f"model_layers must be >= 1, got {n}")
    if not 0 <= k <= n - 1:
        raise ValueError(
            f"num_layers (layers to offload) must be in [0, model_layers - 1] = [0, {n - 1}], "
            f"got {k}: at least one layer's activations must stay on the GPU"
        )
    if n > 1 and k == n - 1:
        # k = n-1: layer i's offload finishes at the forward of layer n-k+i = i+1.
        better = (
            f"num_layers <= {n - 2} leaves each copy at least one more layer's forward to "
            "overlap with"
            if n > 2
            else "with two layers no schedule does better: copies overlap a whole layer's "
            "forward from model_layers=3 on"
        )
        warn_at_caller(
            f"num_layers={k} = model_layers - 1: each offloaded layer's copies must finish "
            "before the next layer's forward starts, so compute waits for them (they "
            f"overlap only the rest of their own layer's forward); {better}",
            NoOverlapWarning,
        )
    return k, n
