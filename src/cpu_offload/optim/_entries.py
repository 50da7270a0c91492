"""What steps each parameter: entries, host buckets and sub-optimizers.

Every parameter of a :class:`~cpu_offload.optim.HybridDeviceOptimizer` gets one
:class:`Entry`: the tensor its sub-optimizer steps (the parameter itself, a host copy or
a fp32 master) and the host buffers its copies go through; a gradient copy started in
backward is recorded on it as an :class:`EarlyCopy`. Entries are grouped into
sub-optimizers (:class:`Sub`): host buckets and one device optimizer.
"""

from __future__ import annotations

import threading
import weakref  # noqa: F401  (EarlyCopy.grad is a weak reference)
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from cpu_offload._compat import fused_optimizer_supported

__all__ = [
    "CopyDtype",
    "EarlyCopy",
    "Entry",
    "EntryFactory",
    "Sub",
    "bucket_entries",
    "make_sub",
    "side_kwargs",
]

# Which dtype crosses PCIe for a parameter with a host fp32 master: the master's (fp32,
# converted on the device) or the parameter's own (converted on the host).
CopyDtype = Literal["master", "param"]

# Keys of a param group that choose an implementation rather than the maths; they stay as
# each sub-optimizer was built (e.g. fused on both sides) instead of following the HDO's
# groups, which may come from a checkpoint of a differently-configured plain optimizer.
IMPLEMENTATION_KEYS = frozenset(
    {"params", "param_names", "fused", "foreach", "capturable", "differentiable"}
)

# Host parameters are stepped in buckets of at least this many elements, each bucket by its
# own host optimizer, so that the copy back of one bucket overlaps the step of the next
# while small parameters (biases, norms) do not pay one optimizer call each.
BUCKET_NUMEL = 1 << 22

# PyTorch's optimizers that have fused kernels (see _compat.fused_optimizer_supported).
_FUSABLE_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
)


@dataclass(eq=False)
class EarlyCopy:
    """A gradient copy started in backward, to be checked in ``step()``."""

    grad: weakref.ref[torch.Tensor]
    version: int
    copy_event: torch.cuda.Event | None
    # The gradient's fingerprint, taken on its device on the stream that produced it,
    # before anything queued after the hook could change it.
    fingerprint: torch.Tensor
    widened: bool  # the worker widens it into the entry's host_grad (entry.pending)


@dataclass(eq=False)
class Entry:
    """One user parameter and what steps it."""

    param: torch.Tensor
    group: int
    host: bool  # stepped by a host optimizer
    offloaded: bool  # a device parameter with a host copy (copies both ways)
    inner: torch.Tensor  # the tensor the sub-optimizer steps
    master: bool  # inner is a fp32 master copy of a lower-precision parameter
    grad_buf: torch.Tensor | None = None  # host buffer the gradient is copied into
    host_grad: torch.Tensor | None = None  # host-widened gradient (grad_copy_dtype="param")
    stage: torch.Tensor | None = None  # host buffer in the parameter's dtype for H2D
    early: EarlyCopy | None = None
    pending: Future[None] | None = None  # last widening task queued on the worker
    d2h_event: torch.cuda.Event | None = None
    h2d_event: torch.cuda.Event | None = None
    widened: bool = False
    has_grad: bool = False  # whether the gradient was there when step() took it
    optimizer: torch.optim.Optimizer | None = None
    # The parameter's version counter when inner last matched it (after a copy either
    # way); another value means someone else wrote the parameter (a model's
    # load_state_dict after the optimizer's, an in-place edit) and inner must follow.
    param_version: int = -1
    # Set when the host step of this entry runs after step() returned: ``landed`` is set
    # once its new value is queued to the parameter (h2d_event then marks the copy).
    landed: threading.Event | None = None
    # True from an asynchronous step until a reader waited for this parameter; a
    # gradient accumulated meanwhile means it was read without waiting.
    unguarded: bool = False
    # Whether the last asynchronous step marked the parameter pending (_pending): a
    # class with its own __torch_function__, or one that cannot be swapped, is not.
    marked: bool = False
    # Stepped on the device with its host state streamed through it (``_stream``).
    streamed: bool = False

    def note_param_written(self) -> None:
        """Record that ``inner`` and the parameter hold the same values now."""
        self.param_version = self.param._version

    @property
    def has_copy(self) -> bool:
        """Whether the sub-optimizer steps a copy (host copy or fp32 master)."""
        return self.inner is not self.param


@dataclass(eq=False)
class Sub:
    """A sub-optimizer and, per its param group, the index of the HDO group it mirrors."""

    optimizer: torch.optim.Optimizer
    group_ids: list[int]
    entries: list[Entry] = field(default_factory=list)


