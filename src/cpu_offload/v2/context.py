"""The V2 public entry point: ``get_cpu_offload_context`` and what it returns."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .._args import (
    activations_requested,
    check_bool,
    check_int,
    check_memory_budget,
    check_min_tensor_size,
    check_stream,
)
from .._compile import outside_compile
from .._warn import warn_at_caller
from ..engine.active import ActiveHooks, active_context
from ..engine.context import OffloadContextBase
from ..engine.selection import ActivationPolicy
from ..engine.transport import Transport, resolve_transport
from .default import DefaultOffloadSynchronizer
from .manual import ManualOffloadSynchronizer
from .schedule import (
    check_layer_counts,
    default_synchronization_dict,
    validate_synchronization_dict,
)
from .synchronizer import OffloadSynchronizer

__all__ = ["OffloadContext", "SyncFunction", "get_cpu_offload_context", "start_offload"]

#: Default smallest tensor worth offloading, in elements (about 1 MB of float32).
DEFAULT_MIN_TENSOR_SIZE = 256 * 1024


def _identity(tensor: Any) -> Any:
    return tensor


class OffloadContext(OffloadContextBase):
    """Wraps one layer's forward: saved tensors go through the synchronizer's hooks.

    Attributes:
        offload_synchronizer: The synchronizer this context drives.
        inside_context: True only inside the ``with`` block.
    """

    def __init__(self, synchronizer: OffloadSynchronizer) -> None:
        super().__init__()
        self.offload_synchronizer = synchronizer
        self.awaiting_sync = False  # a layer ran and sync_function has not been called
        self._refused = False  # the last __enter__ was refused for a missing sync
        self.layer_id: int | None = None
        self._counted = False  # the current `with` block counted a layer
        # Made once and entered per layer: an offloaded layer's tensors go through the
        # synchronizer; any other layer saves its tensors untouched, without hooks.
        self._offload_hooks = ActiveHooks(self, synchronizer.pack_hook, synchronizer.pop_tensor)
        self._hooks_of = synchronizer  # the synchronizer _offload_hooks call
        self._plain_hooks = ActiveHooks(self)

    def is_current_layer_offloaded(self) -> bool:
        return self.layer_id is not None and self.offload_synchronizer.is_layer_offloaded(
            self.layer_id
        )

    def __enter__(self) -> OffloadContext:
        super().__enter__()
        return self

    def _layer_pending(self) -> bool:
        return self.awaiting_sync

    def _open(self) -> ActiveHooks:
        if self.awaiting_sync:
            if not self._refused:
                # Refused once; calling sync_function continues this iteration, while
                # entering again gives it up (a forward restarted after an exception
                # between a layer's block and its sync must not stay blocked).
                self._refused = True
                raise RuntimeError(
                    "the CPU offload context was entered twice without sync_function in "
                    f"between: call x = sync_function(x) on layer {self.layer_id}'s output "
                    "after its `with` block (entering again starts a new iteration)"
                )
            self._restart_iteration()
        if not torch.is_grad_enabled():
            # Nothing is saved for backward: no layer is counted (evaluation loops).
            self._counted = False
            return self._plain_hooks
        sync = self.offload_synchronizer
        try:
            layer = sync.fwd_step()
        except BaseException:
            # Leave nothing behind: the next forward starts a fresh iteration at layer 0.
            sync.start_new_iteration()
            raise
        if self._hooks_of is not sync:  # offload_synchronizer was replaced
            self._offload_hooks = ActiveHooks(self, sync.pack_hook, sync.pop_tensor)
            self._hooks_of = sync
        # Nothing below can fail: the base class enters the hooks next.
        self._counted = True
        self.layer_id = layer
        self.awaiting_sync = True
        return self._offload_hooks if sync.is_layer_offloaded(layer) else self._plain_hooks

    def _restart_iteration(self) -> None:
        """End the iteration now: every layer's tensors are dropped, and the next forward
        starts at layer 0 (after a forward that stopped between layers)."""
        self.awaiting_sync = False
        self._refused = False
        self.layer_id = None
        self.offload_synchronizer.start_new_iteration()

    def _abort(self) -> None:
        if self._counted:
            # A failed layer (out of memory, say) ends the iteration: its buffers go,
            # and training that skips the batch continues exactly.
            self._restart_iteration()


class _BackwardStart:
    """Gradient pre-hook: tells the synchronizer that a layer's backward begins."""

    __slots__ = ("layer_id", "synchronizer")

    def __init__(self, synchronizer: OffloadSynchronizer, layer_id: int) -> None:
        self.synchronizer = synchronizer
        self.layer_id = layer_id

    @outside_compile  # see NOTE [torch.compile and the offload engine]
    def __call__(self, grad_outputs: Any) -> None:
        self.synchronizer.bwd_step(self.layer_id)


