"""Per-layer costs of a workload: what each layer saves for backward, and its FLOPs.

Each layer is run alone on the arguments it received in one forward of the whole
model (captured first), so that layers taking keyword arguments (attention masks,
position embeddings) are profiled as the model calls them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._compat import autograd_clock
from ..engine.selection import ActivationPolicy
from ..engine.tensor_group import SavedEntry, TensorGroupProcessor
from .workload import Workload

__all__ = [
    "SavedLog",
    "capture_inputs",
    "distinct_bytes",
    "forward_cost",
    "saved_bytes",
    "saved_in_forward",
    "saved_per_layer",
]

Call = tuple[tuple[Any, ...], dict[str, Any]]


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    if isinstance(value, list):
        return [_detach(v) for v in value]
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def capture_inputs(workload: Workload) -> list[Call]:
    """The positional and keyword arguments each layer received in one forward."""
    calls: list[Call | None] = [None] * len(workload.layers)
    handles = []
    for j, layer in enumerate(workload.layers):

        def hook(module: nn.Module, args: Any, kwargs: Any, _j: int = j) -> None:
            if calls[_j] is None:
                calls[_j] = (_detach(args), _detach(kwargs))

        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        workload.loss_fn(workload.model, workload.make_batch())  # graph dropped unused
    finally:
        for h in handles:
            h.remove()
    missing = [j for j, c in enumerate(calls) if c is None]
    if missing:
        raise ValueError(f"layers {missing} did not run in the model's forward")
    return [c for c in calls if c is not None]


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


class _OnDevice:
    """Whether a tensor is on the layer's device (what a transport would accept)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device


class SavedLog:
    """Pack hook that keeps every saved tensor, with the autograd clock when it was saved
    (what the engine records to find saved casts: NOTE [Casts rebuilt from their source]
    in ``cpu_offload/engine/recast.py``)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.clocks: list[int] = []
        self.versions: list[int] = []

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.tensors.append(tensor)
        self.clocks.append(autograd_clock())
        self.versions.append(tensor._version)
        return tensor

    def entries(self, policy: ActivationPolicy) -> list[SavedEntry]:
        """The saved tensors ``policy`` selects, as the engine records them; one changed
        in place since it was saved is kept as the engine keeps it."""
        return [
            SavedEntry(t, None, i, version=v, keep=t._version != v, clock=c)
            for i, (t, c, v) in enumerate(
                zip(self.tensors, self.clocks, self.versions, strict=True)
            )
            if policy(t)
        ]


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def activation_storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of a tensor saved for backward; None for a parameter or a view of one.

    Storages are told apart by identity (``storage._cdata``), not address, so that
    tensors on the meta device (which have no memory) count as well.
    """
    if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
        return None
    return t.untyped_storage()


def distinct_bytes(saved: list[torch.Tensor]) -> int:
    """Bytes of the storages of ``saved``, each counted once, parameters left out."""
    storages: dict[int, int] = {}
    for t in saved:
        storage = activation_storage(t)
        if storage is not None:
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def saved_bytes(
    saved: SavedLog,
    policy: ActivationPolicy,
    processor: TensorGroupProcessor | None = None,
) -> tuple[int, int, int]:
    """(distinct bytes saved, bytes the engine would move, bytes it would release without
    moving them) of one layer's saved tensors.

    Parameters (and views of them) are not counted; tensors sharing a storage count
    once. What is moved and released is what the engine's own tensor grouping makes of
    the tensors ``policy`` selects: its units, and the saved casts it rebuilds.
    """
    total = distinct_bytes(saved.tensors)
    entries = saved.entries(policy)
    if not entries:
        return total, 0, 0
    plan = (processor or TensorGroupProcessor()).process(entries)
    moved = min(sum(u.nbytes for u in plan.units), total)
    return total, moved, min(plan.recast_bytes, total - moved)


def saved_in_forward(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SavedLog:
    """Every tensor ``layer`` saves for backward in one forward on ``args`` and ``kwargs``."""
    saved = SavedLog()
    with torch.autograd.graph.saved_tensors_hooks(saved, _identity):
        layer(*args, **kwargs)
    return saved


def saved_per_layer(
    layers: list[nn.Module], calls: list[Call], min_numel: int
) -> list[tuple[int, int, int, int]]:
    """(saved bytes, bytes moved, bytes released unmoved, input bytes) of each layer, as
    offloading it would treat them, from one forward."""
    out = []
    processor = TensorGroupProcessor()
    for layer, (args, kwargs) in zip(layers, calls, strict=True):
        x = _first_tensor(args, kwargs)
        device = x.device if x is not None else next(layer.parameters()).device
        policy = ActivationPolicy(min_numel, _OnDevice(device))
        total, moved, recast = saved_bytes(saved_in_forward(layer, args, kwargs), policy, processor)
        inp = x.numel() * x.element_size() if x is not None else 0
        out.append((total, moved, recast, inp))
    return out


class _OpCounter(TorchDispatchMode):
    """Counts the operators a forward runs: each is at least one kernel launch."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def forward_cost(layers: list[nn.Module], calls: list[Call]) -> list[tuple[int, int]]:
    """(FLOPs, operators) of each layer's forward."""
    from torch.utils.flop_counter import FlopCounterMode

    out = []
    for layer, (args, kwargs) in zip(layers, calls, strict=True):
        flops = FlopCounterMode(display=False)
        ops = _OpCounter()
        with flops, ops, torch.no_grad():
            layer(*args, **kwargs)
        out.append((flops.get_total_flops(), ops.ops))
    return out