@dataclass(frozen=True)
class EntryFactory:
    """Builds entries with one optimizer's precision, copy-dtype and pinning choices."""

    param_update_in_fp32: bool
    grad_copy_dtype: CopyDtype
    param_copy_dtype: CopyDtype
    pin_cpu_grads: bool
    pin_cpu_params: bool

    @torch.no_grad()
    def make(self, p: torch.Tensor, group: int, offloaded: bool, device_param: bool) -> Entry:
        """The entry of parameter ``p`` of HDO group ``group``."""
        host = offloaded or not device_param
        master = self.param_update_in_fp32 and p.is_floating_point() and p.element_size() < 4
        dtype = torch.float32 if master else p.dtype
        if not offloaded:
            inner = p.detach().to(dtype, copy=True) if master else p
            entry = Entry(p, group, host, False, inner, master)
            entry.note_param_written()
            return entry
        pin = p.is_cuda
        # Pin whatever a copy to the device reads from: the host copy itself unless a
        # staging buffer in the parameter's dtype stands in between.
        narrow_on_host = master and self.param_copy_dtype == "param"
        inner = torch.empty(
            p.shape,
            dtype=dtype,
            device="cpu",
            pin_memory=pin and self.pin_cpu_params and not narrow_on_host,
        )
        inner.copy_(p.detach())
        entry = Entry(p, group, True, True, inner, master)
        entry.note_param_written()
        return entry

    def add_copy_buffers(self, entry: Entry) -> None:
        """Give an offloaded entry stepped by the host its gradient and staging buffers.

        Called once the entries streamed through the device (which need none) are known:
        pinned memory allocated and dropped would stay in PyTorch's pinned-memory cache.
        Allocated here, not on first use (gradients normally have the parameter's dtype):
        pinned allocation is slow and must not happen inside backward.
        """
        p = entry.param
        pin = p.is_cuda
        if entry.master and self.param_copy_dtype == "param":
            entry.stage = torch.empty(
                p.shape, dtype=p.dtype, device="cpu", pin_memory=pin and self.pin_cpu_params
            )
        widen_on_device = entry.master and self.grad_copy_dtype == "master"
        entry.grad_buf = torch.empty(
            p.shape,
            dtype=entry.inner.dtype if widen_on_device else p.dtype,
            device="cpu",
            pin_memory=pin and self.pin_cpu_grads,
        )
        if entry.master and self.grad_copy_dtype == "param":
            entry.host_grad = torch.empty(p.shape, dtype=entry.inner.dtype, device="cpu")


def bucket_entries(host_entries: Sequence[Entry], bucketed: bool) -> list[list[Entry]]:
    """Host entries in stepping order, cut into buckets of at least ``BUCKET_NUMEL``.

    A bucket never mixes offloaded entries with host parameters of the caller, so that
    buckets of offloaded entries alone can be stepped after ``step()`` returned, nor
    streamed entries with others (the stream lane steps whole buckets).
    Without ``bucketed``, one bucket per kind.
    """
    buckets: list[list[Entry]] = []
    numel = 0
    for entry in host_entries:
        last = buckets[-1][-1] if buckets else None
        kind_changed = last is not None and (
            last.offloaded != entry.offloaded or last.streamed != entry.streamed
        )
        if not buckets or kind_changed or (bucketed and numel >= BUCKET_NUMEL):
            buckets.append([])
            numel = 0
        buckets[-1].append(entry)
        numel += entry.param.numel()
    return buckets


def side_kwargs(
    defaults: Mapping[str, Any],
    cls: type[torch.optim.Optimizer],
    device_type: str,
    entries: Iterable[Entry] = (),
) -> dict[str, Any]:
    """Sub-optimizer keyword arguments: ``defaults``, fused where nothing else is asked
    and the fused kernels take every tensor stepped (real floating point, not complex)."""
    kwargs = dict(defaults)
    if (
        cls in _FUSABLE_CLASSES
        and "fused" not in kwargs
        and "foreach" not in kwargs
        and fused_optimizer_supported(device_type)
        and all(e.inner.dtype.is_floating_point for e in entries)
    ):
        kwargs["fused"] = True
    return kwargs


def make_sub(
    cls: type[torch.optim.Optimizer],
    entries: Iterable[Entry],
    param_groups: Sequence[Mapping[str, Any]],
    kwargs: Mapping[str, Any],
) -> Sub:
    """A sub-optimizer of ``cls`` over ``entries``, one group per run of HDO groups."""
    entries = list(entries)
    groups: list[dict[str, Any]] = []
    group_ids: list[int] = []
    for entry in entries:
        if not group_ids or group_ids[-1] != entry.group:
            hyper = {
                k: v for k, v in param_groups[entry.group].items() if k not in IMPLEMENTATION_KEYS
            }
            groups.append({**hyper, "params": []})
            group_ids.append(entry.group)
        groups[-1]["params"].append(entry.inner)
    optimizer = cls(groups, **kwargs)
    for entry in entries:
        entry.optimizer = optimizer
    return Sub(optimizer, group_ids, entries)
