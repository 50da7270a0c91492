"""HybridDeviceOptimizer: a GPU optimizer with part of its state and step on the host.

Megatron-LM's ``HybridDeviceOptimizer`` (HDO) keeps the optimizer state of a prefix of the
parameters in host memory and steps it with a host optimizer; this module implements the
same constructor, split and state-dict contract, with a faster data path:

* gradients and updated parameters cross PCIe in the dtype that keeps host memory
  traffic lowest (the host step is bound by host memory bandwidth): with a host fp32
  master they are widened and narrowed on the GPU by default, otherwise they travel in
  their own dtype (``grad_copy_dtype`` / ``param_copy_dtype`` choose);
* gradient copies start in backward, from a post-accumulate-grad hook, and are reused in
  ``step()`` only if the gradient is unchanged as far as its identity, version counter
  and an exact checksum of its bits tell (see ``_fingerprint``);
* host steps are pipelined in buckets with the copies back to the GPU, and the GPU part is
  stepped on the GPU while the host works.

The pieces: ``_entries`` (what steps each parameter), ``_copies`` (the host <-> device
copies of one entry), ``_fingerprint`` (checks of early gradient copies), ``_checkpoint``
(state dicts), ``_step`` (the data path of one step, base class ``HybridStepper``) and
``_build`` (the layout built from the split, base class ``HybridBuilder``), ``_stream``
(the share of the offloaded state stepped on the GPU, ``stream_share``); this module
holds the public class: its options, constructor and public methods.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from cpu_offload._args import check_bool
from cpu_offload._compat import is_current_stream_capturing

from .._args import has_duplicates
from ._args import (
    ParamsT,
    check_copy_dtype,
    check_optimizer_cls,
    materialize,
    pop_flag,
    pop_predicate,
    resolve_param_copy_dtype,
)
from ._build import HybridBuilder, remove_hooks
from ._checkpoint import (
    adopt_param_writes,
    pack_state_dict,
    run_load_hooks,
    run_state_dict_hooks,
)
from ._copies import check_dense_grads
from ._entries import CopyDtype, Entry, EntryFactory, Sub
from ._forward_overlap import ForwardOverlap
from ._split import check_offload_fraction, is_device_tensor, warn_if_nothing_can_be_offloaded
from ._stream import check_stream_share

__all__ = ["KEYWORD_OPTIONS", "HybridDeviceOptimizer"]

# Timings of the host buckets' work (``step_host_subs``), wherever it ran.
_HOST_TIMINGS = frozenset({"host_step_s", "host_wait_s", "host_copy_back_s"})

#: Options :class:`HybridDeviceOptimizer` takes through ``**defaults``: they configure
#: the optimizer and are not hyperparameters of a param group. ``__init__`` takes them
#: out of ``defaults`` by this set, so an option missing here would never be read.
KEYWORD_OPTIONS = frozenset(
    {
        "is_device_param",
        "early_grad_copy",
        "overlap_host_step_with_forward",
        "offload_last_layers",
        "grad_copy_dtype",
        "param_copy_dtype",
        "stream_share",
    }
)


class HybridDeviceOptimizer(HybridBuilder):
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

    Beyond Megatron's, seven keyword arguments are taken out of ``**defaults``:

    * ``early_grad_copy`` (bool or ``"auto"``, default ``"auto"``: True; with
      ``overlap_host_step_with_forward``, True only for parameters that the forward
      reads after one stepped on the device, see below): with
      ``overlap_cpu_optimizer_d2h_h2d``, start each offloaded gradient's copy to the
      host as soon as backward has accumulated it. ``step()`` reuses the copy only if ``param.grad`` is the same tensor
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
    * ``param_copy_dtype`` (``"auto"``, ``"master"`` or ``"param"``, default
      ``"auto"``): the same choice for the updated parameters travelling back:
      ``"master"`` sends fp32 and narrows on the device; ``"param"`` narrows on the host
      and sends the parameter's own dtype (half the PCIe bytes). Both give the same
      values. ``"auto"`` is ``"param"`` with ``stream_share`` (the host-to-device bytes
      bound that step) and ``"master"`` without.

    * ``is_device_param`` (callable or None): tells device parameters, which may be
      offloaded, from host ones, which are stepped in place by the host optimizer; by
      default any parameter not on the CPU is a device parameter.

    * ``overlap_host_step_with_forward`` (bool, default False): ``step()`` returns once
      the work is queued; the host steps the offloaded parameters on a worker thread in
      the order the first forward read them, copying each back as soon as its bucket is
      done. Every module's forward waits (pre-hook) for exactly the parameters it reads,
      and so do ``module.state_dict()``, this optimizer's ``state_dict()``,
      ``load_state_dict()`` and next ``step()``, and :meth:`synchronize`; so does any
      other read of a parameter's values through a torch function (a functional call,
      ``param.cpu()``, an EMA update; not a C++ extension op that bypasses torch
      functions): until its update lands, the parameter's class is a subclass of its own
      whose ``__torch_function__`` waits first (metadata such as ``.grad`` and
      ``.shape`` does not wait). A parameter of a subclass with its own
      ``__torch_function__`` keeps its class; a read of it outside its module's forward
      makes the backward that reaches it raise. Results are bit-identical to the
      option off.
    * ``offload_last_layers`` (bool, default False): offload the same fraction from the
      end of the parameter list (the layers a forward reads last) instead of Megatron's
      prefix, so that the next forward's first layers are GPU-owned.
    * ``stream_share`` (float in ``[0, 1]``, default 0.0): the share of the offloaded
      elements (the first in stepping order, contiguous CUDA parameters) that is stepped
      on the GPU instead of the host, its state streamed from host memory and back in
      chunks during the step (a few hundred MiB of transient device buffers); the state
      still lives in host memory between steps, and the host steps the rest at the same
      time. The host step is bound by host memory bandwidth, and streaming spends less
      of it per element (24 bytes, against 36 for a host step with its copies), so the
      two lanes together finish sooner than the host alone. The streamed parameters are
      stepped by ``cpu_optimizer_cls``'s fused CUDA kernel (``torch.optim.Adam`` or
      ``AdamW`` only; fp32 state, so ``param_update_in_fp32`` for lower-precision
      parameters): bit-identical to stepping them on the device with that fused kernel,
      not to the host kernel. Their gradients never leave the GPU; ``step()``
      semantics are unchanged (with ``overlap_host_step_with_forward``, the streamed
      state, like the host-stepped one, is whole after :meth:`synchronize`).

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
            ``param_copy_dtype``, ``is_device_param``, ``overlap_host_step_with_forward``,
            ``offload_last_layers`` and ``stream_share``.
            When neither ``fused`` nor ``foreach`` is given, PyTorch's Adam, AdamW and SGD
            use their fused kernels on each side where the running PyTorch has them.

    Raises:
        ValueError: If ``params`` is empty, ``offload_fraction`` or ``stream_share`` is
            outside ``[0, 1]``, ``grad_copy_dtype`` or ``param_copy_dtype`` is unknown,
            device parameters span several devices, or ``stream_share`` is positive with
            a ``cpu_optimizer_cls`` it cannot stream or no offloaded CUDA parameter.
        TypeError: If a class is not a ``torch.optim.Optimizer`` subclass, a flag is not
            a bool or ``stream_share`` is not a number.

    Example:
        >>> import torch
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> model = torch.nn.Linear(4, 4, device=device)
        >>> # Without a GPU, treat the CPU parameters as device ones (else nothing moves).
        >>> cpu_stand_in = {} if device == "cuda" else {"is_device_param": lambda p: True}
        >>> opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3,
        ...                             **cpu_stand_in)
        >>> model(torch.randn(2, 4, device=device)).sum().backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

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
        cpu_cls = check_optimizer_cls("cpu_optimizer_cls", cpu_optimizer_cls)
        gpu_cls = check_optimizer_cls("gpu_optimizer_cls", gpu_optimizer_cls)
        for name, value in (
            ("param_update_in_fp32", param_update_in_fp32),
            ("pin_cpu_grads", pin_cpu_grads),
            ("pin_cpu_params", pin_cpu_params),
            ("overlap_cpu_optimizer_d2h_h2d", overlap_cpu_optimizer_d2h_h2d),
        ):
            check_bool(name, value)
        defaults = dict(defaults)
        options = {name: defaults.pop(name) for name in KEYWORD_OPTIONS if name in defaults}
        is_device_param = pop_predicate(options, "is_device_param")
        early = options.pop("early_grad_copy", "auto")
        if early != "auto":
            check_bool("early_grad_copy", early)
        overlap_forward = pop_flag(options, "overlap_host_step_with_forward", False)
        # "auto" with overlap_host_step_with_forward is decided per parameter once the
        # first forward showed the read order (HybridStepper._copies_early).
        early_grad_copy = (not overlap_forward) if early == "auto" else bool(early)
        offload_last_layers = pop_flag(options, "offload_last_layers", False)
        stream_share = check_stream_share(options.pop("stream_share", 0.0), cpu_cls)
        grad_copy_dtype = check_copy_dtype(
            "grad_copy_dtype", options.pop("grad_copy_dtype", "master")
        )
        param_copy_dtype = resolve_param_copy_dtype(
            options.pop("param_copy_dtype", "auto"), stream_share
        )
        param_list = materialize(params)

        super().__init__(param_list, dict(defaults))
        self.offload_fraction = fraction
        self.cpu_optimizer_cls = cpu_cls
        self.gpu_optimizer_cls = gpu_cls
        self.param_update_in_fp32 = param_update_in_fp32
        self.pin_cpu_grads = pin_cpu_grads
        self.pin_cpu_params = pin_cpu_params
        self.overlap_cpu_optimizer_d2h_h2d = overlap_cpu_optimizer_d2h_h2d
        self.early_grad_copy = early_grad_copy
        self._early_auto = early == "auto"
        self.overlap_host_step_with_forward = overlap_forward
        self.offload_last_layers = offload_last_layers
        self.stream_share = stream_share
        self.grad_copy_dtype: CopyDtype = grad_copy_dtype
        #: ``"master"`` or ``"param"`` (``"auto"`` resolved).
        self.param_copy_dtype: CopyDtype = param_copy_dtype
        #: Which parameters count as device parameters, eligible for offloading.
        self.is_device_param: Callable[[torch.Tensor], bool] = (
            is_device_tensor if is_device_param is None else is_device_param
        )
        self.sub_optimizer_kwargs = dict(defaults)
        #: Timings and counters of the last ``step()`` (seconds and counts). With
        #: ``overlap_host_step_with_forward``, the host entries (``host_step_s``,
        #: ``host_wait_s``, ``host_copy_back_s``) add the host work of the ``step()``
        #: before, which finished under this step's forward (the last step's own is
        #: reported by the next ``step()``).
        self.last_step_timings: dict[str, float] = {}
        self._finished_host_timings: dict[str, float] = {}
        self._factory = EntryFactory(
            param_update_in_fp32,
            self.grad_copy_dtype,
            self.param_copy_dtype,
            pin_cpu_grads,
            pin_cpu_params,
        )
        self._executor: ThreadPoolExecutor | None = None
        self._hook_handles: list[Any] = []
        # A dropped optimizer takes its hooks off the parameters it leaves behind.
        weakref.finalize(self, remove_hooks, self._hook_handles)
        self._generation = 0
        self._entries: list[Entry] = []
        self._host_subs: list[Sub] = []
        self._device_sub: Sub | None = None
        self._cuda_device: torch.device | None = None
        self._d2h_stream: torch.cuda.Stream | None = None
        self._h2d_stream: torch.cuda.Stream | None = None
        self._overlap = ForwardOverlap(None) if overlap_forward else None
        self._lane = None
        self._cast_stream: torch.cuda.Stream | None = None
        warn_if_nothing_can_be_offloaded(
            [p for g in self.param_groups for p in g["params"]], fraction, self.is_device_param
        )
        self._build({})

    # ------------------------------------------------------------------ public API

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The host optimizers (in stepping order) followed by the device optimizer."""
        return [s.optimizer for s in self._all_subs()]

    @property
    def offload_mask(self) -> list[bool]:
        """Per parameter in param-group order: True when it is a device parameter whose
        state and step were moved to the host."""
        return [e.offloaded for e in self._entries]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group and recompute the split over all groups (state is kept).

        Args:
            param_group: ``{"params": [...], **hyperparameters}`` as for any optimizer.

        Raises:
            ValueError: If a parameter appears twice in the group (PyTorch's optimizers
                only warn and step it twice; offloaded, it would have two host copies),
                or in another group too.
        """
        super().add_param_group(param_group)
        if has_duplicates(self.param_groups[-1]["params"]):
            self.param_groups.pop()
            raise ValueError(
                "a param group lists a parameter twice; list each parameter once (an "
                "offloaded parameter has one host copy and is stepped once per step())"
            )
        if getattr(self, "_entries", None):
            # After construction: the split depends on all groups, so rebuild it; each
            # parameter's state moves to its (possibly new) side.
            self._build(self._state_by_param())

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update all parameters; on return they hold the new values.

        Device work that reads the parameters afterwards on the current stream sees the
        new values (the current stream waits for the copies back); work on other
        streams must wait for the current stream first. With
        ``overlap_host_step_with_forward``, offloaded parameters are updated after the
        return instead, and their readers wait (see the class docs).

        Args:
            closure: Re-evaluates the model and returns the loss; called once.

        Returns:
            The closure's loss, or None.
        """
        self._wait_for_host_step()  # the state view is rebuilt at the end
        if self._overlap is not None and is_current_stream_capturing():
            raise RuntimeError(
                "overlap_host_step_with_forward=True cannot be captured in a CUDA graph: "
                "its waits run in Python hooks that a graph replay skips"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_dense_grads(self._entries)
        self._sync_hyperparameters()
        adopt_param_writes(self._entries)
        if self._overlap is not None and self._overlap.learning:
            # The first forward showed the order the next ones read the parameters in:
            # step the host buckets in that order from now on.
            self._overlap.finish_learning()
            stepping = [e for sub in self._host_subs for e in sub.entries]
            if self._host_order(self._entries) != stepping:
                self._build(self._state_by_param())
        self._step_all()
        # The host work of the step before, which finished under this step's forward
        # (waited for here or by a synchronize() in between).
        for key, value in self._finished_host_timings.items():
            if key in _HOST_TIMINGS:
                self.last_step_timings[key] = self.last_step_timings.get(key, 0.0) + value
        self._finished_host_timings = {}
        self._refresh_state()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of all parameters (and of the fp32 device master copies).

        Args:
            set_to_none: Set ``.grad`` to None instead of zeroing it.
        """
        if not set_to_none and self._overlap is not None and self._d2h_stream is not None:
            # Zeroing in place must come after the gradients' copies to the host.
            torch.cuda.current_stream(self._cuda_device).wait_stream(self._d2h_stream)
        if not set_to_none and self._lane is not None:
            # ... and after the stream lane has read the streamed ones.
            torch.cuda.current_stream(self._cuda_device).wait_stream(self._lane.compute)
        super().zero_grad(set_to_none)
        for entry in self._entries:
            entry.early = None
            if entry.master and not entry.host:
                entry.inner.grad = None

    def synchronize(self) -> None:
        """Wait until every parameter holds its value from the last ``step()``.

        Only needed with ``overlap_host_step_with_forward=True``, for code that reads
        parameters outside their modules' forwards (see the class docs); a no-op
        otherwise. Work queued afterwards on the current stream, and host reads
        (``.cpu()``, ``.item()``), see the new values.

        Raises:
            RuntimeError: If the host step that ran after ``step()`` returned failed.

        Example:
            >>> model = torch.nn.Linear(4, 4)
            >>> opt = HybridDeviceOptimizer(model.parameters(), lr=1e-3, offload_fraction=0.0)
            >>> opt.synchronize()
        """
        if self._wait_for_host_step():
            # The host buckets stepped after step() returned may have created their
            # state only now: the view step() built does not have it.
            self._refresh_state()

    def _wait_for_host_step(self) -> bool:
        """Wait for the host step still running from the last ``step()``; True if one was."""
        if self._lane is not None:
            # The streamed state back in host memory (NOTE [Streaming host state ...]).
            self._lane.wait()
        if self._overlap is None or not self._overlap.busy:
            return False
        self._finished_host_timings = self._overlap.wait_all()
        return True

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
            self.synchronize()
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
            for parameters updated through one. Hooks registered with
            ``register_state_dict_pre_hook`` / ``_post_hook`` run as for PyTorch's.
        """

        def make() -> dict[str, Any]:
            self.synchronize()
            adopt_param_writes(self._entries)
            self._refresh_state()
            return pack_state_dict(self.param_groups, self.state)

        return run_state_dict_hooks(self, make)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this class or of a plain optimizer of the same class.

        Hyperparameters come from the state dict, as for PyTorch's optimizers; each
        parameter's state goes to its side of the (recomputed) split, so a checkpoint
        taken at one fraction loads at any other. Host copies and fp32 master copies are
        refreshed from the current parameters, then from ``master_param`` where the
        state dict has it (exact resume of a lower-precision model). Tensors are copied.

        Hooks registered with ``register_load_state_dict_pre_hook`` / ``_post_hook`` run
        as for PyTorch's. A load that fails leaves the optimizer as it was.

        Args:
            state_dict: From :meth:`state_dict` here or of a plain optimizer.

        Raises:
            TypeError: If ``state_dict`` is not a mapping.
            ValueError: If the groups or their sizes do not match this optimizer's.
        """
        run_load_hooks(self, state_dict, self._load)
