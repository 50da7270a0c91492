"""Parts of a wrapped layer (its submodules) kept, offloaded or recomputed on their own.

A layer's saved tensors are not alike: on Megatron-Core's GPT with local attention, three
quarters of a layer's bytes are the attention core's scores and probabilities, cheap to
recompute from q, k and v, while the projections' inputs are costly to recompute and cheap
to move. :func:`cpu_offload.offload_layers` therefore takes, per layer, a choice per part
(``parts={3: {"self_attention.core_attention": "recompute", "mlp": "offload"}}``): what a
part saves is offloaded, recomputed in backward, or kept, and whatever the layer saves
outside its parts is kept.

NOTE [Parts of a layer]
A layer with an offloaded part counts as offloaded for the schedule (its bytes leave
before the forward of layer ``n-m+j`` and come back at the backward of ``n-m+j-1``, as a
whole layer's would). Its forward runs inside the offload context, whose hooks would
offload everything it saves; so the whole forward runs under hooks that keep each tensor
(detached and version-checked: NOTE [Kept tensors are detached], NOTE [Kept tensors keep
their version check]), and each offloaded part's forward under the engine's own pack and
unpack hooks again: the innermost hooks decide. Once every offloaded part of the layer has
run, and none runs any more (one may call another), nothing more reaches the engine in
that forward: the layer's copies are queued then
(``DefaultOffloadSynchronizer.start_offload_early``), beside the rest of the layer, not at
its end. With a part offloaded in every layer but the last, the schedule makes each
layer's forward wait for the previous layer's copies, which queued at the layer's end
overlapped nothing. Its memory still goes at the schedule's point, and its saved casts at
its end (after a version check: NOTE [Casts rebuilt from their source] in
``engine/recast.py``); ``start_offload`` on what it saved is refused from then on, and an
offloaded part run again keeps what it saves. A recomputed part runs through the same
non-reentrant checkpoint as a recomputed layer (NOTE [Recomputation runs the whole
layer]), whose own hooks take what the part saves; the checkpoint's copy of the part's
inputs is saved under the enclosing hooks, and kept. Under ``torch.no_grad()``, in a
recomputation in backward, or inside a model's own checkpoint, a part runs as it is.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ._layer_stack import check_indices
from ._layer_wrap import wrap_of
from .engine.saved_checks import KeptAsSaved

__all__ = ["PART_CHOICES", "Choice", "PartPlan", "check_part_names", "check_parts", "keep_saved"]


class Choice(str, enum.Enum):
    """What happens to what a layer, or a part of it, saves for backward: kept,
    offloaded or recomputed; or, for a whole layer, kept with its saved casts rebuilt
    in backward (``RECAST``: NOTE [A kept layer's casts] in
    ``cpu_offload/engine/kept_layer.py``). Also ``cpu_offload.plan.Choice``."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    RECAST = "recast"


#: The choices a part of a layer may have.
PART_CHOICES = (Choice.KEEP, Choice.OFFLOAD, Choice.RECOMPUTE)


#: Layer index -> part name (a submodule path inside the layer) -> choice.
PartPlan = dict[int, dict[str, Choice]]


def _unpack(kept: KeptAsSaved) -> torch.Tensor:
    return kept.unpack()


def keep_saved(layer: str) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that keep every tensor where it is (NOTE [Parts of a layer]),
    version-checked as without hooks (NOTE [Kept tensors keep their version check] in
    ``engine/saved_checks.py``); ``layer`` names the layer in the check's message."""
    return torch.autograd.graph.saved_tensors_hooks(
        functools.partial(KeptAsSaved, layer=layer), _unpack
    )


def check_part_names(arg: str, index: int, layer: nn.Module, names: Iterable[object]) -> list[str]:
    """``names`` checked as parts of ``layer`` (layer ``index``): submodules of it, each
    once, none inside another.

    Args:
        arg: What the message calls the argument (``"parts"``).
        index: The layer's index.
        layer: The layer.
        names: Submodule paths inside it.

    Raises:
        ValueError: On a name that is not a submodule of the layer (the message lists
            them), a name given twice, or a part inside another.
    """
    known = [name for name, _ in layer.named_modules() if name]
    out: list[str] = []
    for name in names:
        if not isinstance(name, str) or name not in known:
            shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
            raise ValueError(
                f"{arg}[{index}]: {name!r} is not a submodule of layer {index} "
                f"({type(layer).__name__}); its submodules: {shown}"
            )
        if name in out:
            raise ValueError(f"{arg}[{index}]: {name!r} is given twice")
        out.append(name)
    for a in out:
        for b in out:
            if a != b and b.startswith(a + "."):
                raise ValueError(
                    f"{arg}[{index}]: {b!r} lies inside {a!r}; give each part once, the "
                    "outer one or the ones inside it"
                )
    return out


def check_parts(
    parts: Mapping[Any, Mapping[Any, Any]] | None,
    layers: list[nn.Module],
    whole: Iterable[int],
    owned: Collection[nn.Module] = (),
) -> PartPlan:
    """``parts`` checked: layer index -> {submodule path: :class:`Choice`}.

    Args:
        parts: What :func:`cpu_offload.offload_layers` was given, or None.
        layers: The wrapped layers.
        whole: Indices of the layers offloaded, recomputed or recast whole.
        owned: Part modules the caller wraps already (a handle that reassigns its
            parts): not refused as wrapped by another ``offload_layers``.

    Raises:
        TypeError: If ``parts`` is not a mapping of layer indices to mappings of names,
            or a key is not an int.
        ValueError: On an index out of range, a layer also offloaded or recomputed whole,
            a name that is not a submodule of its layer (or is given twice, or lies inside
            another), a module that is a part twice (shared by two layers) or is wrapped
            by another ``offload_layers`` already, or an unknown choice.
    """
    if parts is None:
        return {}
    if not isinstance(parts, Mapping):
        raise TypeError(
            "parts must map layer indices to {submodule name: choice}, got "
            f"{type(parts).__name__}"
        )
    check_indices("parts", parts.keys(), len(layers))
    taken = set(whole)
    allowed = ", ".join(repr(c.value) for c in PART_CHOICES)
    out: PartPlan = {}
    seen: dict[int, str] = {}  # id of a part's module -> where it was given
    for index, choices in parts.items():
        if index in taken:
            raise ValueError(
                f"parts: layer {index} is also offloaded, recomputed or recast whole; give a layer "
                "either a whole-layer choice or choices for its parts"
            )
        if not isinstance(choices, Mapping):
            raise TypeError(
                f"parts[{index}] must map submodule names to choices, got {type(choices).__name__}"
            )
        layer_parts: dict[str, Choice] = {}
        for name in check_part_names("parts", index, layers[index], choices.keys()):
            choice = choices[name]
            try:
                layer_parts[name] = Choice(choice)
                if layer_parts[name] not in PART_CHOICES:
                    raise ValueError(choice)
            except ValueError:
                raise ValueError(
                    f"parts[{index}][{name!r}] must be one of {allowed}; got {choice!r}"
                ) from None
            module = layers[index].get_submodule(name)
            where = f"parts[{index}][{name!r}]"
            if id(module) in seen:
                raise ValueError(
                    f"{where} is the module of {seen[id(module)]} too: a module shared by "
                    "two layers (or two parts) can be a part of one only"
                )
            seen[id(module)] = where
            if wrap_of(module) is not None and not any(module is m for m in owned):
                raise ValueError(
                    f"{where} ({type(module).__name__}) is wrapped by another offload_layers "
                    "already; call remove() on that handle first"
                )
        if layer_parts:
            out[index] = layer_parts
    return out
