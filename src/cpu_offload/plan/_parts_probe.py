"""The parts of a layer for the planner: which submodules, what each saves, what it costs.

One probed step records, for every submodule of every layer, the storages autograd saves
while it is the innermost module running and the storages of its tensor inputs; the parts
are then chosen from that (:func:`choose_parts`) or named by the user, and each part's
forward is timed in steps of their own (on CUDA with the stream held back before each
layer, NOTE [Device time under a host-bound step] in :mod:`._probe`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .._layer_parts import check_part_names
from .._layer_stack import check_indices
from ..compare._profile import SavedLog, activation_storage
from ..engine.recast import CastRef
from ..engine.selection import ActivationPolicy
from ..engine.tensor_group import TensorGroupProcessor
from ._probe import Clock, sleep_cycles, timed_step
from .costs import PartCost, Storage
from .model import Profile

__all__ = ["PartsSpec", "check_parts_spec", "choose_parts", "part_costs", "with_parts"]

#: What ``profile_model(parts=...)`` takes: True (chosen), names for every layer, or
#: names per layer index.
PartsSpec = bool | Sequence[str] | Mapping[int, Sequence[str]]

#: A child is split into its own children when one of them saves at least this share of
#: the child's bytes (an attention block whose core saves the scores).
SPLIT_SHARE = 0.5


def _tensors(value: object, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, out)
    elif isinstance(value, Mapping):
        for item in value.values():
            _tensors(item, out)
    return out


@dataclass
class _Layer:
    """What one layer's forward saved, storage by storage, and who saved or took what."""

    keep: list[torch.Tensor] = field(default_factory=list)  # alive until the layer ends
    index: dict[int, int] = field(default_factory=dict)  # storage id -> storage number
    storages: list[list[int]] = field(default_factory=list)  # [bytes, offload bytes]
    saved_by: dict[str, set[int]] = field(default_factory=dict)  # innermost module -> saved
    inputs_of: dict[str, set[int]] = field(default_factory=dict)  # module -> its inputs
    log: SavedLog = field(default_factory=SavedLog)  # what it saved, until the layer ends
    recast_of: dict[int, int] = field(default_factory=dict)  # saved cast -> its source

    def find_recasts(self, policy: ActivationPolicy) -> None:
        """Which saved storages offloading rebuilds from others (the engine's own
        grouping of everything the layer saved, NOTE [Casts rebuilt from their source]
        in ``cpu_offload/engine/recast.py``); then let the saved tensors go."""
        entries = self.log.entries(policy)
        plan = TensorGroupProcessor().process(entries) if entries else None
        refs = [] if plan is None else plan.refs
        for entry, ref in zip(entries, refs, strict=True):
            if isinstance(ref, CastRef):
                source = next(e for e, r in zip(entries, refs, strict=True) if r is ref.source)
                self.recast_of[self._number_of(entry.tensor)] = self._number_of(source.tensor)
        self.log = SavedLog()

    def _number_of(self, t: torch.Tensor) -> int:
        storage = activation_storage(t)
        assert storage is not None  # the policy takes no parameter
        return self.index[storage._cdata]

    def number(self, t: torch.Tensor, policy: ActivationPolicy, saved: bool) -> int | None:
        storage = activation_storage(t)
        if storage is None:
            return None
        key = storage._cdata
        number = self.index.get(key)
        if number is None:
            number = self.index[key] = len(self.storages)
            self.storages.append([storage.nbytes(), 0])
            self.keep.append(t)  # so that the storage id is not reused in this layer
        entry = self.storages[number]
        if saved and policy(t):
            entry[1] = entry[0]
        return number


