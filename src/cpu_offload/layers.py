"""One call to offload (or recompute) the layers of a model whose code you cannot edit.

:func:`offload_layers` does what the quickstart's loop does by hand: it runs each layer's
forward inside the offload context and passes the layer's output through the sync
function, by replacing the ``forward`` of each layer instance (not of its class), and
:meth:`OffloadedLayers.remove` puts the original methods back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ._args import check_int
from ._compat import in_backward
from ._compile import keep_engine_out_of_compile
from ._layer_call import run_layer, run_layer_recomputed
from ._layer_stack import check_indices, find_layers, offload_schedule
from ._log import logger
from ._marking import MarkOutputs
from ._switch import ENV_VAR, use_v1

__all__ = ["OffloadedLayers", "layer_runner", "offload_layers", "sync_first"]

# Arguments offload_layers computes itself from the layers and the indices.
_OWN_ARGUMENTS = (
    "enabled",
    "num_layers",
    "model_layers",
    "manual_synchronization",
    "synchronization_dict",
)


def sync_first(out: Any, sync: Callable[[torch.Tensor], torch.Tensor], index: int) -> Any:
    """Pass the hidden state in ``out`` through ``sync``: ``out`` itself, or its first element."""
    if isinstance(out, torch.Tensor):
        return sync(out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        # Hugging Face ModelOutput: the first field set is the hidden state (``out[0]``),
        # and setting the attribute keeps its dict view in step.
        for f in dataclasses.fields(out):
            value = getattr(out, f.name)
            if value is not None:
                if isinstance(value, torch.Tensor):
                    setattr(out, f.name, sync(value))
                    return out
                break
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        first = sync(out[0])
        if isinstance(out, list):
            return [first, *out[1:]]
        if hasattr(out, "_fields"):  # a namedtuple
            return type(out)(first, *out[1:])
        return (first, *out[1:])
    raise TypeError(
        f"offload_layers: layer {index} returned a {type(out).__name__}; a layer's output "
        "must be a tensor, or a tuple, list or dataclass whose first element is the "
        "hidden-state tensor passed to the next layer"
    )


def _unbound(
    forward: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``forward`` and ``args`` as a plain function and its arguments, the module first.

    For :mod:`cpu_offload._layer_call`, whose frame torch.compile compiles: it guards on
    the identity of what it calls (PyTorch 2.6), and a bound method is an object per
    layer, so each layer would compile again and layers past the recompile limit (8)
    would run uncompiled. A class's function is one object for all its layers.
    """
    func = getattr(forward, "__func__", None)
    owner = getattr(forward, "__self__", None)
    if func is None or owner is None:
        return forward, args
    return func, (owner, *args)


