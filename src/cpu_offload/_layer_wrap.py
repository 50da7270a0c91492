"""How :func:`cpu_offload.offload_layers` puts its runner in front of one layer, and takes it away.

Most layers get a bound ``forward`` on the instance (:class:`ForwardPatch`); a layer whose
class defines its own ``__call__`` gets a subclass instead (:class:`CallPatch`). Either way
the wrapping state sits on the instance under :data:`WRAP_ATTR`, and ``undo()`` leaves the
layer as it was.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

__all__ = ["WRAP_ATTR", "CallPatch", "ForwardPatch", "Patch", "Wrap", "patch_layer", "wrap_of"]

# NOTE [Wrapped layers and their copies]
# offload_layers puts a bound method on each layer instance, ``forward`` (so that
# nn.Module.__call__ finds it), and the wrapping state beside it under WRAP_ATTR. The
# state knows the very layer it was made for. A copy of a wrapped layer
# (``copy.deepcopy`` for an EMA or reference model, ``torch.save`` of the whole model)
# gets the bound method rebound to itself, and the state dropped (``__deepcopy__`` and
# pickling both give None, which keeps nothing of the original alive); finding no state
# of its own, the copy runs its class's forward: a plain layer with its own weights,
# outside the original's schedule. Were the state a closure over the original's bound
# forward, the copy would run the original's weights and advance its schedule.
WRAP_ATTR = "_cpu_offload_wrap"


class Runner(Protocol):
    """What runs a wrapped layer: ``runner(index, forward, args, kwargs)``."""

    def __call__(
        self, index: int, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
    ) -> Any: ...


class Wrap:
    """What :func:`patch_layer` keeps on one wrapped layer (see the NOTE above)."""

    __slots__ = ("forward", "index", "layer", "runner")

    def __init__(
        self, layer: nn.Module, runner: Runner, index: int, forward: Callable[..., Any]
    ) -> None:
        self.layer = weakref.ref(layer)
        self.runner = runner
        self.index = index
        self.forward = forward  # what the layer ran before wrapping

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # the copy is a plain layer (see the NOTE above)

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return (_no_wrap, ())


def _no_wrap() -> None:
    """What a pickled :class:`Wrap` loads as: nothing (the loaded layer is plain)."""
    return None


def wrap_of(layer: nn.Module) -> Wrap | None:
    """The wrapping state made for ``layer`` itself (None for a plain layer or a copy)."""
    wrap = layer.__dict__.get(WRAP_ATTR)
    return wrap if isinstance(wrap, Wrap) and wrap.layer() is layer else None


def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward :class:`ForwardPatch` installs (named so that pickling finds a plain one)."""
    wrap = wrap_of(self)
    if wrap is None:
        # A copy of a wrapped layer: see NOTE [Wrapped layers and their copies].
        return type(self).forward(self, *args, **kwargs)
    return wrap.runner(wrap.index, wrap.forward, args, kwargs)


_wrapped_forward = forward
del forward


class Patch(Protocol):
    """One wrapped layer: ``check()`` that it can be undone, then ``undo()``."""

    layer: nn.Module

    def check(self) -> None: ...

    def undo(self) -> None: ...


class ForwardPatch:
    """A bound ``forward`` on the layer instance, in front of the one it had."""

    def __init__(self, layer: nn.Module, runner: Runner, index: int) -> None:
        self.layer = layer
        self.had_own = "forward" in layer.__dict__
        self.previous = layer.__dict__.get("forward")
        layer.__dict__[WRAP_ATTR] = Wrap(layer, runner, index, layer.forward)
        self.forward = types.MethodType(_wrapped_forward, layer)
        layer.forward = self.forward  # type: ignore[method-assign]

    def check(self) -> None:
        if self.layer.__dict__.get("forward") is not self.forward:
            raise RuntimeError(
                f"offload_layers: the forward of {type(self.layer).__name__} was replaced "
                "after offload_layers wrapped it; undo that wrapper first"
            )

    def undo(self) -> None:
        if self.had_own:
            self.layer.forward = self.previous  # type: ignore[method-assign,assignment]
        else:
            del self.layer.__dict__["forward"]
        del self.layer.__dict__[WRAP_ATTR]