class SyncFunction:
    """Marks the end of a layer's forward; its backward hook marks the start of its backward.

    Call it on each layer's output, outside the context: ``x = sync_function(x)``.
    """

    def __init__(self, context: OffloadContext) -> None:
        self.context = context

    @outside_compile
    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        ctx = self.context
        ctx._owner.check_caller("synced")
        if ctx.inside_context:
            raise RuntimeError(
                "sync_function must be called outside the CPU offload context, on the "
                "layer's output after its `with` block"
            )
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"sync_function expects a tensor, got {type(tensor).__name__}")
        if not torch.is_grad_enabled():
            return tensor
        if not ctx.awaiting_sync or ctx.layer_id is None:
            raise RuntimeError(
                "sync_function was called before any layer ran under the CPU offload "
                "context (or twice for one layer): call it once after each layer's `with` block"
            )
        if not tensor.requires_grad:
            raise ValueError(
                "sync_function needs the layer's output to require grad (it registers "
                "the hook that starts the layer's backward), got a tensor with "
                "requires_grad=False"
            )
        out = tensor if tensor.grad_fn is not None else tensor.view_as(tensor)
        assert out.grad_fn is not None
        out.grad_fn.register_prehook(_BackwardStart(ctx.offload_synchronizer, ctx.layer_id))
        ctx.awaiting_sync = False
        ctx._refused = False
        return out


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int | None = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: torch.cuda.Stream | None = None,
    *,
    synchronization_dict: dict[int, tuple[bool, int, bool, int]] | None = None,
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE,
    transport: Transport | None = None,
    duplex: bool = False,
    memory_budget: int | None = None,
) -> tuple[Any, Any] | tuple[Any, Any, ManualOffloadSynchronizer | None]:
    """Make the context and sync function that offload activations to host memory.

    Wrap each layer's forward in the context and pass its output through the sync
    function. Tensors autograd saves inside the context are copied to pinned host
    memory on a separate stream, their device memory is released, and they are copied
    back before backward needs them. Results are bit-identical to no offloading.

    The positional order is Transformer Engine's (Megatron-LM calls it positionally).

    Args:
        enabled: Turn offloading on. When False, returns ``(nullcontext(), identity)``
            and checks only argument types.
        num_layers: How many layers to offload (k, the first k), in ``[0, model_layers-1]``.
            Ignored with ``manual_synchronization`` or ``synchronization_dict``.
        model_layers: Total number of layers run under the context (n). Must be right.
        offload_activations: Legacy; must be True for anything to be offloaded.
        offload_weights: Legacy; True warns (``DeprecationWarning``) and has no effect.
        double_buffering: Legacy; True warns and has no effect (V2 allocates reload
            buffers on the compute stream, which makes double buffering unnecessary).
        manual_synchronization: Return a :class:`ManualOffloadSynchronizer` as third
            value and let the caller decide when each layer moves.
        retain_pinned_cpu_buffers: Keep each layer's pinned host buffers at fixed
            addresses across iterations (needed to capture CUDA graphs before PyTorch
            2.11); shapes must then stay the same every iteration.
        offload_stream: CUDA stream for the copies; a new one if None. Accepted in both
            modes (the reference accepts it only in manual mode).
        synchronization_dict: Layer id -> ``(offload_fwd, offload_num, reload_fwd,
            reload_num)``, a schedule for pipeline parallelism (see the docs).
        min_tensor_size_to_offload: Smallest tensor to offload, in elements.
        transport: What moves the bytes. By default the CUDA transport when CUDA is
            available, else the CPU stand-in (copies between CPU tensors), so that the
            same program runs and can be tested on a machine without a GPU.
        duplex: Copy back to the GPU on a stream of its own, so that reloads never queue
            behind offloads and both directions of the link run at once. The schedule's
            points (and so the peak memory) are those of the default; reloads and
            offloads overlap where the schedule lets a layer's reload start while
            another's offload still runs (``synchronization_dict`` pipeline schedules,
            manual synchronization). Ignored by the CPU stand-in, whose copies are
            synchronous. Excludes ``transport`` (give that one a ``reload_stream``).
        memory_budget: Bytes of allocated device memory the training step may peak at
            (as ``torch.cuda.max_memory_allocated`` reads it). Offloaded layers then keep
            on the device the tensors that fit under it, from the third iteration on
            (the second is read to choose), and copy only the rest: fewer bytes cross
            the link. None: keep only what fits under the peak the step reaches with
            every eligible tensor moved. A budget below that peak keeps nothing more.
            Excludes ``manual_synchronization`` (it has no schedule to place the room
            in) and ``retain_pinned_cpu_buffers`` (its fixed buffers need the same
            tensors moved every iteration).

    Returns:
        ``(context, sync_function)``, or ``(context, sync_function, synchronizer)`` with
        ``manual_synchronization=True`` (``None`` as synchronizer when disabled).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``model_layers < 1``, ``num_layers`` is outside
            ``[0, model_layers - 1]``, nothing is to be offloaded, the
            ``synchronization_dict`` is invalid, ``duplex`` is given with ``transport``,
            or ``memory_budget`` is negative or given with ``manual_synchronization``
            or ``retain_pinned_cpu_buffers``.

    Example:
        >>> layers = [torch.nn.Linear(1024, 1024) for _ in range(4)]
        >>> ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4)
        >>> x = torch.randn(256, 1024, requires_grad=True)
        >>> for layer in layers:
        ...     with ctx:
        ...         x = layer(x)
        ...     x = sync(x)
        >>> x.sum().backward()
    """
    flags: tuple[tuple[str, object], ...] = (
        ("enabled", enabled),
        ("offload_activations", offload_activations),
        ("offload_weights", offload_weights),
        ("double_buffering", double_buffering),
        ("manual_synchronization", manual_synchronization),
        ("retain_pinned_cpu_buffers", retain_pinned_cpu_buffers),
        ("duplex", duplex),
    )
    for name, flag in flags:
        check_bool(name, flag)
    if num_layers is not None:
        check_int("num_layers", num_layers)
    check_int("model_layers", model_layers)
    check_int("min_tensor_size_to_offload", min_tensor_size_to_offload)
    check_stream("offload_stream", offload_stream)
    check_memory_budget(memory_budget)
    if transport is not None:
        resolve_transport(transport)
    if double_buffering and enabled:
        warn_at_caller(
            "double_buffering=True has no effect under the V2 backend (it allocates every "
            "reload buffer on the compute stream, which makes double buffering "
            "unnecessary): drop the argument, or set NVTE_CPU_OFFLOAD_V1=1 for V1's "
            "double-buffered handler"
        )

    disabled: tuple[Any, ...] = (contextlib.nullcontext(), _identity)
    if manual_synchronization:
        disabled = (*disabled, None)
    if not enabled:
        return disabled  # type: ignore[return-value]

    if not activations_requested(offload_activations, offload_weights):
        return disabled  # type: ignore[return-value]

    if model_layers < 1:
        raise ValueError(f"model_layers must be >= 1, got {model_layers}")
    check_min_tensor_size(min_tensor_size_to_offload)
    if manual_synchronization and synchronization_dict is not None:
        raise ValueError(
            "synchronization_dict and manual_synchronization=True exclude each other: "
            "pass one or the other"
        )
    if manual_synchronization and memory_budget is not None:
        raise ValueError(
            "memory_budget and manual_synchronization=True exclude each other: the "
            "budget is placed by the schedule, which manual synchronization leaves to "
            "the caller; drop memory_budget, or use a synchronization_dict"
        )
    if synchronization_dict is not None:
        schedule = validate_synchronization_dict(synchronization_dict, model_layers)
    elif not manual_synchronization:
        if num_layers is None:
            raise TypeError("num_layers must be an int (layers to offload), got None")
        k, _ = check_layer_counts(num_layers, model_layers)
        schedule = default_synchronization_dict(k, model_layers)

    if duplex and transport is not None:
        raise ValueError(
            "duplex=True and transport= exclude each other: give the transport its own "
            "reload stream (CudaTransport(stream, reload_stream=torch.cuda.Stream())) "
            "or pass duplex=True without a transport"
        )
    transport = resolve_transport(transport, offload_stream, duplex)
    policy = ActivationPolicy(min_tensor_size_to_offload, transport.accepts)
    synchronizer: OffloadSynchronizer
    if manual_synchronization:
        synchronizer = ManualOffloadSynchronizer(
            model_layers, retain_pinned_cpu_buffers, transport=transport, policy=policy
        )
    else:
        synchronizer = DefaultOffloadSynchronizer(
            model_layers,
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
            synchronization_dict=schedule,
            transport=transport,
            policy=policy,
            memory_budget=memory_budget,
        )
    context = OffloadContext(synchronizer)
    sync_function = SyncFunction(context)
    if manual_synchronization:
        assert isinstance(synchronizer, ManualOffloadSynchronizer)
        return context, sync_function, synchronizer
    return context, sync_function


