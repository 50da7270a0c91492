"""A layer that keeps what it saves on the device, but for its saved casts.

NOTE [A kept layer's casts]
A layer kept on the device holds every tensor it saves until its backward: with its
softmax in fp32, both the fp32 probabilities and their bf16 cast (NOTE [Casts rebuilt
from their source] in ``recast.py``). Dropping the cast at the end of the forward and
casting it again in backward frees its bytes for one elementwise kernel: on
Megatron-Core's GPT at h 2048, s 2048, b 2, 256 of a layer's 1,028 MiB for about 0.2 ms
of an H200 per layer. :class:`KeptLayer` does this with the engine's own rules: at the
forward's end, :meth:`TensorGroupProcessor.casts_to_rebuild` finds the casts among what the
layer saved, under the same conditions as in an offloaded layer, and each read of one in
backward checks its source's version as there.

Nothing moves, so nothing else of the engine is needed, and the host's work stays small
(a kept layer is chosen where the host may bound the step). What autograd holds for
each saved tensor is a cell of its own (:class:`_Saved`) with the tensor, detached (NOTE
[Kept tensors are detached] in ``cpu_offload/v2/synchronizer.py``), and its version at
the save, checked when backward reads it; a cast's cell holds its source instead. So
each tensor lives exactly as long as autograd's saved variable does, as without the
package: a node that reads its saved tensors twice gets them twice, a second backward
over a retained graph (``retain_graph=True``) reads them again, two forwards before one
backward (two losses summed, a layer used twice) keep their cells apart, and a forward
that never gets a backward frees everything with its graph. Until its forward ends, the
layer also holds the tensors it was given (their autograd nodes are what tell a cast
from its source), and lets go of them then, or when the forward raises.
"""

from __future__ import annotations

import typing
import weakref
from collections.abc import Hashable

import torch

from .._compat import autograd_clock, to_copy_node_type
from .._compile import outside_compile
from .recast import CastRef
from .saved_checks import KeptAsSaved, inplace_error, source_changed_error
from .selection import is_marked_not_offload
from .tensor_group import SavedEntry, TensorGroupProcessor

__all__ = ["KeptLayer"]


class _Saved:
    """What autograd holds for one tensor a kept layer saved: the tensor (detached) and
    its version at the save; for a rebuilt cast, its :class:`CastRef` and source instead
    (NOTE [A kept layer's casts])."""

    __slots__ = ("cast", "layer", "original", "source", "source_version", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, layer: str) -> None:
        self.tensor: torch.Tensor | None = tensor.detach()
        self.version = tensor._version
        self.layer = layer
        self.cast: CastRef | None = None
        self.source: torch.Tensor | None = None
        self.source_version = 0
        #: A rebuilt cast's own tensor (the base of a saved view of it), while anything
        #: else holds it: a change to it after the save fails as without the package.
        self.original: weakref.ref[torch.Tensor] | None = None

    def unpack(self) -> torch.Tensor:
        """The tensor saved, or the cast rebuilt from its source, after the checks."""
        cast = self.cast
        if cast is None:
            tensor = self.tensor
            assert tensor is not None
            if tensor._version != self.version:
                raise inplace_error(tensor, self.version, self.layer)
            return tensor
        original = self.original() if self.original is not None else None
        if original is not None and original._version != self.version:
            raise inplace_error(original, self.version, self.layer)
        source = self.source
        assert source is not None
        if source._version != self.source_version:
            raise source_changed_error(source, self.source_version, self.layer)
        return cast.read(lambda: source, _current_stream())


def _current_stream() -> Hashable:
    # A cast read on two streams is cast once on each (CastRef.read).
    return torch.cuda.current_stream() if torch.cuda.is_initialized() else None


def _unpack(saved: _Saved | KeptAsSaved) -> torch.Tensor:
    return saved.unpack()


def _candidates(tensors: list[torch.Tensor]) -> list[int]:
    """The indices, in saving order, of the saved tensors that may be casts (made by
    ``_to_copy``, or views of such) or their sources (not views, of a cast's shape): what
    :meth:`TensorGroupProcessor.casts_to_rebuild` needs to see. Grouping only those keeps the
    host's work at the forward's end small where a layer saves no cast, or few."""
    cast_node = to_copy_node_type()
    casts: list[int] = []
    shapes: set[torch.Size] = set()
    for i, t in enumerate(tensors):
        base = t._base
        root = t if base is None else base
        if type(root.grad_fn) is cast_node:
            casts.append(i)
            shapes.add(root.shape)
    if not casts:
        return []
    taken = set(casts)
    return [
        i for i, t in enumerate(tensors) if i in taken or (t._base is None and t.shape in shapes)
    ]


