"""Megatron-Core in one call: put ``cpu_offload`` where Megatron-Core looks for its
offload context, and make its linear layers mark their inputs.

Megatron-Core reads ``megatron.core.transformer.transformer_block.get_cpu_offload_context``
when it builds a transformer block, and its linear layers mark their inputs with the V1
mark only when ``megatron.core.tensor_parallel.layers.HAVE_TE`` is true. Without
Transformer Engine both are missing and offloading is refused.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from ._args import check_memory_budget
from .engine.transport import Transport

__all__ = ["MegatronCoreOffload", "use_with_megatron_core"]

_MISSING = object()


class _ContextFunction:
    """Megatron-Core's signature of ``get_cpu_offload_context``, routed to ``cpu_offload``.

    Some Megatron-Core versions pass ``retain_pinned_cpu_buffers`` as the seventh
    positional argument, where ``cpu_offload``'s signature has ``manual_synchronization``.
    """

    def __init__(self, transport: Transport | None, memory_budget: int | None = None) -> None:
        self.transport = transport
        self.memory_budget = memory_budget

    def __call__(
        self,
        enabled: bool,
        num_layers: int,
        model_layers: int,
        activation_offloading: bool,
        weight_offloading: bool,
        double_buffering: bool,
        retain_pinned_cpu_buffers: bool = False,
    ) -> Any:
        import cpu_offload

        return cpu_offload.get_cpu_offload_context(
            enabled,
            num_layers,
            model_layers,
            activation_offloading,
            weight_offloading,
            double_buffering,
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
            transport=self.transport,
            memory_budget=self.memory_budget,
        )


class MegatronCoreOffload:
    """What :func:`use_with_megatron_core` changed; :meth:`remove` puts it back.

    Also a context manager: leaving the ``with`` block calls :meth:`remove`.
    Models built while it is in place keep their offload context after it is removed.
    """

    def __init__(
        self,
        block: Any,
        layers: Any,
        transport: Transport | None,
        memory_budget: int | None = None,
    ) -> None:
        self._block = block
        self._layers = layers
        self._saved = (block.__dict__.get("get_cpu_offload_context", _MISSING), layers.HAVE_TE)
        self.function = _ContextFunction(transport, memory_budget)
        block.get_cpu_offload_context = self.function
        layers.HAVE_TE = True
        self.active = True

    def remove(self) -> None:
        """Restore both attributes as they were. Calling it again does nothing."""
        if not self.active:
            return
        function, have_te = self._saved
        if function is _MISSING:
            del self._block.get_cpu_offload_context
        else:
            self._block.get_cpu_offload_context = function
        self._layers.HAVE_TE = have_te
        self.active = False

    def __enter__(self) -> MegatronCoreOffload:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


def use_with_megatron_core(
    *, transport: Transport | None = None, memory_budget: int | None = None
) -> MegatronCoreOffload:
    """Let Megatron-Core offload activations through ``cpu_offload``, without TE.

    Call it before building the model; then switch offloading on with Megatron-Core's
    own fields (``cpu_offloading=True``, ``cpu_offloading_num_layers=k`` in its
    ``TransformerConfig``). The backend is the one ``NVTE_CPU_OFFLOAD_V1`` selects when
    the model is built: V2 offloads what it detects, V1 what the linear layers mark.

    Args:
        transport: Passed to :func:`cpu_offload.get_cpu_offload_context` (by default
            the CUDA transport, or the CPU stand-in without CUDA).
        memory_budget: Passed to :func:`cpu_offload.get_cpu_offload_context`: bytes of
            allocated device memory the step may peak at, under which offloaded layers
            keep what fits (None: the step's own peak with everything moved).

    Returns:
        A :class:`MegatronCoreOffload`; ``remove()`` restores Megatron-Core's two
        attributes.

    Raises:
        ImportError: If ``megatron.core`` is not installed (the message says so).
        TypeError: If ``transport`` is not a ``cpu_offload`` transport, or
            ``memory_budget`` not an int or None.
        ValueError: If ``memory_budget`` is negative.

    Example:
        >>> from cpu_offload.megatron import use_with_megatron_core
        >>> handle = use_with_megatron_core()  # doctest: +SKIP
        >>> model = GPTModel(config, get_gpt_layer_local_spec(), ...)  # doctest: +SKIP
    """
    if transport is not None and not isinstance(transport, Transport):
        raise TypeError(
            f"transport must be a cpu_offload Transport, got {type(transport).__name__}"
        )
    check_memory_budget(memory_budget)
    try:
        import megatron.core.tensor_parallel.layers as layers
        import megatron.core.transformer.transformer_block as block
    except ImportError as err:
        raise ImportError(
            f"use_with_megatron_core needs megatron-core (pip install megatron-core): {err}"
        ) from err
    return MegatronCoreOffload(block, layers, transport, memory_budget)
