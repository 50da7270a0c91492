"""Saved tensors that are exact casts of other saved tensors: stored once, cast again.

NOTE [Casts rebuilt from their source]
Attention that takes its softmax in fp32 saves the probabilities twice: softmax saves
its fp32 output for its own backward, and the matmul with v saves the bf16 cast of it
(Megatron-Core's local ``DotProductAttention`` with ``attention_softmax_in_fp32``, and
``transformers``' eager attention, ``softmax(..., dtype=torch.float32).to(q.dtype)``).
On Megatron-Core's GPT at h 2048, s 2048, b 2 that cast is 256 of a layer's 1,028 MiB.
Copying it to the host and back buys nothing: the engine moves the fp32 tensor anyway,
and casting it again in backward gives the same bits (a cast is elementwise, with one
rounding rule) in a fraction of the copy's time. So a saved tensor ``t`` is not copied
but rebuilt from its source ``s`` when all of these hold:

* ``t``'s autograd node is ``aten._to_copy``'s (``.to(dtype)``, ``.float()``, ...), whose
  only input edge is ``s``'s (same node, same output), ``s`` is saved as itself in the
  same layer, and neither is a view; both are real floating-point tensors of one shape
  on one device;
* the layer saves ``t`` itself or one view of it (``bmm`` saves the probabilities
  reshaped to 3-D) holding at least half of it: several views would each rebuild all of
  ``t`` in backward, so they are moved as before;
* ``t`` is at version 0 when the layer's copies start, and still when its device memory
  goes (below): nothing changed it after the cast;
* ``s`` was saved before the cast ran: the cast's node was made after ``s``'s pack hook
  ran (``_compat.autograd_clock``), and ``s`` is at the version it was saved at when the
  layer's copies start (else it is kept on the device, and backward raises as without
  offloading). So ``s`` had the saved value when the cast read it. Without the clock
  check, ``s`` changed under ``torch.no_grad()`` between the cast and its saving would
  go unnoticed.

* neither was marked with ``start_offload`` (finished after saving, maybe by a write the
  version counter does not see). Other writes that bypass the version counter (``.data``,
  a raw pointer) between the cast and the layer's end are not seen: mark such a tensor
  with ``start_offload`` or ``mark_not_offload``.

With attention dropout the product with v saves the dropout's output, not the cast:
nothing is rebuilt there. Backward then reads ``s``'s reload and casts it into a tensor
with ``t``'s size and strides (``torch.empty_strided(...).copy_(s)``, the kernel
``_to_copy`` runs), then takes the saved view of it. The engine drops its reference to
``t`` when the layer's copies start (no copy reads it), or at its forward's end where they
start before it (after its last offloaded part: NOTE [Parts of a layer] in
``cpu_offload/_layer_parts.py``), so ``t``'s device memory goes then, before any release
of the moved tensors (a deferred release holds only what the deferral budget counted), and
comes back only when backward reads it; a cast saved twice is rebuilt once for both. Each
read of the cast checks that ``s`` is still at its saved version, so a ``s`` changed after
the layer's copies started (kept on the device by a byte budget, say) fails loudly instead
of giving other values. V1 and V2 share this (it is the engine's tensor grouping), but V1
moves only marked tensors: there the cast and its source must both be marked. A layer that
is kept or recomputed is not touched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .._compat import to_copy_node_type

__all__ = ["CastRef", "SavedLeaf", "cast_ref", "casts_among", "find_casts"]


@dataclass(frozen=True, slots=True)
class CastRef:
    """A saved tensor rebuilt from a cast of another saved tensor: the cast itself, or
    one view of it (``view``: size, stride, offset)."""

    #: How the source is read: its reference in a GroupPlan, or, in a kept layer
    #: (``kept_layer.py``), the pushed index of its first save.
    source: object
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None
    #: The pushed entries of the source: a read of the cast checks their versions.
    source_entries: tuple[int, ...]
    #: How many pushed entries are this cast (saved twice: one rebuild serves both).
    saves: int
    held: _Held = field(default_factory=lambda: _Held(), compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the rebuilt cast (all of it, when a view of it was saved)."""
        return math.prod(self.size) * self.dtype.itemsize

    def read(self, source: Callable[[], torch.Tensor], stream: Hashable) -> torch.Tensor:
        """The cast (or its saved view) for a read on ``stream``: rebuilt from
        ``source()`` into the saved cast's size and strides (the kernel
        ``tensor.to(dtype)`` runs, so the same bits), and held for the cast's other
        saves read on the same stream, until each was read once."""
        held = self.held
        base = held.tensor if held.stream == stream else None
        if base is None:
            src = source()
            base = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=src.device)
            base.copy_(src)
            held.tensor, held.stream, held.reads = base, stream, self.saves
        held.reads -= 1
        if held.reads <= 0:
            held.tensor = None
        return base if self.view is None else base.as_strided(*self.view)


