"""Synchronizers: decide *when* each layer's tensors move.

:class:`OffloadSynchronizer` keeps one :class:`OffloadableLayerState` per layer and
counts forward and backward steps. Its subclasses decide the moments:
:class:`~cpu_offload.v2.default.DefaultOffloadSynchronizer` (in ``default.py``) follows a
schedule (the default k-of-n rule, or a ``synchronization_dict``);
:class:`~cpu_offload.v2.manual.ManualOffloadSynchronizer` (in ``manual.py``) leaves them
to the caller.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import _log
from .._args import check_bool, check_int
from .._compat import (
    capture_buffer_policy,
    pinned_alloc_in_capture_supported,
    queue_backward_callback,
)
from .._warn import warn_at_caller
from ..engine.layer_state import LayerPhase, OffloadableLayerState
from ..engine.saved_checks import KeptAsSaved
from ..engine.selection import ActivationPolicy
from ..engine.tensor_group import TensorGroupProcessor
from ..engine.transport import Transport, resolve_transport

__all__ = [
    "OffloadSynchronizer",
    "TensorId",
]

# NOTE [Kept tensors are detached]
# A pack hook that returns the tensor it was given, unchanged, makes autograd keep that
# very tensor object. For a tensor saved as an output of its own node (exp, sigmoid,
# SDPA's output), the tensor holds its grad_fn and the grad_fn holds the saved tensor:
# a reference cycle through autograd's C++ objects, which Python's garbage collector
# cannot see. A forward with grad enabled and no backward (a validation loop without
# torch.no_grad, a skipped batch, an exception between layers) then keeps every such
# tensor alive for good. Returning ``tensor.detach()`` (a new tensor object over the
# same storage and version counter) breaks the cycle at no copy; autograd re-attaches
# the grad_fn when it unpacks. Every tensor a pack hook of ours keeps goes back detached
# (in a KeptAsSaved: NOTE [Kept tensors keep their version check] in
# engine/saved_checks.py), except a leaf that requires grad (a weight): it holds no node
# and cannot get one while it requires grad (autograd refuses an in-place change of such
# a leaf outside torch.no_grad), so it closes no cycle, and a detach costs half a
# microsecond for each of an offloaded layer's weights. A tensor that needs no grad is
# detached all the same:
# an in-place op may give it a grad_fn after its save (``h.add_(h * w)``) whose graph
# reaches the node that saved it.


# NOTE [Small tensors stay at the door]
# The pack hook runs for every tensor an offloaded layer saves, and many of them (norm
# statistics, masks, scalars) are below V2's size threshold: the layer would keep them
# anyway. The hook tests the size first and keeps such a tensor without the layer's
# bookkeeping, which it would otherwise pay in the forward, where the host often bounds
# the step. The test is the first one ActivationPolicy makes, so what is offloaded does
# not change; with another policy (V1's marks, a caller's own, a subclass of
# ActivationPolicy) the threshold is 0 and every tensor goes to the layer. The threshold
# is read once, from the policy the synchronizer is made with. A layer that no longer
# collects (its offload started) still gets every tensor, and refuses it with its
# wrong-state error; with DEBUG logging on, every tensor goes to the layer too, which
# logs why it keeps each one.


_COLLECTING = LayerPhase.NOT_OFFLOADED  # read per saved tensor: a module name is cheaper
#: Where a kept tensor was saved when no layer's forward runs, for the message of its check.
_OUTSIDE = "the offload context, outside its layers"


class TensorId(int):
    """What ``push_tensor`` returns for a tensor it will offload: an ``int`` id.

    Its value is the tensor's index among those its layer saved (the reference's id);
    it also carries the layer and the iteration, so that ``pop_tensor`` finds the
    tensor again and refuses one from an iteration whose memory was released. Callers
    that drive a synchronizer by hand may treat it as a plain ``int``.
    """

    layer: int
    iteration: int

    def __new__(cls, index: int, layer: int, iteration: int) -> TensorId:
        obj = super().__new__(cls, index)
        obj.layer = layer
        obj.iteration = iteration
        return obj

    def __repr__(self) -> str:
        return f"TensorId({int(self)}, layer={self.layer}, iteration={self.iteration})"

    def __reduce__(self) -> tuple[type[TensorId], tuple[int, int, int]]:
        return (TensorId, (int(self), self.layer, self.iteration))


class OffloadSynchronizer:
    """One layer state per layer, and the forward/backward step counting.

    Args:
        num_layers: Number of layers run under the offload context per iteration.
        retain_pinned_cpu_buffers: Keep each layer's host buffers across iterations.
        offload_stream: CUDA stream for the copies (a new one if None).
        transport: What moves the bytes (overrides ``offload_stream``); by default the
            CUDA transport when CUDA is available, else the CPU stand-in.
        policy: Which saved tensors are candidates for offloading.

    Raises:
        TypeError / ValueError: On a bad argument, naming it.
    """

    def __init__(
        self,
        num_layers: int,
        retain_pinned_cpu_buffers: bool = False,
        offload_stream: torch.cuda.Stream | None = None,
        *,
        transport: Transport | None = None,
        policy: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        if check_int("num_layers", num_layers) < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        check_bool("retain_pinned_cpu_buffers", retain_pinned_cpu_buffers)
        if transport is not None and offload_stream is not None:
            raise ValueError(
                "offload_stream and transport exclude each other: give the stream to the "
                "transport (CudaTransport(stream)) or pass only offload_stream"
            )
        self.num_layers = num_layers
        self.retain_pinned_cpu_buffers = retain_pinned_cpu_buffers
        # Whether a capture can be refused at all: from PyTorch 2.11 on it never is, and
        # the stream query costs each layer's forward a microsecond or two of host time.
        # Fixed here, as the flag and the running PyTorch version are.
        self._refuses_capture = (
            not retain_pinned_cpu_buffers and not pinned_alloc_in_capture_supported()
        )
        self.transport = resolve_transport(transport, offload_stream)
        self.policy = policy if policy is not None else self.transport.accepts
        # See NOTE [Small tensors stay at the door]. Exactly the class: a subclass may
        # take tensors below its threshold.
        self._min_numel = self.policy.min_numel if type(self.policy) is ActivationPolicy else 0
        processor = TensorGroupProcessor()
        self.layers = [
            OffloadableLayerState(
                transport=self.transport,
                retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
                policy=self.policy,
                processor=processor,
                name=f"layer {i}",
            )
            for i in range(num_layers)
        ]
        self.iteration = 0
        self.current_layer: int | None = None  # layer whose forward runs now
        self._forwards = 0  # forwards begun in this iteration
        self._backward_layers: list[int] = []  # layers whose backward began in this part
        self._callback_queued = False
        self._backward_seen = False  # a backward began since this iteration's forwards
        self._warned_on_demand = False
        self._warned_nothing_offloaded = False

    # -- the step protocol -------------------------------------------------------------

    def fwd_step(self) -> int:
        """Call before each layer's forward. Returns the layer id.

        After ``num_layers`` forwards, or once a backward has begun, the next call starts
        a new iteration and releases every layer's memory first.

        Raises:
            RuntimeError: When a CUDA graph is being captured below PyTorch 2.11 and
                buffers are not retained (see :func:`cpu_offload._compat.capture_buffer_policy`).
        """
        if self._refuses_capture:
            capture_buffer_policy(False, self.transport.capturing())
        if self._forwards == self.num_layers or self._backward_seen:
            self.start_new_iteration()
        layer = self._forwards
        if _log.debug_enabled():
            _log.logger.debug("iteration %d: layer %d's forward begins", self.iteration, layer)
        if self.current_layer is not None:
            self._on_forward_end(self.current_layer)
        self._forwards += 1
        self.current_layer = layer
        self._on_forward_start(layer)
        return layer

    def bwd_step(self, layer_id: int) -> None:
        """Call when ``layer_id``'s backward is about to start.

        Raises:
            TypeError: If ``layer_id`` is not an int.
            ValueError: If ``layer_id`` is not in ``[0, num_layers - 1]``; in the default
                schedule, when the first backward of an iteration begins after a number
                of forwards other than ``num_layers`` (a wrong ``model_layers``, or a
                forward cut short by an exception outside the offload context); the
                iteration is released first.
        """
        self._check_layer_id(layer_id)
        if not self._backward_seen:
            self._backward_seen = True
            self._check_forward_count()
        if self.current_layer is not None:
            # The forward pass is over: the last layer's forward has ended.
            self._on_forward_end(self.current_layer)
            self.current_layer = None
        if not self._callback_queued:
            self._callback_queued = True
            try:
                queue_backward_callback(self.finish_part_of_bwd)
            except RuntimeError:
                # Not inside a backward pass (a caller driving the steps by hand): the
                # caller calls finish_part_of_bwd itself.
                self._callback_queued = False
        self._backward_layers.append(layer_id)
        self._on_backward_start(layer_id)

    def finish_part_of_bwd(self) -> None:
        """Call after each backward pass: joins outstanding reloads, releases its layers."""
        self._callback_queued = False
        for layer in self.layers:
            layer.wait_for_reloads()
        for layer_id in self._backward_layers:
            self.layers[layer_id].release_all_memory()
        self._backward_layers.clear()

    def start_new_iteration(self) -> None:
        """Release every layer and restart the forward count at layer 0."""
        self.release_all()
        self.iteration += 1

    def release_all(self) -> None:
        """Drop every layer's tensors and reset the step counters."""
        for layer in self.layers:
            layer.release_all_memory()
        self._forwards = 0
        self._backward_seen = False
        # A backward that raised never ran its queued callback: forget it.
        self._callback_queued = False
        self.current_layer = None
        self._backward_layers.clear()

    # -- tensors ---------------------------------------------------------------------

    def push_tensor(self, tensor: torch.Tensor) -> TensorId | torch.Tensor:
        """Saved-tensor pack hook: hand ``tensor`` to the current layer.

        Returns:
            A :class:`TensorId` (an ``int``) for a tensor that will be offloaded, else
            the tensor itself.
        """
        layer = self.current_layer
        if layer is None or not self._pushes_to(layer):
            return tensor
        out = self.layers[layer].push_tensor(tensor)
        if isinstance(out, torch.Tensor):
            return out
        return TensorId(out, layer, self.iteration)

    def pack_hook(self, tensor: torch.Tensor) -> TensorId | KeptAsSaved:
        """The saved-tensor pack hook the offload context installs.

        :meth:`push_tensor`, with a kept tensor given to autograd as a
        :class:`~cpu_offload.engine.saved_checks.KeptAsSaved`: detached unless it is a
        leaf that requires grad (see NOTE [Kept tensors are detached]), with its version
        checked when backward reads it (NOTE [Kept tensors keep their version check] in
        ``engine/saved_checks.py``). A tensor below the policy's size threshold is kept
        without being handed to the layer (NOTE [Small tensors stay at the door]).
        """
        layer = self.current_layer
        if layer is not None and (
            tensor.numel() >= self._min_numel
            # A layer no longer collecting refuses every tensor, small ones too.
            or self.layers[layer].phase is not _COLLECTING
            or _log.debug_enabled()
        ):
            out = self.push_tensor(tensor)
            if not isinstance(out, torch.Tensor):
                return out
        return KeptAsSaved(tensor, _OUTSIDE if layer is None else self.layers[layer].name)

    def pop_tensor(self, packed: TensorId | KeptAsSaved | torch.Tensor) -> torch.Tensor:
        """Saved-tensor unpack hook: the tensor pushed as ``packed``.

        Raises:
            TypeError: If ``packed`` is neither a tensor nor what :meth:`push_tensor` or
                :meth:`pack_hook` returned.
            RuntimeError: If the id belongs to an iteration whose memory was released, or
                the tensor was kept and changed in place after it was saved.
        """
        if type(packed) is KeptAsSaved:
            return packed.unpack()
        if isinstance(packed, torch.Tensor):
            return packed
        if not isinstance(packed, TensorId):
            raise TypeError(
                "pop_tensor takes what push_tensor or pack_hook returned (a tensor, a "
                f"KeptAsSaved or a TensorId), got {type(packed).__name__} {packed!r}"
            )
        if packed.iteration != self.iteration:
            raise RuntimeError(
                "a tensor saved under the CPU offload context belongs to an earlier "
                "iteration whose memory was released: run backward before the next "
                f"forward pass of all {self.num_layers} layers (or use one offload "
                "context per micro-batch in flight)"
            )
        state = self.layers[packed.layer]
        if state.phase is LayerPhase.OFFLOAD_STARTED and packed.layer == self.current_layer:
            # Read in its own forward after its copies were queued (autograd.grad inside
            # the layer; NOTE [Parts of a layer]): still on the device, as before them.
            kept = state.saved_tensor(int(packed))
            if kept is not None:
                return kept
        if state.phase in (LayerPhase.OFFLOAD_STARTED, LayerPhase.OFFLOAD_FINISHED):
            self._reload_on_demand(packed.layer, state)
        return state.pop_tensor(int(packed))

    def _reload_on_demand(self, layer_id: int, state: OffloadableLayerState) -> None:
        # Backward needs a layer whose reload was never scheduled (a partial backward,
        # autograd.grad, a manual schedule without start_reload_layer): do it now.
        if not self._warned_on_demand:
            self._warned_on_demand = True
            warn_at_caller(
                f"cpu_offload: backward reached layer {layer_id} before its reload was "
                "started; reloading it now, without overlap. Check model_layers and that "
                "every layer's output went through sync_function."
            )
        if state.phase is LayerPhase.OFFLOAD_STARTED:
            state.release_activation_forward_gpu_memory()
        state.start_reload()

    # -- reporting -------------------------------------------------------------------

    def get_offloaded_total_size_mb(self) -> float:
        """MiB held in host copies across all layers."""
        return sum(layer.get_offloaded_total_size_mb() for layer in self.layers)

    def is_layer_offloaded(self, layer_id: int) -> bool:
        """Whether ``layer_id``'s saved tensors may be offloaded."""
        return self._pushes_to(layer_id)

    def _check_layer_id(self, layer_id: object) -> None:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id must be in [0, {self.num_layers - 1}], got {layer_id}")

    # -- what subclasses decide ------------------------------------------------------

    def _pushes_to(self, layer_id: int) -> bool:
        return True

    def _check_forward_count(self) -> None:
        """Called at the first backward of an iteration; the default schedule checks it."""

    def _on_forward_start(self, layer_id: int) -> None:
        """Work due when ``layer_id``'s forward begins."""

    def _on_forward_end(self, layer_id: int) -> None:
        """Work due when ``layer_id``'s forward has ended: where its copies were queued
        in it, its saved casts go now (NOTE [Parts of a layer] in ``_layer_parts.py``)."""
        state = self.layers[layer_id]
        if state.phase is LayerPhase.OFFLOAD_STARTED:
            state.let_casts_go()

    def _on_backward_start(self, layer_id: int) -> None:
        """Work due when ``layer_id``'s backward begins."""


def __getattr__(name: str) -> object:
    # The two subclasses lived here before default.py and manual.py; imported lazily,
    # since both import this module.
    if name == "ManualOffloadSynchronizer":
        from .manual import ManualOffloadSynchronizer

        return ManualOffloadSynchronizer
    if name == "DefaultOffloadSynchronizer":
        from .default import DefaultOffloadSynchronizer

        return DefaultOffloadSynchronizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