# NOTE [Layers that checkpoint themselves]
# Some layer classes run code outside their forward, in their own __call__: transformers'
# GradientCheckpointingLayer (transformers 5.0 to 5.2x) checkpoints the whole
# nn.Module.__call__ there when gradient checkpointing is on. A forward replaced on the
# instance would then run inside the model's checkpoint, where the offload context must
# push no hooks (NOTE [Offloading inside a checkpoint] in cpu_offload.engine.context), and
# what that checkpoint keeps, the layer's inputs, would stay on the device. So a layer
# whose class defines __call__ gets, instead, a subclass whose __call__ runs the class's
# __call__ under the runner: the model's checkpoint then starts inside the offload
# context, the inputs it saves go through the offload hooks, and the rest it drops, as
# transformers' ``gradient_checkpointing_kwargs={"offload": True}`` does with
# save_on_cpu, but asynchronously. The subclass keeps the class's name, pickles and
# deep-copies as the class itself (a plain layer, as for forward patches), and undo()
# gives the instance its class back.


def _new_instance(cls: type, *args: Any) -> Any:
    """``cls.__new__(cls, *args)``: how a pickled or copied wrapped layer is made again."""
    return cls.__new__(cls, *args)


@functools.cache
def _calling_subclass(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with a ``__call__`` that runs ``cls.__call__`` under the layer's runner."""

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        wrap = wrap_of(self)
        if wrap is None:
            return cls.__call__(self, *args, **kwargs)
        return wrap.runner(wrap.index, wrap.forward, args, kwargs)

    def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
        # Copies and pickles are instances of cls: plain layers of their own.
        reduced = cls.__reduce_ex__(self, protocol)
        if isinstance(reduced, tuple) and len(reduced) > 1 and reduced[1]:
            args = reduced[1]
            if args[0] is type(self):
                return (_new_instance, (cls, *args[1:]), *reduced[2:])
        return reduced

    namespace = {
        "__call__": __call__,
        "__reduce_ex__": __reduce_ex__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    return type(cls.__name__, (cls,), namespace)


class CallPatch:
    """The layer's class replaced by a subclass whose ``__call__`` goes through the runner."""

    def __init__(self, layer: nn.Module, runner: Runner, index: int) -> None:
        self.layer = layer
        self.cls = type(layer)
        self.subclass = _calling_subclass(self.cls)  # type: ignore[arg-type]
        layer.__class__ = self.subclass
        layer.__dict__[WRAP_ATTR] = Wrap(
            layer, runner, index, functools.partial(self.cls.__call__, layer)
        )

    def check(self) -> None:
        # A subclass of ours is fine (FSDP2's fully_shard makes one): see undo().
        if not isinstance(self.layer, self.subclass):
            raise RuntimeError(
                f"offload_layers: the class of {self.cls.__name__} was replaced after "
                "offload_layers wrapped it; undo that wrapper first"
            )

    def undo(self) -> None:
        del self.layer.__dict__[WRAP_ATTR]
        if type(self.layer) is self.subclass:
            self.layer.__class__ = self.cls
        # Else a class made from ours (FSDP2's) stays: without the wrapping state its
        # __call__ is the original class's.


def patch_layer(layer: nn.Module, runner: Runner, index: int) -> Patch:
    """Put ``runner`` in front of ``layer``: through its ``__call__`` where its class
    defines one (NOTE [Layers that checkpoint themselves]), else through ``forward``."""
    if type(layer).__call__ is not nn.Module.__call__:
        return CallPatch(layer, runner, index)
    return ForwardPatch(layer, runner, index)
