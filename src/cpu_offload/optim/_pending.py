"""Parameters whose update from the host is still in flight: every read waits for it.

With ``overlap_host_step_with_forward``, ``step()`` returns before the host has stepped
the offloaded parameters. Module forwards wait for the parameters they read (the global
pre-hook of ``_forward_overlap``), but a parameter can be read anywhere else too: a
training loop's functional call, an EMA update, a norm logged between steps,
``param.cpu()``. Such a read must see the new value, never the old one.

So while its update is pending, a parameter's class is swapped for a subclass of its own
class whose ``__torch_function__`` first waits for the update (which swaps the class
back) and then runs the function as usual. Reads of metadata only (``.grad``,
``.shape``, ``.dtype``, hashing for dict keys, ...) do not wait: ``zero_grad()`` right
after ``step()`` must not wait for the host step it is meant to overlap.

Reads that bypass torch functions (a C++ extension op bound without torch-function
handling, a pointer taken earlier) are not seen.

A parameter of a tensor subclass with a ``__torch_function__`` of its own, or whose
class cannot be swapped, stays as it is: running its functions with its override off
could change what they do. A read of it outside its module's forward is still caught
where backward reaches it (``UnguardedReadError``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cpu_offload._compat import is_current_stream_capturing

__all__ = [
    "hand_over",
    "is_pending",
    "is_writer",
    "mark_pending",
    "unmark_pending",
    "wait_for_copy",
    "wait_for_others",
    "writing",
]

#: Attribute of a pending parameter: ``(wait, entry)``, weakly held (strongly after
#: :func:`hand_over`); each called with no argument gives the object.
_ATTR = "_cpu_offload_pending_update"

# Every change of a parameter's mark (its pending class and _ATTR) and every check of
# whose mark it is, together: readers and optimizers on other threads change them too.
# Reentrant: what runs under it allocates, so the garbage collector can run an
# optimizer's finalizer (which changes its own marks) on the same thread meanwhile.
_SWAP = threading.RLock()

# Set on the thread that steps the host buckets: its writes into pending parameters
# must not wait for themselves (see :func:`writing`).
_WRITER = threading.local()

# Pending subclasses, one per parameter class (created on first use), and back.
_PENDING_CLASSES: dict[type, type] = {}
_ORIGINAL_CLASSES: dict[type, type] = {}


def _metadata_functions() -> frozenset[Any]:
    """Functions that read no values of a tensor: they never wait."""
    tensor = torch.Tensor
    properties = (
        "grad",
        "_grad",
        "requires_grad",
        "is_leaf",
        "grad_fn",
        "shape",
        "dtype",
        "device",
        "layout",
        "ndim",
        "_version",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "names",
        "_backward_hooks",
        "_post_accumulate_grad_hooks",
    )
    found: set[Any] = set()
    for name in properties:
        descriptor = getattr(tensor, name, None)
        for accessor in ("__get__", "__set__", "__delete__"):
            function = getattr(descriptor, accessor, None)
            if function is not None:
                found.add(function)
    for name in (
        "__hash__",
        "size",
        "dim",
        "numel",
        "stride",
        "element_size",
        "is_contiguous",
        "get_device",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "requires_grad_",
        "retain_grad",
    ):
        function = getattr(tensor, name, None)
        if function is not None:
            found.add(function)
    return frozenset(found)


_METADATA: frozenset[Any] = _metadata_functions()


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


class _PendingUpdate:
    """Mixin of the pending subclasses: any value read waits for the update first."""

    __slots__ = ()  # the parameter's layout stays its own: its class can be swapped

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA or getattr(_WRITER, "active", False):
            # No wait: metadata only, or the host-step thread writing the new values.
            # The pending parameter's own class has no override to skip here.
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        for tensor in (*_tensors_in(args), *_tensors_in(kwargs)):
            if is_pending(tensor):
                _wait(tensor)
        # Every pending argument has its own class back: the call dispatches as it
        # would have without this option (other subclasses' overrides included).
        return func(*args, **kwargs)

    # Copies and pickles read the values, and must neither see the old ones nor carry
    # the pending class or its weak references: wait, then do it as the own class does.
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        _wait(self)  # type: ignore[arg-type]
        return self.__deepcopy__(memo)  # the own class's, now

    def __reduce_ex__(self, protocol: Any) -> Any:
        _wait(self)  # type: ignore[arg-type]
        return self.__reduce_ex__(protocol)


@contextmanager
def writing() -> Iterator[None]:
    """On this thread, torch functions on pending parameters run without waiting.

    For the thread that steps the host buckets and writes the parameters' new values.
    """
    _WRITER.active = True
    try:
        yield
    finally:
        _WRITER.active = False


def is_writer() -> bool:
    """Whether this thread steps the host buckets now (inside :func:`writing`)."""
    return bool(getattr(_WRITER, "active", False))


def _pending_class(cls: type) -> type:
    pending = _PENDING_CLASSES.get(cls)
    if pending is None:
        pending = type(f"_Pending{cls.__name__}", (_PendingUpdate, cls), {"__slots__": ()})
        _PENDING_CLASSES[cls] = pending
        _ORIGINAL_CLASSES[pending] = cls
    return pending


def is_pending(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter whose update is still in flight."""
    return isinstance(tensor, _PendingUpdate)


