"""Tensor groups: what exactly is copied for one layer, and how it is rebuilt.

All tensors one layer saved for backward form a group. Before the copies start, the
group is reduced to *units*: dense blocks of memory that a single copy moves and a
single allocation restores with the same size and strides. Each transform comes with its
inverse, applied after reload:

* wrapper subclasses (``__tensor_flatten__``) -> their inner tensors, and back
  (``__tensor_unflatten__``);
* the same tensor saved twice -> one unit, and back to the *same* reloaded tensor;
* views of one base (q, k, v sliced from one qkv projection) -> the base, when the views
  cover it, and back to views with the same size, stride and offset (a layer may keep
  such views on the device instead: NOTE [Bytes that pay] in ``peak_watch.py``);
* a dense but permuted tensor -> a host buffer with the same strides, and back;
* a cast of another saved tensor (fp32 attention probabilities and their bf16 copy) ->
  nothing, cast again from the other one's reload (NOTE [Casts rebuilt from their
  source] in ``recast.py``).

A tensor none of these can restore exactly (a small strided slice of a large tensor,
overlapping strides) stays on the device, with a warning once per shape: its layout is
never changed behind a kernel's back.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .._warn import warn_at_caller
from .layout import TensorLayout
from .recast import CastRef, cast_ref, casts_among
from .selection import is_dense

__all__ = ["CastRef", "GroupPlan", "KeptRef", "SavedEntry", "TensorGroupProcessor", "Unit"]

#: Views are replaced by their base only when they hold at least this share of it, so
#: that a small slice never drags a large base through the link.
_BASE_COVERAGE = 0.5


@dataclass(slots=True)  # made per saved tensor: slots make it cheaper
class SavedEntry:
    """One tensor pushed by autograd, with the event marking when it was complete."""

    tensor: torch.Tensor
    ready: object | None
    seq: int
    force_base: bool = False
    #: The tensor's version counter when it was saved: an in-place change after that
    #: must still fail in backward, as it does without offloading.
    version: int = 0
    #: Keep on the device as it is (it was modified in place after it was saved).
    keep: bool = False
    #: After the device memory is released: the original, to detect later changes.
    weak: weakref.ref[torch.Tensor] | None = None
    #: ``_compat.autograd_clock()`` when it was saved; -1: unknown (NOTE [Casts rebuilt
    #: from their source] in ``recast.py``).
    clock: int = -1


@dataclass(slots=True)  # made per saved tensor: slots make it cheaper
class Unit:
    """A dense block moved by one copy each way."""

    layout: TensorLayout
    device: torch.device
    tensor: torch.Tensor | None  # the device tensor, until its memory is released
    ready: object | None
    ready_seq: int
    host: torch.Tensor | None = None  # raw host buffer
    host_view: torch.Tensor | None = None  # the buffer seen with the unit's layout
    copied: object | None = None  # event: offload copy done
    reloaded: torch.Tensor | None = None
    restored: object | None = None  # event: reload copy done
    #: The stream ``reloaded`` was allocated on, and the streams that waited for
    #: ``restored``: backward runs each node on its forward's stream, so one reloaded
    #: tensor may be read on several.
    home: Hashable = None
    waited: set[Hashable] = field(default_factory=set)
    pending_pops: int = 0
    #: Stays on the device: never copied; ``reloaded`` is the device tensor itself until
    #: its last read, then ``returned`` (weak references to the tensors rebuilt from it)
    #: lets a later read find the memory while autograd still holds one of them.
    kept: bool = False
    returned: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    storage_offset: int = 0  # of the kept device tensor, to rebuild it from ``returned``
    #: Read by backward at least once (NOTE [Reloads in the order backward reads] in
    #: ``reload_order.py``).
    read: bool = False

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


@dataclass(frozen=True, slots=True)
class _UnitRef:
    unit: int
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None  # size, stride, offset


@dataclass(frozen=True)
class KeptRef:
    """A saved tensor served as it is, from the device (not restorable from units)."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class _SubclassRef:
    cls: type
    ctx: object
    size: torch.Size
    stride: tuple[int, ...]
    inner: dict[str, _Ref]


