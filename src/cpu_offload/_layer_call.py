"""Where a wrapped layer's own forward is called: the frames ``torch.compile`` compiles.

The rest of the package is kept out of TorchDynamo's reach (NOTE [torch.compile and the
offload engine] in :mod:`cpu_offload._compile`), so these two functions live apart: when a
model compiled as a whole reaches an offloaded layer, the engine runs as plain Python and
calls one of them, whose frame Dynamo then compiles with the layer's forward inlined (one
graph per layer; ``torch.nn`` layers too, whose own frames Dynamo does not compile when
they are called from outside a compiled frame). A recomputed layer's ``checkpoint`` is
traced with it, so that its recomputation in backward runs the same compiled code as its
forward. Without ``torch.compile`` they are one plain call each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.checkpoint import checkpoint

__all__ = ["run_layer", "run_layer_recomputed"]


def run_layer(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``forward(*args, **kwargs)``."""
    return forward(*args, **kwargs)


def run_layer_recomputed(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``forward(*args, **kwargs)`` under non-reentrant activation checkpointing."""
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