def mark_pending(param: torch.Tensor, wait: Callable[[Any], None], entry: Any) -> bool:
    """Make every value read of ``param`` call ``wait(entry)`` first, once.

    ``wait`` must end with :func:`unmark_pending` of ``param`` (unless the parameter was
    marked again for a later update meanwhile). A ``param`` already pending behind the
    same object's wait takes the new ``entry``; one pending behind another object's must
    be waited for first (:func:`wait_for_others`, with no lock held).

    Returns:
        False if ``param`` is left as it is: a subclass with a ``__torch_function__`` of
        its own, or a class that cannot be swapped.

    Raises:
        TypeError: If ``wait`` is not a bound method.
        RuntimeError: If ``param`` is pending behind another object's wait (marked again
            on another thread since :func:`wait_for_others` returned).
    """
    owner = getattr(wait, "__self__", None)
    function = getattr(wait, "__func__", None)
    if owner is None or function is None:
        raise TypeError("wait must be a bound method (held weakly)")
    mark = (weakref.WeakMethod(wait), weakref.ref(entry))
    with _SWAP:
        if isinstance(param, _PendingUpdate):
            if _owner_of(param) is not owner:
                raise RuntimeError(
                    "HybridDeviceOptimizer: a parameter is still waiting for another "
                    "optimizer's update from the host; step one optimizer per parameter, "
                    "or call the other optimizer's synchronize() first"
                )
            param.__dict__[_ATTR] = mark
            return True
        original = type(param)
        own = getattr(original, "__torch_function__", None)
        if original is not torch.Tensor and own is not torch._C._disabled_torch_function_impl:
            return False  # a subclass's own override: not ours to turn off
        try:
            param.__dict__[_ATTR] = mark
            param.__class__ = _pending_class(original)
        except TypeError:
            param.__dict__.pop(_ATTR, None)
            return False
    return True


def wait_for_others(param: torch.Tensor, wait: Callable[[Any], None]) -> None:
    """Wait until ``param`` is not pending behind another object's wait than ``wait``'s.

    Before :func:`mark_pending`, with no lock held (another optimizer's wait takes its
    own): an update still in flight from another optimizer, or the copy back of a
    collected one (:func:`hand_over`), lands first, so that reads never wait for the old
    update only. Whatever that wait raises propagates.
    """
    owner = getattr(wait, "__self__", None)
    while isinstance(param, _PendingUpdate) and _owner_of(param) is not owner:
        _wait(param)


def hand_over(param: torch.Tensor, entry: Any, wait: Callable[[torch.Tensor], None]) -> bool:
    """Keep ``param``, pending behind ``entry``, pending behind ``wait(param)``, held strongly.

    For a parameter whose optimizer is gone while its update is still to be waited for
    (the optimizer's ``wait`` is held weakly): ``wait`` must end with
    ``unmark_pending(param, param)``.

    Returns:
        False if ``param`` is not pending behind ``entry`` (nothing makes its reads wait,
        or another update's mark does).
    """
    with _SWAP:
        if not isinstance(param, _PendingUpdate) or _entry_of(param) is not entry:
            return False
        param.__dict__[_ATTR] = (_Held(wait), weakref.ref(param))
    return True


class _Held:
    """A strong reference with the call of a weak one (``ref()`` gives the object)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


def unmark_pending(param: torch.Tensor, entry: Any = None) -> None:
    """Give ``param`` its own class back (a no-op if it is not pending).

    Args:
        param: The parameter.
        entry: Only if ``param`` is pending behind this entry (what its wait is called
            with): a reader that waited for one update leaves a later update's mark.
    """
    with _SWAP:
        if entry is not None and _entry_of(param) is not entry:
            return
        # Two readers on two threads may both get here: whichever comes second finds the
        # own class already back (not a pending class) and leaves it.
        original = _ORIGINAL_CLASSES.get(type(param))
        if original is not None:
            param.__class__ = original
        param.__dict__.pop(_ATTR, None)


def _owner_of(param: torch.Tensor) -> Any:
    """The object whose bound ``wait`` a pending ``param`` calls (None: it is gone)."""
    wait_ref, _ = param.__dict__.get(_ATTR, (None, None))
    wait = wait_ref() if wait_ref is not None else None
    return getattr(wait, "__self__", None)


def _entry_of(param: torch.Tensor) -> Any:
    """What a pending ``param``'s wait is called with (None: not pending, or gone)."""
    _, entry_ref = param.__dict__.get(_ATTR, (None, None))
    return entry_ref() if entry_ref is not None else None


def _wait(param: torch.Tensor) -> None:
    wait_ref, entry_ref = param.__dict__.get(_ATTR, (None, None))
    wait = wait_ref() if wait_ref is not None else None
    entry = entry_ref() if entry_ref is not None else None
    if wait is None or entry is None:
        # The optimizer is gone, and its finalizer (which hands its copies back over to
        # wait for) may not have run yet: wait for the entry's copy back here.
        event = getattr(entry, "h2d_event", None)
        if event is None:
            unmark_pending(param, entry)
        else:
            wait_for_copy(param, event, entry)
        return
    wait(entry)  # unmarks it, unless a later step marked it again meanwhile


def wait_for_copy(param: torch.Tensor, event: torch.cuda.Event, entry: Any) -> None:
    """Wait on the host for ``event``, the copy back of an update whose optimizer is
    gone, then give ``param`` its class back if it is still pending behind ``entry``.

    Raises:
        RuntimeError: Inside a CUDA graph capture, where no wait is possible (``param``
            stays pending).
    """
    if is_current_stream_capturing():
        raise RuntimeError(
            "HybridDeviceOptimizer: a parameter was read inside a CUDA graph capture "
            "while the update from the host step of an optimizer that has since been "
            "freed (overlap_host_step_with_forward) may still be copied back; read "
            "each of its parameters once before capturing (any value read, such as "
            "param.detach().clone(), waits for the copy), or call the optimizer's "
            "synchronize() before dropping it"
        )
    event.synchronize()
    unmark_pending(param, entry)
