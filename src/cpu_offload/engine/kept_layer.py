"""A layer that keeps what it saves on the device, but for its saved casts.

NOTE [A kept layer's casts]
A layer kept on the device holds every tensor it saves until its backward: with its
softmax in fp32, both the fp32 probabilities and their bf16 cast (NOTE [Casts rebuilt
from their source] in ``recast.py``). Dropping the cast at the end of the forward and
casting it again in backward frees its bytes for one elementwise kernel: on
Megatron-Core's GPT at h 2048, s 2048, b 2, 256 of a layer's 1,028 MiB for about 0.2 ms
of an H200 per layer. :class:`KeptLayer` does this with the engine's own grouping and
checks. Its layer state keeps every unit on the device (``keep_budget=None``), so
nothing is copied and no stream is touched; only the casts the grouping finds leave,
under the same conditions as in an offloaded layer, and each read of one in backward
checks its source's version as there. It needs no offload schedule: the state goes
through its phases on its own, its reload (of nothing) starting at the first read in
backward. What it holds is released when that backward ends (a tensor no node of it read,
on a branch that needs no gradient, would otherwise stay until the layer's next
forward), or else when the layer's next forward starts. As with offloaded layers, a
second backward over the same graph then finds nothing to read, and says so.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .._compat import in_backward, queue_backward_callback
from .._compile import outside_compile
from .host_buffers import HostBufferPool
from .layer_state import LayerPhase, OffloadableLayerState
from .layout import TensorLayout
from .selection import ActivationPolicy
from .transport import Transport

__all__ = ["KeepTransport", "KeptLayer"]


class KeepTransport(Transport):
    """A transport for a layer whose units all stay on the device: it records nothing and
    moves nothing (NOTE [A kept layer's casts])."""

    def __init__(self) -> None:
        super().__init__(HostBufferPool(pin_memory=False))

    def accepts(self, tensor: torch.Tensor) -> bool:
        return True  # the policy chooses; nothing leaves the device anyway

    def record(self) -> None:
        return None  # no copy waits for a tensor to be complete

    def wait(self, event: object | None, stream: Hashable | None = None) -> None:
        return None

    def current_stream(self) -> Hashable:
        # A cast read on two streams is cast once on each (CastRef.read).
        return torch.cuda.current_stream() if torch.cuda.is_initialized() else None

    def use_on_current_stream(self, tensor: torch.Tensor, stream: Hashable | None = None) -> None:
        return None  # a rebuilt cast is made on the stream that reads it

    def offload(self, src: torch.Tensor, ready: object | None, dst: torch.Tensor) -> None:
        raise RuntimeError("KeepTransport moves nothing: every unit of its layer is kept")

    def allocate(self, layout: TensorLayout, device: torch.device) -> torch.Tensor:
        raise RuntimeError("KeepTransport moves nothing: every unit of its layer is kept")

    def reload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        raise RuntimeError("KeepTransport moves nothing: every unit of its layer is kept")


def _anywhere(tensor: torch.Tensor) -> bool:
    return True


class KeptLayer:
    """The saved tensors of one kept layer, its saved casts rebuilt in backward (NOTE [A
    kept layer's casts]).

    Enter :meth:`saving` around each forward with grad enabled, and call :meth:`finish`
    after it; backward reads the tensors through the hooks :meth:`saving` installed.

    Args:
        name: The layer's name in messages.
        min_numel: Saved tensors with fewer elements are left to autograd as they are
            (neither a cast nor a source): the offload context's
            ``min_tensor_size_to_offload``.

    Example:
        >>> layer = KeptLayer("layer 0", min_numel=1)
        >>> x = torch.randn(64, 64, requires_grad=True)
        >>> v = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
        >>> with layer.saving():  # softmax saves p, the product saves its bf16 cast
        ...     p = x.softmax(-1)
        ...     y = (p.to(torch.bfloat16) @ v).sum()
        >>> layer.finish()
        >>> layer.state.recast_bytes  # the cast's bytes went at the forward's end
        8192
        >>> y.backward()
    """

    def __init__(self, name: str, min_numel: int) -> None:
        self.state = OffloadableLayerState(
            transport=KeepTransport(), policy=ActivationPolicy(min_numel, _anywhere), name=name
        )
        self.state.keep_budget = None  # every unit stays
        self.state.keep_view_bases = True
        # Entries into the engine run uncompiled (NOTE [torch.compile and the offload
        # engine]); made once, a hooks object is made per forward.
        self._hooks = (outside_compile(self.state.push_tensor), outside_compile(self._pop))

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks for the layer's next forward; what the last one saved is
        let go first."""
        self.state.release_all_memory()
        return torch.autograd.graph.saved_tensors_hooks(*self._hooks)

    @outside_compile
    def finish(self) -> None:
        """At the end of the forward: find the saved casts and let them go."""
        state = self.state
        state.start_offload()
        state.release_activation_forward_gpu_memory()

    def _pop(self, packed: int | torch.Tensor) -> torch.Tensor:
        state = self.state
        if state.phase is LayerPhase.OFFLOAD_FINISHED:
            state.start_reload()  # nothing to copy back: every unit stayed
            if in_backward():
                queue_backward_callback(state.release_all_memory)
        return state.pop_tensor(packed)