_Ref = _UnitRef | KeptRef | _SubclassRef | CastRef


@dataclass
class GroupPlan:
    """The units of one layer and, per pushed id, how to rebuild its tensor."""

    units: list[Unit] = field(default_factory=list)
    refs: list[_Ref] = field(default_factory=list)
    #: Bytes of the bases copied only because strided views of them were saved: what
    #: keeping those views on the device would spare the link.
    view_base_bytes: int = 0
    #: Bytes of the saved tensors rebuilt as casts of others instead of moved.
    recast_bytes: int = 0

    @property
    def moved(self) -> list[Unit]:
        """The units copied to the host and back (all but the kept ones)."""
        return [u for u in self.units if not u.kept]

    def keep_units(self, budget: int) -> int:
        """Keep moved units on the device, largest first, within ``budget`` bytes.

        A kept unit is never copied, and the tensors of its references are served from
        the device tensor itself (NOTE [Bytes that pay] in ``peak_watch.py``).

        Returns:
            The bytes kept.
        """
        kept = 0
        if budget <= 0:
            return kept
        for unit in sorted(self.moved, key=lambda u: u.nbytes, reverse=True):
            tensor = unit.tensor
            assert tensor is not None
            # A slice of a larger storage would keep all of it alive: moved, only the
            # slice comes back.
            if kept + unit.nbytes <= budget and not _shares_storage(tensor, unit.nbytes):
                unit.kept = True
                unit.storage_offset = int(tensor.storage_offset())
                kept += unit.nbytes
        return kept

    def late_tail(self, moved: list[Unit], budget: int) -> int:
        """How many of ``moved`` (in copy order) to release at the layer's point, so that
        the rest, the last ones copied, fit in ``budget`` bytes released one point late
        (NOTE [Bytes that pay] in ``peak_watch.py``).

        The tail holds only units that own their whole storage (a slice would hold all of
        it), and no tensor is rebuilt from units on both sides (it would hold the early
        ones too): what is deferred is exactly what the device keeps longer.
        """
        split, deferred = len(moved), 0
        while split > 0:
            unit = moved[split - 1]
            assert unit.tensor is not None
            if deferred + unit.nbytes > budget or _shares_storage(unit.tensor, unit.nbytes):
                break
            split -= 1
            deferred += unit.nbytes
        while split < len(moved) and self._straddles({id(u) for u in moved[split:]}):
            split += 1
        return split

    def _straddles(self, late: set[int]) -> bool:
        for ref in self.refs:
            ids = self.unit_ids(ref)
            if len(ids) > 1 and len({id(self.units[u]) in late for u in ids}) > 1:
                return True
        return False

    def keep(self, index: int, tensor: torch.Tensor) -> None:
        """Serve pushed id ``index`` from ``tensor`` itself instead of its units."""
        for u in self.unit_ids(self.refs[index]):
            self.units[u].pending_pops -= 1
        self.refs[index] = KeptRef(tensor)

    def unit_ids(self, ref: _Ref) -> list[int]:
        """The units ``ref`` is rebuilt from."""
        if isinstance(ref, _UnitRef):
            return [ref.unit]
        if isinstance(ref, _SubclassRef):
            return [u for r in ref.inner.values() for u in self.unit_ids(r)]
        if isinstance(ref, CastRef):
            return self.unit_ids(ref.source)  # type: ignore[arg-type]
        return []


def _shares_storage(tensor: torch.Tensor, nbytes: int) -> bool:
    """Whether ``tensor``'s storage holds more than its ``nbytes``."""
    return tensor.untyped_storage().nbytes() != nbytes


def _is_wrapper(tensor: torch.Tensor) -> bool:
    return type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__")


def _storage_key(t: torch.Tensor) -> tuple[object, ...]:
    # The address of the first element, with shape, strides and dtype, names one view of
    # one memory (two live storages never share an address). ``data_ptr()`` is used
    # rather than the storage's address and offset: it costs no storage object.
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


