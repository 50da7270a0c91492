"""The layout of HybridDeviceOptimizer: entries, sub-optimizers and hooks from the split.

:class:`HybridBuilder` turns the offload split into one entry per parameter, host
buckets with their host optimizers and one device optimizer, and registers the
post-accumulate-grad hooks that start early gradient copies. It runs at construction
and again after ``add_param_group`` and ``load_state_dict``, and keeps ``state`` a view
of the sub-optimizers' state and their hyperparameters in step with ``param_groups``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._checkpoint import (
    StateView,
    adopt_param_writes,
    install_state,
    match_loaded_groups,
    state_view,
)
from ._entries import (
    IMPLEMENTATION_KEYS,
    Entry,
    EntryFactory,
    Sub,
    bucket_entries,
    make_sub,
    side_kwargs,
)
from ._split import compute_offload_split
from ._step import HybridStepper
from ._stream import StateStream, mark_streamed

__all__ = ["HybridBuilder", "remove_hooks"]


class _GradReadyHook:
    """Post-accumulate-grad hook that starts an offloaded gradient's copy in backward.

    Holds the optimizer weakly: the hook lives on the parameter, which must not keep the
    optimizer alive.
    """

    def __init__(self, owner: HybridStepper, entry: Entry, generation: int) -> None:
        self._owner = weakref.ref(owner)
        self._entry = weakref.ref(entry)
        self._generation = generation

    def __call__(self, param: torch.Tensor) -> None:
        owner = self._owner()
        entry = self._entry()
        if owner is not None and entry is not None:
            owner._on_grad_ready(entry, self._generation)


def remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class HybridBuilder(HybridStepper):
    """Base class of :class:`~cpu_offload.optim.HybridDeviceOptimizer`: its layout.

    The attributes below are set by ``HybridDeviceOptimizer.__init__``.
    """

    offload_fraction: float
    cpu_optimizer_cls: type[torch.optim.Optimizer]
    gpu_optimizer_cls: type[torch.optim.Optimizer]
    offload_last_layers: bool
    stream_share: float
    is_device_param: Callable[[torch.Tensor], bool]
    sub_optimizer_kwargs: dict[str, Any]
    _factory: EntryFactory
    _hook_handles: list[Any]

    if TYPE_CHECKING:
        # HybridDeviceOptimizer's: waits for a host step still running from step().
        def synchronize(self) -> None: ...

    # ------------------------------------------------------------------ building

    def _state_by_param(self) -> dict[torch.Tensor, dict[str, Any]]:
        self.synchronize()
        adopt_param_writes(self._entries)
        self._refresh_state()
        return {p: dict(s) for p, s in self.state.items() if s}

    def __getstate__(self) -> dict[str, Any]:
        # PyTorch's optimizers pickle their defaults, state and groups only: a copy
        # would lack the threads, streams, host buffers and entries this one runs on.
        raise TypeError(
            "HybridDeviceOptimizer cannot be pickled or deep-copied (it holds threads, "
            "streams and host buffers): save optimizer.state_dict() and load it into a "
            "new HybridDeviceOptimizer"
        )

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict`` (hooks already run); a failure restores the state before."""
        before = self._state_by_param()  # synchronizes first
        groups = self.param_groups
        self.param_groups, by_param = match_loaded_groups(groups, state_dict)
        try:
            self._build(by_param)
        except BaseException:
            self.param_groups = groups
            self._build(before)
            raise

    def _teardown(self) -> None:
        self.synchronize()
        remove_hooks(self._hook_handles)
        for entry in self._entries:
            if entry.pending is not None:
                entry.pending.result()
        self._generation += 1

    def _build(self, state_by_param: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        self._teardown()
        flat = [p for g in self.param_groups for p in g["params"]]
        split = compute_offload_split(
            flat,
            self.offload_fraction,
            is_device=self.is_device_param,
            from_end=self.offload_last_layers,
        )
        cuda_devices = {p.device for p, off in zip(flat, split, strict=True) if off and p.is_cuda}
        if len(cuda_devices) > 1:
            raise ValueError(
                "params: all offloaded CUDA parameters of one HybridDeviceOptimizer must be "
                f"on one device, got {sorted(str(d) for d in cuda_devices)}"
            )
        self._cuda_device = next(iter(cuda_devices), None)
        entries: list[Entry] = []
        position = 0
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                device_param = bool(self.is_device_param(p))
                entries.append(self._factory.make(p, group_index, split[position], device_param))
                position += 1
        self._entries = entries

        cuda = self._cuda_device is not None
        use_streams = cuda and self.overlap_cpu_optimizer_d2h_h2d
        self._d2h_stream = torch.cuda.Stream(self._cuda_device) if use_streams else None
        # Copies back queued from the host-step thread need a stream of their own.
        late = cuda and self._overlap is not None
        self._h2d_stream = torch.cuda.Stream(self._cuda_device) if use_streams or late else None

        host_entries = self._host_order(entries)
        streamed = mark_streamed(host_entries, self.stream_share)
        for entry in host_entries:
            if entry.offloaded and not entry.streamed:
                self._factory.add_copy_buffers(entry)
        self._lane = (
            StateStream(self.cpu_optimizer_cls, self._cuda_device)
            if streamed and self._cuda_device is not None
            else None
        )
        device_entries = [e for e in entries if not e.host]
        host_kwargs = side_kwargs(
            self.sub_optimizer_kwargs, self.cpu_optimizer_cls, "cpu", host_entries
        )
        buckets = bucket_entries(
            host_entries, self.overlap_cpu_optimizer_d2h_h2d or self._overlap is not None
        )
        self._host_subs = [
            make_sub(self.cpu_optimizer_cls, b, self.param_groups, host_kwargs) for b in buckets
        ]
        self._device_sub = None
        if device_entries:
            device_type = device_entries[0].param.device.type
            device_kwargs = side_kwargs(
                self.sub_optimizer_kwargs, self.gpu_optimizer_cls, device_type, device_entries
            )
            self._device_sub = make_sub(
                self.gpu_optimizer_cls, device_entries, self.param_groups, device_kwargs
            )

        # The HDO's groups and defaults carry the sub-optimizers' full hyperparameter set,
        # so that a state dict of this optimizer configures a plain optimizer completely
        # (e.g. AdamW's decoupled_weight_decay, whose absence would mean Adam).
        for sub in self._all_subs():
            for key, value in sub.optimizer.defaults.items():
                self.defaults.setdefault(key, value)
                for group in self.param_groups:
                    group.setdefault(key, value)

        install_state(entries, state_by_param)
        self._refresh_state()
        if self._overlap is not None:
            self._overlap.cuda_device = self._cuda_device
            self._overlap.track(entries)
        if (self.overlap_cpu_optimizer_d2h_h2d and self.early_grad_copy) or self._overlap:
            for entry in entries:
                p = entry.param
                if entry.offloaded and p.requires_grad and p.is_leaf:
                    hook = _GradReadyHook(self, entry, self._generation)
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def _host_order(self, entries: list[Entry]) -> list[Entry]:
        host = [e for e in entries if e.host]
        if self._overlap is None:
            # Reverse parameter order: backward produces the last parameters' gradients
            # first, so their early copies are the first to be complete.
            return host[::-1]
        # The order the next forward reads them in (learned from the first forward;
        # parameters it did not read follow, in parameter order).
        unseen = len(entries)

        def position(item: tuple[int, Entry]) -> tuple[int, int]:
            seen = self._overlap.forward_position(item[1])  # type: ignore[union-attr]
            return (unseen if seen is None else seen, item[0])

        return [e for _, e in sorted(enumerate(host), key=position)]

    # ------------------------------------------------------------------ state view

    def _refresh_state(self) -> None:
        if isinstance(self.state, StateView):
            self.state.refill(self._entries)
        else:
            self.state = state_view(self._entries, self.synchronize)

    def _sync_hyperparameters(self) -> None:
        for sub in self._all_subs():
            for sub_group, group_id in zip(sub.optimizer.param_groups, sub.group_ids, strict=True):
                for key, value in self.param_groups[group_id].items():
                    if key not in IMPLEMENTATION_KEYS:
                        sub_group[key] = value

    def _all_subs(self) -> list[Sub]:
        return self._host_subs + ([self._device_sub] if self._device_sub is not None else [])
