"""The variants ``cpu-offload compare`` runs: how each one wraps a layer.

Every variant runs the same layers on the same batch; only :meth:`Variant.call`
differs. Offloading and its alternatives apply to the first ``k`` layers.
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from .. import v1, v2
from .._layer_runner import recompute
from .._marking import MarkOutputs
from ..engine.selection import is_marked_for_offload
from ..engine.transport import Transport
from ..layers import sync_first

__all__ = ["VARIANTS", "Variant", "make_variant"]


class _MarkedAndLarge:
    """V1's checker in the comparison: marked, and at least ``min_numel`` elements."""

    def __init__(self, min_numel: int) -> None:
        self.min_numel = min_numel

    def __call__(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() >= self.min_numel and is_marked_for_offload(tensor)


class Variant(ABC):
    """One way of running the layers.

    Args:
        num_layers: n, the layers in the model.
        num_offloaded: k, the layers offloaded (or checkpointed), from the first.
        min_numel: Smallest tensor offloading moves.
        transport_factory: Makes the transport for the variants that copy on streams of
            their own (None: the backend's default).

    Class attributes (facts the runner and the report read, instead of names):
        name: The name in ``--variants`` and in the report.
        offloads: It copies activations to host memory.
        copy_streams: Its copies run on streams of their own (a transport records them):
            bandwidth and stalls are measured for it.
        schedule: The schedule :func:`~cpu_offload.compare.simulate.simulate` replays
            for it on a machine without a GPU.
    """

    name: str = ""
    offloads: bool = False
    copy_streams: bool = False
    schedule: str = ""

    def __init__(
        self,
        num_layers: int,
        num_offloaded: int,
        min_numel: int,
        transport_factory: Callable[[], Transport] | None = None,
    ) -> None:
        self.n = num_layers
        self.k = num_offloaded
        self.min_numel = min_numel
        self.transport_factory = transport_factory if self.copy_streams else None
        self.transports: list[Transport] = []

    @property
    def offloaded_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose activations it offloads."""
        return tuple(range(self.k)) if self.offloads else ()

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        """Indices of the layers it recomputes in backward."""
        return ()

    def _transport(self) -> Transport | None:
        if self.transport_factory is None:
            return None
        t = self.transport_factory()
        self.transports.append(t)
        return t

    def install(self, layers: list[torch.nn.Module]) -> list[Any]:
        """Wrap what runs inside ``layers`` (parts of a layer, say) beside the layers'
        forwards; the patches returned are undone when the variant is removed."""
        return []

    @abstractmethod
    def call(
        self, index: int, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        """Run layer ``index``'s ``forward`` on ``args`` and ``kwargs``.

        The layer's output is a tensor, or a tuple, list or dataclass whose first
        element is the hidden state.
        """


class _NoOffload(Variant):
    name = "none"
    schedule = "none"

    def call(self, index, forward, args, kwargs):  # type: ignore[no-untyped-def]
        return forward(*args, **kwargs)


class _V2(Variant):
    name = "v2"
    offloads = True
    copy_streams = True
    schedule = "v2"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        transport = self._transport()
        self.ctx, self.sync = v2.get_cpu_offload_context(  # type: ignore[misc]
            True,
            self.k,
            self.n,
            min_tensor_size_to_offload=self.min_numel,
            transport=transport,
        )
        if transport is None:
            self.transports.append(self.ctx.offload_synchronizer.transport)

    def call(self, index, forward, args, kwargs):  # type: ignore[no-untyped-def]
        with self.ctx:
            out = forward(*args, **kwargs)
        return sync_first(out, self.sync, index)


class _V1Async(Variant):
    name = "v1-async"
    offloads = True
    copy_streams = True
    schedule = "v1-async"
    double_buffering = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        handler = v1.AsyncDoubleBufferGroupOffloadHandler(
            self.k,
            self.n,
            tensor_need_offloading_checker=_MarkedAndLarge(self.min_numel),
            double_buffering=self.double_buffering,
            transport=self._transport(),
        )
        if not self.transports:
            self.transports.append(handler.transport)
        self.ctx = v1.CpuOffloadHookWithOffloadHandler(handler)
        self.commit = functools.partial(v1.group_prefetch_offload_commit, offload_handler=handler)

    def call(self, index, forward, args, kwargs):  # type: ignore[no-untyped-def]
        with self.ctx, MarkOutputs():
            out = forward(*args, **kwargs)
        return sync_first(out, self.commit, index)


class _V1DoubleBuffer(_V1Async):
    name = "v1-async-db"
    double_buffering = True


class _V1Sync(Variant):
    name = "v1-sync"
    offloads = True
    schedule = "v1-sync"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        handler = v1.SynchronizedGroupOffloadHandler(
            self.k, tensor_need_offloading_checker=_MarkedAndLarge(self.min_numel)
        )
        self.ctx = v1.CpuOffloadHookWithOffloadHandler(handler)
        self.commit = functools.partial(v1.group_prefetch_offload_commit, offload_handler=handler)

    def call(self, index, forward, args, kwargs):  # type: ignore[no-untyped-def]
        with self.ctx, MarkOutputs():
            out = forward(*args, **kwargs)
        return sync_first(out, self.commit, index)


class _Checkpoint(Variant):
    name = "checkpoint"
    schedule = "checkpoint"

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        return tuple(range(self.k))

    def call(self, index, forward, args, kwargs):  # type: ignore[no-untyped-def]
        if index < self.k:
            return recompute(forward, args, kwargs)
        return forward(*args, **kwargs)


class _SaveOnCpu(Variant):
    name = "save_on_cpu"
    schedule = "save_on_cpu"

    def call(self, index, forward, args, kwargs):  # type: ignore[no-untyped-def]
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if index >= self.k or first is None or not first.is_cuda:
            # Without CUDA there is no device memory to save: run the layer as is.
            ctx: Any = contextlib.nullcontext()
        else:
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
        with ctx:
            return forward(*args, **kwargs)


#: Variant name -> class, in the order the report lists them.
VARIANTS: dict[str, type[Variant]] = {
    cls.name: cls
    for cls in (_NoOffload, _V1Sync, _V1Async, _V1DoubleBuffer, _V2, _Checkpoint, _SaveOnCpu)
}


def make_variant(
    name: str,
    num_layers: int,
    num_offloaded: int,
    min_numel: int,
    transport_factory: Callable[[], Transport] | None = None,
) -> Variant:
    """Build the variant called ``name``.

    Raises:
        ValueError: If ``name`` is not one of :data:`VARIANTS`.
    """
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}; got {name!r}")
    return VARIANTS[name](num_layers, num_offloaded, min_numel, transport_factory)