def start_offload(*tensors: torch.Tensor, offload_base_tensor: bool = False) -> None:
    """Record that ``tensors`` are complete now, so their copies may start from here.

    Use it when a layer saves a tensor for backward before it has finished writing it
    (a buffer filled later in the layer): the copy then waits for this point instead of
    the save. With ``offload_base_tensor=True`` a view is offloaded as its whole base
    and rebuilt as the same view after reload. Outside an active V2 offload context it
    does nothing.

    Args:
        *tensors: Tensors already saved in the current layer.
        offload_base_tensor: Offload views of these tensors as their base.

    Raises:
        TypeError: If an entry is not a tensor.
        RuntimeError: If one was saved by an offloaded part of the current layer whose
            copies are queued already, after its last offloaded part (NOTE [Parts of a
            layer] in ``cpu_offload/_layer_parts.py``): call it inside that part.

    Example:
        >>> start_offload(qkv_view, offload_base_tensor=True)  # doctest: +SKIP
    """
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"start_offload expects tensors, got {type(t).__name__}")
    ctx = active_context()
    if not isinstance(ctx, OffloadContext) or ctx.layer_id is None:
        return
    sync = ctx.offload_synchronizer
    if sync.is_layer_offloaded(ctx.layer_id):
        sync.layers[ctx.layer_id].mark_ready(tensors, offload_base_tensor)
