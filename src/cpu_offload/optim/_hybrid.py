"""HybridDeviceOptimizer: a GPU optimizer with part of its state and step on the host.

Megatron-LM's ``HybridDeviceOptimizer`` (HDO) keeps the optimizer state of a prefix of the
parameters in host memory and steps it with a host optimizer; this module implements the
same constructor, split and state-dict contract, with a faster data path:

* gradients and updated parameters cross PCIe in the dtype that keeps host memory
  traffic lowest (the host step is bound by host memory bandwidth): with a host fp32
  master they are widened and narrowed on the GPU by default, otherwise they travel in
  their own dtype (``grad_copy_dtype`` / ``param_copy_dtype`` choose);
* gradient copies start in backward, from a post-accumulate-grad hook, and are reused in
  ``step()`` only if the gradient is provably unchanged (same tensor, same version counter,
  same content fingerprint, taken on the GPU); otherwise ``step()`` copies again;
* host steps are pipelined in buckets with the copies back to the GPU, and the GPU part is
  stepped on the GPU while the host works.

Nothing in here compares PyTorch versions: the one version question (fused kernels) goes
to :func:`cpu_offload._compat.fused_optimizer_supported`.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from cpu_offload._compat import fused_optimizer_supported, is_current_stream_capturing

from ._split import check_offload_fraction, compute_offload_split, is_device_tensor

__all__ = ["HybridDeviceOptimizer"]

# Keys of a param group that choose an implementation rather than the maths; they stay as
# each sub-optimizer was built (e.g. fused on both sides) instead of following the HDO's
# groups, which may come from a checkpoint of a differently-configured plain optimizer.
_IMPLEMENTATION_KEYS = frozenset(
    {"params", "param_names", "fused", "foreach", "capturable", "differentiable"}
)

# Host parameters are stepped in buckets of at least this many elements, each bucket by its
# own host optimizer, so that the copy back of one bucket overlaps the step of the next
# while small parameters (biases, norms) do not pay one optimizer call each.
_BUCKET_NUMEL = 1 << 22

# PyTorch's optimizers that have fused kernels (see _compat.fused_optimizer_supported).
_FUSABLE_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
)

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
# Which dtype crosses PCIe for a parameter with a host fp32 master: the master's (fp32,
# converted on the device) or the parameter's own (converted on the host).
_CopyDtype = Literal["master", "param"]


# Integer dtype of each element width, to read a tensor's bits element by element.
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


_FINGERPRINT_CHUNK = 1 << 24  # elements widened at a time: bounds the temporary memory
_FINGERPRINT_ROW = 1 << 15  # 2^15 unsigned 16-bit codes sum below 2^31: int32 rows


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """An exact checksum of ``tensor``'s bits, as int64 ``(sum, max, min)``, on its device.

    Each element's bits are read as *unsigned* integers of its width (8-byte elements
    as two 4-byte halves) and summed exactly in int64. Signed codes would let +x
    and a negative value mirror each other and cancel when both are zeroed; unsigned
    codes are all positive, so zeroing any nonzero elements, any single-element edit
    and any uniform power-of-2 scaling (which adds the same amount to every nonzero
    code) change the sum. Integer reductions are exact in any order, so the value does
    not depend on the reduction's layout. Max and min of the signed codes come on top.
    """
    if tensor.numel() == 0:
        return torch.zeros(3, dtype=torch.int64, device=tensor.device)
    flat = tensor.detach().reshape(-1)
    ints = flat.view(_INT_VIEW[tensor.element_size()])
    # Wider elements are summed as their 4-byte halves, so that the sum stays exact.
    width = min(tensor.element_size(), 4)
    words = (flat if width == tensor.element_size() else flat.contiguous()).view(_INT_VIEW[width])
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    mask = (1 << (8 * width)) - 1
    for chunk in words.split(_FINGERPRINT_CHUNK):
        if width <= 2:
            codes = chunk.to(torch.int32).bitwise_and_(mask)
            full = codes.numel() - codes.numel() % _FINGERPRINT_ROW
            rows = codes[:full].view(-1, _FINGERPRINT_ROW).sum(1, dtype=torch.int32)
            total += rows.sum(dtype=torch.int64) + codes[full:].sum(dtype=torch.int64)
        else:
            total += chunk.to(torch.int64).bitwise_and_(mask).sum()
    return torch.stack([total, ints.amax().to(torch.int64), ints.amin().to(torch.int64)])


def _widen_after_copy(
    event: torch.cuda.Event | None, buf: torch.Tensor, wide: torch.Tensor
) -> None:
    # Runs on the worker thread while backward goes on (grad_copy_dtype="param" with a
    # fp32 master): wait for the copy to the host, then widen it for the master.
    if event is not None:
        event.synchronize()
    wide.copy_(buf)


def _copy_converted(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """``dst.copy_(src)`` with any dtype conversion done on ``src``'s device.

    PyTorch converts on the host for a blocking device-to-host copy; converting on the
    GPU first keeps the host's memory bandwidth for the host step.
    """
    if src.dtype != dst.dtype:
        src = src.to(dst.dtype)
    dst.copy_(src, non_blocking=non_blocking)


@dataclass(eq=False)
class _EarlyCopy:
    """A gradient copy started in backward, to be checked in ``step()``."""

    grad: weakref.ref[torch.Tensor]
    version: int
    copy_event: torch.cuda.Event | None
    # The gradient's fingerprint, taken on its device on the stream that produced it,
    # before anything queued after the hook could change it.
    fingerprint: torch.Tensor
    widened: bool  # the worker widens it into the entry's host_grad (entry.pending)


@dataclass(eq=False)
class _Entry:
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
    early: _EarlyCopy | None = None
    pending: Future[None] | None = None  # last task queued on the worker
    d2h_event: torch.cuda.Event | None = None
    h2d_event: torch.cuda.Event | None = None
    widened: bool = False
    optimizer: torch.optim.Optimizer | None = None
    # The parameter's version counter when inner last matched it (after a copy either
    # way); another value means someone else wrote the parameter (a model's
    # load_state_dict after the optimizer's, an in-place edit) and inner must follow.
    param_version: int = -1

    def note_param_written(self) -> None:
        self.param_version = self.param._version

    @property
    def has_copy(self) -> bool:
        """Whether the sub-optimizer steps a copy (host copy or fp32 master)."""
        return self.inner is not self.param


@dataclass(eq=False)
class _Sub:
    """A sub-optimizer and, per its param group, the index of the HDO group it mirrors."""

    optimizer: torch.optim.Optimizer
    group_ids: list[int]
    entries: list[_Entry] = field(default_factory=list)


class _GradReadyHook:
    """Post-accumulate-grad hook that starts an offloaded gradient's copy in backward.

    Holds the optimizer weakly: the hook lives on the parameter, which must not keep the
    optimizer alive.
    """

    def __init__(self, owner: HybridDeviceOptimizer, entry: _Entry, generation: int) -> None:
        self._owner = weakref.ref(owner)
        self._entry = weakref.ref(entry)
        self._generation = generation

    def __call__(self, param: torch.Tensor) -> None:
        owner = self._owner()
        entry = self._entry()
        if owner is not None and entry is not None:
            owner._on_grad_ready(entry, self._generation)


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """An optimizer that keeps the state of a fraction of the parameters on the host.

    Megatron-LM's ``HybridDeviceOptimizer`` constructor and behaviour: walking the
    parameters in param-group order, device parameters are offloaded while the offloaded
    element count is below ``offload_fraction`` of all device elements (see
    :func:`compute_offload_split`). An offloaded parameter gets a host copy (a fp32
    master copy when ``param_update_in_fp32`` and the parameter is lower precision), its
    state lives on the host, a host optimizer of ``cpu_optimizer_cls`` steps it and the
    new values are copied back into the device parameter. The others are stepped on the
    device by ``gpu_optimizer_cls`` (on fp32 master copies with ``param_update_in_fp32``).
    Host (CPU) parameters given by the caller are stepped in place by the host optimizer.

    It is a :class:`torch.optim.Optimizer` over the caller's parameters: ``param_groups``
    changes (learning-rate schedulers) reach the sub-optimizers at the next ``step()``;
    ``state`` maps each parameter to its state (host tensors for offloaded parameters);
    ``state_dict()`` is keyed like a plain optimizer's and loads into one, and the reverse.

    Beyond Megatron's, four keyword arguments are taken out of ``**defaults``:

    * ``early_grad_copy`` (bool, default True): with ``overlap_cpu_optimizer_d2h_h2d``,
      start each offloaded gradient's copy to the host as soon as backward has
      accumulated it. ``step()`` reuses the copy only if ``param.grad`` is the same tensor
      with the same version counter and the same content checksum as when it was copied,
      so clipping, unscaling, all-reduce or any other change made between backward and
      ``step()`` is honoured (the gradient is then copied again). Turn it off when the
      gradients are always rewritten after backward (DDP, ``GradScaler``): the early
      copies would only cost PCIe bandwidth.
    * ``grad_copy_dtype`` (``"master"`` or ``"param"``, default ``"master"``): the dtype
      in which gradients of parameters with a host fp32 master travel to the host.
      ``"master"`` widens on the device and sends fp32 (twice the PCIe bytes, a transient
      fp32 copy of one gradient on the device, no host work); ``"param"`` sends the
      gradient's own dtype and widens on the host (on a worker thread during backward).
      The host step is bound by host memory bandwidth, which host widening takes from it,
      so ``"master"`` is faster wherever the copies overlap backward and the host step.
    * ``param_copy_dtype`` (``"master"`` or ``"param"``, default ``"master"``): the same
      choice for the updated parameters travelling back: ``"master"`` sends fp32 and
      narrows on the device; ``"param"`` narrows on the host and sends the parameter's
      own dtype (half the PCIe bytes).

    * ``is_device_param`` (callable or None): tells device parameters, which may be
      offloaded, from host ones, which are stepped in place by the host optimizer; by
      default any parameter not on the CPU is a device parameter.

    Without a host fp32 master, gradients and parameters always travel in their own dtype.

    Parameters written outside the optimizer (``model.load_state_dict`` before or after
    the optimizer's, an in-place edit under ``torch.no_grad()``) are seen by the next
    ``step()`` or ``state_dict()`` through their version counter, so resuming from a
    checkpoint is exact in either load order. A fp32 master whose rounding equals the
    written parameter is kept. Writes through ``param.data`` bypass the version counter
    and are not seen.

    Args:
        params: Parameters or param-group dicts, as for any optimizer.
        offload_fraction: Fraction of the device parameters' elements whose state is
            offloaded, in ``[0.0, 1.0]``.
        cpu_optimizer_cls: Host optimizer class; ``torch.optim.AdamW`` when None.
        gpu_optimizer_cls: Device optimizer class; ``torch.optim.AdamW`` when None.
        param_update_in_fp32: Step fp32 master copies of lower-precision parameters.
        pin_cpu_grads: Pin the host gradient buffers (page-locked, for async copies).
        pin_cpu_params: Pin the host buffers that parameters are copied back from.
        overlap_cpu_optimizer_d2h_h2d: Copy on side streams and step each host bucket as
            soon as its gradients have arrived, its copy back overlapping later steps.
            Off: one host optimizer, copies on the current stream.
        **defaults: Hyperparameters (lr, betas, eps, weight_decay, momentum, fused, ...)
            for both sub-optimizers, plus ``early_grad_copy``, ``grad_copy_dtype``,
            ``param_copy_dtype`` and ``is_device_param``.
            When neither ``fused`` nor ``foreach`` is given, PyTorch's Adam, AdamW and SGD
            use their fused kernels on each side where the running PyTorch has them.

    Raises:
        ValueError: If ``params`` is empty, ``offload_fraction`` is outside ``[0, 1]``,
            ``grad_copy_dtype`` or ``param_copy_dtype`` is unknown, or device parameters
            span several devices.
        TypeError: If a class is not a ``torch.optim.Optimizer`` subclass or a flag is
            not a bool.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    # Gradients smaller than this are copied in step(), not from backward: checking an
    # early copy costs a few kernel launches, more than copying a small gradient again.
    _early_min_numel = 1 << 19

    def __init__(
        self,
        params: ParamsT,
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
        gpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        **defaults: Any,
    ) -> None:
        fraction = check_offload_fraction(offload_fraction)
        cpu_cls = _check_optimizer_cls("cpu_optimizer_cls", cpu_optimizer_cls)
        gpu_cls = _check_optimizer_cls("gpu_optimizer_cls", gpu_optimizer_cls)
        for name, value in (
            ("param_update_in_fp32", param_update_in_fp32),
            ("pin_cpu_grads", pin_cpu_grads),
            ("pin_cpu_params", pin_cpu_params),
            ("overlap_cpu_optimizer_d2h_h2d", overlap_cpu_optimizer_d2h_h2d),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        is_device_param = defaults.pop("is_device_param", None)
        if is_device_param is not None and not callable(is_device_param):
            raise TypeError(
                "is_device_param must be a callable taking a tensor and returning a bool, "
                f"or None, got {type(is_device_param).__name__}"
            )
        early_grad_copy = defaults.pop("early_grad_copy", True)
        if not isinstance(early_grad_copy, bool):
            raise TypeError(f"early_grad_copy must be a bool, got {type(early_grad_copy).__name__}")
        copy_dtypes = {
            name: _check_copy_dtype(name, defaults.pop(name, "master"))
            for name in ("grad_copy_dtype", "param_copy_dtype")
        }
        param_list = _materialize(params)

        super().__init__(param_list, dict(defaults))
        self.offload_fraction = fraction
        self.cpu_optimizer_cls = cpu_cls
        self.gpu_optimizer_cls = gpu_cls
        self.param_update_in_fp32 = param_update_in_fp32
        self.pin_cpu_grads = pin_cpu_grads
        self.pin_cpu_params = pin_cpu_params
        self.overlap_cpu_optimizer_d2h_h2d = overlap_cpu_optimizer_d2h_h2d
        self.early_grad_copy = early_grad_copy
        #: Which parameters count as device parameters, eligible for offloading.
        self.is_device_param: Callable[[torch.Tensor], bool] = (
            is_device_tensor if is_device_param is None else is_device_param
        )
        self.grad_copy_dtype: _CopyDtype = copy_dtypes["grad_copy_dtype"]
        self.param_copy_dtype: _CopyDtype = copy_dtypes["param_copy_dtype"]
        self.sub_optimizer_kwargs = dict(defaults)
        #: Timings and counters of the last ``step()`` (seconds and counts).
        self.last_step_timings: dict[str, float] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._hook_handles: list[Any] = []
        # A dropped optimizer takes its hooks off the parameters it leaves behind.
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        self._generation = 0
        self._entries: list[_Entry] = []
        self._host_subs: list[_Sub] = []
        self._device_sub: _Sub | None = None
        self._cuda_device: torch.device | None = None
        self._d2h_stream: torch.cuda.Stream | None = None
        self._h2d_stream: torch.cuda.Stream | None = None
        self._build({})

    # ------------------------------------------------------------------ public API

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The host optimizers (in stepping order) followed by the device optimizer."""
        subs = [s.optimizer for s in self._host_subs]
        if self._device_sub is not None:
            subs.append(self._device_sub.optimizer)
        return subs

    @property
    def offload_mask(self) -> list[bool]:
        """Per parameter in param-group order: True when it is a device parameter whose
        state and step were moved to the host."""
        return [e.offloaded for e in self._entries]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group and recompute the split over all groups (state is kept).

        Args:
            param_group: ``{"params": [...], **hyperparameters}`` as for any optimizer.
        """
        super().add_param_group(param_group)
        if getattr(self, "_entries", None):
            # After construction: the split depends on all groups, so rebuild it; each
            # parameter's state moves to its (possibly new) side.
            self._build(self._state_by_param())

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update all parameters; on return they hold the new values.

        Device work that reads the parameters afterwards on the current stream sees the
        new values (the current stream waits for the copies back); work on other
        streams must wait for the current stream first.

        Args:
            closure: Re-evaluates the model and returns the loss; called once.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self._adopt_param_writes()
        self._step_all()
        self._refresh_state()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of all parameters (and of the fp32 device master copies).

        Args:
            set_to_none: Set ``.grad`` to None instead of zeroing it.
        """
        super().zero_grad(set_to_none)
        for entry in self._entries:
            entry.early = None
            if entry.master and not entry.host:
                entry.inner.grad = None

    def dummy_step(self) -> None:
        """Create every parameter's optimizer state without changing any parameter.

        Megatron calls this before loading a checkpoint in place (e.g. a distributed
        checkpoint that needs the state tensors to exist). Unlike Megatron's, which steps
        with random gradients, this steps with zero gradients and a learning rate of 0,
        so parameters keep their exact values; state is created as after one step (step
        count 1). Its values are those of a step on zero gradients: zero moments for
        AdamW, but a coupled weight decay (SGD's, Adam's L2 mode) puts the decay term into
        the moments. A checkpoint loaded afterwards replaces them. Existing gradients are
        restored afterwards.
        """
        saved_grads = [p.grad for g in self.param_groups for p in g["params"]]
        saved_lrs = [g.get("lr") for g in self.param_groups]
        try:
            for group in self.param_groups:
                if "lr" in group:
                    group["lr"] = 0.0
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            self.step()
        finally:
            for group, lr in zip(self.param_groups, saved_lrs, strict=True):
                if lr is not None:
                    group["lr"] = lr
            params = [p for g in self.param_groups for p in g["params"]]
            for p, grad in zip(params, saved_grads, strict=True):
                p.grad = grad
            for entry in self._entries:
                entry.early = None

    def state_dict(self) -> dict[str, Any]:
        """The state in a plain optimizer's format (loads into one of the same class).

        Returns:
            ``{"state": {index: {...}}, "param_groups": [{..., "params": [indices]}]}``,
            indices counting parameters in param-group order. State tensors are the live
            ones (as for PyTorch's optimizers): host tensors for offloaded parameters,
            device tensors for the others, plus ``master_param`` (the fp32 master copy)
            for parameters updated through one.
        """
        self._adopt_param_writes()
        self._refresh_state()
        groups: list[dict[str, Any]] = []
        index = 0
        indices: dict[int, int] = {}
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            for p in group["params"]:
                indices[id(p)] = index
                index += 1
            groups.append(packed)
        state = {indices[id(p)]: dict(s) for p, s in self.state.items() if id(p) in indices}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this class or of a plain optimizer of the same class.

        Hyperparameters come from the state dict, as for PyTorch's optimizers; each
        parameter's state goes to its side of the (recomputed) split, so a checkpoint
        taken at one fraction loads at any other. Host copies and fp32 master copies are
        refreshed from the current parameters, then from ``master_param`` where the
        state dict has it (exact resume of a lower-precision model). Tensors are copied.

        Args:
            state_dict: From :meth:`state_dict` here or of a plain optimizer.

        Raises:
            ValueError: If the groups or their sizes do not match this optimizer's.
        """
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("state_dict must be a mapping with 'state' and 'param_groups' entries")
        saved_groups = deepcopy(list(state_dict["param_groups"]))
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group "
                    "that doesn't match the size of optimizer's group"
                )
        id_map: dict[Any, torch.Tensor] = {}
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            id_map.update(zip(saved["params"], group["params"], strict=True))
        new_groups = []
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            saved["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                saved["param_names"] = group["param_names"]
            new_groups.append(saved)
        self.param_groups = new_groups
        by_param = {id_map[k]: dict(v) for k, v in state_dict["state"].items() if k in id_map}
        self._build(by_param)

    # ------------------------------------------------------------------ test seam

    def _is_device_param(self, param: torch.Tensor) -> bool:
        return bool(self.is_device_param(param))

    # ------------------------------------------------------------------ building

    def _state_by_param(self) -> dict[torch.Tensor, dict[str, Any]]:
        self._adopt_param_writes()
        self._refresh_state()
        return {p: dict(s) for p, s in self.state.items() if s}

    def _teardown(self) -> None:
        _remove_hooks(self._hook_handles)
        for entry in self._entries:
            if entry.pending is not None:
                entry.pending.result()
        self._generation += 1

    def _build(self, state_by_param: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        self._teardown()
        flat = [p for g in self.param_groups for p in g["params"]]
        split = compute_offload_split(flat, self.offload_fraction, is_device=self._is_device_param)
        cuda_devices = {p.device for p, off in zip(flat, split, strict=True) if off and p.is_cuda}
        if len(cuda_devices) > 1:
            raise ValueError(
                "params: all offloaded CUDA parameters of one HybridDeviceOptimizer must be "
                f"on one device, got {sorted(str(d) for d in cuda_devices)}"
            )
        self._cuda_device = next(iter(cuda_devices), None)
        entries: list[_Entry] = []
        position = 0
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                entries.append(self._make_entry(p, group_index, split[position]))
                position += 1
        self._entries = entries

        use_streams = self._cuda_device is not None and self.overlap_cpu_optimizer_d2h_h2d
        if use_streams:
            self._d2h_stream = torch.cuda.Stream(self._cuda_device)
            self._h2d_stream = torch.cuda.Stream(self._cuda_device)
        else:
            self._d2h_stream = self._h2d_stream = None

        # Host side, in reverse parameter order: backward produces the last parameters'
        # gradients first, so their early copies are the first to be complete.
        host_entries = [e for e in reversed(entries) if e.host]
        device_entries = [e for e in entries if not e.host]
        host_kwargs = self._side_kwargs(self.cpu_optimizer_cls, "cpu")
        if self.overlap_cpu_optimizer_d2h_h2d:
            buckets: list[list[_Entry]] = []
            numel = 0
            for entry in host_entries:
                if not buckets or numel >= _BUCKET_NUMEL:
                    buckets.append([])
                    numel = 0
                buckets[-1].append(entry)
                numel += entry.param.numel()
        else:
            buckets = [host_entries] if host_entries else []
        self._host_subs = [self._make_sub(self.cpu_optimizer_cls, b, host_kwargs) for b in buckets]
        self._device_sub = None
        if device_entries:
            device_type = device_entries[0].param.device.type
            device_kwargs = self._side_kwargs(self.gpu_optimizer_cls, device_type)
            self._device_sub = self._make_sub(self.gpu_optimizer_cls, device_entries, device_kwargs)

        # The HDO's groups and defaults carry the sub-optimizers' full hyperparameter set,
        # so that a state dict of this optimizer configures a plain optimizer completely
        # (e.g. AdamW's decoupled_weight_decay, whose absence would mean Adam).
        for sub in self._host_subs + ([self._device_sub] if self._device_sub else []):
            for key, value in sub.optimizer.defaults.items():
                self.defaults.setdefault(key, value)
                for group in self.param_groups:
                    group.setdefault(key, value)

        self._install_state(state_by_param)
        if self.overlap_cpu_optimizer_d2h_h2d and self.early_grad_copy:
            for entry in entries:
                p = entry.param
                if entry.offloaded and p.requires_grad and p.is_leaf:
                    hook = _GradReadyHook(self, entry, self._generation)
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def _make_entry(self, p: torch.Tensor, group: int, offloaded: bool) -> _Entry:
        device_param = self._is_device_param(p)
        host = offloaded or not device_param
        master = self.param_update_in_fp32 and p.is_floating_point() and p.element_size() < 4
        dtype = torch.float32 if master else p.dtype
        with torch.no_grad():
            if offloaded:
                pin = p.is_cuda
                # Pin whatever a copy to the device reads from: the host copy itself
                # unless a staging buffer in the parameter's dtype stands in between.
                narrow_on_host = master and self.param_copy_dtype == "param"
                inner = torch.empty(
                    p.shape,
                    dtype=dtype,
                    device="cpu",
                    pin_memory=pin and self.pin_cpu_params and not narrow_on_host,
                )
                inner.copy_(p.detach())
                entry = _Entry(p, group, True, True, inner, master)
                entry.note_param_written()
                if narrow_on_host:
                    entry.stage = torch.empty(
                        p.shape, dtype=p.dtype, device="cpu", pin_memory=pin and self.pin_cpu_params
                    )
                # Allocated now (gradients normally have the parameter's dtype): pinned
                # allocation is slow and must not happen inside backward.
                grad_dtype = dtype if master and self.grad_copy_dtype == "master" else p.dtype
                entry.grad_buf = torch.empty(
                    p.shape, dtype=grad_dtype, device="cpu", pin_memory=pin and self.pin_cpu_grads
                )
                if master and self.grad_copy_dtype == "param":
                    entry.host_grad = torch.empty(p.shape, dtype=dtype, device="cpu")
                return entry
            inner = p.detach().to(dtype, copy=True) if master else p
            entry = _Entry(p, group, host, False, inner, master)
            entry.note_param_written()
            return entry

    def _side_kwargs(self, cls: type[torch.optim.Optimizer], device_type: str) -> dict[str, Any]:
        kwargs = dict(self.sub_optimizer_kwargs)
        if (
            cls in _FUSABLE_CLASSES
            and "fused" not in kwargs
            and "foreach" not in kwargs
            and fused_optimizer_supported(device_type)
        ):
            kwargs["fused"] = True
        return kwargs

    def _make_sub(
        self, cls: type[torch.optim.Optimizer], entries: list[_Entry], kwargs: dict[str, Any]
    ) -> _Sub:
        groups: list[dict[str, Any]] = []
        group_ids: list[int] = []
        for entry in entries:
            if not group_ids or group_ids[-1] != entry.group:
                hyper = {
                    k: v
                    for k, v in self.param_groups[entry.group].items()
                    if k not in _IMPLEMENTATION_KEYS
                }
                groups.append({**hyper, "params": []})
                group_ids.append(entry.group)
            groups[-1]["params"].append(entry.inner)
        optimizer = cls(groups, **kwargs)
        for entry in entries:
            entry.optimizer = optimizer
        return _Sub(optimizer, group_ids, list(entries))

    def _install_state(self, state_by_param: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        for entry in self._entries:
            saved = state_by_param.get(entry.param)
            if not saved:
                continue
            assert entry.optimizer is not None
            group = _group_of(entry.optimizer, entry.inner)
            new_state: dict[str, Any] = {}
            for key, value in saved.items():
                if key == "master_param":
                    if entry.master and isinstance(value, torch.Tensor):
                        with torch.no_grad():
                            entry.inner.copy_(value)
                    continue
                new_state[key] = _place_state_value(key, value, entry.inner, group)
            entry.optimizer.state[entry.inner] = new_state
        self._refresh_state()

    # ------------------------------------------------------------------ state view

    @torch.no_grad()
    def _adopt_param_writes(self) -> None:
        """Bring host copies and fp32 masters up to parameters written by others.

        A parameter written outside the optimizer (``model.load_state_dict`` after the
        optimizer's, an in-place edit) has a new version counter. Its copy takes the new
        values, except that a fp32 master whose rounding equals the parameter is kept: that
        is a model checkpoint of the same training state loaded after the optimizer's,
        and the master holds the bits the parameter's dtype cannot.
        """
        for entry in self._entries:
            if not entry.has_copy or entry.param._version == entry.param_version:
                continue
            param = entry.param.detach()
            if not (entry.master and torch.equal(param, entry.inner.to(param.device, param.dtype))):
                entry.inner.copy_(param)
            entry.note_param_written()

    def _refresh_state(self) -> None:
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for entry in self._entries:
            assert entry.optimizer is not None
            sub_state = entry.optimizer.state.get(entry.inner)
            if not sub_state:
                continue
            if entry.master:
                sub_state["master_param"] = entry.inner
            state[entry.param] = sub_state
        self.state = state

    def _sync_hyperparameters(self) -> None:
        for sub in self._all_subs():
            for sub_group, group_id in zip(sub.optimizer.param_groups, sub.group_ids, strict=True):
                for key, value in self.param_groups[group_id].items():
                    if key not in _IMPLEMENTATION_KEYS:
                        sub_group[key] = value

    def _all_subs(self) -> list[_Sub]:
        return self._host_subs + ([self._device_sub] if self._device_sub is not None else [])

    # ------------------------------------------------------------------ early copies

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            # One thread: widening tasks of one entry must run in submission order.
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="cpu_offload_hdo")
            weakref.finalize(self, self._executor.shutdown, wait=False)
        return self._executor

    def _on_grad_ready(self, entry: _Entry, generation: int) -> None:
        """Start an offloaded gradient's copy from backward (post-accumulate-grad hook)."""
        grad = entry.param.grad
        if generation != self._generation or grad is None or grad.is_sparse:
            return
        if grad.numel() < self._early_min_numel or is_current_stream_capturing():
            return
        if entry.pending is not None:
            # The worker may still read the previous copy in this buffer.
            entry.pending.result()
            entry.pending = None
        # Taken on the stream that produced the gradient, so that it describes the
        # gradient as backward left it: a change queued later (clipping on this stream)
        # may race with the copy below, but then step() sees another fingerprint.
        fingerprint = _fingerprint(grad)
        buf = self._grad_buffer(entry, grad)
        stream = self._d2h_stream
        copy_event = None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(stream):
                _copy_converted(buf, grad, non_blocking=True)
                copy_event = stream.record_event()
            # The side stream reads the gradient: keep its memory until that is done.
            grad.record_stream(stream)
        else:
            _copy_converted(buf, grad, non_blocking=False)
        host_grad, widened = entry.host_grad, False
        if host_grad is not None and buf.dtype != host_grad.dtype:
            entry.pending = self._worker().submit(_widen_after_copy, copy_event, buf, host_grad)
            widened = True
        entry.early = _EarlyCopy(weakref.ref(grad), grad._version, copy_event, fingerprint, widened)

    def _grad_buffer(self, entry: _Entry, grad: torch.Tensor) -> torch.Tensor:
        # fp32 for a fp32 master with grad_copy_dtype="master" (widened on the device),
        # the gradient's own dtype otherwise.
        dtype = entry.inner.dtype if entry.host_grad is None and entry.master else grad.dtype
        buf = entry.grad_buf
        if buf is None or buf.dtype != dtype or buf.shape != grad.shape:
            pin = entry.param.is_cuda and self.pin_cpu_grads
            buf = torch.empty(grad.shape, dtype=dtype, device="cpu", pin_memory=pin)
            entry.grad_buf = buf
        return buf

    def _check_early_copies(
        self, entries: list[_Entry]
    ) -> tuple[list[_Entry], torch.Tensor | None, torch.cuda.Event | None]:
        """Queue the check of the gradients that have a still-plausible early copy.

        Returns the candidates, whether each gradient's fingerprint is unchanged (a host
        bool tensor, complete once the returned event is) and that event (None off
        CUDA). Drops the other early copies.
        """
        candidates: list[_Entry] = []
        now: list[torch.Tensor] = []
        for entry in entries:
            record, entry.early = entry.early, None
            grad = entry.param.grad
            if record is None or grad is None:
                continue
            if record.grad() is not grad or grad._version != record.version:
                continue
            entry.early = record
            candidates.append(entry)
            now.append(_fingerprint(grad))
        if not candidates:
            return [], None, None
        then = torch.stack([e.early.fingerprint for e in candidates])  # type: ignore[union-attr]
        same = (torch.stack(now) == then).all(dim=1)
        if not same.is_cuda:
            return candidates, same, None
        # A non-blocking copy and an event, so that the device step can be queued before
        # the host waits for these (and thereby for the end of backward).
        same_host = same.to("cpu", non_blocking=True)
        return candidates, same_host, torch.cuda.current_stream(same.device).record_event()

    def _keep_unchanged_early_copies(
        self,
        candidates: list[_Entry],
        same: torch.Tensor | None,
        event: torch.cuda.Event | None,
    ) -> int:
        """Keep the early copies whose gradient's fingerprint is unchanged; count them."""
        if not candidates or same is None:
            return 0
        if event is not None:
            event.synchronize()
        kept = 0
        for entry, ok in zip(candidates, same.tolist(), strict=True):
            if ok:
                kept += 1
            else:
                entry.early = None
        return kept

    # ------------------------------------------------------------------ the step

    def _step_all(self) -> None:
        t_start = time.perf_counter()
        offloaded = [e for e in self._entries if e.offloaded]
        early_candidates = sum(1 for e in offloaded if e.early is not None)
        current = (
            torch.cuda.current_stream(self._cuda_device) if self._cuda_device is not None else None
        )
        # Side streams in the overlapped mode, the current stream otherwise.
        d2h = self._d2h_stream if self._d2h_stream is not None else current
        h2d = self._h2d_stream if self._h2d_stream is not None else current
        # Everything queued before step() (backward, clipping, ...): the gradient copies
        # must come after it, and the copies back must not overwrite parameters it may
        # still read. Recorded before the device step so that the copies back do not
        # also wait for the device optimizer.
        before_step = current.record_event() if current is not None else None

        # 1. Which early copies still hold the gradient (the check queued first) ...
        candidates, same, checked = self._check_early_copies(offloaded)

        # 2. ... while the device part is queued, to run on the device as the host works.
        if self._device_sub is not None:
            self._step_device()
        kept = self._keep_unchanged_early_copies(candidates, same, checked)
        t_checked = time.perf_counter()

        # 3. Gradients to the host, for every offloaded entry without a valid early copy,
        #    in host-stepping order.
        if self._d2h_stream is not None and before_step is not None:
            self._d2h_stream.wait_event(before_step)
        for sub in self._host_subs:
            for entry in sub.entries:
                self._start_grad_copy(entry, d2h)

        # 4. Host buckets: wait for their gradients, step, copy back (pipelined).
        if self._h2d_stream is not None and before_step is not None:
            self._h2d_stream.wait_event(before_step)
        host_step = wait = convert = 0.0
        for sub in self._host_subs:
            t0 = time.perf_counter()
            for entry in sub.entries:
                self._host_grad_ready(entry)
            t1 = time.perf_counter()
            sub.optimizer.step()
            t2 = time.perf_counter()
            for entry in sub.entries:
                self._copy_back(entry, h2d)
            t3 = time.perf_counter()
            wait += t1 - t0
            host_step += t2 - t1
            convert += t3 - t2
        if self._h2d_stream is not None and current is not None:
            # Whatever the caller queues next on the current stream sees the new values.
            current.wait_stream(self._h2d_stream)
        self.last_step_timings = {
            "step_s": time.perf_counter() - t_start,
            "check_s": t_checked - t_start,
            "host_step_s": host_step,
            "host_wait_s": wait,
            "host_copy_back_s": convert,
            "host_numel": float(sum(e.param.numel() for e in self._entries if e.host)),
            "early_copies": float(early_candidates),
            "early_copies_reused": float(kept),
        }

    def _start_grad_copy(self, entry: _Entry, stream: torch.cuda.Stream | None) -> None:
        entry.widened = False
        entry.d2h_event = None
        grad = entry.param.grad
        if not entry.offloaded:
            # A host parameter: stepped in place, or through a host fp32 master.
            if entry.master:
                entry.inner.grad = None if grad is None else grad.to(entry.inner.dtype)
            return
        if grad is None:
            entry.inner.grad = None
            entry.early = None
            return
        if entry.early is not None:
            entry.d2h_event = entry.early.copy_event
            entry.widened = entry.early.widened
            entry.early = None
            return
        if entry.pending is not None:
            entry.pending.result()
            entry.pending = None
        buf = self._grad_buffer(entry, grad)
        if stream is not None:
            with torch.cuda.stream(stream):
                _copy_converted(buf, grad, non_blocking=True)
                entry.d2h_event = stream.record_event()
            grad.record_stream(stream)
        else:
            _copy_converted(buf, grad, non_blocking=False)

    def _host_grad_ready(self, entry: _Entry) -> None:
        if not entry.offloaded:
            return
        if entry.param.grad is None:
            entry.inner.grad = None
            return
        if entry.h2d_event is not None:
            # The previous copy back may still read the host buffers about to be written.
            entry.h2d_event.synchronize()
        buf = entry.grad_buf
        assert buf is not None
        if entry.pending is not None:
            entry.pending.result()
            entry.pending = None
        elif entry.d2h_event is not None:
            entry.d2h_event.synchronize()
        if entry.host_grad is not None:
            if not entry.widened:
                entry.host_grad.copy_(buf)
            entry.inner.grad = entry.host_grad
        elif buf.dtype == entry.inner.dtype:
            entry.inner.grad = buf
        else:
            entry.inner.grad = buf.to(entry.inner.dtype)

    def _copy_back(self, entry: _Entry, stream: torch.cuda.Stream | None) -> None:
        if entry.inner.grad is None:
            return  # not stepped: nothing changed
        if not entry.offloaded:
            if entry.master:
                entry.param.copy_(entry.inner)
                entry.note_param_written()
                entry.inner.grad = None
            return
        source = entry.inner
        if entry.stage is not None:
            entry.stage.copy_(entry.inner)  # narrow on the host: half the bytes cross PCIe
            source = entry.stage
        if stream is None:
            entry.param.copy_(source)
            entry.note_param_written()
            return
        with torch.cuda.stream(stream):
            if source.dtype != entry.param.dtype:
                # param_copy_dtype="master": fp32 crosses PCIe, narrowed on the device.
                wide = torch.empty(source.shape, dtype=source.dtype, device=entry.param.device)
                wide.copy_(source, non_blocking=True)
                entry.param.copy_(wide)
            else:
                entry.param.copy_(source, non_blocking=True)
            entry.h2d_event = stream.record_event()
        entry.note_param_written()

    def _step_device(self) -> None:
        sub = self._device_sub
        assert sub is not None
        for entry in sub.entries:
            if entry.master:
                grad = entry.param.grad
                entry.inner.grad = None if grad is None else grad.to(entry.inner.dtype)
        sub.optimizer.step()
        for entry in sub.entries:
            if entry.master and entry.inner.grad is not None:
                entry.param.copy_(entry.inner)
                entry.note_param_written()
                # The fp32 gradient is transient: freeing it keeps the device state at
                # master + moments (12 bytes per parameter for AdamW).
                entry.inner.grad = None


def _check_copy_dtype(name: str, value: Any) -> _CopyDtype:
    if value not in ("master", "param"):
        raise ValueError(f"{name} must be 'master' or 'param', got {value!r}")
    return value  # type: ignore[no-any-return]


def _check_optimizer_cls(
    name: str, cls: type[torch.optim.Optimizer] | None
) -> type[torch.optim.Optimizer]:
    if cls is None:
        return torch.optim.AdamW
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"{name} must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW) or "
            f"None, got {cls!r}"
        )
    return cls


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _materialize(params: ParamsT) -> list[Any]:
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or param-group dicts, got a single "
            f"{torch.typename(params)}"
        )
    items = list(params)
    count = 0
    for i, item in enumerate(items):
        if isinstance(item, Mapping):
            group_params = item.get("params", [])
            if not isinstance(group_params, torch.Tensor):
                # A generator (model.parameters()) can be read once: keep the list.
                group_params = list(group_params)
                items[i] = {**item, "params": group_params}
            count += 1 if isinstance(group_params, torch.Tensor) else len(group_params)
        else:
            count += 1
    if count == 0:
        raise ValueError(
            "params is empty: HybridDeviceOptimizer needs at least one parameter "
            "(pass model.parameters() or a list of param-group dicts)"
        )
    return items


def _group_of(optimizer: torch.optim.Optimizer, inner: torch.Tensor) -> dict[str, Any]:
    for group in optimizer.param_groups:
        if any(p is inner for p in group["params"]):
            return group
    raise RuntimeError("internal error: a parameter is missing from its sub-optimizer")


def _place_state_value(key: str, value: Any, inner: torch.Tensor, group: Mapping[str, Any]) -> Any:
    """Copy one loaded state value to the side and dtype its sub-optimizer expects.

    PyTorch's policy, applied to the tensor the sub-optimizer steps (the host copy or the
    fp32 master), so that fp32 moments of a bf16 model stay fp32: ``step`` is a float32
    tensor on the parameter's device for fused or capturable optimizers and a host tensor
    otherwise; floating state takes the parameter's dtype and device. Always copies, so
    that two optimizers never share state tensors.
    """
    if isinstance(value, Mapping):
        return {k: _place_state_value(k, v, inner, group) for k, v in value.items()}
    if key == "step":
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value), dtype=torch.float32)
        if on_device:
            return value.to(dtype=torch.float32, device=inner.device, copy=True)
        return value.to(device="cpu", copy=True)
    if isinstance(value, torch.Tensor):
        if inner.is_floating_point() and value.is_floating_point():
            return value.to(dtype=inner.dtype, device=inner.device, copy=True)
        return value.to(device=inner.device, copy=True)
    return deepcopy(value)