class _Recorder:
    """Hooks on every submodule of every layer (see the module's notes)."""

    def __init__(self, layers: Sequence[nn.Module], policy: ActivationPolicy) -> None:
        self.policy = policy
        self.layers = [_Layer() for _ in layers]
        self.stack: list[str] = []
        self.current: _Layer | None = None
        self.handles: list[Any] = []
        self._saving: Any = None
        for j, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._layer_pre(j)))
            self.handles.append(layer.register_forward_hook(self._layer_post))
            for name, module in layer.named_modules():
                if name:
                    self.handles.append(
                        module.register_forward_pre_hook(self._pre(name), with_kwargs=True)
                    )
                    self.handles.append(module.register_forward_hook(self._post))

    def _layer_pre(self, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            if not torch.is_grad_enabled():
                return
            self.current = self.layers[j]
            self.stack = [""]
            self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._saving.__enter__()

        return hook

    def _layer_post(self, module: nn.Module, args: tuple, out: object) -> None:
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None
            assert self.current is not None
            self.current.find_recasts(self.policy)
            self.current.keep.clear()
            self.current = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        layer = self.current
        if layer is not None:
            layer.log(t)
            number = layer.number(t, self.policy, saved=True)
            if number is not None:
                layer.saved_by.setdefault(self.stack[-1], set()).add(number)
        return t

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            layer = self.current
            if layer is None:
                return
            inputs = layer.inputs_of.setdefault(name, set())
            for t in _tensors((args, kwargs), []):
                number = layer.number(t, self.policy, saved=False)
                if number is not None:
                    inputs.add(number)
            self.stack.append(name)

        return hook

    def _post(self, module: nn.Module, args: tuple, out: object) -> None:
        if self.current is not None and len(self.stack) > 1:
            self.stack.pop()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _inside(name: str, part: str) -> bool:
    return name == part or name.startswith(part + ".")


def _bytes(layer: _Layer, numbers: set[int]) -> int:
    return sum(layer.storages[i][0] for i in numbers)


def _saved_within(layer: _Layer, part: str) -> set[int]:
    out: set[int] = set()
    for name, numbers in layer.saved_by.items():
        if name and _inside(name, part):
            out |= numbers
    return out


def choose_parts(module: nn.Module, layer: _Layer) -> list[str]:
    """The parts of one layer: its children that save anything, each split into its own
    children where one of those saves at least :data:`SPLIT_SHARE` of its bytes (the
    attention core of an attention block)."""
    parts = []
    for name, child in module.named_children():
        total = _bytes(layer, _saved_within(layer, name))
        if total == 0:
            continue
        grandchildren = [f"{name}.{g}" for g, _ in child.named_children()]
        shares = {g: _bytes(layer, _saved_within(layer, g)) for g in grandchildren}
        if shares and max(shares.values()) >= SPLIT_SHARE * total:
            parts += [g for g, b in shares.items() if b > 0]
        else:
            parts.append(name)
    return parts


def _names_for(spec: PartsSpec, j: int, module: nn.Module, layer: _Layer) -> list[str]:
    if spec is True:
        return choose_parts(module, layer)
    if isinstance(spec, Mapping):
        return list(spec.get(j, ()))
    return list(spec)  # type: ignore[arg-type]


def check_parts_spec(spec: object, layers: Sequence[nn.Module]) -> None:
    """Refuse a ``parts`` argument of :func:`cpu_offload.plan.profile_model` that cannot
    be used, naming what is wrong (see :func:`cpu_offload._layer_parts.check_part_names`)."""
    if isinstance(spec, bool):
        return
    if isinstance(spec, (str, bytes)) or not isinstance(spec, (Sequence, Mapping)):
        raise TypeError(
            "parts must be True, False, a list of submodule names, or a dict of layer "
            f"index to such lists; got {type(spec).__name__}"
        )
    if isinstance(spec, Mapping):
        check_indices("parts", spec.keys(), len(layers))
        per_layer = list(spec.items())
    else:
        per_layer = [(j, spec) for j in range(len(layers))]
    for j, names in per_layer:
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
            raise TypeError(f"parts[{j}] must be a list of submodule names, got {names!r}")
        check_part_names("parts", j, layers[j], names)


class _Timer:
    """Each part's forward on the device's clock and the host's, over some steps."""

    def __init__(self, layers: Sequence[nn.Module], names: list[list[str]], clock: Any) -> None:
        self.clock = clock
        self.device: dict[tuple[int, str], list[tuple[object, object]]] = {}
        self.host: dict[tuple[int, str], list[float]] = {}
        self._open: dict[tuple[int, str], tuple[object, float]] = {}
        self.handles = []
        for j, (layer, part_names) in enumerate(zip(layers, names, strict=True)):
            for name in part_names:
                module = layer.get_submodule(name)
                self.handles.append(module.register_forward_pre_hook(self._pre((j, name))))
                self.handles.append(module.register_forward_hook(self._post((j, name))))

    def _pre(self, key: tuple[int, str]) -> Callable[..., None]:
        def hook(*_: object) -> None:
            if torch.is_grad_enabled():
                self._open[key] = (self.clock.now(), time.perf_counter())

        return hook

    def _post(self, key: tuple[int, str]) -> Callable[..., None]:
        def hook(*_: object) -> None:
            opened = self._open.pop(key, None)
            if opened is not None:
                event, host = opened
                self.host.setdefault(key, []).append((time.perf_counter() - host) * 1e3)
                self.device.setdefault(key, []).append((event, self.clock.now()))

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def part_costs(
    layers: Sequence[nn.Module],
    step: Callable[[], torch.Tensor],
    policy: ActivationPolicy,
    spec: PartsSpec,
    clock: Any,
    timed_steps: Callable[[], None],
) -> list[tuple[tuple[Storage, ...], tuple[PartCost, ...]]]:
    """Per layer, its storages and parts (:class:`PartCost`).

    Args:
        layers: The layers.
        step: Runs the forward and returns the loss.
        policy: The engine's selection, for what offloading would move.
        spec: Which parts (see :data:`PartsSpec`).
        clock: The device's clock (:class:`._probe.Clock`).
        timed_steps: Runs the steps in which the parts' forwards are timed (on CUDA,
            with the stream held back before each layer).
    """
    recorder = _Recorder(layers, policy)
    try:
        step().backward()
    finally:
        recorder.remove()
    names = [
        _names_for(spec, j, module, rec)
        for j, (module, rec) in enumerate(zip(layers, recorder.layers, strict=True))
    ]
    timer = _Timer(layers, names, clock)
    try:
        timed_steps()
    finally:
        timer.remove()
    if clock.cuda:
        torch.cuda.synchronize()
    out = []
    for j, (rec, part_names) in enumerate(zip(recorder.layers, names, strict=True)):
        outside: set[int] = set()
        for name, numbers in rec.saved_by.items():
            if not any(_inside(name, part) for part in part_names):
                outside |= numbers
        storages = tuple(
            Storage(b, o, i in outside, rec.recast_of.get(i))
            for i, (b, o) in enumerate(rec.storages)
        )
        parts = []
        for name in part_names:
            marks = timer.device.get((j, name), [])
            device_ms = [clock.ms(a, b) for a, b in marks] or [0.0]
            parts.append(
                PartCost(
                    name,
                    statistics.median(device_ms),
                    statistics.median(timer.host.get((j, name), [0.0])),
                    tuple(sorted(_saved_within(rec, name))),
                    tuple(sorted(rec.inputs_of.get(name, ()))),
                )
            )
        out.append((storages, tuple(parts)))
    return out


def with_parts(
    profile: Profile,
    layers: Sequence[nn.Module],
    step: Callable[[], torch.Tensor],
    clock: Clock,
    policy: ActivationPolicy,
    spec: PartsSpec,
    steps: int,
) -> Profile:
    """``profile`` with each layer's parts and storages (:func:`part_costs`)."""

    def timed_steps() -> None:
        # On CUDA the stream is held back before each layer, so that the parts' events
        # measure the device's time (NOTE [Device time under a host-bound step]).
        sleep = None
        if clock.cuda:
            host_ms = [
                0.0 if c.host is None else max(c.host.forward_ms, c.host.backward_ms)
                for c in profile.layers
            ]
            sleep = sleep_cycles(
                [max(h, c.forward_ms) for h, c in zip(host_ms, profile.layers, strict=True)]
            )
        for _ in range(steps):
            timed_step(layers, step, clock, sleep=sleep)

    found = part_costs(layers, step, policy, spec, clock, timed_steps)
    return replace(
        profile,
        layers=tuple(
            replace(cost, storages=storages, parts=parts)
            for cost, (storages, parts) in zip(profile.layers, found, strict=True)
        ),
    )
