"""Finding the stack of layers in a model, and choosing which of them to offload."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from ._args import check_int, has_duplicates
from ._switch import use_v1

__all__ = ["LAYER_PATHS", "check_indices", "checked_sets", "find_layers", "offload_schedule"]

#: Attribute paths tried, in order, on a whole model: Hugging Face decoders
#: (``model.model.layers``, GPT-2's ``model.transformer.h``, OPT's
#: ``model.model.decoder.layers``), ``nn.TransformerEncoder`` / ``LlamaModel``
#: (``layers``) and Megatron-Core's ``GPTModel`` (``decoder.layers``, or
#: ``module.decoder.layers`` inside its ``Float16Module``).
LAYER_PATHS: tuple[str, ...] = (
    "model.layers",
    "transformer.h",
    "model.decoder.layers",
    "layers",
    "decoder.layers",
    "module.decoder.layers",
    "h",
    "gpt_neox.layers",
    "transformer.layers",
    "blocks",
)


def _lookup(model: nn.Module, path: str) -> object:
    obj: object = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_layers(model_or_layers: object) -> list[nn.Module]:
    """The layers of ``model_or_layers``, in forward order.

    Args:
        model_or_layers: An ``nn.ModuleList``, an ``nn.Sequential``, a list or tuple of
            modules, or a whole model whose layer stack sits at one of
            :data:`LAYER_PATHS`.

    Returns:
        The layers as a list (the modules themselves, not copies).

    Raises:
        TypeError: If a sequence holds something that is not an ``nn.Module``, or the
            argument is neither a module nor a sequence of modules.
        ValueError: If no layer stack is found in a model (the message lists the paths
            tried and says what to pass instead), the stack is empty, or a module is in
            it twice or inside another of its layers.
    """
    if isinstance(model_or_layers, (nn.ModuleList, nn.Sequential)):
        layers = list(model_or_layers)
    elif isinstance(model_or_layers, nn.Module):
        found = None
        for path in LAYER_PATHS:
            candidate = _lookup(model_or_layers, path)
            if isinstance(candidate, (nn.ModuleList, nn.Sequential)) and len(candidate) > 0:
                found = candidate
                break
        if found is None:
            raise ValueError(
                f"offload_layers could not find the layer stack of "
                f"{type(model_or_layers).__name__}: tried model.{', model.'.join(LAYER_PATHS)}. "
                "Pass the nn.ModuleList of its layers (or a list of them) instead, for "
                "example offload_layers(model.blocks, num_offloaded=2)"
            )
        layers = list(found)
    elif isinstance(model_or_layers, Sequence) and not isinstance(model_or_layers, str):
        layers = list(model_or_layers)
        for i, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(
                    f"offload_layers: entry {i} of the layer sequence is a "
                    f"{type(layer).__name__}, not an nn.Module"
                )
    else:
        raise TypeError(
            "offload_layers expects an nn.Module (a model, an nn.ModuleList or an "
            f"nn.Sequential) or a list of modules, got {type(model_or_layers).__name__}"
        )
    if not layers:
        raise ValueError("offload_layers: the layer stack is empty")
    if has_duplicates(layers):
        # One module run twice per forward would be counted as two layers by the
        # schedule, but it has one forward method to wrap.
        raise ValueError("offload_layers: the same module appears twice in the layer stack")
    ids = {id(layer): i for i, layer in enumerate(layers)}
    for i, layer in enumerate(layers):
        for child in layer.modules():
            j = ids.get(id(child))
            if child is not layer and j is not None:
                # Its forward runs inside layer i's: the stack's order would be wrong.
                raise ValueError(
                    f"offload_layers: entry {j} of the layer stack is a submodule of entry "
                    f"{i}; pass the layers that run one after another"
                )
    return layers


def check_indices(name: str, indices: Iterable[object], num_layers: int) -> frozenset[int]:
    """``indices`` as a set of layer indices in ``[0, num_layers - 1]``.

    Raises:
        TypeError: If ``indices`` is not iterable or holds something other than ints.
        ValueError: If an index is out of range or given twice.
    """
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
        raise TypeError(
            f"{name} must be an iterable of layer indices, got {type(indices).__name__}"
        )
    out = set()
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"{name} must hold ints (layer indices), got {index!r}")
        if not 0 <= index < num_layers:
            raise ValueError(
                f"{name}: layer index {index} is out of range [0, {num_layers - 1}] "
                f"for a stack of {num_layers} layers"
            )
        if index in out:
            raise ValueError(f"{name}: layer index {index} is given twice")
        out.add(index)
    return frozenset(out)


def offload_schedule(
    offloaded: frozenset[int], num_layers: int
) -> dict[int, tuple[bool, int, bool, int]]:
    """A ``synchronization_dict`` for any set of offloaded layers, the default rule extended.

    The ``j``-th offloaded layer (of ``m``) finishes its offload before the forward of
    layer ``n-m+j`` and starts its reload when the backward of layer ``n-m+j-1`` starts,
    so that at most ``n-m`` layers' activations are on the device at once. For the first
    ``k`` layers this is the default schedule. An offloaded layer with no later forward
    to finish before (the last layers all offloaded) finishes when the backward begins
    and reloads at the backward of the layer after it: it saves no memory.
    """
    n, m = num_layers, len(offloaded)
    schedule: dict[int, tuple[bool, int, bool, int]] = {}
    for j, layer in enumerate(sorted(offloaded)):
        finish = n - m + j
        if finish > layer:
            schedule[layer] = (True, finish, False, finish - 1)
        else:
            schedule[layer] = (False, n - 1, False, min(layer + 1, n - 1))
    return schedule


def _offloaded_set(
    num_offloaded: int | None, offloaded: Iterable[int] | None, n: int
) -> frozenset[int]:
    if num_offloaded is not None and offloaded is not None:
        raise ValueError(
            "offload_layers: pass num_offloaded (the first k layers) or offloaded "
            "(explicit layer indices), not both"
        )
    if offloaded is not None:
        return check_indices("offloaded", offloaded, n)
    if num_offloaded is None:
        return frozenset()
    check_int("num_offloaded", num_offloaded)
    v1 = use_v1()
    top = n if v1 else n - 1  # V2 keeps at least one layer's activations on the GPU
    if not 0 <= num_offloaded <= top:
        why = "V1 backend" if v1 else "V2 backend, which keeps one layer's activations on the GPU"
        raise ValueError(
            f"num_offloaded must be in [0, {top}] for a stack of {n} layers under the "
            f"{why}, got {num_offloaded}"
        )
    return frozenset(range(num_offloaded))


def checked_sets(
    num_offloaded: int | None,
    offloaded: Iterable[int] | None,
    recomputed: Iterable[int],
    recast: Iterable[int],
    n: int,
) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
    """The offloaded, the recomputed and the recast layer indices, checked and disjoint."""
    offloaded_set = _offloaded_set(num_offloaded, offloaded, n)
    recomputed_set = check_indices("recomputed", recomputed, n)
    recast_set = check_indices("recast", recast, n)
    for (a, a_set), (b, b_set) in (
        (("offloaded", offloaded_set), ("recomputed", recomputed_set)),
        (("offloaded", offloaded_set), ("recast", recast_set)),
        (("recomputed", recomputed_set), ("recast", recast_set)),
    ):
        both = sorted(a_set & b_set)
        if both:
            raise ValueError(
                f"offload_layers: layers {both} are in both {a} and {b}; give each layer "
                "one of offloaded, recomputed and recast (an offloaded layer's casts are "
                "rebuilt already, a recomputed one saves none)"
            )
    return offloaded_set, recomputed_set, recast_set
