"""Where a wrapped layer's own forward is called: the frames ``torch.compile`` compiles.

The rest of the package is kept out of TorchDynamo's reach (NOTE [torch.compile and the
offload engine] in :mod:`cpu_offload._compile`), so these two functions live apart: when a
model compiled as a whole reaches an offloaded layer, the engine runs as plain Python and
calls one of them, whose frame Dynamo then compiles with the layer's forward inlined (one
graph per layer; ``torch.nn`` layers too, whose own frames Dynamo does not compile when
they are called from outside a compiled frame). A recomputed layer's ``checkpoint`` is
traced with it, so that its recomputation in backward runs the same compiled code as its
forward. Without ``torch.compile`` they are one plain call each, and a recomputed layer
goes through the package's own recomputation (:mod:`cpu_offload._recompute`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.compiler import is_compiling
from torch.utils.checkpoint import checkpoint

from ._compat import CHECKPOINT_EARLY_STOP_KWARG
from ._recompute import run_recomputed

__all__ = ["run_layer", "run_layer_recomputed"]


def _one_object_per_argument(
    call: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``call`` and ``args`` with an object passed twice passed once, and repeated inside.

    ``checkpoint`` recomputes with a detached copy of each argument, one per argument: a
    tensor passed as two arguments (``attn(h, h, h)``) comes back as distinct objects,
    and code that tests ``query is key`` (``nn.MultiheadAttention``) takes another path
    in the recomputation, which then saves other tensors and fails.
    """
    unique: list[Any] = []
    where: list[int] = []
    for arg in args:
        for i, seen in enumerate(unique):
            if seen is arg:
                where.append(i)
                break
        else:
            where.append(len(unique))
            unique.append(arg)
    if len(unique) == len(args):
        return call, args

    def repeated(*given: Any) -> Any:
        return call(*(given[i] for i in where))

    return repeated, tuple(unique)


def run_layer(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``forward(*args, **kwargs)``."""
    return forward(*args, **kwargs)


def run_layer_recomputed(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``forward(*args, **kwargs)`` under non-reentrant activation checkpointing, whose
    recomputation runs ``forward`` to its end: the package's own in eager mode
    (:func:`cpu_offload._recompute.run_recomputed`), ``torch.utils.checkpoint`` under
    ``torch.compile``.

    See NOTE [Recomputation runs the whole layer] in :mod:`cpu_offload.layers`: the
    default early stop ends the recomputation at the last saved tensor, so a layer that
    clears state it keeps on itself after that point never clears it.

    Example:
        >>> import torch
        >>> from cpu_offload._compat import checkpoint_early_stop_off
        >>> x = torch.ones(2, requires_grad=True)
        >>> with checkpoint_early_stop_off():
        ...     y = run_layer_recomputed(torch.mul, (x, 3.0), {})
        >>> y.sum().backward()
        >>> x.grad
        tensor([3., 3.])
    """
    # The keyword arguments are bound first: checkpoint() keeps those named like its own
    # options (debug, context_fn, ...) for itself.
    call = functools.partial(forward, **kwargs) if kwargs else forward
    call, args = _one_object_per_argument(call, args)
    if not is_compiling():
        # NOTE [A lean recomputation] in cpu_offload._recompute; traced by torch.compile,
        # PyTorch's own checkpoint below, which the compiler understands.
        return run_recomputed(call, *args)
    if CHECKPOINT_EARLY_STOP_KWARG:
        return checkpoint(call, *args, use_reentrant=False, early_stop=False)
    # Before PyTorch 2.9 the caller turns early stop off around this call, outside the
    # compiled frame (cpu_offload._compat.checkpoint_early_stop_off).
    return checkpoint(call, *args, use_reentrant=False)
