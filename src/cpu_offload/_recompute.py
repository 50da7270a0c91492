"""Recomputing a layer's forward in backward with little host time (eager mode).

:func:`run_recomputed` does what ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
early_stop=False)`` does for a layer, with PyTorch's defaults (RNG state preserved, the
default determinism check), at a fraction of its host time: NOTE [A lean recomputation].
"""

# NOTE [A lean recomputation]
# A recomputed layer saves nothing of its own for backward: each tensor its forward saves
# is replaced by a placeholder, and the first time backward needs one, the forward runs
# again from the layer's inputs to its end (NOTE [Recomputation runs the whole layer] in
# cpu_offload._layer_runner), saving every tensor again. PyTorch's non-reentrant
# checkpoint does this, and on the host it costs more than the layer's own Python and
# kernel launches on the small models where the host bounds the step: a holder, a weak
# reference and, under no_grad, a metadata dict per saved tensor in the forward, and as
# much again in backward (on a 2-core CPU, a GPT layer of 24 saved tensors: 205 us more
# in the forward against 30 us here). This module keeps what that checkpoint promises,
# with one small object per call:
#
# * The inputs are saved for backward by an autograd function of their own
#   (:class:`_KeepInputs`), before the placeholders' hooks are pushed: they go through
#   whatever saved-tensor hooks surround the call (the offload engine's, which may move
#   them to the host), and come back through them for the recomputation.
# * The forward's placeholder is the index of the tensor among those the call saved, and
#   its (shape, dtype, device), against which the recomputation's tensors are checked:
#   a different count or layout raises ``CheckpointError``, as PyTorch's default check.
# * Before the forward, the CPU's RNG state is taken, and that of each CUDA device a
#   tensor among the arguments lies on (in containers too), as PyTorch's checkpoint takes
#   them; they are set for the recomputation and the caller's restored after it, so that
#   dropout draws the same masks. Autocast and the ``torch.device`` context in force run
#   as they did in the forward.
# * The recomputation's tensors are kept per backward pass (graph task), detached where
#   they require grad so that the recomputed graph is freed, and each is dropped when
#   backward takes it: a second backward over a retained graph recomputes again. The
#   engine's threads (one per device) ask under a lock: one recomputation per pass. A
#   tensor backward does not read stays until the graph is freed, as with PyTorch's
#   checkpoint; a read outside a backward pass recomputes for itself and keeps nothing.
# * A backward through the layer's saved tensors inside its own forward (autograd.grad in
#   the forward) is refused with a CheckpointError: there is nothing to recompute from
#   yet. PyTorch's checkpoint supports it by recomputing the partial forward.
#
# Only eager calls take this path: under torch.compile, run_layer_recomputed traces
# PyTorch's checkpoint, which the compiler understands. The hooks' owner says what it is
# (``recomputes_in_backward``), so that an offload context or a part entered inside the
# call's forward leaves its placeholders in charge, as inside PyTorch's checkpoint
# (cpu_offload._compat.in_checkpoint_forward).

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointError

__all__ = ["run_recomputed"]

_Layout = tuple[torch.Size, torch.dtype, torch.device]


