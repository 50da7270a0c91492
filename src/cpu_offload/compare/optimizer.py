"""The optimizer section of ``cpu-offload compare``: offload fractions side by side.

Every configuration trains the same model, from the same weights and on the same batch,
for the same number of steps with a :class:`~cpu_offload.optim.HybridDeviceOptimizer`
(through :func:`~cpu_offload.optim.measure_optimizer`). A first run without offloading is
the reference: each configuration's parameters (and fp32 master copies) after the last
step and its loss at every step are compared with it, so the row without offloading
shows the run-to-run noise floor.

On a GPU, step times and memory are measured. Without one, the optimizer runs on the CPU
as a stand-in that treats CPU parameters as device parameters, so that the split, the
host/device state accounting and the numerics are those of a GPU run; the device memory
reported is then what would stay on the GPU by accounting, and step times are CPU times,
not representative of a GPU.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..megatron import OptimizerOffloadConfig, optimizer_class
from ..models import ModelSpec, build_layers
from ..optim import HybridDeviceOptimizer, OptimizerMeasurement, measure_optimizer
from ..optim._split import check_offload_fraction
from ._random import SameRandomState
from ._rows import row_by_name

__all__ = [
    "DEFAULT_FRACTIONS",
    "OptimizerCompareConfig",
    "OptimizerReport",
    "OptimizerResult",
    "OptimizerVariant",
    "default_optimizer_variants",
    "run_optimizer_compare",
]

#: Offload fractions the comparison runs by default (each with overlap on and off).
DEFAULT_FRACTIONS: tuple[float, ...] = (0.25, 0.5, 1.0)


@dataclass(frozen=True)
class OptimizerVariant:
    """One optimizer-offloading configuration.

    Attributes:
        offload_fraction: ``optimizer_offload_fraction``, in ``[0.0, 1.0]``; 0.0 is the
            run without offloading.
        overlap: ``overlap_cpu_optimizer_d2h_h2d`` (no effect at fraction 0).
        under_forward: ``overlap_host_step_with_forward``: the host step finishes under
            the next forward (no effect at fraction 0).
        last_layers: ``offload_last_layers``: the fraction is taken from the end of the
            parameter list (no effect at fraction 0).
        stream_share: ``stream_share``: this share of the offloaded state is stepped on
            the GPU, streamed from host memory (no effect at fraction 0).

    Raises:
        TypeError, ValueError: If ``offload_fraction`` or ``stream_share`` is not a
            number in ``[0, 1]`` or a flag is not a bool.
    """

    offload_fraction: float
    overlap: bool = True
    under_forward: bool = False
    last_layers: bool = False
    stream_share: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload_fraction", check_offload_fraction(self.offload_fraction))
        for name in ("overlap", "under_forward", "last_layers"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        share = check_offload_fraction(self.stream_share, "stream_share")
        object.__setattr__(self, "stream_share", share)

    @property
    def name(self) -> str:
        """The row label: ``"0 (no offload)"`` or e.g. ``"0.25, overlap on"``, with
        ``", host step under forward"``, ``", last layers"`` and e.g. ``", 0.5 streamed"``
        where they are on."""
        if self.offload_fraction == 0.0:
            return "0 (no offload)"
        label = f"{self.offload_fraction:g}, overlap {'on' if self.overlap else 'off'}"
        if self.under_forward:
            label += ", host step under forward"
        if self.last_layers:
            label += ", last layers"
        if self.stream_share > 0.0:
            label += f", {self.stream_share:g} streamed"
        return label


def default_optimizer_variants() -> tuple[OptimizerVariant, ...]:
    """No offloading, then each of :data:`DEFAULT_FRACTIONS` with overlap on and off.

    Returns:
        Seven variants, the one without offloading first.
    """
    return (OptimizerVariant(0.0),) + tuple(
        OptimizerVariant(fraction, overlap)
        for fraction in DEFAULT_FRACTIONS
        for overlap in (True, False)
    )


@dataclass(frozen=True)
class OptimizerCompareConfig:
    """What the optimizer section runs.

    Attributes:
        variants: The configurations; the one without offloading is added first when
            missing (every ratio is against it).
        optimizer: Megatron's optimizer name: ``"adam"`` (AdamW) or ``"sgd"`` (SGD with
            momentum 0.9), on both sides.
        param_update_in_fp32: fp32 master copies of lower-precision parameters.
        pin_cpu_grads: Page-lock the host gradient buffers.
        pin_cpu_params: Page-lock the host parameter buffers.
        lr: Learning rate (1e-4, as in the optimizer benchmark: an untrained model trained
            on the comparison's loss is unstable at 1e-3, and in an unstable run any
            rounding difference grows until the runs cannot be compared).
        weight_decay: Weight decay.

    Raises:
        ValueError: If ``variants`` is empty or ``optimizer`` is unknown.
    """

    variants: tuple[OptimizerVariant, ...] = field(default_factory=default_optimizer_variants)
    optimizer: str = "adam"
    param_update_in_fp32: bool = True
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    lr: float = 1e-4
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if not self.variants:
            raise ValueError("variants must name at least one OptimizerVariant")
        self.optimizer_cls()  # raises for an unknown optimizer name

    @classmethod
    def from_megatron(
        cls, config: OptimizerOffloadConfig, given: Collection[str] = ()
    ) -> OptimizerCompareConfig:
        """The configurations that Megatron Bridge overrides select.

        Fields the overrides did not set keep every value of the default set; a field
        they set narrows it to that value: ``optimizer_offload_fraction=0.5`` runs 0.5
        with overlap on and off, adding ``overlap_cpu_optimizer_d2h_h2d=true`` runs only
        0.5 with overlap on; a fraction of 0 runs no offloaded configuration. The run
        without offloading is always first. ``overlap_host_step_with_forward``,
        ``offload_last_layers`` and ``stream_share`` (ours, not Megatron's) apply to every
        offloaded configuration when set. ``optimizer``, ``pin_cpu_grads`` and
        ``pin_cpu_params`` are taken as they are; ``optimizer_cpu_offload`` is the
        caller's to honour (this section compares offloaded configurations).

        Args:
            config: The optimizer config after the overrides.
            given: Names of the fields the overrides set (``"optimizer_offload_fraction"``).

        Returns:
            The configuration of the optimizer section.
        """
        if "optimizer_offload_fraction" in given:
            fractions: tuple[float, ...] = (config.optimizer_offload_fraction,)
        else:
            fractions = DEFAULT_FRACTIONS
        if "overlap_cpu_optimizer_d2h_h2d" in given:
            overlaps: tuple[bool, ...] = (config.overlap_cpu_optimizer_d2h_h2d,)
        else:
            overlaps = (True, False)
        variants = [OptimizerVariant(0.0, overlaps[0])]
        variants += [
            OptimizerVariant(
                f,
                o,
                under_forward=config.overlap_host_step_with_forward,
                last_layers=config.offload_last_layers,
                stream_share=config.stream_share,
            )
            for f in fractions
            if f > 0.0
            for o in overlaps
        ]
        return cls(
            variants=tuple(variants),
            optimizer=config.optimizer,
            pin_cpu_grads=config.pin_cpu_grads,
            pin_cpu_params=config.pin_cpu_params,
        )

    def optimizer_cls(self) -> type[torch.optim.Optimizer]:
        """The ``torch.optim`` class of both sides.

        Raises:
            ValueError: If ``optimizer`` is not ``"adam"`` or ``"sgd"``.
        """
        return optimizer_class(OptimizerOffloadConfig(optimizer=self.optimizer))

    def hyperparameters(self) -> dict[str, Any]:
        """The keyword arguments both sub-optimizers get."""
        hyper: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.optimizer == "sgd":
            hyper["momentum"] = 0.9
        return hyper

    def runs(self) -> tuple[OptimizerVariant, ...]:
        """The variants in running order: without offloading first, no duplicates."""
        baseline = [v for v in self.variants if v.offload_fraction == 0.0][:1]
        others = [v for v in self.variants if v.offload_fraction > 0.0]
        return tuple(dict.fromkeys([*(baseline or [OptimizerVariant(0.0)]), *others]))


@dataclass
class OptimizerResult:
    """One configuration's figures.

    Attributes:
        name: Row label.
        offload_fraction: The configured fraction.
        overlap: ``overlap_cpu_optimizer_d2h_h2d``.
        step_ms: Median whole training step (forward, backward, ``step()``, ``zero_grad``).
        step_ratio: ``step_ms`` over the row without offloading.
        forward_backward_ms: Median forward and backward.
        host_step_ms: Median time in the host sub-optimizers' ``step()``.
        host_numel: Parameter elements stepped on the host.
        param_bytes: Bytes of the model's parameters (on the device in every row).
        device_state_bytes: Optimizer state on the device side (fp32 masters, moments).
        host_state_bytes: Optimizer state on the host side.
        device_bytes: ``param_bytes + device_state_bytes``.
        device_ratio: ``device_bytes`` over the row without offloading.
        peak_allocated_bytes: Peak device memory over the timed steps (0 on the CPU).
        max_param_diff: Largest absolute difference of any parameter element from the
            reference run after the same steps.
        max_master_diff: The same for the fp32 master copies (None without them).
        max_loss_diff: Largest absolute difference of the loss at any step.
        early_copies_reused: Gradient copies started in backward and reused, per step.
    """

    name: str
    offload_fraction: float
    overlap: bool
    step_ms: float
    step_ratio: float
    forward_backward_ms: float
    host_step_ms: float
    host_numel: int
    param_bytes: int
    device_state_bytes: int
    host_state_bytes: int
    device_bytes: int
    device_ratio: float
    peak_allocated_bytes: int
    max_param_diff: float
    max_master_diff: float | None
    max_loss_diff: float
    early_copies_reused: float

    def within_tolerance(self, atol: float = 1e-3) -> bool:
        """Whether the loss and the parameters agree with no offloading within ``atol``.

        The default is Megatron's tolerance (its tests' ``atol`` on parameters, Megatron
        Bridge's criterion on the loss). Parameters are compared through their fp32
        master copies where there are any: lower-precision parameters can round one unit
        apart from masters that differ in their last bits.

        Args:
            atol: The largest absolute difference accepted.

        Returns:
            True when both differences are at most ``atol``.
        """
        params = self.max_param_diff if self.max_master_diff is None else self.max_master_diff
        return self.max_loss_diff <= atol and params <= atol


@dataclass
class OptimizerReport:
    """The optimizer section of a comparison.

    Attributes:
        optimizer: Class name of both sides (``"AdamW"``).
        hyperparameters: Their keyword arguments.
        param_update_in_fp32: fp32 master copies of lower-precision parameters.
        steps: Timed steps per configuration.
        warmup: Untimed steps before them (the parameters are compared after both).
        stand_in: True when the run used the CPU stand-in (no GPU).
        device: The device's name.
        results: One per configuration, the one without offloading first.
        notes: How to read the figures.
    """

    optimizer: str
    hyperparameters: dict[str, Any]
    param_update_in_fp32: bool
    steps: int
    warmup: int
    stand_in: bool
    device: str
    results: list[OptimizerResult]
    notes: list[str] = field(default_factory=list)

    def result(self, name: str) -> OptimizerResult:
        """The result of the row called ``name``.

        Raises:
            KeyError: If there is no such row.
        """
        return row_by_name(self.results, name)


def _every_param(param: torch.Tensor) -> bool:
    """The CPU stand-in's device predicate: CPU parameters count as device parameters,
    so that a CPU run offloads them (everything else is the code that runs on a GPU,
    with synchronous copies between CPU tensors)."""
    return True


class _Snapshot:
    """The parameters, fp32 master copies and losses of one run, on the host."""

    def __init__(self, model: nn.Module, optimizer: HybridDeviceOptimizer) -> None:
        params = list(model.parameters())
        self.params = [p.detach().float().cpu() for p in params]
        self.masters: list[torch.Tensor | None] = []
        for p in params:
            master = optimizer.state.get(p, {}).get("master_param")
            self.masters.append(None if master is None else master.detach().float().cpu())

    def param_diff(self, other: _Snapshot) -> float:
        """Largest absolute difference of any parameter element."""
        return _max_abs_diff(self.params, other.params)

    def master_diff(self, other: _Snapshot) -> float | None:
        """Largest absolute difference of any fp32 master element (None without masters)."""
        pairs = [(a, b) for a, b in zip(self.masters, other.masters, strict=True) if a is not None]
        if not pairs or any(b is None for _, b in pairs):
            return None
        return _max_abs_diff([a for a, _ in pairs], [b for _, b in pairs])  # type: ignore[misc]


def _max_abs_diff(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> float:
    return max(
        ((x - y).abs().max().item() for x, y in zip(xs, ys, strict=True) if x.numel()),
        default=0.0,
    )


class _Trainer:
    """Trains fresh copies of one model with one optimizer configuration after another."""

    def __init__(
        self, spec: ModelSpec, config: OptimizerCompareConfig, device: torch.device
    ) -> None:
        self.config = config
        self.device = device
        self.pristine = build_layers(spec, "cpu")  # copied to the device for every run
        self.batch = spec.make_input(device)
        self.stand_in_kwargs: dict[str, Any] = (
            {} if device.type == "cuda" else {"is_device_param": _every_param}
        )
        # Every configuration trains from this state: step i draws the same numbers in each.
        self.random_state = SameRandomState(device.type == "cuda")

    def _loss(self, model: nn.Module) -> torch.Tensor:
        return model(self.batch).float().square().mean()

    def run(
        self, variant: OptimizerVariant, steps: int, warmup: int
    ) -> tuple[OptimizerMeasurement, _Snapshot, int]:
        """Train a fresh copy; return its measurement, its final snapshot and its
        parameter bytes."""
        # The previous run's model and optimizer are gone: return their memory first, so
        # that every run's peak starts from the same point.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        model = nn.Sequential(*copy.deepcopy(self.pristine)).to(self.device)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        snapshots: list[_Snapshot] = []
        cls = self.config.optimizer_cls()
        with self.random_state.replay():
            measurement = measure_optimizer(
                model,
                self._loss,
                offload_fraction=variant.offload_fraction,
                overlap_cpu_optimizer_d2h_h2d=variant.overlap,
                overlap_host_step_with_forward=variant.under_forward,
                offload_last_layers=variant.last_layers,
                stream_share=variant.stream_share,
                param_update_in_fp32=self.config.param_update_in_fp32,
                steps=steps,
                warmup=warmup,
                cpu_optimizer_cls=cls,
                gpu_optimizer_cls=cls,
                hybrid_cls=HybridDeviceOptimizer,
                **self.stand_in_kwargs,
                on_finish=lambda opt: snapshots.append(_Snapshot(model, opt)),
                pin_cpu_grads=self.config.pin_cpu_grads,
                pin_cpu_params=self.config.pin_cpu_params,
                **self.config.hyperparameters(),
            )
        return measurement, snapshots[0], param_bytes


def run_optimizer_compare(
    spec: ModelSpec,
    config: OptimizerCompareConfig,
    *,
    device: str = "cuda",
    steps: int = 5,
    warmup: int = 2,
    progress: Callable[[str], None] = lambda msg: None,
) -> OptimizerReport:
    """Run every configuration of ``config`` on the model of ``spec``.

    Args:
        spec: The model (the same one the activation variants run).
        config: The configurations and the optimizer.
        device: ``"cuda"`` (measured) or ``"cpu"`` (the stand-in).
        steps: Timed steps per configuration (>= 1).
        warmup: Untimed steps before them (>= 0).
        progress: Called with a line of text as each run starts.

    Returns:
        The report, its rows in :meth:`OptimizerCompareConfig.runs` order.

    Raises:
        ValueError: If ``device`` is neither ``"cuda"`` nor ``"cpu"``, or from
            :func:`~cpu_offload.optim.measure_optimizer` (``steps``, ``warmup``).
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    dev = torch.device(device)
    trainer = _Trainer(spec, config, dev)
    runs = config.runs()
    total = warmup + steps
    progress(f"optimizer: reference run without offloading ({total} steps)")
    ref, ref_snapshot, _ = trainer.run(OptimizerVariant(0.0), steps, warmup)
    results: list[OptimizerResult] = []
    for idx, variant in enumerate(runs, 1):
        progress(f"optimizer [{idx}/{len(runs)}] {variant.name}: {warmup} warm-up + {steps} steps")
        m, snapshot, param_bytes = trainer.run(variant, steps, warmup)
        base = results[0] if results else None
        device_bytes = param_bytes + m.state_bytes_device_side
        results.append(
            OptimizerResult(
                name=variant.name,
                offload_fraction=variant.offload_fraction,
                overlap=variant.overlap,
                step_ms=m.step_ms,
                step_ratio=m.step_ms / base.step_ms if base else 1.0,
                forward_backward_ms=m.forward_backward_ms,
                host_step_ms=m.host_step_ms,
                host_numel=m.host_numel,
                param_bytes=param_bytes,
                device_state_bytes=m.state_bytes_device_side,
                host_state_bytes=m.state_bytes_host_side,
                device_bytes=device_bytes,
                device_ratio=device_bytes / base.device_bytes if base else 1.0,
                peak_allocated_bytes=m.peak_allocated_bytes,
                max_param_diff=snapshot.param_diff(ref_snapshot),
                max_master_diff=snapshot.master_diff(ref_snapshot),
                max_loss_diff=max(abs(a - b) for a, b in zip(m.losses, ref.losses, strict=True)),
                early_copies_reused=m.early_copies_reused,
            )
        )
    stand_in = dev.type != "cuda"
    cls = config.optimizer_cls()
    return OptimizerReport(
        optimizer=cls.__name__,
        hyperparameters=config.hyperparameters(),
        param_update_in_fp32=config.param_update_in_fp32,
        steps=steps,
        warmup=warmup,
        stand_in=stand_in,
        device=ref.device if not stand_in else "cpu (CPU stand-in)",
        results=results,
        notes=_notes(spec, stand_in, any(r.max_master_diff is not None for r in results)),
    )


def _notes(spec: ModelSpec, stand_in: bool, masters: bool) -> list[str]:
    notes = [
        "Optimizer rows: each trains the same model from the same weights and random state; "
        "differences are "
        "against a first run without offloading after the same steps (the '0 (no offload)' "
        "row is a second such run: the noise floor). GPU memory is the parameters plus the "
        "optimizer state kept on the device (fp32 masters, moments); gradients and "
        "activations come on top."
    ]
    if masters:
        width = torch.finfo(spec.dtype).eps
        notes.append(
            f"The parameters are {str(spec.dtype).replace('torch.', '')}: fp32 masters that "
            "differ in their last bits can round to parameters one unit apart (up to "
            f"{width:g} of the value); max|dmaster| compares the fp32 masters themselves."
        )
    if stand_in:
        notes.append(
            "No GPU: the optimizer ran on the CPU as a STAND-IN that treats CPU parameters as "
            "device parameters. The split, the state accounting and the differences are "
            "real; 'GPU MiB' is what would stay on the GPU, by accounting; step times are "
            "CPU times and NOT representative of a GPU, so no ratio to no offloading is "
            "shown for them."
        )
    return notes
