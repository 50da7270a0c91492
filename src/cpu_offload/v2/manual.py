"""The synchronizer whose moments the caller chooses (pipeline schedules)."""

from __future__ import annotations

from ..engine.active import active_context
from ..engine.layer_state import OffloadableLayerState
from .synchronizer import OffloadSynchronizer

__all__ = ["ManualOffloadSynchronizer"]


class ManualOffloadSynchronizer(OffloadSynchronizer):
    """Offloading driven by the caller, for pipeline schedules.

    Every layer's candidate tensors are held; a layer is offloaded only if the caller
    calls :meth:`start_offload_layer`, :meth:`release_activation_forward_gpu_memory` and
    :meth:`start_reload_layer` for it, in that order. A layer for which none is called
    is simply not offloaded.
    """

    def _layer(self, layer_id: int) -> OffloadableLayerState:
        self._check_layer_id(layer_id)
        return self.layers[layer_id]

    def start_offload_layer(self, layer_id: int) -> None:
        """Queue asynchronous device-to-host copies of ``layer_id``'s saved tensors.

        Each copy waits for the event recorded when its tensor was saved. Called inside
        the layer's own ``with`` block, its saved casts go when its forward ends (the next
        layer's, or the backward's, start), as where the default schedule queues a
        layer's copies early (NOTE [Parts of a layer] in ``cpu_offload/_layer_parts.py``);
        else at once.

        Raises:
            RuntimeError: If the layer's offload already started.
        """
        state = self._layer(layer_id)
        ctx = active_context()  # the context whose `with` block runs now, if any
        own = getattr(ctx, "offload_synchronizer", None) is self
        state.start_offload(casts_go=not (own and getattr(ctx, "layer_id", None) == layer_id))

    def release_activation_forward_gpu_memory(self, layer_id: int) -> None:
        """Make the current stream wait for ``layer_id``'s offload, then free its memory.

        Raises:
            RuntimeError: If :meth:`start_offload_layer` was not called first.
        """
        self._layer(layer_id).release_activation_forward_gpu_memory()

    def start_reload_layer(self, layer_id: int) -> None:
        """Queue host-to-device copies of ``layer_id``'s tensors.

        The compute stream waits for each tensor's copy when backward first uses it.

        Raises:
            RuntimeError: If the layer's memory was not released first.
        """
        self._layer(layer_id).start_reload()
