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

The hooks themselves never see a fake or functional tensor of ``torch.compile``: Dynamo
and AOTAutograd switch saved-tensor hooks off while they trace
(``torch._C._autograd._saved_tensors_hooks_set_tracing``), so the hooks run when the
compiled function runs, on the real tensors it saves for backward.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

from ._compat import dynamo_skip

__all__ = ["TRACEABLE_MODULES", "engine_modules", "keep_engine_out_of_compile"]

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
