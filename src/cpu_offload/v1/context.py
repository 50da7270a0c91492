"""V1 saved-tensor hooks, the group-commit function and ``get_cpu_offload_context``."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from .._args import activations_requested, check_bool, check_int
from .._compile import outside_compile
from ..engine.active import ActiveHooks
from ..engine.context import OffloadContextBase
from ..engine.saved_checks import KeptAsSaved
from ..engine.selection import is_marked_for_offload
from ..engine.transport import Transport, resolve_transport
from .handlers import AsyncDoubleBufferGroupOffloadHandler, OffloadHandler

__all__ = [
    "CpuOffloadHookWithOffloadHandler",
    "CpuOffloadSavedTensorHook",
    "GroupCommitFunction",
    "get_cpu_offload_context",
    "group_prefetch_offload_commit",
]


class CpuOffloadSavedTensorHook(OffloadContextBase):
    """Context manager that routes tensors saved for backward through two methods.

    Subclasses implement :meth:`on_save_for_backward` (returns what autograd keeps) and
    :meth:`on_get_saved_tensor` (turns it back into the tensor).

    Attributes:
        inside_context: True only inside the ``with`` block.
    """

    def on_save_for_backward(self, tensor: torch.Tensor) -> Any:
        """Called with each tensor saved for backward."""
        raise NotImplementedError(
            "on_save_for_backward is not implemented in CpuOffloadSavedTensorHook; subclass it"
        )

    def on_get_saved_tensor(self, saved_state: Any) -> torch.Tensor:
        """Called in backward with what :meth:`on_save_for_backward` returned."""
        raise NotImplementedError(
            "on_get_saved_tensor is not implemented in CpuOffloadSavedTensorHook; subclass it"
        )

    def _on_enter(self) -> None:
        """Called when the ``with`` block begins, before the hooks are installed."""

    def _open(self) -> ActiveHooks:
        self._on_enter()
        return ActiveHooks(self, self.on_save_for_backward, self.on_get_saved_tensor)

    def __enter__(self) -> CpuOffloadSavedTensorHook:
        super().__enter__()
        return self


class CpuOffloadHookWithOffloadHandler(CpuOffloadSavedTensorHook):
    """Saved-tensor hooks that delegate to an :class:`OffloadHandler`.

    Args:
        offload_handler: The handler that offloads and reloads.
        handler_extra_kwargs: Extra keyword arguments passed to ``tensor_push`` and
            ``tensor_pop``.
        debug: Unused; kept for signature compatibility.
    """

    def __init__(
        self,
        offload_handler: OffloadHandler,
        handler_extra_kwargs: dict[str, Any] | None = None,
        debug: bool = False,
    ) -> None:
        super().__init__()
        self.offload_handler = offload_handler
        self.handler_extra_kwargs = dict(handler_extra_kwargs or {})
        self.debug = debug
        offload_handler.attach_context()

    def on_save_for_backward(self, tensor: torch.Tensor) -> Any:
        out = self.offload_handler.tensor_push(tensor, **self.handler_extra_kwargs)
        if out is not tensor:
            return out
        # Detached and version-checked: NOTE [Kept tensors are detached] in
        # cpu_offload.v2.synchronizer, NOTE [Kept tensors keep their version check] in
        # cpu_offload.engine.saved_checks.
        group = getattr(self.offload_handler, "current_group", None)
        where = "the V1 offload context" if group is None else f"layer {group} (V1)"
        return KeptAsSaved(tensor, where)

    def on_get_saved_tensor(self, saved_state: Any) -> torch.Tensor:
        if type(saved_state) is KeptAsSaved:
            # The handler sees the kept tensor itself, as it returned it.
            saved_state = saved_state.unpack()
        return self.offload_handler.tensor_pop(saved_state, **self.handler_extra_kwargs)

    def is_current_layer_offloaded(self) -> bool:
        return self.offload_handler.is_current_group_offloaded()

    def _restart_iteration(self) -> None:
        """End the iteration now: the handler forgets it, and the next forward starts at
        layer 0 (after a forward that stopped between layers)."""
        self.offload_handler.abort()

    def _abort(self) -> None:
        self._restart_iteration()

    def _on_enter(self) -> None:
        self.offload_handler.on_context_enter()

    def _on_exit(self) -> None:
        self.offload_handler.on_context_exit()


class GroupCommitFunction(torch.autograd.Function):
    """Identity on a layer's output that marks group boundaries.

    Its forward tells the handler that a group (layer) ended; its backward tells it
    that a group's backward begins.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, cpu_offload_handler: Any) -> torch.Tensor:
        cpu_offload_handler.on_group_commit_forward()
        ctx.cpu_offload_handler = cpu_offload_handler
        return tensor

    @staticmethod
    @outside_compile
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.cpu_offload_handler.on_group_commit_backward()
        return grad_output, None