class _Runner:
    """Runs one layer's forward: recomputed, offloaded, or counted by the schedule."""

    def __init__(
        self,
        context: Any,
        sync: Callable[[torch.Tensor], torch.Tensor] | None,
        offloaded: frozenset[int],
        recomputed: frozenset[int],
        num_layers: int,
        mark_outputs: bool,
    ) -> None:
        self.context = context
        self.sync = sync
        self.offloaded = offloaded
        self.recomputed = recomputed
        self.num_layers = num_layers
        self.mark_outputs = mark_outputs
        self.last_index: int | None = None

    def __call__(
        self, index: int, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        if not torch.is_grad_enabled() or in_backward():
            # Evaluation (nothing is saved for backward), or a recomputation inside
            # backward (a model's own activation checkpointing, whose activations are
            # used at once): the schedule must not count it.
            return run_layer(*_unbound(forward, args), kwargs)
        run = functools.partial(
            run_layer_recomputed if index in self.recomputed else run_layer,
            *_unbound(forward, args),
            kwargs,
        )

        if self.context is None:
            return run()
        if index == 0 and self.last_index not in (None, self.num_layers - 1):
            # The previous forward stopped between layers (an exception outside a layer):
            # start the iteration afresh instead of counting on from where it stopped.
            self.context._restart_iteration()
        elif index != 0 and self.last_index != index - 1:
            self._refuse_order(index)
        self.last_index = None
        mark = MarkOutputs() if self.mark_outputs and index in self.offloaded else None
        with self.context, mark or contextlib.nullcontext():
            out = run()
        assert self.sync is not None
        try:
            out = sync_first(out, self.sync, index)
        except TypeError:
            self.context._restart_iteration()
            raise
        self.last_index = index
        return out

    @property
    def transport(self) -> Any:
        """The transport of the offload context (None when no layer is offloaded)."""
        if self.context is None:
            return None
        synchronizer = getattr(self.context, "offload_synchronizer", None)
        if synchronizer is not None:  # V2
            return synchronizer.transport
        return getattr(self.context.offload_handler, "transport", None)  # V1

    def _refuse_order(self, index: int) -> None:
        last = self.last_index
        if last is None:
            cause = f"the forward began at layer {index}, not at layer 0"
        elif index == last:
            cause = f"layer {index} ran twice in a row"
        elif index < last:
            cause = f"layer {index} ran again after layer {last} in the same forward"
        else:
            skipped = ", ".join(str(i) for i in range(last + 1, index))
            cause = f"layer(s) {skipped} did not run between layers {last} and {index}"
        self.context._restart_iteration()
        raise RuntimeError(
            f"offload_layers: {cause}. The offload schedule counts each layer once per "
            "forward, in order: run every wrapped layer once per forward (no layer drop, "
            "no reuse of a layer), or wrap only the layers that run that way"
        )


# NOTE [Wrapped layers and their copies]
# offload_layers puts a bound method on each layer instance, ``forward`` (so that
# nn.Module.__call__ finds it), and the wrapping state beside it under _WRAP_ATTR. The
# state knows the very layer it was made for. A copy of a wrapped layer
# (``copy.deepcopy`` for an EMA or reference model, ``torch.save`` of the whole model)
# gets the bound method rebound to itself, and the state shared (``__deepcopy__``) or
# dropped (pickling); seeing that the state is not its own, the copy runs its class's
# forward: a plain layer with its own weights, outside the original's schedule. Were
# the state a closure over the original's bound forward, the copy would run the
# original's weights and advance its schedule.
_WRAP_ATTR = "_cpu_offload_wrap"


class _Wrap:
    """What :func:`offload_layers` keeps on one wrapped layer (see the NOTE above)."""

    __slots__ = ("forward", "index", "layer", "runner")

    def __init__(
        self, layer: nn.Module, runner: _Runner, index: int, forward: Callable[..., Any]
    ) -> None:
        self.layer = weakref.ref(layer)
        self.runner = runner
        self.index = index
        self.forward = forward  # the layer's own forward, as it was before wrapping

    def __deepcopy__(self, memo: dict[int, Any]) -> _Wrap:
        return self  # shared: the copy sees that it is not the layer this was made for

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return (_no_wrap, ())


def _no_wrap() -> None:
    """What a pickled :class:`_Wrap` loads as: nothing (the loaded layer is plain)."""
    return None


def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward :func:`offload_layers` installs (named so that pickling finds a plain one)."""
    wrap = self.__dict__.get(_WRAP_ATTR)
    if wrap is None or wrap.layer() is not self:
        # A copy of a wrapped layer: see NOTE [Wrapped layers and their copies].
        return type(self).forward(self, *args, **kwargs)
    return wrap.runner(wrap.index, wrap.forward, args, kwargs)


_wrapped_forward = forward
del forward


class OffloadedLayers:
    """What :func:`offload_layers` returns: the wrapped layers, and how to unwrap them.

    Also a context manager: leaving the ``with`` block calls :meth:`remove`.

    Attributes:
        layers: The layers, in forward order (the modules themselves).
        num_layers: How many there are.
        offloaded: Indices of the offloaded layers, sorted.
        recomputed: Indices of the recomputed (checkpointed) layers, sorted.
        backend: ``"v1"`` or ``"v2"``, or None when no layer is offloaded.
        context: The offload context the layers run in (None when none is offloaded).
        sync: Its sync (V2) or commit (V1) function, or None.
    """

    def __init__(
        self,
        layers: list[nn.Module],
        offloaded: frozenset[int],
        recomputed: frozenset[int],
        backend: str | None,
        context: Any,
        sync: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        self.layers = layers
        self.num_layers = len(layers)
        self.offloaded = tuple(sorted(offloaded))
        self.recomputed = tuple(sorted(recomputed))
        self.backend = backend
        self.context = context
        self.sync = sync
        self._installed: list[tuple[nn.Module, Any, bool, Any]] = []

    def _install(self, runner: _Runner) -> None:
        counted = runner.context is not None  # every layer counts in the schedule
        for index, layer in enumerate(self.layers):
            if not counted and index not in runner.recomputed:
                continue
            had_own = "forward" in layer.__dict__
            previous = layer.__dict__.get("forward")
            wrap = _Wrap(layer, runner, index, layer.forward)
            forward = types.MethodType(_wrapped_forward, layer)
            layer.__dict__[_WRAP_ATTR] = wrap
            layer.forward = forward  # type: ignore[method-assign]
            self._installed.append((layer, forward, had_own, previous))

    @property
    def active(self) -> bool:
        """Whether the layers are still wrapped (False after :meth:`remove`)."""
        return bool(self._installed)

    def remove(self) -> None:
        """Put back each layer's own ``forward``: the model behaves as before the call.

        Calling it again does nothing.

        Raises:
            RuntimeError: If a layer's ``forward`` was replaced again after
                :func:`offload_layers` wrapped it (removing ours would drop that one too).
        """
        for layer, forward, _, _ in self._installed:
            if layer.__dict__.get("forward") is not forward:
                raise RuntimeError(
                    f"offload_layers: the forward of {type(layer).__name__} was replaced "
                    "after offload_layers wrapped it; undo that wrapper first"
                )
        for layer, _, had_own, previous in self._installed:
            if had_own:
                layer.forward = previous  # type: ignore[method-assign]
            else:
                del layer.__dict__["forward"]
            del layer.__dict__[_WRAP_ATTR]
        self._installed.clear()
        logger.debug("offload_layers: removed from %d layers", self.num_layers)

    def __enter__(self) -> OffloadedLayers:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"OffloadedLayers(num_layers={self.num_layers}, offloaded={list(self.offloaded)}, "
            f"recomputed={list(self.recomputed)}, backend={self.backend!r}, "
            f"active={self.active})"
        )


def _offloaded_set(
    num_offloaded: int | None, offloaded: Iterable[int] | None, n: int
) -> frozenset[int]:
    if num_offloaded is not None and offloaded is not None:
        raise ValueError(
            "offload_layers: pass num_offloaded (the first k layers) or offloaded "
            "(explicit layer indices), not both"
        )
    if offloaded is not None:
        return check_indices("offloaded", offloaded, n)
    if num_offloaded is None:
        return frozenset()
    check_int("num_offloaded", num_offloaded)
    v1 = use_v1()
    top = n if v1 else n - 1  # V2 keeps at least one layer's activations on the GPU
    if not 0 <= num_offloaded <= top:
        why = "V1 backend" if v1 else "V2 backend, which keeps one layer's activations on the GPU"
        raise ValueError(
            f"num_offloaded must be in [0, {top}] for a stack of {n} layers under the "
            f"{why}, got {num_offloaded}"
        )
    return frozenset(range(num_offloaded))


def _make_context(
    offloaded: frozenset[int], n: int, v1: bool, context_kwargs: dict[str, Any]
) -> tuple[Any, Any]:
    from . import get_cpu_offload_context  # the package imports this module

    m = len(offloaded)
    prefix = offloaded == frozenset(range(m))
    if v1:
        if not prefix:
            raise ValueError(
                f"offloaded={sorted(offloaded)}: the V1 backend ({ENV_VAR} is set) offloads "
                "only the first k layers; pass num_offloaded=k, or unset "
                f"{ENV_VAR} to offload any set of layers with V2"
            )
        return get_cpu_offload_context(True, m, n, **context_kwargs)
    if m >= n:
        raise ValueError(
            f"offload_layers: {m} of {n} layers offloaded; at least one layer's activations "
            f"must stay on the GPU (offload at most {n - 1})"
        )
    if prefix:
        return get_cpu_offload_context(True, m, n, **context_kwargs)
    return get_cpu_offload_context(
        True, m, n, synchronization_dict=offload_schedule(offloaded, n), **context_kwargs
    )


def layer_runner(
    num_layers: int,
    offloaded: frozenset[int],
    recomputed: frozenset[int],
    **context_kwargs: Any,
) -> tuple[_Runner, str | None]:
    """What runs each layer of :func:`offload_layers`, and its backend (None: none offloaded).

    The runner is called as ``runner(index, forward, args, kwargs)``; anything that
    replaces the layers' forward (``offload_layers``, the variants of ``compare``) calls
    it. ``offloaded`` and ``recomputed`` are checked indices (see
    :func:`cpu_offload._layer_stack.check_indices`), disjoint.

    Raises:
        ValueError: If the backend cannot offload the set (V1: only the first k; V2: not
            all of the layers).
    """
    keep_engine_out_of_compile()  # see NOTE [torch.compile and the offload engine]
    v1 = use_v1()
    context = sync = None
    backend = None
    if offloaded:
        context, sync = _make_context(offloaded, num_layers, v1, context_kwargs)
        backend = "v1" if v1 else "v2"
    runner = _Runner(context, sync, offloaded, recomputed, num_layers, mark_outputs=v1)
    return runner, backend


def offload_layers(
    model_or_layers: nn.Module | Iterable[nn.Module],
    num_offloaded: int | None = None,
    *,
    offloaded: Iterable[int] | None = None,
    recomputed: Iterable[int] = (),
    **context_kwargs: Any,
) -> OffloadedLayers:
    """Offload the activations of a model's layers, without editing the model's code.

    Each layer's forward is replaced, on the layer instance, by one that runs it inside
    the offload context and passes its output through the sync function, as the
    hand-written loop of the quickstart does. Layers may return a tensor, or a tuple,
    list or dataclass (a Hugging Face ``ModelOutput``) whose first element is the hidden
    state; any positional and keyword arguments reach the layer unchanged. Under
    ``torch.no_grad()`` the layers run as they are (nothing is offloaded, nothing is
    counted). Recomputed layers run through
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Results are bit-identical
    to the model without offloading.

    The backend is the one ``NVTE_CPU_OFFLOAD_V1`` selects, as for
    :func:`cpu_offload.get_cpu_offload_context`. Under V1, which offloads only marked
    tensors, every tensor the offloaded layers compute is marked.

    The model may be compiled with ``torch.compile`` before or after this call, as a
    whole or layer by layer: each wrapped layer is then a graph break, and its forward
    compiles into a graph of its own (see docs/compile.md).

    Every forward must run all the layers once, and its backward must run before the
    next forward with grad enabled (gradient accumulation: forward and backward for
    each micro-batch, then one optimizer step).

    Args:
        model_or_layers: A model (its layer stack is found at ``model.layers``,
            ``model.model.layers``, ``model.transformer.h`` and the other paths of
            ``cpu_offload._layer_stack.LAYER_PATHS``), an ``nn.ModuleList``, an
            ``nn.Sequential`` or a list of modules.
        num_offloaded: Offload the first ``k`` layers (V2: ``0 <= k <= n-1``; V1:
            ``0 <= k <= n``).
        offloaded: Explicit layer indices to offload instead of ``num_offloaded``
            (V2 only, unless they are the first k). The ``j``-th of ``m`` finishes its
            offload before the forward of layer ``n-m+j``, as in the default schedule.
        recomputed: Layer indices to recompute in backward instead of keeping their
            activations; none of them may be offloaded.
        **context_kwargs: Passed to :func:`cpu_offload.get_cpu_offload_context`
            (``transport``, ``min_tensor_size_to_offload``, ``offload_stream``, ...).

    Returns:
        An :class:`OffloadedLayers` handle; ``handle.remove()`` (or leaving it as a
        context manager) restores the model.

    Raises:
        TypeError: If the layers cannot be found in what was passed, an index is not an
            int, or ``context_kwargs`` names an argument this function sets itself.
        ValueError: If both ``num_offloaded`` and ``offloaded`` are given, neither they
            nor ``recomputed`` ask for anything, an index is out of range, a layer is
            both offloaded and recomputed, the layers are already wrapped, or the
            backend cannot offload the set (V1: only the first k; V2: not all of them).

    Example:
        >>> import cpu_offload
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
        >>> handle = cpu_offload.offload_layers(model, num_offloaded=2,
        ...                                     min_tensor_size_to_offload=1024)
        >>> model(torch.randn(64, 512, requires_grad=True)).sum().backward()
        >>> handle.remove()
    """
    layers = find_layers(model_or_layers)
    n = len(layers)
    own = sorted(set(context_kwargs) & set(_OWN_ARGUMENTS))
    if own:
        raise TypeError(
            f"offload_layers sets {', '.join(own)} itself from the layers and the indices; "
            "pass num_offloaded or offloaded instead"
        )
    offloaded_set = _offloaded_set(num_offloaded, offloaded, n)
    recomputed_set = check_indices("recomputed", recomputed, n)
    both = sorted(offloaded_set & recomputed_set)
    if both:
        raise ValueError(
            f"offload_layers: layers {both} are both offloaded and recomputed; a layer's "
            "activations are either offloaded or recomputed, not both"
        )
    if num_offloaded is None and offloaded is None and not recomputed_set:
        raise ValueError(
            "offload_layers: nothing to do; pass num_offloaded=k, offloaded=[...] or "
            "recomputed=[...]"
        )
    for index, layer in enumerate(layers):
        wrap = layer.__dict__.get(_WRAP_ATTR)
        if wrap is not None and wrap.layer() is layer:
            raise ValueError(
                f"offload_layers: layer {index} ({type(layer).__name__}) is already wrapped "
                "by offload_layers; call remove() on that handle first"
            )
    runner, backend = layer_runner(n, offloaded_set, recomputed_set, **context_kwargs)
    handle = OffloadedLayers(
        layers, offloaded_set, recomputed_set, backend, runner.context, runner.sync
    )
    handle._install(runner)
    logger.debug("offload_layers: %r", handle)
    return handle