@dataclass(slots=True)  # made per saved tensor: slots make it cheaper
class _Leaf:
    tensor: torch.Tensor
    ready: object | None
    seq: int
    force_base: bool
    clock: int
    key: tuple[object, ...] = ()


class _Grouped(NamedTuple):
    leaves: list[_Leaf]
    templates: list[object]  # per pushed entry: a leaf index, or a wrapper's template
    alias: list[int]  # per leaf: the index of the leaf with the same memory
    roots: dict[tuple[object, ...], tuple[torch.Tensor, list[int]]]


def _pushed(grouped: _Grouped) -> dict[int, list[int]]:
    """Distinct leaf -> the pushed entries that are it."""
    pushed: dict[int, list[int]] = {}
    for e, tpl in enumerate(grouped.templates):
        if isinstance(tpl, int):
            pushed.setdefault(grouped.alias[tpl], []).append(e)
    return pushed


def _cast_ref(
    grouped: _Grouped,
    pushed: dict[int, list[int]],
    root_key: tuple[object, ...],
    source: int,
    source_ref: object,
) -> CastRef:
    """The :class:`CastRef` of the cast ``root_key`` of leaf ``source``
    (:func:`.recast.casts_among`); ``source_ref`` is how the source is read."""
    root, (i,) = grouped.roots[root_key]
    return cast_ref(
        root, root_key, grouped.leaves[i], source_ref, tuple(pushed[source]), len(pushed[i])
    )