class _KeepInputs(torch.autograd.Function):
    """Saves a call's tensor arguments for backward; its output is never used."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        ctx.inputs = 1 + len(tensors)
        return dummy.new_empty((0,))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[None, ...]:  # pragma: no cover - unused
        return (None,) * ctx.inputs


class _Recomputation:
    """One recomputed call: its inputs, what it saved, and its recomputations.

    Its :meth:`pack` and :meth:`unpack` are the saved-tensor hooks of the call's forward.
    """

    #: What :func:`cpu_offload._compat.in_checkpoint_forward` reads on the hooks' owner.
    recomputes_in_backward = True

    __slots__ = (
        "fn",
        "args",
        "where",
        "keeper",
        "layouts",
        "rng",
        "autocast",
        "device_mode",
        "again",
        "lock",
        "done",
        "__weakref__",
    )

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        # Tensors go through autograd (_KeepInputs); the rest is kept here.
        self.where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        tensors = [args[i] for i in self.where]
        self.keeper = _KeepInputs.apply(torch.empty((0,), requires_grad=True), *tensors)
        self.layouts: list[_Layout] = []
        self.rng = _RngStates.of(args)
        self.autocast = _autocast_state()
        self.device_mode = _device_mode()
        self.again: dict[int, dict[int, torch.Tensor]] = {}
        # The autograd engine reads saved tensors on one thread per device: one
        # recomputation per backward pass, whichever thread asks first.
        self.lock = threading.Lock()
        self.done = False  # the forward has returned

    def pack(self, tensor: torch.Tensor) -> int:
        self.layouts.append((tensor.shape, tensor.dtype, tensor.device))
        return len(self.layouts) - 1

    def unpack(self, index: int) -> torch.Tensor:
        if not self.done:
            raise CheckpointError(
                "cpu_offload: a backward ran through a recomputed layer's saved tensors "
                "during that layer's own forward (torch.autograd.grad inside the forward); "
                "keep that layer, or checkpoint it with torch.utils.checkpoint yourself"
            )
        task = torch._C._current_graph_task_id()
        if task == -1:
            # Read outside a backward pass (grad_fn._saved_*): a recomputation of its
            # own, kept by no one.
            return self._recompute()[index]
        with self.lock:
            tensors = self.again.get(task)
            if tensors is None:
                tensors = self.again[task] = self._recompute()
            tensor = tensors.pop(index, None)
        if tensor is None:
            raise CheckpointError(
                "cpu_offload: a saved tensor of a recomputed layer was unpacked twice in "
                "one backward pass; read ctx.saved_tensors once per backward"
            )
        return tensor

    def _recompute(self) -> dict[int, torch.Tensor]:
        saved = self.keeper.grad_fn.saved_tensors
        args = list(self.args)
        for i, tensor in zip(self.where, saved, strict=True):
            args[i] = tensor
        got: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> None:
            # Detached: the recomputed graph is not needed, and goes with the call.
            got.append(tensor.detach() if tensor.requires_grad else tensor)

        device = self.device_mode if self.device_mode is not None else contextlib.nullcontext()
        with self.rng.restored(), _autocast_as(self.autocast), device, torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
                self.fn(*args)
        _check_layouts(self.layouts, got)
        return dict(enumerate(got))


def _device_mode() -> Any:
    """The innermost ``torch.device`` context in force (None if none): factory functions
    in the recomputation follow it as they did in the forward."""
    if not torch._C._len_torch_function_stack():
        return None
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    modes = reversed(_get_current_function_mode_stack())
    return next((m for m in modes if isinstance(m, DeviceContext)), None)


def _never_unpacked(_: object) -> torch.Tensor:  # pragma: no cover - the graph is dropped
    raise CheckpointError("cpu_offload: the recomputation's own graph was used in backward")


def _check_layouts(forward: Sequence[_Layout], again: Sequence[torch.Tensor]) -> None:
    """The recomputation saved what the forward saved (count, shape, dtype, device)."""
    if len(again) != len(forward):
        raise CheckpointError(
            f"cpu_offload: a recomputed layer saved {len(again)} tensors in its "
            f"recomputation and {len(forward)} in its forward; its forward must save the "
            "same tensors each time it runs (no data-dependent branches between the two)"
        )
    for i, (layout, tensor) in enumerate(zip(forward, again, strict=True)):
        if layout != (tensor.shape, tensor.dtype, tensor.device):
            raise CheckpointError(
                f"cpu_offload: saved tensor {i} of a recomputed layer was {tuple(layout)} "
                f"in the forward and {(tensor.shape, tensor.dtype, tensor.device)} in the "
                "recomputation; the layer's forward must run the same way twice"
            )


class _RngStates:
    """The CPU's RNG state and that of some CUDA devices, taken now."""

    __slots__ = ("cpu", "devices", "states")

    def __init__(self, devices: Sequence[int]) -> None:
        self.cpu = torch.get_rng_state()
        self.devices = devices
        self.states = [torch.cuda.get_rng_state(d) for d in devices]

    @classmethod
    def of(cls, args: Sequence[Any]) -> _RngStates:
        """The states of the CPU and of the CUDA devices of the tensors in ``args``, in
        containers too."""
        leaves = tree_leaves(list(args))
        return cls(
            sorted({t.get_device() for t in leaves if isinstance(t, torch.Tensor) and t.is_cuda})
        )

    def set(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.states, strict=True):
            torch.cuda.set_rng_state(state, device)

    def restored(self) -> _RngRestored:
        """A block that runs with these states, the caller's given back after it."""
        return _RngRestored(self)


class _RngRestored:
    """See :meth:`_RngStates.restored`."""

    __slots__ = ("saved", "caller")

    def __init__(self, saved: _RngStates) -> None:
        self.saved = saved

    def __enter__(self) -> None:
        self.caller = _RngStates(self.saved.devices)
        self.saved.set()

    def __exit__(self, *exc: object) -> None:
        self.caller.set()


_Autocast = tuple[bool, torch.dtype, bool]
_AutocastState = tuple[_Autocast, _Autocast]
_AUTOCAST_DEVICES = ("cuda", "cpu")


def _autocast_state() -> _AutocastState:
    """Whether autocast is on, at which dtype, and its cache, for CUDA and the CPU."""
    cache = torch.is_autocast_cache_enabled()
    return tuple(  # type: ignore[return-value]
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d), cache)
        for d in _AUTOCAST_DEVICES
    )


class _autocast_as:  # noqa: N801 - used as a context manager
    """Autocast as ``state`` says, entered for each device where it differs from now."""

    __slots__ = ("state", "entered")

    def __init__(self, state: _AutocastState) -> None:
        self.state = state
        self.entered: list[torch.autocast] = []

    def __enter__(self) -> None:
        now = _autocast_state()
        for device, want, have in zip(_AUTOCAST_DEVICES, self.state, now, strict=True):
            if want != have:
                on, dtype, cache = want
                ctx = torch.autocast(device, dtype=dtype, enabled=on, cache_enabled=cache)
                ctx.__enter__()
                self.entered.append(ctx)

    def __exit__(self, *exc: object) -> None:
        for ctx in reversed(self.entered):
            ctx.__exit__(None, None, None)
        self.entered.clear()


def run_recomputed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its saved tensors recomputed in backward (NOTE [A lean recomputation]).

    Args:
        fn: The layer's forward, its keyword arguments bound.
        *args: Its positional arguments.

    Returns:
        What ``fn`` returns.

    Raises:
        torch.utils.checkpoint.CheckpointError: In backward, if the recomputation saved
            other tensors than the forward, or a saved tensor was unpacked twice; in the
            forward, if ``fn`` runs a backward through the tensors it saved.

    Example:
        >>> x = torch.ones(3, requires_grad=True)
        >>> y = run_recomputed(lambda t: (t * t).sin(), x)
        >>> y.sum().backward()
        >>> torch.allclose(x.grad, (2 * x * (x * x).cos()).detach())
        True
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    call = _Recomputation(fn, args)
    with torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack):
        out = fn(*args)
    call.done = True
    return out