@dataclass(slots=True)
class _Held:
    tensor: torch.Tensor | None = None
    stream: Hashable = None
    reads: int = 0


class SavedLeaf(Protocol):
    """What the search for casts reads of one distinct saved tensor (the tensor group's
    leaf): the tensor, when it was first saved, and the key of its memory."""

    tensor: torch.Tensor
    clock: int
    key: tuple[object, ...]


#: Storage key of a base tensor -> the base and the indices of the leaves of its memory.
Roots = Mapping[tuple[object, ...], tuple[torch.Tensor, list[int]]]


def casts_among(
    roots: Roots, leaves: Sequence[SavedLeaf], distinct: Sequence[int], coverage: float
) -> dict[tuple[object, ...], int]:
    """Roots rebuilt as casts of a saved source -> the source's leaf index (NOTE [Casts
    rebuilt from their source]).

    A root qualifies when one tensor is saved of it: itself, or a view of its dtype that
    holds at least ``coverage`` of it (the rebuilt cast is the whole root; several views
    of one cast would each rebuild it, so they are moved). Sources are the ``distinct``
    leaves saved as themselves.
    """
    keys = [
        key
        for key, (root, members) in roots.items()
        if len(members) == 1
        and leaves[members[0]].clock >= 0  # not marked by start_offload
        and leaves[members[0]].tensor.dtype == root.dtype
        and leaves[members[0]].tensor.numel() >= coverage * root.numel()
    ]
    sources = [i for i in distinct if leaves[i].tensor._base is None]
    found = find_casts(
        [roots[key][0] for key in keys],
        [leaves[i].tensor for i in sources],
        [leaves[i].clock for i in sources],
    )
    return {keys[c]: sources[s] for c, s in found.items()}


def cast_ref(
    root: torch.Tensor,
    root_key: tuple[object, ...],
    leaf: SavedLeaf,
    source_ref: object,
    source_entries: tuple[int, ...],
    saves: int,
) -> CastRef:
    """The :class:`CastRef` of ``root``, a cast :func:`casts_among` found, saved as
    ``leaf`` (itself or one view of it) by ``saves`` pushed entries."""
    t = leaf.tensor
    view = None
    if leaf.key != root_key:
        view = (tuple(t.shape), t.stride(), int(t.storage_offset() - root.storage_offset()))
    return CastRef(
        source_ref,
        root.dtype,
        tuple(root.shape),
        root.stride(),
        view,
        source_entries,
        saves,
    )


def find_casts(
    casts: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], clocks: Sequence[int]
) -> dict[int, int]:
    """Which of ``casts`` are exact casts of one of ``sources`` (NOTE [Casts rebuilt from
    their source]).

    Args:
        casts: Tensors whose memory a layer's saved tensors use (saved as themselves,
            or bases of saved views), unchanged since they were saved.
        sources: Tensors the layer saved as themselves, unchanged since.
        clocks: For each source, :func:`cpu_offload._compat.autograd_clock` when it was
            first saved (-1: unknown, never a source).

    Returns:
        Index in ``casts`` -> index in ``sources``.
    """
    cast_node = to_copy_node_type()
    nodes = [t.grad_fn for t in casts]
    if not any(type(node) is cast_node for node in nodes):
        return {}
    by_edge: dict[tuple[object, int], int] = {}
    for j, s in enumerate(sources):
        made_by = s.grad_fn
        if made_by is not None and clocks[j] >= 0 and _plain(s):
            by_edge.setdefault((made_by, s.output_nr), j)
    found: dict[int, int] = {}
    for i, (t, cast) in enumerate(zip(casts, nodes, strict=True)):
        if cast is None or type(cast) is not cast_node or t._version != 0 or not _plain(t):
            continue
        edges = cast.next_functions
        if len(edges) != 1 or edges[0][0] is None:
            continue
        k = by_edge.get((edges[0][0], edges[0][1]))
        if k is None or sources[k] is t:
            continue
        s = sources[k]
        if s.shape != t.shape or s.device != t.device:
            continue
        if cast._sequence_nr() < clocks[k]:
            continue  # cast before ``s`` was saved: ``s`` may have changed in between
        found[i] = k
    return found


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t._base is None and t.dtype.is_floating_point
