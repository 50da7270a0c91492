"""Which offload contexts are active: the state behind ``is_cpu_offload_enabled()``.

The public query functions take no arguments (it is the reference API), so the active
contexts must be found without the caller's help. They live here and nowhere else, in a
context variable, so that threads and asyncio tasks each see their own.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Protocol

import torch

from .._compile import outside_compile

__all__ = [
    "ActiveContext",
    "ActiveHooks",
    "ContextOwner",
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
        # Weakly: the owner holds its hooks, and a cycle would keep the owner (and its
        # host buffers) alive until the garbage collector runs.
        self._owner = weakref.ref(owner)
        self._hooks = (
            None
            if pack is None or unpack is None
            # Called from compiled code too: see NOTE [torch.compile and the offload engine].
            else torch.autograd.graph.saved_tensors_hooks(
                outside_compile(pack), outside_compile(unpack)
            )
        )

    @property
    def has_hooks(self) -> bool:
        """Whether entering pushes saved-tensor hooks (False: it only marks the context)."""
        return self._hooks is not None

    def __enter__(self) -> ActiveHooks:
        if self._hooks is not None:
            self._hooks.__enter__()
        owner = self._owner()
        assert owner is not None  # its owner enters it
        push_active(owner)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        owner = self._owner()
        if owner is not None:
            pop_active(owner)
        if self._hooks is not None:
            self._hooks.__exit__(exc_type, exc, tb)


class ContextOwner:
    """Which thread an offload context belongs to.

    Saved-tensor hooks are per thread, but a context counts layers, iterations and
    pending syncs for one sequence of layers: two threads driving one context would
    interleave their layers. The first thread that enters a context owns it; another
    thread entering it (at the same time or later, with a layer still waiting for its
    sync) is refused with an error that says so, instead of failing later on a
    confused count. The claim is a pop from a one-element list, which is atomic, so
    two threads entering at once cannot both get in (and the object still deep-copies,
    as configurations that hold a context need).
    """

    def __init__(self) -> None:
        self._token = [True]
        self._thread: int | None = None  # the thread inside the `with` block
        self._last: int | None = None  # the thread that entered last

    def claim(self, layer_pending: bool) -> None:
        """Enter for the calling thread.

        Args:
            layer_pending: A layer entered earlier still waits for its sync/commit.

        Raises:
            RuntimeError: If the context is entered already (in this thread: a nested
                ``with``; in another: a context shared between threads).
        """
        me = threading.get_ident()
        try:
            self._token.pop()
        except IndexError:
            if self._thread == me:
                raise RuntimeError(
                    "the CPU offload context is already entered (nested `with`): leave it "
                    "before entering it again"
                ) from None
            raise self._foreign() from None
        if layer_pending and self._last not in (None, me):
            self._token.append(True)
            raise self._foreign()
        self._thread = self._last = me

    def release(self) -> None:
        """Leave (called by the owner's ``__exit__``); a no-op when not entered."""
        if self._thread is None:
            return
        self._thread = None
        self._token.append(True)

    def check_caller(self, what: str) -> None:
        """Refuse ``what`` from a thread other than the one inside the context."""
        if self._thread is not None and self._thread != threading.get_ident():
            raise self._foreign(what)

    @staticmethod
    def _foreign(what: str = "entered") -> RuntimeError:
        return RuntimeError(
            f"the CPU offload context was {what} from a second thread while another thread "
            "uses it: an offload context belongs to one thread; make one context (one "
            "get_cpu_offload_context call) per thread"
        )


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