class _Forward:
    """The tensors one forward of a kept layer saved, held until it ends."""

    __slots__ = ("cells", "clocks", "tensors")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.clocks: list[int] = []
        self.cells: list[_Saved] = []


class KeptLayer:
    """The saved tensors of one kept layer, its saved casts rebuilt in backward (NOTE [A
    kept layer's casts]).

    Enter :meth:`saving` around each forward with grad enabled, and call :meth:`finish`
    after it, or :meth:`abandon` when the forward raised; backward reads the tensors
    through the cells the hooks gave autograd.

    Args:
        name: The layer's name in messages.
        min_numel: Saved tensors with fewer elements are kept as they are (neither a
            cast nor a source): the offload context's ``min_tensor_size_to_offload``.

    Example:
        >>> layer = KeptLayer("layer 0", min_numel=1)
        >>> x = torch.randn(64, 64, requires_grad=True)
        >>> v = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
        >>> with layer.saving():  # softmax saves p, the product saves its bf16 cast
        ...     p = x.softmax(-1)
        ...     y = (p.to(torch.bfloat16) @ v).sum()
        >>> layer.finish()
        >>> layer.recast_bytes  # the cast's bytes went at the forward's end
        8192
        >>> y.backward()
    """

    def __init__(self, name: str, min_numel: int) -> None:
        self.name = name
        self.min_numel = min_numel
        #: Bytes of the casts the last finished forward let go.
        self.recast_bytes = 0
        self._current: _Forward | None = None
        self._processor = TensorGroupProcessor()
        # Entries into the engine run uncompiled (NOTE [torch.compile and the offload
        # engine]); made once, a hooks object is made per forward.
        self._hooks = (outside_compile(self._pack), outside_compile(_unpack))

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks for the layer's next forward."""
        self._current = _Forward()
        return torch.autograd.graph.saved_tensors_hooks(*self._hooks)

    def _pack(self, tensor: torch.Tensor) -> _Saved | KeptAsSaved:
        forward = self._current
        if forward is None:
            raise RuntimeError(
                f"{self.name}: a tensor was saved for backward outside the layer's forward "
                "(KeptLayer.saving() was not entered, or finish() was called already)"
            )
        if (
            tensor.numel() < self.min_numel
            # Neither a cast nor a source: made by no node (a weight, an input), not a
            # plain dense tensor of floating point, or marked to stay as it is.
            or tensor.grad_fn is None
            or type(tensor) is not torch.Tensor
            or tensor.layout is not torch.strided
            or tensor.is_nested
            or not tensor.dtype.is_floating_point
            or is_marked_not_offload(tensor)
        ):
            return KeptAsSaved(tensor, self.name)
        cell = _Saved(tensor, self.name)
        forward.tensors.append(tensor)
        forward.clocks.append(autograd_clock())
        forward.cells.append(cell)
        return cell

    @outside_compile
    def finish(self) -> None:
        """At the end of a forward that completed: find the saved casts and let them go."""
        forward, self._current = self._current, None
        if forward is None or not forward.cells:
            self.recast_bytes = 0
            return
        cells, tensors = forward.cells, forward.tensors
        among = _candidates(tensors)
        entries = [
            SavedEntry(
                tensors[i],
                None,
                i,
                version=cells[i].version,
                # Changed since its save: backward raises, and it is no cast's source.
                keep=tensors[i]._version != cells[i].version,
                clock=forward.clocks[i],
            )
            for i in among
        ]
        casts = self._processor.casts_to_rebuild(entries) if entries else {}
        # A cast saved twice has one CastRef for both saves.
        rebuilt: dict[int, CastRef] = {}
        for j, ref in casts.items():  # in saving order: a source comes first
            source = cells[among[typing.cast(int, ref.source)]]
            if source.tensor is None:
                continue  # a cast of a cast: its source goes already; this one stays
            rebuilt[id(ref)] = ref
            cell = cells[among[j]]
            cell.cast, cell.source, cell.source_version = ref, source.tensor, source.version
            # The cast itself: a view of it saved (bmm's 3-D probabilities) dies here,
            # but the cast or another view may live on and be changed.
            saved = entries[j].tensor
            cell.original = weakref.ref(saved if saved._base is None else saved._base)
            cell.tensor = None
        self.recast_bytes = sum(ref.nbytes for ref in rebuilt.values())

    def abandon(self) -> None:
        """After a forward that raised: let go of the tensors it was given. What its
        cells hold goes with whatever is left of its graph."""
        self._current = None