class TensorGroupProcessor:
    """Turns one layer's saved tensors into units, and rebuilds them after reload.

    The processor keeps only the set of shapes it has warned about, so that a layout it
    cannot restore is reported once rather than every step.
    """

    def __init__(self) -> None:
        self._warned: set[tuple[object, ...]] = set()

    # -- forward: tensors -> units ---------------------------------------------------

    def process(self, entries: Sequence[SavedEntry], keep_view_bases: bool = False) -> GroupPlan:
        """Group ``entries`` (in push order) into units and references.

        ``keep_view_bases``: bases copied only for the sake of views become units that
        stay on the device (:attr:`Unit.kept`): no copy either way, the views are rebuilt
        from the base itself (NOTE [Bytes that pay] in ``peak_watch.py``).
        """
        grouped = self._group(entries)
        leaves, templates, alias, roots = grouped
        plan = GroupPlan()
        leaf_refs: dict[int, _Ref] = {}
        casts = casts_among(roots, leaves, sorted(set(alias)), _BASE_COVERAGE)
        for root_key, (root, members) in roots.items():
            if root_key in casts:
                continue  # rebuilt from its source below
            if len(members) == 1:
                leaf = leaves[members[0]]
                if leaf.tensor is root:
                    # The common case, a tensor saved as itself (not a view): no grouping
                    # to decide, and no call to make for it.
                    leaf_refs[members[0]] = self._own_unit(root, leaf, plan)
                    continue
                if not leaf.force_base and leaf.key != root_key and is_dense(leaf.tensor):
                    # A dense view saved alone (Linear's input reshaped to 2-D, its base
                    # not saved): _plan_root would copy it as a unit of its own too.
                    leaf_refs[members[0]] = _UnitRef(self._add_unit(plan, leaf.tensor, leaf), None)
                    continue
            leaf_refs.update(self._plan_root(root, members, leaves, plan, keep_view_bases))
        pushed = _pushed(grouped)
        for root_key, source in casts.items():  # in saving order: a source comes first
            cast = _cast_ref(grouped, pushed, root_key, source, leaf_refs[source])
            leaf_refs[roots[root_key][1][0]] = cast
            plan.recast_bytes += cast.nbytes

        plan.refs = [self._resolve(tpl, leaf_refs, alias) for tpl in templates]
        for ref in plan.refs:
            for u in plan.unit_ids(ref):
                plan.units[u].pending_pops += 1
        return plan

    def casts_to_rebuild(self, entries: Sequence[SavedEntry]) -> dict[int, CastRef]:
        """For a layer that keeps what it saved on the device: which pushed entries are
        casts to rebuild from another pushed tensor (NOTE [A kept layer's casts] in
        ``kept_layer.py``), by the same rules as :meth:`process`.

        Returns:
            Pushed index of each cast -> its :class:`CastRef`, whose ``source`` is the
            pushed index of the source's first save.
        """
        grouped = self._group(entries)
        leaves, _, alias, roots = grouped
        casts = casts_among(roots, leaves, sorted(set(alias)), _BASE_COVERAGE)
        if not casts:
            return {}
        pushed = _pushed(grouped)
        found: dict[int, CastRef] = {}
        for root_key, source in casts.items():
            cast = _cast_ref(grouped, pushed, root_key, source, pushed[source][0])
            for e in pushed[roots[root_key][1][0]]:
                found[e] = cast
        return found

    def _group(self, entries: Sequence[SavedEntry]) -> _Grouped:
        """``entries`` as distinct leaves (the same memory saved twice is one), grouped
        by the base tensor that owns their memory."""
        leaves: list[_Leaf] = []
        templates = [self._flatten(e.tensor, e, leaves) for e in entries]

        # Deduplicate: the same memory saved twice is one leaf.
        canonical: dict[tuple[object, ...], int] = {}
        alias: list[int] = []
        for i, leaf in enumerate(leaves):
            leaf.key = _storage_key(leaf.tensor)
            j = canonical.setdefault(leaf.key, i)
            if j != i:  # the later save decides when the shared copy may start
                if leaf.seq > leaves[j].seq:
                    leaves[j].ready, leaves[j].seq = leaf.ready, leaf.seq
                leaves[j].force_base |= leaf.force_base
                leaves[j].clock = -1 if leaf.clock < 0 else min(leaves[j].clock, leaf.clock)
            alias.append(j)

        roots: dict[tuple[object, ...], tuple[torch.Tensor, list[int]]] = {}
        for i in sorted(set(alias)):
            t = leaves[i].tensor
            base = t._base
            if base is None:
                roots.setdefault(leaves[i].key, (t, []))[1].append(i)
            else:
                roots.setdefault(_storage_key(base), (base, []))[1].append(i)
        return _Grouped(leaves, templates, alias, roots)

    def _flatten(self, tensor: torch.Tensor, entry: SavedEntry, leaves: list[_Leaf]) -> object:
        # A template mirrors the nesting of wrapper subclasses; ints are leaf indices.
        if entry.keep:
            return KeptRef(tensor)
        if _is_wrapper(tensor):
            names, ctx = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
            inner = {n: self._flatten(getattr(tensor, n), entry, leaves) for n in names}
            return (type(tensor), ctx, tensor.size(), tensor.stride(), inner)
        leaves.append(_Leaf(tensor, entry.ready, entry.seq, entry.force_base, entry.clock))
        return len(leaves) - 1

    def _resolve(self, template: object, leaf_refs: dict[int, _Ref], alias: list[int]) -> _Ref:
        if isinstance(template, int):
            return leaf_refs[alias[template]]
        if isinstance(template, KeptRef):
            return template
        assert isinstance(template, tuple)
        cls, ctx, size, stride, inner = template
        return _SubclassRef(
            cls,
            ctx,
            size,
            stride,
            {n: self._resolve(t, leaf_refs, alias) for n, t in inner.items()},
        )

    def _plan_root(
        self,
        root: torch.Tensor,
        members: list[int],
        leaves: list[_Leaf],
        plan: GroupPlan,
        keep_view_bases: bool,
    ) -> dict[int, _Ref]:
        refs: dict[int, _Ref] = {}
        tensors = [leaves[i].tensor for i in members]
        root_key = _storage_key(root)
        same_dtype = all(t.dtype == root.dtype for t in tensors)
        covered = sum(t.numel() for t in tensors)
        take_root = (
            is_dense(root)
            and same_dtype
            and (
                any(leaves[i].key == root_key for i in members)
                or any(leaves[i].force_base for i in members)
                or (
                    (len(tensors) > 1 or not all(is_dense(t) for t in tensors))
                    and covered >= _BASE_COVERAGE * root.numel()
                )
            )
        )
        # Copied only because views of it cannot be copied on their own (not saved itself,
        # not marked with offload_base_tensor=True): a base the layer may keep instead.
        for_views = (
            take_root
            and not any(leaves[i].key == root_key or leaves[i].force_base for i in members)
            and not all(is_dense(t) for t in tensors)
        )
        if for_views:
            plan.view_base_bytes += root.numel() * root.element_size()
        if take_root:
            ready_leaf = max((leaves[i] for i in members), key=lambda leaf: leaf.seq)
            u = self._add_unit(plan, root, ready_leaf)
            if for_views and keep_view_bases:
                plan.units[u].kept = True
                plan.units[u].storage_offset = int(root.storage_offset())
            for i, t in zip(members, tensors, strict=True):
                view = None
                if leaves[i].key != root_key:
                    view = (
                        tuple(t.shape),
                        t.stride(),
                        int(t.storage_offset() - root.storage_offset()),
                    )
                refs[i] = _UnitRef(u, view)
            return refs
        for i, t in zip(members, tensors, strict=True):
            refs[i] = self._own_unit(t, leaves[i], plan)
        return refs

    def _own_unit(self, tensor: torch.Tensor, leaf: _Leaf, plan: GroupPlan) -> _Ref:
        """``tensor`` as a unit of its own if it is dense, else kept on the device."""
        if is_dense(tensor):
            return _UnitRef(self._add_unit(plan, tensor, leaf), None)
        self._warn_kept(tensor)
        return KeptRef(tensor)

    @staticmethod
    def _add_unit(plan: GroupPlan, tensor: torch.Tensor, leaf: _Leaf) -> int:
        plan.units.append(
            Unit(TensorLayout.of(tensor), tensor.device, tensor, leaf.ready, leaf.seq)
        )
        return len(plan.units) - 1

    def _warn_kept(self, t: torch.Tensor) -> None:
        key = (tuple(t.shape), t.stride(), t.dtype)
        if key in self._warned:
            return
        self._warned.add(key)
        warn_at_caller(
            f"cpu_offload: a saved tensor of shape {tuple(t.shape)}, stride {t.stride()} and "
            f"dtype {t.dtype} stays on the GPU: it is a strided view whose layout cannot be "
            "restored exactly after a copy, and its base is not worth copying instead. "
            "Use start_offload(tensor, offload_base_tensor=True) to offload its base, or "
            "mark_not_offload(tensor) to silence this warning."
        )

    # -- backward: units -> tensors --------------------------------------------------

    @staticmethod
    def restore(plan: GroupPlan, ref: _Ref, stream: Hashable = None) -> torch.Tensor:
        """Rebuild the tensor of ``ref`` from the reloaded units of ``plan``, for a read
        on ``stream`` (the current one)."""
        if isinstance(ref, KeptRef):
            return ref.tensor
        if isinstance(ref, CastRef):
            source: Any = ref.source
            return ref.read(lambda: TensorGroupProcessor.restore(plan, source, stream), stream)
        if isinstance(ref, _SubclassRef):
            inner = {n: TensorGroupProcessor.restore(plan, r, stream) for n, r in ref.inner.items()}
            return ref.cls.__tensor_unflatten__(inner, ref.ctx, ref.size, ref.stride)  # type: ignore[attr-defined]
        unit = plan.units[ref.unit]
        base = unit.reloaded
        assert base is not None, "unit restored before it was reloaded"
        if ref.view is None:
            out = base
        else:
            size, stride, offset = ref.view
            out = base.as_strided(size, stride, base.storage_offset() + offset)
        if unit.kept:
            # A later read finds the memory through what autograd still holds of it
            # (the inner tensors of a wrapper subclass included).
            unit.returned.append(weakref.ref(out))
        return out
