"""What runs each layer :func:`cpu_offload.offload_layers` wraps: recomputed, offloaded,
or counted by the schedule, and what it tells a :class:`StepWatch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ._compat import (
    checkpoint_early_stop_off,
    in_backward,
    in_checkpoint_forward,
    swap_dynamo_callback,
)
from ._compile import call_compiled, outside_compile
from ._layer_call import run_layer, run_layer_recomputed
from ._layer_parts import Choice, PartPlan, keep_saved
from ._marking import MarkOutputs
from ._warn import warn_at_caller
from .engine.kept_layer import KeptLayer

__all__ = ["PartRunner", "Runner", "StepWatch", "recompute", "sync_first"]


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


# NOTE [Recomputation runs the whole layer]
# Recomputed layers are recomputed to the end of their forward: by the package's own
# recomputation in eager mode (NOTE [A lean recomputation] in cpu_offload._recompute), and
# under torch.compile by torch.utils.checkpoint.checkpoint(use_reentrant=False) with early
# stop off. With early stop on (PyTorch's default), the recomputation in
# backward ends as soon as the last saved tensor is saved again, and the rest of the
# layer's forward never runs. A layer that keeps a tensor on itself in the middle of its
# forward and clears it at the end (Megatron-Core's TransformerLayer keeps its MLP norm's
# input until the end of the MLP) then keeps the recomputed tensor, and with it the
# recomputed graph, until its next forward: each recomputed layer adds its saved bytes to
# the next step's peak. Running the recomputation to its end costs the few operations
# after the last saved tensor (the layer's final residual addition) and frees what the
# recomputation promises.


# NOTE [No KV cache in training forwards]
# transformers' decoders make a KV cache in every forward whose config says use_cache,
# training included, and pass it to each layer, which stores its keys and values in it.
# The cache holds them until the model's output is dropped, after the forward: an
# offloaded layer's keys and values are then copied to the host without their device
# memory being freed, and a recomputed layer keeps them although its checkpoint means to
# drop them. Worse, the recomputation in backward updates the cache a second time
# (transformers' own gradient checkpointing drops the cache for that reason), doubling
# the keys the recomputed attention runs over. So in a forward with grad enabled whose
# first layer is given an empty cache (one the model made itself), the wrapped layers
# get None in its place. A cache that already holds positions (a prefix the caller
# passed) is the model's input: it is passed on unchanged, unless a layer is recomputed,
# which is refused (the recomputation would update it a second time). Evaluation and
# generation, under no_grad, keep their cache.


def _caches(kwargs: dict) -> list[str]:
    """The names of the keyword arguments that are transformers caches."""
    cache_type = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if cache_type is None:
        return []
    return [name for name, value in kwargs.items() if isinstance(value, cache_type)]


class StepWatch(Protocol):
    """What :meth:`OffloadedLayers.watch_steps` calls on each training forward.

    ``forward_started()`` runs before the first layer of a forward with grad enabled (it
    may call :meth:`OffloadedLayers.reassign`, or raise to stop the step);
    ``forward_ended(output)`` runs after the last layer, with its output.
    """

    def forward_started(self) -> None: ...

    def forward_ended(self, output: Any) -> None: ...


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


def recompute(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict) -> Any:
    """Run a layer's forward under activation checkpointing that recomputes it to its end
    in backward (NOTE [Recomputation runs the whole layer]); the early-stop switch of older
    PyTorch releases is set here, outside the frame ``torch.compile`` traces."""
    with checkpoint_early_stop_off():
        return run_layer_recomputed(*_unbound(forward, args), kwargs)


class Runner:
    """Runs one layer's forward: recomputed, offloaded, or counted by the schedule.

    Called as ``runner(index, forward, args, kwargs)`` by whatever replaces the layers'
    forward (:func:`cpu_offload.offload_layers`, the variants of ``compare``).
    """

    def __init__(
        self,
        context: Any,
        sync: Callable[[torch.Tensor], torch.Tensor] | None,
        offloaded: frozenset[int],
        recomputed: frozenset[int],
        num_layers: int,
        mark_outputs: bool,
        parts: PartPlan | None = None,
        recast: frozenset[int] = frozenset(),
        min_numel: int = 0,
    ) -> None:
        self.context = context
        self.sync = sync
        self.offloaded = offloaded
        self.recomputed = recomputed
        self.num_layers = num_layers
        self.mark_outputs = mark_outputs
        #: Per layer, what each of its parts does (NOTE [Parts of a layer]).
        self.parts: PartPlan = parts or {}
        #: Kept layers whose saved casts are rebuilt in backward (NOTE [A kept layer's
        #: casts] in ``cpu_offload/engine/kept_layer.py``), each with its saved tensors.
        self.recast = {i: KeptLayer(f"layer {i}", min_numel) for i in sorted(recast)}
        self._warned_recast = False
        #: The layer whose training forward runs now, for its parts (None between layers).
        self.running: int | None = None
        #: The running layer's offloaded parts that have run, and whether its copies are
        #: queued since the last of them (NOTE [Parts of a layer]).
        self._parts_ran: set[str] = set()
        self._copies_queued = False
        #: Offloaded parts of it running now (one may call another): its copies wait
        #: for the outermost (NOTE [Parts of a layer]).
        self.offloading_parts = 0
        self._engine_hooks: tuple[Any, Any] | None = None  # (synchronizer, its hooks)
        self.last_index: int | None = None
        self.watch: StepWatch | None = None
        #: Inside a wrapped layer's forward (reassigning the layers is refused there).
        self.depth = 0
        # This forward's caches to leave out (NOTE [No KV cache in training forwards]).
        self._dropped: list[str] = []
        self._warned_cache = False
        self._warned_parts = False
        #: The layer after which take() ran in the middle of a forward, or None.
        self._taken_after: int | None = None

    def take(self, other: Runner) -> None:
        """Run as ``other`` does from the next forward on (another set of layers)."""
        self.context, self.sync = other.context, other.sync
        self.offloaded, self.recomputed = other.offloaded, other.recomputed
        self.parts = other.parts
        self.recast = other.recast
        self.mark_outputs = other.mark_outputs
        self._engine_hooks = None
        if self.last_index is not None and self.last_index != self.num_layers - 1:
            # Taken between two layers of a forward: said if that forward then fails.
            self._taken_after = self.last_index
        self.last_index = None

    def offload_hooks(self) -> Any:
        """Saved-tensor hooks that hand tensors to the engine, for an offloaded part's
        forward (NOTE [Parts of a layer]); None when no layer is offloaded.

        A new hooks object each time (one may be entered once at a time), over the pack
        and unpack functions made once per synchronizer.
        """
        synchronizer = getattr(self.context, "offload_synchronizer", None)
        if synchronizer is None:
            return None
        cached = self._engine_hooks
        if cached is None or cached[0] is not synchronizer:
            cached = (
                synchronizer,
                (outside_compile(synchronizer.pack_hook), outside_compile(synchronizer.pop_tensor)),
            )
            self._engine_hooks = cached
        return torch.autograd.graph.saved_tensors_hooks(*cached[1])

    def __call__(
        self, index: int, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        if not torch.is_grad_enabled() or in_backward():
            # Evaluation (nothing is saved for backward), or a recomputation inside
            # backward (a model's own activation checkpointing, whose activations are
            # used at once): the schedule must not count it.
            return run_layer(*_unbound(forward, args), kwargs)
        # The engine runs uncompiled, the layer's forward compiled if its caller is: see
        # NOTE [torch.compile and the offload engine].
        callback = swap_dynamo_callback(None)
        try:
            watch = self.watch
            if index == 0:
                if watch is not None:
                    watch.forward_started()
                self._dropped = self._caches_to_drop(kwargs)
            if self._dropped:
                kwargs = {**kwargs, **dict.fromkeys(self._dropped, None)}
            self.depth += 1
            self.running = index  # for its parts
            self._parts_ran.clear()
            self._copies_queued = False
            self.offloading_parts = 0
            try:
                out = self._run(index, forward, args, kwargs, callback)
            finally:
                self.depth -= 1
                self.running = None
            if watch is not None and index == self.num_layers - 1:
                watch.forward_ended(out)
            return out
        finally:
            swap_dynamo_callback(callback)

    def copies_queued(self) -> bool:
        """Whether the running layer's copies are queued already: an offloaded part that
        runs again after that keeps what it saves (NOTE [Parts of a layer])."""
        return self._copies_queued

    def offloaded_part_ran(self, name: str) -> None:
        """After offloaded part ``name`` of the running layer ran: once every offloaded
        part of it has, queue the layer's copies (NOTE [Parts of a layer])."""
        ran = self._parts_ran
        ran.add(name)
        if self.offloading_parts:  # inside another offloaded part, which saves on
            return
        parts = self.parts.get(self.running, {}) if self.running is not None else {}
        if any(c is Choice.OFFLOAD and n not in ran for n, c in parts.items()):
            return
        start = getattr(
            getattr(self.context, "offload_synchronizer", None), "start_offload_early", None
        )
        if start is not None:
            self._copies_queued = start()

    def warn_checkpointed_part(self, layer: int, name: str) -> None:
        """Once per handle: a part ran inside the model's own checkpoint, which keeps its
        layer's inputs only; the part has nothing of its own to offload or recompute."""
        if self._warned_parts:
            return
        self._warned_parts = True
        warn_at_caller(
            f"offload_layers: part {name!r} of layer {layer} runs inside the model's own "
            "activation checkpoint, which saves only the layer's inputs: its choice does "
            "nothing there. Offload such layers whole (offloaded=[...]) to move the inputs "
            "the checkpoint keeps, or turn the model's checkpointing off to plan parts"
        )

    def _caches_to_drop(self, kwargs: dict) -> list[str]:
        """At a forward's first layer: which caches to leave out of this forward."""
        names = _caches(kwargs)
        filled = [name for name in names if kwargs[name].get_seq_length() > 0]
        if filled and self.recomputed:
            raise ValueError(
                f"offload_layers: the transformers cache passed as {', '.join(filled)} "
                "already holds positions, and the recomputed layers "
                f"{sorted(self.recomputed)} would update it a second time in backward: "
                "recompute no layer in a forward given a filled cache, or pass none"
            )
        if filled or not names:
            return []
        if not self._warned_cache:
            self._warned_cache = True
            warn_at_caller(
                f"offload_layers: the transformers cache passed as {', '.join(names)} is not "
                "given to the wrapped layers in forwards with grad enabled: it would keep "
                "every layer's keys and values on the device, and a recomputation would "
                "update it twice. Pass use_cache=False to the model in training to leave "
                "it out yourself"
            )
        return names

    def _run(
        self,
        index: int,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict,
        callback: object,
    ) -> Any:
        if index in self.recomputed and not in_checkpoint_forward():
            # See NOTE [Recomputation runs the whole layer]. Inside the model's own
            # checkpoint the layer is recomputed already: a second one would only add
            # another recomputation.
            run = functools.partial(call_compiled, callback, recompute, forward, args, kwargs)
        else:
            run = functools.partial(
                call_compiled, callback, run_layer, *_unbound(forward, args), kwargs
            )

        kept = self._kept_layer(index)
        if kept is not None:
            run = functools.partial(_kept_run, kept, run)
        if self.context is None:
            return run()
        if index == 0 and self.last_index not in (None, self.num_layers - 1):
            # The previous forward stopped between layers (an exception outside a layer):
            # start the iteration afresh instead of counting on from where it stopped.
            self.context._restart_iteration()
        elif index != 0 and self.last_index != index - 1:
            self._refuse_order(index)
        if index == 0:
            self._taken_after = None  # a forward from the start: nothing to tell
        self.last_index = None
        mark = MarkOutputs() if self.mark_outputs and index in self.offloaded else None
        # An offloaded layer with parts keeps what its offloaded parts do not take.
        keep = (
            keep_saved(f"layer {index}")
            if index in self.parts and index in self.offloaded
            else None
        )
        with self.context, mark or contextlib.nullcontext(), keep or contextlib.nullcontext():
            out = run()
        assert self.sync is not None
        try:
            out = sync_first(out, self.sync, index)
        except TypeError:
            self.context._restart_iteration()
            raise
        self.last_index = index
        return out

    def _kept_layer(self, index: int) -> KeptLayer | None:
        """Layer ``index``'s :class:`KeptLayer` if its saved casts are rebuilt here: not
        inside the model's own checkpoint, which keeps only the layer's inputs (its hooks
        would take what the checkpoint means to drop)."""
        kept = self.recast.get(index)
        if kept is None or not in_checkpoint_forward():
            return kept
        if not self._warned_recast:
            self._warned_recast = True
            warn_at_caller(
                f"offload_layers: layer {index} runs inside the model's own activation "
                "checkpoint, which saves only the layer's inputs: there are no saved casts "
                "to rebuild (recast=... does nothing there). Offload such layers "
                "(offloaded=[...]) to move the inputs the checkpoint keeps"
            )
        return None

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
        taken, self._taken_after = self._taken_after, None
        if taken is not None:
            raise RuntimeError(
                f"offload_layers: reassign() was called in the middle of a forward (after "
                f"layer {taken}), and the layers it gave take effect at layer 0: call it "
                "between training steps (after a backward, before the next forward)"
            )
        raise RuntimeError(
            f"offload_layers: {cause}. The offload schedule counts each layer once per "
            "forward, in order: run every wrapped layer once per forward (no layer drop, "
            "no reuse of a layer), or wrap only the layers that run that way"
        )


