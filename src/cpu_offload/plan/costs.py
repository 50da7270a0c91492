"""What one layer costs in a training step, as the planner's model sees it.

A layer's cost is whole-layer figures (forward, backward and recomputation times, the
bytes it saves, the part of them offloading moves, its input) and, where the profile
measured them, its parts (:class:`PartCost`: submodules whose saved tensors may be kept,
offloaded or recomputed on their own) over the distinct storages the layer saves
(:class:`Storage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._layer_parts import Choice

__all__ = [
    "Choice",
    "HostCost",
    "LayerCost",
    "PartCost",
    "Parts",
    "Storage",
    "offload_layers_arguments",
]


@dataclass(frozen=True)
class HostCost:
    """The host's time for one layer's work (ms): Python, autograd and kernel launches.

    Every field is at least 0 (or None, where it says so).

    Attributes:
        forward_ms: The forward of a kept layer.
        backward_ms: The backward of a kept layer.
        offload_forward_ms: What offloading adds to the forward (the saved-tensor hooks,
            the copies to queue).
        offload_backward_ms: What offloading adds to the backward (the reloads to queue,
            the tensors to rebuild).
        recompute_forward_ms: What recomputing adds to the forward (the checkpoint's
            hooks).
        recompute_backward_ms: What recomputing adds to the backward: the forward run
            again, and the checkpoint's unpacking.
        engaged_forward_ms: What the offload engine adds to the forward of a layer it
            does not offload, in a plan that offloads some layer: every layer then runs
            under the offload context and its sync (``offload_forward_ms`` includes it).
        engaged_backward_ms: The same for the backward.
        part_recompute_forward_ms: What each part recomputed on its own adds to the
            forward beyond its share of ``recompute_forward_ms`` (its checkpoint's fixed
            cost; :mod:`cpu_offload.plan._parts_host`).
        part_recompute_backward_ms: The same for the backward.
        part_offload_forward_ms: What each part offloaded on its own adds to the forward
            beyond its share of ``offload_forward_ms``.
        part_offload_backward_ms: The same for the backward.
        own_forward_ms: The forward of a kept layer from the layer's own start:
            ``forward_ms`` less the host time before it (the model's code between layers,
            NOTE [A layer's host time runs from the previous layer's end] in
            ``_probe.py``), what a part's share of the layer is taken of; 0 where not
            measured (``forward_ms`` then).
        recast_forward_ms: What keeping the layer with its saved casts rebuilt adds to
            the forward: a layer state of its own, a hook per saved tensor, the search
            for casts at the forward's end (NOTE [A kept layer's casts] in
            ``cpu_offload/engine/kept_layer.py``). None where not measured (the
            engaged share then, ``engaged_forward_ms``).
        recast_backward_ms: The same for the backward (each saved tensor read back
            through the layer's state, the casts made again).
    """

    forward_ms: float
    backward_ms: float
    offload_forward_ms: float = 0.0
    offload_backward_ms: float = 0.0
    recompute_forward_ms: float = 0.0
    recompute_backward_ms: float = 0.0
    engaged_forward_ms: float = 0.0
    engaged_backward_ms: float = 0.0
    part_recompute_forward_ms: float = 0.0
    part_recompute_backward_ms: float = 0.0
    part_offload_forward_ms: float = 0.0
    part_offload_backward_ms: float = 0.0
    own_forward_ms: float = 0.0
    recast_forward_ms: float | None = None
    recast_backward_ms: float | None = None

    def forward(self, choice: Choice, engaged: bool = False) -> float:
        """Host time of the layer's forward under ``choice``; ``engaged``: the plan
        offloads some layer."""
        return _plus(
            self.forward_ms,
            choice,
            self.offload_forward_ms,
            self.recompute_forward_ms,
            self.engaged_forward_ms,
            engaged,
            self.recast_forward_ms,
        )

    def backward(self, choice: Choice, engaged: bool = False) -> float:
        """Host time of the layer's backward (with its recomputation) under ``choice``;
        ``engaged``: the plan offloads some layer."""
        return _plus(
            self.backward_ms,
            choice,
            self.offload_backward_ms,
            self.recompute_backward_ms,
            self.engaged_backward_ms,
            engaged,
            self.recast_backward_ms,
        )


def _plus(
    kept_ms: float,
    choice: Choice,
    offload_ms: float,
    recompute_ms: float,
    engaged_ms: float,
    engaged: bool,
    recast_ms: float | None,
) -> float:
    # Called for every layer of every plan the search scores: plain branches, no lookups.
    if choice is Choice.OFFLOAD:
        kept_ms += offload_ms
    elif choice is Choice.RECAST:
        # A layer kept with its casts rebuilt runs the engine's hooks and grouping for
        # every tensor it saves, with no copies or events, engaged or not (its hooks are
        # the innermost). Where the profile did not time it, the offload context's share
        # of a kept layer stands in; on Megatron-Core's GPT at h 1024 (H200) it was
        # about half of the measured cost.
        kept_ms += engaged_ms if recast_ms is None else recast_ms
    else:
        if engaged:
            kept_ms += engaged_ms
        if choice is Choice.RECOMPUTE:
            kept_ms += recompute_ms
    return max(kept_ms, 0.0)


@dataclass(frozen=True)
class Storage:
    """One distinct storage a layer saves for backward, or gives a part as its input.

    Attributes:
        nbytes: Its size.
        offload_bytes: What offloading moves of it (0 below the engine's threshold, or
            where the engine keeps it).
        outside: Whether the layer saves it outside its parts too: kept whatever its
            parts do.
        recast_of: The storage it is a saved cast of, where offloading rebuilds it from
            that one instead of moving it (both sent to the engine; NOTE [Casts rebuilt
            from their source] in ``cpu_offload/engine/recast.py``), else None.
    """

    nbytes: int
    offload_bytes: int
    outside: bool = False
    recast_of: int | None = None


@dataclass(frozen=True)
class PartCost:
    """One part of a layer: a submodule whose saved tensors get a choice of their own.

    Attributes:
        name: Its path inside the layer (``"self_attention.core_attention"``).
        forward_ms: The device's time for its forward: what recomputing it costs.
        host_ms: The host's time for its forward.
        saved: Indices into :attr:`LayerCost.storages` of what it saves for backward
            (where parts are nested, the innermost saves it).
        inputs: Indices of the storages of its tensor inputs: what recomputing it keeps.
    """

    name: str
    forward_ms: float
    host_ms: float
    saved: tuple[int, ...]
    inputs: tuple[int, ...]


@dataclass(frozen=True)
class Parts:
    """One layer's plan part by part: keep, offload or recompute each of its parts.

    What the layer saves outside its parts is kept; the layer counts as offloaded for
    the schedule if any part is offloaded (NOTE [Parts of a layer] in
    :mod:`cpu_offload._layer_parts`).

    Attributes:
        choices: ``(part name, choice)`` per part, in the order of the layer's
            :attr:`LayerCost.parts`.
    """

    choices: tuple[tuple[str, Choice], ...]

    @property
    def offloads(self) -> bool:
        """Whether any part is offloaded."""
        return any(c is Choice.OFFLOAD for _, c in self.choices)

    def describe(self) -> str:
        """``name:K/O/R`` per part that is not kept, comma-separated (``-``: none)."""
        shown = [f"{n}:{c.value[0].upper()}" for n, c in self.choices if c is not Choice.KEEP]
        return ",".join(shown) or "-"


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs in one training step.

    With :attr:`host` set, the times are the device's alone (the compute stream's, with
    the host far ahead) and ``host`` holds the host's; without it, each time is what the
    layer took in a plain step, host and device together.

    Attributes:
        forward_ms: Forward time.
        backward_ms: Backward time (without recomputation).
        saved_bytes: Bytes the layer keeps for backward (distinct storages, no parameters).
        offload_bytes: The part of ``saved_bytes`` offloading moves (above the threshold).
        input_bytes: The layer's input, what a recomputed layer keeps until its backward.
        recompute_ms: Forward time when recomputed in backward (``forward_ms`` if None).
        workspace_bytes: Temporary memory at the peak of the layer's forward or backward,
            beyond what it saves.
        host: The host's time for the layer's work, if measured.
        storages: The distinct storages the layer saves and its parts take as inputs,
            where its parts were profiled (:class:`Storage`).
        parts: Its parts, where profiled (:class:`PartCost`): what a :class:`Parts`
            choice keeps, offloads and recomputes is taken from them.
        recast_bytes: The part of ``saved_bytes`` offloading releases without moving it:
            saved casts of other saved tensors, cast again in backward (NOTE [Casts
            rebuilt from their source] in ``cpu_offload/engine/recast.py``); a layer
            kept with :attr:`Choice.RECAST` releases them too (NOTE [A kept layer's
            casts] in ``cpu_offload/engine/kept_layer.py``).
        recast_ms: The device's time to cast them again in backward.
    """

    forward_ms: float
    backward_ms: float
    saved_bytes: int
    offload_bytes: int
    input_bytes: int
    recompute_ms: float | None = None
    workspace_bytes: int = 0
    host: HostCost | None = None
    storages: tuple[Storage, ...] = ()
    parts: tuple[PartCost, ...] = ()
    recast_bytes: int = 0
    recast_ms: float = 0.0

    @property
    def rerun_ms(self) -> float:
        """Time of the recomputation in backward."""
        return self.forward_ms if self.recompute_ms is None else self.recompute_ms

    @property
    def recompute_alloc_bytes(self) -> int:
        """Bytes a recomputation allocates: the saved tensors but the kept input."""
        return max(self.saved_bytes - self.input_bytes, 0)


def offload_layers_arguments(choices: Sequence[Choice | Parts]) -> dict[str, Any]:
    """The keyword arguments ``offloaded``, ``recomputed``, ``parts`` and ``recast`` of
    :func:`cpu_offload.offload_layers` for validated per-layer choices (kept parts left
    out of ``parts``).

    Example:
        >>> plan = [Choice.OFFLOAD, Parts((("mlp", Choice.RECOMPUTE),)), Choice.RECAST]
        >>> offload_layers_arguments(plan)
        {'offloaded': (0,), 'recomputed': (), 'parts': {1: {'mlp': 'recompute'}}, 'recast': (2,)}
    """
    return {
        "offloaded": tuple(i for i, c in enumerate(choices) if c is Choice.OFFLOAD),
        "recomputed": tuple(i for i, c in enumerate(choices) if c is Choice.RECOMPUTE),
        "parts": {
            i: {name: c.value for name, c in p.choices if c is not Choice.KEEP}
            for i, p in enumerate(choices)
            if isinstance(p, Parts)
        },
        "recast": tuple(i for i, c in enumerate(choices) if c is Choice.RECAST),
    }