@outside_compile  # see NOTE [torch.compile and the offload engine]
def group_prefetch_offload_commit(tensor: torch.Tensor, offload_handler: Any) -> torch.Tensor:
    """Commit the current group: ``GroupCommitFunction.apply(tensor, offload_handler)``."""
    if not torch.is_grad_enabled():
        return tensor
    return GroupCommitFunction.apply(tensor, offload_handler)


def _commit_disabled(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    *,
    transport: Transport | None = None,
) -> tuple[Any, Any]:
    """The legacy (V1) offload context and commit function.

    Only tensors marked ``activation_offloading`` (see :func:`mark_activation_offload`)
    are offloaded. The first ``num_layers`` layers are offloaded on their own stream,
    released spread over the model and reloaded symmetrically with prefetch
    (:class:`AsyncDoubleBufferGroupOffloadHandler`).

    Args:
        enabled: Turn offloading on. When False, returns ``(nullcontext(), identity)``
            without touching CUDA.
        num_layers: Layers to offload (k), in ``[0, model_layers]``.
        model_layers: Layers in the model (n), >= 1.
        offload_activations: Must be True for anything to be offloaded.
        offload_weights: Deprecated: warns and has no effect.
        double_buffering: Reuse two sets of reload buffers.
        transport: What moves the bytes; by default CUDA streams when CUDA is available,
            else the CPU stand-in.

    Returns:
        ``(context, commit_function)``; call ``x = commit_function(x)`` after each layer.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If the layer counts are out of range or nothing is to be offloaded.

    Example:
        >>> from cpu_offload import mark_activation_offload
        >>> ctx, commit = get_cpu_offload_context(True, 1, 2)
        >>> layers = [torch.nn.Linear(1024, 1024) for _ in range(2)]
        >>> x = torch.randn(512, 1024, requires_grad=True)
        >>> for layer in layers:
        ...     with ctx:
        ...         mark_activation_offload(x)  # the layer's input: Linear saves it
        ...         x = layer(x)
        ...     x = commit(x)
        >>> x.sum().backward()
    """
    flags: tuple[tuple[str, object], ...] = (
        ("enabled", enabled),
        ("offload_activations", offload_activations),
        ("offload_weights", offload_weights),
        ("double_buffering", double_buffering),
    )
    for name, flag in flags:
        check_bool(name, flag)
    check_int("num_layers", num_layers)
    check_int("model_layers", model_layers)
    if transport is not None:
        resolve_transport(transport)
    if not enabled:
        return contextlib.nullcontext(), _commit_disabled
    if not activations_requested(offload_activations, offload_weights):
        return contextlib.nullcontext(), _commit_disabled
    if model_layers < 1:
        raise ValueError(f"model_layers must be >= 1, got {model_layers}")
    if not 0 <= num_layers <= model_layers:
        raise ValueError(
            f"num_layers must be in [0, model_layers] = [0, {model_layers}], got {num_layers}"
        )
    handler = AsyncDoubleBufferGroupOffloadHandler(
        num_offload_group=num_layers,
        num_model_group=model_layers,
        tensor_need_offloading_checker=is_marked_for_offload,
        double_buffering=double_buffering,
        transport=transport,
    )
    context = CpuOffloadHookWithOffloadHandler(handler)
    return context, functools.partial(group_prefetch_offload_commit, offload_handler=handler)
