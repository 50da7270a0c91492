"""A layer that keeps what it saves on the device, but for its saved casts.

NOTE [A kept layer's casts]
A layer kept on the device holds every tensor it saves until its backward: with its
softmax in fp32, both the fp32 probabilities and their bf16 cast (NOTE [Casts rebuilt
from their source] in ``recast.py``). Dropping the cast at the end of the forward and
casting it again in backward frees its bytes for one elementwise kernel: on
Megatron-Core's GPT at h 2048, s 2048, b 2, 256 of a layer's 1,028 MiB for about 0.2 ms
of an H200 per layer. :class:`KeptLayer` does this with the engine's own grouping and
checks: each forward gets a layer state of its own that keeps every unit on the device
(``keep_budget=None``) through a transport that moves nothing, so only the casts the
grouping finds leave, under the same conditions as in an offloaded layer, and each read
of one in backward checks its source's version as there.

What autograd holds for each saved tensor is a small cell naming that forward's state,
so the state lives exactly as long as the graph does: two forwards before one backward
(two losses summed, a layer used twice) keep two states apart, and a forward that never
gets a backward frees everything with its graph, as without the package. The state
holds the tensors it was given only until the forward ends (their autograd nodes are
what tell a cast from its source); from then on it holds detached aliases (NOTE [Kept
tensors are detached] in ``cpu_offload/v2/synchronizer.py``), which share the originals'
memory and version counters, so an in-place change after the save still fails in
backward as it does without the package. A second backward over the same graph
(``retain_graph=True``) finds the kept tensors read already and says so, as for an
offloaded layer.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Hashable

import torch

from .._compile import outside_compile
from .host_buffers import HostBufferPool
from .layer_state import LayerPhase, OffloadableLayerState
from .layout import TensorLayout
from .saved_checks import KeptAsSaved
from .selection import ActivationPolicy
from .tensor_group import CastRef, KeptRef
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


class _Saved:
    """What autograd holds for one tensor a kept layer saved: its forward's state and
    its id there (NOTE [A kept layer's casts])."""

    __slots__ = ("index", "state")

    def __init__(self, state: OffloadableLayerState, index: int) -> None:
        self.state = state
        self.index = index


def _unpack(saved: _Saved | KeptAsSaved) -> torch.Tensor:
    if type(saved) is KeptAsSaved:
        return saved.unpack()  # kept as it was (below the size threshold, a weight)
    assert isinstance(saved, _Saved)
    state = saved.state
    if state.phase is LayerPhase.OFFLOAD_FINISHED:
        state.start_reload()  # nothing to copy back: every unit stayed
    return state.pop_tensor(saved.index)


class KeptLayer:
    """The saved tensors of one kept layer, its saved casts rebuilt in backward (NOTE [A
    kept layer's casts]).

    Enter :meth:`saving` around each forward with grad enabled, and call :meth:`finish`
    after it, or :meth:`abandon` when the forward raised; backward reads the tensors
    through the cells the hooks gave autograd.

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
        >>> layer.last_state.recast_bytes  # the cast's bytes went at the forward's end
        8192
        >>> y.backward()
    """

    def __init__(self, name: str, min_numel: int) -> None:
        self.name = name
        self.policy = ActivationPolicy(min_numel, _anywhere)
        self._current: OffloadableLayerState | None = None
        self._last: weakref.ref[OffloadableLayerState] | None = None
        # Entries into the engine run uncompiled (NOTE [torch.compile and the offload
        # engine]); made once, a hooks object is made per forward.
        self._hooks = (outside_compile(self._pack), outside_compile(_unpack))

    @property
    def last_state(self) -> OffloadableLayerState | None:
        """The layer state of the last forward, while its graph (or anything) holds it."""
        return None if self._last is None else self._last()

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks for the layer's next forward, with a layer state of its own."""
        state = OffloadableLayerState(transport=KeepTransport(), policy=self.policy, name=self.name)
        state.keep_budget = None  # every unit stays
        state.keep_view_bases = True
        self._current = state
        self._last = weakref.ref(state)
        return torch.autograd.graph.saved_tensors_hooks(*self._hooks)

    def _pack(self, tensor: torch.Tensor) -> _Saved | KeptAsSaved:
        state = self._current
        if state is None:
            raise RuntimeError(
                f"{self.name}: a tensor was saved for backward outside the layer's forward "
                "(KeptLayer.saving() was not entered, or finish() was called already)"
            )
        packed = state.push_tensor(tensor)
        if isinstance(packed, int):
            return _Saved(state, packed)
        # NOTE [Kept tensors keep their version check] in saved_checks.py.
        return KeptAsSaved(tensor, self.name)

    @outside_compile
    def finish(self) -> None:
        """At the end of a forward that completed: find the saved casts and let them go,
        and hold detached aliases of the rest from now on."""
        state, self._current = self._current, None
        if state is None:
            return
        entries = list(state._entries)
        aliases = [entry.tensor.detach() for entry in entries]
        try:
            with warnings.catch_warnings():
                # A strided slice whose layout could not be copied stays as it is, which
                # is what this layer does with every tensor: no advice to give.
                warnings.simplefilter("ignore", UserWarning)
                state.start_offload()
            state.release_activation_forward_gpu_memory()
        except BaseException:
            state.release_all_memory()
            raise
        plan = state._plan
        assert plan is not None
        for unit in plan.units:
            if unit.reloaded is not None:
                unit.reloaded = unit.reloaded.detach()
        for i, ref in enumerate(plan.refs):
            if isinstance(ref, KeptRef):
                plan.refs[i] = KeptRef(ref.tensor.detach())
        for entry, alias, ref in zip(entries, aliases, plan.refs, strict=True):
            entry.weak = None
            entry.tensor = None if isinstance(ref, CastRef) else alias  # type: ignore[assignment]

    def abandon(self) -> None:
        """After a forward that raised: let go of what it saved."""
        state, self._current = self._current, None
        if state is not None:
            state.release_all_memory()
