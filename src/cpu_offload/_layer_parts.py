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
(detached, NOTE [Kept tensors are detached]), and each offloaded part's forward under
the engine's own pack and unpack hooks again: the innermost hooks decide. A recomputed
part runs through the same non-reentrant checkpoint as a recomputed layer (NOTE
[Recomputation runs the whole layer]), whose own hooks take what the part saves; the
checkpoint's copy of the part's inputs is saved under the enclosing hooks, and kept. Under
``torch.no_grad()``, in a recomputation in backward, or inside a model's own checkpoint,
a part runs as it is.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["PartChoice", "PartPlan", "check_parts", "keep_saved"]


class PartChoice(str, enum.Enum):
    """What happens to what one part of a layer saves for backward."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"


#: Layer index -> part name (a submodule path inside the layer) -> choice.
PartPlan = dict[int, dict[str, PartChoice]]


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def keep_saved() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that keep every tensor where it is (NOTE [Parts of a layer])."""
    return torch.autograd.graph.saved_tensors_hooks(_detached, _same)


def _submodule_names(layer: nn.Module) -> list[str]:
    return [name for name, _ in layer.named_modules() if name]


def check_parts(
    parts: Mapping[Any, Mapping[Any, Any]] | None,
    layers: list[nn.Module],
    whole: Iterable[int],
) -> PartPlan:
    """``parts`` checked: layer index -> {submodule path: :class:`PartChoice`}.

    Args:
        parts: What :func:`cpu_offload.offload_layers` was given, or None.
        layers: The wrapped layers.
        whole: Indices of the layers offloaded or recomputed whole.

    Raises:
        TypeError: If ``parts`` is not a mapping of layer indices to mappings of names.
        ValueError: On an index out of range, a layer also offloaded or recomputed whole,
            a name that is not a submodule of its layer, a part inside another, or an
            unknown choice.
    """
    if parts is None:
        return {}
    if not isinstance(parts, Mapping):
        raise TypeError(
            "parts must map layer indices to {submodule name: choice}, got "
            f"{type(parts).__name__}"
        )
    n = len(layers)
    taken = set(whole)
    allowed = ", ".join(repr(c.value) for c in PartChoice)
    out: PartPlan = {}
    for index, choices in parts.items():
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"parts: keys must be layer indices (ints), got {index!r}")
        if not 0 <= index < n:
            raise ValueError(
                f"parts: layer index {index} is out of range [0, {n - 1}] for a stack of {n} layers"
            )
        if index in taken:
            raise ValueError(
                f"parts: layer {index} is also offloaded or recomputed whole; give a layer "
                "either a whole-layer choice or choices for its parts"
            )
        if not isinstance(choices, Mapping):
            raise TypeError(
                f"parts[{index}] must map submodule names to choices, got {type(choices).__name__}"
            )
        names = _submodule_names(layers[index])
        layer_parts: dict[str, PartChoice] = {}
        for name, choice in choices.items():
            if not isinstance(name, str) or name not in names:
                shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
                raise ValueError(
                    f"parts[{index}]: {name!r} is not a submodule of layer {index} "
                    f"({type(layers[index]).__name__}); its submodules: {shown}"
                )
            try:
                layer_parts[name] = PartChoice(choice)
            except ValueError:
                raise ValueError(
                    f"parts[{index}][{name!r}] must be one of {allowed}; got {choice!r}"
                ) from None
        for a in layer_parts:
            for b in layer_parts:
                if a != b and b.startswith(a + "."):
                    raise ValueError(
                        f"parts[{index}]: {b!r} lies inside {a!r}; give each part once, "
                        "the outer one or the ones inside it"
                    )
        if layer_parts:
            out[index] = layer_parts
    return out
