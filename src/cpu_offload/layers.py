"""One call to offload (or recompute) the layers of a model whose code you cannot edit.

:func:`offload_layers` does what the quickstart's loop does by hand: it runs each layer's
forward inside the offload context and passes the layer's output through the sync
function, by replacing the ``forward`` of each layer instance (not of its class), and
:meth:`OffloadedLayers.remove` puts the original methods back.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from torch import nn

from ._args import check_min_tensor_size
from ._compat import in_backward
from ._compile import keep_engine_out_of_compile
from ._layer_parts import Choice, PartPlan, check_parts
from ._layer_runner import PartRunner, Runner, StepWatch, sync_first
from ._layer_stack import checked_sets, find_layers, offload_schedule
from ._layer_wrap import Patch, patch_layer, wrap_of
from ._log import logger
from ._switch import ENV_VAR, use_v1
from .v2.context import DEFAULT_MIN_TENSOR_SIZE
from .v2.default import DefaultOffloadSynchronizer

__all__ = ["OffloadedLayers", "StepWatch", "layer_runner", "offload_layers", "sync_first"]

# Arguments offload_layers computes itself from the layers and the indices.
_OWN_ARGUMENTS = (
    "enabled",
    "num_layers",
    "model_layers",
    "manual_synchronization",
    "synchronization_dict",
)


class OffloadedLayers:
    """What :func:`offload_layers` returns: the wrapped layers, and how to unwrap them.

    Also a context manager: leaving the ``with`` block calls :meth:`remove`.

    Attributes:
        layers: The layers, in forward order (the modules themselves).
        num_layers: How many there are.
        offloaded: Indices of the layers offloaded whole, sorted (a layer that offloads a
            part counts as offloaded for the schedule, and is in ``parts``).
        recomputed: Indices of the recomputed (checkpointed) layers, sorted.
        parts: Per layer, what each of its parts does (``{index: {name: choice}}``).
        backend: ``"v1"`` or ``"v2"``, or None when no layer is offloaded.
        context: The offload context the layers run in (None when none is offloaded).
        sync: Its sync (V2) or commit (V1) function, or None.
    """

    def __init__(
        self,
        layers: list[nn.Module],
        runner: Runner,
        backend: str | None,
        context_kwargs: dict[str, Any],
    ) -> None:
        self.layers = layers
        self.num_layers = len(layers)
        self._runner = runner
        self._context_kwargs = context_kwargs
        self._describe(backend)
        self._installed: dict[int, Patch] = {}
        self._installed_parts: dict[tuple[int, str], Patch] = {}
        self._removed = False

    def _describe(self, backend: str | None) -> None:
        runner = self._runner
        self.offloaded = tuple(sorted(runner.offloaded - set(runner.parts)))
        self.recomputed = tuple(sorted(runner.recomputed))
        self.parts = {j: {name: c.value for name, c in p.items()} for j, p in runner.parts.items()}
        self.recast = tuple(runner.recast)
        self.backend = backend
        self.context = runner.context
        self.sync = runner.sync

    def _install(self) -> None:
        """Wrap every layer, once any is offloaded or recomputed or the steps are watched:
        the runner counts each layer for the schedule and sees where a forward begins."""
        runner = self._runner
        self._install_parts()
        if (
            runner.context is None
            and not runner.recomputed
            and not runner.parts
            and not runner.recast
            and runner.watch is None
        ):
            return  # every layer kept: nothing to run through the handle
        added: list[int] = []
        try:
            for index, layer in enumerate(self.layers):
                if index not in self._installed:
                    self._installed[index] = patch_layer(layer, runner, index)
                    added.append(index)
        except BaseException:
            # A layer that cannot be wrapped (a class that refuses a subclass, say) leaves
            # no other layer wrapped behind it.
            for index in added:
                self._installed.pop(index).undo()
            raise

    def _install_parts(self) -> None:
        """Put a :class:`PartRunner` in front of each part the runner names, and take it
        from the parts it no longer names."""
        wanted = {(j, name) for j, p in self._runner.parts.items() for name in p}
        for key in [k for k in self._installed_parts if k not in wanted]:
            self._installed_parts.pop(key).undo()
        for j, name in sorted(wanted - set(self._installed_parts)):
            module = self.layers[j].get_submodule(name)
            runner = PartRunner(self._runner, j, name)
            self._installed_parts[(j, name)] = patch_layer(module, runner, j)

    def _check_usable(self, method: str) -> None:
        if self._removed:
            raise RuntimeError(
                f"offload_layers: {method}() after remove(); wrap the layers again with "
                "offload_layers"
            )
        if self._runner.depth or in_backward():
            raise RuntimeError(
                f"offload_layers: {method}() during a forward or a backward; call it between "
                "training steps"
            )

    def reassign(
        self,
        *,
        offloaded: Iterable[int] = (),
        recomputed: Iterable[int] = (),
        parts: Mapping[int, Mapping[str, str]] | None = None,
        recast: Iterable[int] = (),
    ) -> None:
        """Offload and recompute other layers (or parts of layers), from the next forward on.

        The offload context is made again with the arguments :func:`offload_layers`
        was given. Call it between training steps (after a backward, before the next
        forward), never during one.

        Args:
            offloaded: Layer indices to offload.
            recomputed: Layer indices to recompute; none of them offloaded.
            parts: Choices for parts of other layers, as :func:`offload_layers` takes them.
            recast: Kept layers whose saved casts are rebuilt, as :func:`offload_layers`
                takes them.

        Raises:
            RuntimeError: After :meth:`remove`, or during a forward or a backward.
            ValueError: As :func:`offload_layers` for the same indices.
        """
        self._check_usable("reassign")
        offloaded_set, recomputed_set, recast_set = checked_sets(
            None, offloaded, recomputed, recast, self.num_layers
        )
        # The parts this handle wraps now may be parts of the new plan too.
        owned = [patch.layer for patch in self._installed_parts.values()]
        taken = offloaded_set | recomputed_set | recast_set
        part_plan = check_parts(parts, self.layers, taken, owned)
        runner, backend = layer_runner(
            self.num_layers,
            offloaded_set,
            recomputed_set,
            parts=part_plan,
            recast=recast_set,
            **self._context_kwargs,
        )
        self._runner.take(runner)
        self._describe(backend)
        self._install()
        logger.debug("offload_layers: reassigned to %r", self)

    @property
    def watch(self) -> StepWatch | None:
        """What :meth:`watch_steps` installed, or None."""
        return self._runner.watch

    def watch_steps(self, watch: StepWatch) -> None:
        """Have ``watch`` called at the start and the end of each training forward.

        Every layer is wrapped from now on, so that the first and the last run through
        the handle whatever they do.

        Args:
            watch: The :class:`StepWatch` (``apply_plan``'s budget check, say).

        Raises:
            TypeError: If ``watch`` lacks a callable ``forward_started`` or
                ``forward_ended``.
            RuntimeError: After :meth:`remove`, or during a forward or a backward.
        """
        missing = [
            name
            for name in ("forward_started", "forward_ended")
            if not callable(getattr(watch, name, None))
        ]
        if missing:
            raise TypeError(
                f"watch must have callable forward_started() and forward_ended(output); "
                f"{type(watch).__name__} lacks {', '.join(missing)}"
            )
        self._check_usable("watch_steps")
        self._runner.watch = watch
        self._install()

    @property
    def active(self) -> bool:
        """Whether the layers are still wrapped (False after :meth:`remove`)."""
        return bool(self._installed)

    def remove(self) -> None:
        """Put back each layer's own ``forward`` (or class): the model behaves as before
        the call.

        Calling it again does nothing.

        Raises:
            RuntimeError: If a layer's ``forward`` (or class) was replaced again after
                :func:`offload_layers` wrapped it (removing ours would drop that one too).
        """
        patches = [*self._installed.values(), *self._installed_parts.values()]
        for patch in patches:
            patch.check()
        for patch in patches:
            patch.undo()
        self._installed.clear()
        self._installed_parts.clear()
        self._runner.watch = None
        # The handle usually outlives remove() (a variable holds it), and with it the
        # transport: its host buffers, free again after each backward, are dropped now.
        transport = self._runner.transport
        if transport is not None:
            transport.pool.clear()
        self._removed = True
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
            f"recomputed={list(self.recomputed)}, "
            + (f"parts={self.parts}, " if self.parts else "")
            + (f"recast={list(self.recast)}, " if self.recast else "")
            + f"backend={self.backend!r}, active={self.active})"
        )


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
            f"offload_layers: {m} of {n} layers offloaded (whole, or a part of them: a layer "
            "that offloads a part counts as offloaded); at least one layer's activations "
            f"must stay on the GPU (offload at most {n - 1})"
        )
    if prefix:
        context, sync = get_cpu_offload_context(True, m, n, **context_kwargs)
    else:
        context, sync = get_cpu_offload_context(
            True, m, n, synchronization_dict=offload_schedule(offloaded, n), **context_kwargs
        )
    synchronizer = context.offload_synchronizer
    if isinstance(synchronizer, DefaultOffloadSynchronizer):
        synchronizer.forward_count_advice = (
            f"offload_layers wrapped {n} layers, each to run once per forward, in order, "
            "and a backward after each forward: a wrapped layer that runs again after the "
            "last one in the same forward (a layer reused, as with tied weights) cannot be "
            "counted; wrap only the layers that run once per forward"
        )
    return context, sync


def _check_context_names(context_kwargs: Mapping[str, Any]) -> None:
    """Refuse a keyword argument :func:`cpu_offload.get_cpu_offload_context` does not
    take, at the call: without an offloaded layer no context is made, and a misspelled
    name would otherwise pass unseen until a later ``reassign`` offloads one."""
    from . import get_cpu_offload_context  # the package imports this module

    known = [
        name
        for name in inspect.signature(get_cpu_offload_context).parameters
        if name not in _OWN_ARGUMENTS
    ]
    unknown = sorted(set(context_kwargs) - set(known))
    if unknown:
        what = (
            "an unexpected keyword argument"
            if len(unknown) == 1
            else "unexpected keyword arguments"
        )
        raise TypeError(
            f"offload_layers got {what} {', '.join(map(repr, unknown))}; the offload "
            f"context takes {', '.join(known)}"
        )


def layer_runner(
    num_layers: int,
    offloaded: frozenset[int],
    recomputed: frozenset[int],
    parts: PartPlan | None = None,
    recast: frozenset[int] = frozenset(),
    **context_kwargs: Any,
) -> tuple[Runner, str | None]:
    """What runs each layer of :func:`offload_layers`, and its backend (None: none offloaded).

    The runner is called as ``runner(index, forward, args, kwargs)``; anything that
    replaces the layers' forward (``offload_layers``, the variants of ``compare``) calls
    it. ``offloaded`` and ``recomputed`` are checked indices (see
    :func:`cpu_offload._layer_stack.check_indices`), disjoint; ``parts`` is checked
    (:func:`cpu_offload._layer_parts.check_parts`), and a layer with an offloaded part
    counts as offloaded (NOTE [Parts of a layer]).

    Raises:
        ValueError: If the backend cannot offload the set (V1: only the first k, and no
            parts; V2: not all of the layers).
    """
    keep_engine_out_of_compile()  # see NOTE [torch.compile and the offload engine]
    v1 = use_v1()
    parts = parts or {}
    with_parts = frozenset(j for j, p in parts.items() if Choice.OFFLOAD in p.values())
    if v1 and with_parts:
        raise ValueError(
            f"parts: layers {sorted(with_parts)} offload parts, which the V1 backend "
            f"({ENV_VAR} is set) cannot do (it offloads whole layers); unset {ENV_VAR}, "
            "or offload these layers whole"
        )
    offloaded = offloaded | with_parts
    context = sync = None
    backend = None
    if offloaded:
        context, sync = _make_context(offloaded, num_layers, v1, context_kwargs)
        backend = "v1" if v1 else "v2"
    min_numel = context_kwargs.get("min_tensor_size_to_offload", DEFAULT_MIN_TENSOR_SIZE)
    runner = Runner(
        context,
        sync,
        offloaded,
        recomputed,
        num_layers,
        mark_outputs=v1,
        parts=parts,
        recast=recast,
        min_numel=check_min_tensor_size(min_numel),
    )
    return runner, backend


def offload_layers(
    model_or_layers: nn.Module | Iterable[nn.Module],
    num_offloaded: int | None = None,
    *,
    offloaded: Iterable[int] | None = None,
    recomputed: Iterable[int] = (),
    parts: Mapping[int, Mapping[str, str]] | None = None,
    recast: Iterable[int] = (),
    **context_kwargs: Any,
) -> OffloadedLayers:
    """Offload the activations of a model's layers, without editing the model's code.

    Each layer's forward is replaced, on the layer instance, by one that runs it inside
    the offload context and passes its output through the sync function, as the
    hand-written loop of the quickstart does. Layers may return a tensor, or a tuple,
    list or dataclass (a Hugging Face ``ModelOutput``) whose first element is the hidden
    state; any positional and keyword arguments reach the layer unchanged. Under
    ``torch.no_grad()`` the layers run as they are (nothing is offloaded, nothing is
    counted). Recomputed layers are recomputed in backward as
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` does, by the package's own
    recomputation in eager mode (NOTE [A lean recomputation] in
    ``cpu_offload._recompute``) and by that checkpoint under ``torch.compile``. Results
    are bit-identical to the model without offloading.

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
        parts: Per layer, a choice for some of its submodules (V2 only for
            ``"offload"``): ``{3: {"self_attention.core_attention": "recompute",
            "mlp": "offload"}}``. What a part saves for backward is kept (``"keep"``),
            offloaded (``"offload"``: the layer then counts as offloaded for the
            schedule) or recomputed in backward (``"recompute"``: the part runs through
            the same checkpoint as a recomputed layer); what the layer saves outside its
            parts is kept. A layer given parts is not in ``offloaded`` or ``recomputed``.
        recast: Layer indices kept on the device whose saved casts (the bf16 copy of an
            fp32 softmax) are cast again in backward instead of held: everything else
            they save stays, nothing is copied (NOTE [A kept layer's casts] in
            ``cpu_offload/engine/kept_layer.py``). Offloaded layers do this already;
            none of them may be offloaded, recomputed or given parts. Any backend.
        **context_kwargs: Passed to :func:`cpu_offload.get_cpu_offload_context`
            (``transport``, ``min_tensor_size_to_offload``, ``offload_stream``, ...).

    Returns:
        An :class:`OffloadedLayers` handle; ``handle.remove()`` (or leaving it as a
        context manager) restores the model.

    Raises:
        TypeError: If the layers cannot be found in what was passed, an index is not an
            int, or ``context_kwargs`` names an argument this function sets itself or
            one the offload context does not take (checked even when no layer is
            offloaded).
        ValueError: If both ``num_offloaded`` and ``offloaded`` are given, none of them,
            ``recomputed`` and ``parts`` asks for anything, an index is out of range, a
            layer is both offloaded and recomputed (or given parts too), a part is not a
            submodule of its layer or lies inside another, a choice is unknown, the
            layers are already wrapped, or the backend cannot offload the set (V1: only
            the first k and no parts; V2: not all of them).

    Example:
        >>> import torch, cpu_offload
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
    _check_context_names(context_kwargs)
    offloaded_set, recomputed_set, recast_set = checked_sets(
        num_offloaded, offloaded, recomputed, recast, n
    )
    part_plan = check_parts(parts, layers, offloaded_set | recomputed_set | recast_set)
    if (
        num_offloaded is None
        and offloaded is None
        and not recomputed_set
        and not part_plan
        and not recast_set
    ):
        raise ValueError(
            "offload_layers: nothing to do; pass num_offloaded=k, offloaded=[...], "
            "recomputed=[...], parts={...} or recast=[...]"
        )
    for index, layer in enumerate(layers):
        if wrap_of(layer) is not None:
            raise ValueError(
                f"offload_layers: layer {index} ({type(layer).__name__}) is already wrapped "
                "by offload_layers; call remove() on that handle first"
            )
    runner, backend = layer_runner(
        n, offloaded_set, recomputed_set, parts=part_plan, recast=recast_set, **context_kwargs
    )
    handle = OffloadedLayers(layers, runner, backend, context_kwargs)
    handle._install()
    logger.debug("offload_layers: %r", handle)
    return handle
