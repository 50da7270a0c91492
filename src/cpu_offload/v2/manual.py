"""The synchronizer whose moments the caller chooses (pipeline schedules)."""

from __future__ import annotations

from ..engine.layer_state import LayerPhase, OffloadableLayerState
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

        Each copy waits for the event recorded when its tensor was saved. Called in the
        layer's own forward, its saved casts go at the forward's end, as where the
        default schedule queues a layer's copies early (NOTE [Parts of a layer] in
        ``cpu_offload/_layer_parts.py``).

        Raises:
            RuntimeError: If the layer's offload already started.
        """
        self._layer(layer_id).start_offload(casts_go=layer_id != self.current_layer)

    def _on_forward_end(self, layer_id: int) -> None:
        state = self.layers[layer_id]
        if state.phase is LayerPhase.OFFLOAD_STARTED:
            state.let_casts_go()

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
