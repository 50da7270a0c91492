"""Which offload contexts are active: the state behind ``is_cpu_offload_enabled()``.

The public query functions take no arguments (it is the reference API), so the active
contexts must be found without the caller's help. They live here and nowhere else, in a
context variable, so that threads and asyncio tasks each see their own.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Protocol

import torch

__all__ = [
    "ActiveContext",
    "ActiveHooks",
    "active_context",
    "pop_active",
    "push_active",
]


class ActiveContext(Protocol):
    """What the query functions ask of an active offload context."""

    def is_current_layer_offloaded(self) -> bool: ...


_ACTIVE: ContextVar[tuple[ActiveContext, ...]] = ContextVar("cpu_offload_active", default=())


def push_active(ctx: ActiveContext) -> None:
    _ACTIVE.set((*_ACTIVE.get(), ctx))


def pop_active(ctx: ActiveContext) -> None:
    stack = _ACTIVE.get()
    if stack and stack[-1] is ctx:
        _ACTIVE.set(stack[:-1])
    else:  # exits out of order (a generator closed late): remove wherever it is
        _ACTIVE.set(tuple(c for c in stack if c is not ctx))


class ActiveHooks:
    """An offload context's saved-tensor hooks and its place among the active contexts.

    Entered as the last step of a context's ``__enter__`` (nothing after it can fail, so
    no hooks stay pushed by a failed entry) and left first in its ``__exit__``. Without
    hooks (``pack`` None: a pass-through under ``torch.no_grad``) it only marks the
    context active.
    """

    def __init__(
        self,
        owner: ActiveContext,
        pack: Callable[[torch.Tensor], Any] | None = None,
        unpack: Callable[[Any], torch.Tensor] | None = None,
    ) -> None:
        self.owner = owner
        self._hooks = (
            None
            if pack is None or unpack is None
            else torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        )

    @property
    def has_hooks(self) -> bool:
        return self._hooks is not None

    def __enter__(self) -> ActiveHooks:
        if self._hooks is not None:
            self._hooks.__enter__()
        push_active(self.owner)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pop_active(self.owner)
        if self._hooks is not None:
            self._hooks.__exit__(exc_type, exc, tb)


def active_context() -> ActiveContext | None:
    """The innermost active offload context, or None."""
    stack = _ACTIVE.get()
    return stack[-1] if stack else None


def is_cpu_offload_enabled() -> bool:
    """Whether an offload context (V1 or V2) is active here.

    Returns:
        True inside the ``with`` block of an enabled offload context.

    Example:
        >>> is_cpu_offload_enabled()
        False
    """
    return active_context() is not None


def is_current_layer_offloaded() -> bool:
    """Whether the layer whose forward runs now has its activations offloaded.

    Returns:
        False outside an offload context.
    """
    ctx = active_context()
    return ctx is not None and ctx.is_current_layer_offloaded()
