"""Keeping ``torch.compile`` out of the offload engine (what TorchDynamo may trace).

NOTE [torch.compile and the offload engine]
What runs between layers (counting layers, starting copies into host buffers, putting a
backward hook on a layer's output) and in the saved-tensor hooks is Python that must run
as written, on real tensors. Left to TorchDynamo, the front end of ``torch.compile``, it
was turned into graphs piece by piece: compiling a model around ``offload_layers``
traced the code that views a ``uint8`` host buffer as ``float32`` into a graph whose
output aliases its input, and AOTAutograd's replay of that alias failed with
``self.stride(-1) must be 1 to view Byte as Float``. Saved-tensor hooks called while a
compiled layer runs were compiled too, once for each shape of tensor they were given.

So the package's modules are registered with Dynamo as PyTorch registers its own
internals (:func:`cpu_offload._compat.dynamo_skip`): a call into them from compiled code
is a graph break and runs as plain Python, and their functions are never compiled, not
even when a compiled function calls them back (the hooks). Three modules stay
traceable (:data:`TRACEABLE_MODULES`): ``models``, whose GPT layers are models, not
engine; ``_layer_call``, the one frame through which ``offload_layers`` calls a layer's
own forward, which Dynamo compiles with the forward inlined (a frame of ``torch.nn``
code called from plain Python would not be compiled at all) and with a recomputed
layer's checkpoint, so that its recomputation runs the same compiled code; and
``_marking``, V1's marking mode, which leaves compiled code unmarked instead of breaking
the graph at every operation.

A model compiled as a whole therefore compiles into a graph per wrapped layer plus the
code between them: what the model compiles into with a graph break before and after each
layer, or with each layer compiled on its own. With the Inductor backend, one graph of
the whole model (without offloading) may round differently, since Inductor fuses
operations across a layer boundary there.

Skipping the engine's files is not enough: Dynamo still looks at every Python function
that skipped code calls, and compiles those that live elsewhere. The engine calls code
that no file holds (the ``__init__`` that ``dataclasses`` writes, in ``<string>``) and
code of the user's (a ``tensor_filter``); compiled with a real CUDA tensor as an argument,
a dataclass ``__init__`` crashed Dynamo in PyTorch 2.11 (a segmentation fault). So every
entry into the engine from code that may run compiled (an offload context's ``__enter__``
and ``__exit__``, the sync and commit functions, the saved-tensor hooks, the backward
hooks, ``offload_layers``' runner) runs with Dynamo's frame evaluation off
(:func:`outside_compile`): nothing it calls is compiled. The runner turns it back on for
the one call that must be compiled, the layer's own forward (:func:`call_compiled`).

The hooks themselves never see a fake or functional tensor of ``torch.compile``: Dynamo
and AOTAutograd switch saved-tensor hooks off while they trace
(``torch._C._autograd._saved_tensors_hooks_set_tracing``), so the hooks run when the
compiled function runs, on the real tensors it saves for backward.
"""

from __future__ import annotations

import functools
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ._compat import dynamo_skip, swap_dynamo_callback

__all__ = [
    "TRACEABLE_MODULES",
    "call_compiled",
    "engine_modules",
    "keep_engine_out_of_compile",
    "outside_compile",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The package's modules that torch.compile may trace (all others are engine).
TRACEABLE_MODULES = frozenset({"models", "_layer_call", "_marking"})

_registered = False


def engine_modules() -> list[str]:
    """The dotted names of the package's modules and subpackages that are engine."""
    package = __name__.rpartition(".")[0]
    return [
        f"{package}.{info.name}"
        for info in pkgutil.iter_modules([str(Path(__file__).parent)])
        if info.name not in TRACEABLE_MODULES
    ]


def keep_engine_out_of_compile() -> None:
    """Register the engine's modules with TorchDynamo (see the NOTE above); once per process.

    Called where offloading is set up (an offload context, ``offload_layers``), before
    anything of it can be compiled.
    """
    global _registered
    if _registered:
        return
    for module in engine_modules():
        dynamo_skip(module)
    _registered = True


def outside_compile(fn: F) -> F:
    """``fn`` runs with TorchDynamo's frame evaluation off, whoever calls it.

    For the engine's entry points (see the NOTE above): from compiled code they are a
    graph break already; this also keeps Dynamo away from what they call. The previous
    state is restored on return, so nested entries are free.

    Example:
        >>> import torch
        >>> from cpu_offload._compile import outside_compile
        >>> @outside_compile
        ... def engine_step(x):
        ...     return x + 1
        >>> engine_step(torch.ones(2)).tolist()
        [2.0, 2.0]
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        callback = swap_dynamo_callback(None)
        try:
            return fn(*args, **kwargs)
        finally:
            swap_dynamo_callback(callback)

    return run  # type: ignore[return-value]


def call_compiled(callback: object, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with Dynamo's callback ``callback`` on, from engine code.

    ``callback`` is what :func:`cpu_offload._compat.swap_dynamo_callback` returned when
    the engine was entered: the caller's compilation, which the layer's forward joins.
    Frame evaluation is off again on return.
    """
    swap_dynamo_callback(callback)
    try:
        return fn(*args, **kwargs)
    finally:
        swap_dynamo_callback(None)