def _kept_run(kept: KeptLayer, run: Callable[[], Any]) -> Any:
    """``run()`` with what it saves for backward held by ``kept``, its saved casts let
    go at the end (NOTE [A kept layer's casts] in ``cpu_offload/engine/kept_layer.py``)."""
    try:
        with kept.saving():
            out = run()
    except BaseException:
        kept.abandon()
        raise
    kept.finish()
    return out


class PartRunner:
    """Runs one part of a wrapped layer: kept, offloaded or recomputed (NOTE [Parts of a
    layer] in :mod:`cpu_offload._layer_parts`).

    Called as ``runner(index, forward, args, kwargs)`` by the part's patched forward
    (:func:`cpu_offload._layer_wrap.patch_layer`). What it does is read from the layer
    runner at each call, so that :meth:`Runner.take` changes it too.

    Args:
        owner: The layer runner; the part acts only while it runs layer ``layer`` in a
            training forward.
        layer: The index of the layer the part belongs to.
        name: The part's submodule path inside that layer.
    """

    def __init__(self, owner: Runner, layer: int, name: str) -> None:
        self.owner = owner
        self.layer = layer
        self.name = name

    def __call__(
        self, index: int, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        owner = self.owner
        choice = owner.parts.get(self.layer, {}).get(self.name, Choice.KEEP)
        if (
            choice is Choice.KEEP
            or owner.running != self.layer
            or not torch.is_grad_enabled()
            or in_backward()
        ):
            return run_layer(*_unbound(forward, args), kwargs)
        if in_checkpoint_forward():
            owner.warn_checkpointed_part(self.layer, self.name)
            return run_layer(*_unbound(forward, args), kwargs)
        callback = swap_dynamo_callback(None)
        try:
            if choice is Choice.RECOMPUTE:
                return call_compiled(callback, recompute, forward, args, kwargs)
            hooks = owner.offload_hooks()
            if hooks is None or owner.copies_queued():
                # Run again after its layer's copies were queued: the layer's hooks
                # keep what it saves.
                return call_compiled(callback, run_layer, *_unbound(forward, args), kwargs)
            owner.offloading_parts += 1
            try:
                with hooks:
                    out = call_compiled(callback, run_layer, *_unbound(forward, args), kwargs)
            finally:
                owner.offloading_parts -= 1
            owner.offloaded_part_ran(self.name)
            return out
        finally:
            swap_dynamo_callback(callback)
