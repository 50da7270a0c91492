"""Running the variants side by side and measuring them.

On a GPU every figure is measured: numerics against no offloading, the peak of
``torch.cuda.max_memory_allocated`` over the step, median step time, the bandwidth of
each copy from CUDA events, the time the compute stream stalled waiting on copies, and
a timeline of one step. Without a GPU the layers run on the CPU through the stand-in
transport: numerics are real, while times and memory come from the timeline model of
:mod:`cpu_offload.compare.simulate`, fed with FLOP counts and assumed device figures.
"""

from __future__ import annotations

import functools
import gc
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .._compat import TORCH_VERSION_STRING
from .._link import measure_link
from ..engine.transport import CudaTransport, HostTransport, Transport
from ..models import ModelSpec
from ..v2.context import DEFAULT_MIN_TENSOR_SIZE
from ._profile import capture_inputs, forward_cost, saved_per_layer
from ._random import SameRandomState
from ._rows import row_by_name
from ._step import Installed, Step, one_step
from .optimizer import OptimizerCompareConfig, OptimizerReport, run_optimizer_compare
from .simulate import LayerProfile, SimResult, Span, simulate
from .variants import Variant, make_variant
from .workload import Workload, spec_workload

if TYPE_CHECKING:
    from ..plan.search import Plan

__all__ = ["CompareConfig", "CompareReport", "VariantResult", "run_compare"]

_GB = 1e9


@dataclass
class CompareConfig:
    """What ``cpu-offload compare`` runs.

    ``activation`` runs the activation variants (``variants``, no offloading always
    first) on ``num_offloaded`` of the model's layers; ``optimizer``, when given, runs the
    optimizer-offloading configurations on the same model, for the same ``steps`` and
    ``warmup``. At least one of the two must be on. The model is ``workload`` when given
    (a model of the user's), else the built-in layers of ``spec``; the optimizer section
    needs ``spec``. ``steps=None`` picks the number of measured steps from the length of
    a step: at least 10 and about one second of steps per variant, at most 50 (on the
    CPU stand-in, 2: its times are simulated).
    """

    spec: ModelSpec | None
    num_offloaded: int
    variants: Sequence[str]
    steps: int | None = 5
    warmup: int = 2
    min_numel: int = DEFAULT_MIN_TENSOR_SIZE
    device: str = "cuda"
    deterministic: bool = True
    sim_tflops: float = 400.0  # assumed device throughput for the simulated mode
    sim_link_gbps: float = 50.0  # assumed link bandwidth for the simulated mode
    sim_launch_us: float = 6.0  # assumed time of one kernel launch for the simulated mode
    timeline_variants: Sequence[str] = ("v2", "v1-async")
    activation: bool = True
    optimizer: OptimizerCompareConfig | None = None
    workload: Workload | None = None
    #: A per-layer plan (:class:`cpu_offload.plan.Plan`) to run as the ``plan`` row.
    plan: Plan | None = None


@dataclass
class VariantResult:
    """Everything measured for one variant.

    ``step_ms`` is the median step time, ``step_spread_ms`` the spread of the measured
    steps (largest minus smallest; 0 when simulated). ``copy_streams``, ``schedule``,
    ``offloaded_layers`` and ``recomputed_layers`` are the variant's facts (see
    :class:`~cpu_offload.compare.variants.Variant`).
    """

    name: str
    max_loss_diff: float
    max_grad_diff: float
    peak_bytes: int
    step_ms: float
    step_times_ms: list[float] = field(default_factory=list)
    step_spread_ms: float = 0.0
    offload_gbps: float | None = None
    reload_gbps: float | None = None
    stall_ms: float | None = None
    bytes_offloaded_per_step: int = 0
    copy_streams: bool = False
    schedule: str = ""
    offloaded_layers: tuple[int, ...] = ()
    recomputed_layers: tuple[int, ...] = ()
    spans: list[Span] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class CompareReport:
    """The comparison: one result per variant plus the context to read them.

    Without the activation variants (``CompareConfig.activation=False``) ``results`` is
    empty and the noise floors are None; ``optimizer`` holds the optimizer section when
    it ran. ``same_random_state`` is True when every step of every variant (and of both
    reference runs) started from the same CPU and CUDA generator state.
    """

    config: dict[str, object]
    device: str
    torch_version: str
    simulated: bool
    noise_floor_loss: float | None
    noise_floor_grad: float | None
    link_d2h_gbps: float | None
    link_h2d_gbps: float | None
    link_duplex_gbps: float | None
    results: list[VariantResult]
    floor_ms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    optimizer: OptimizerReport | None = None
    package_version: str = ""
    same_random_state: bool = False

    def result(self, name: str) -> VariantResult:
        """The result of the activation variant called ``name``.

        Raises:
            KeyError: If there is no such variant.
        """
        return row_by_name(self.results, name)


# -- the comparison --------------------------------------------------------------------


def _diffs(step: Step, ref: Step) -> tuple[float, float]:
    """Largest absolute difference of the loss and of any gradient element."""
    grad = max(
        (
            (x.float() - y.float()).abs().max().item()
            for x, y in zip(step.grads, ref.grads, strict=True)
        ),
        default=0.0,
    )
    return abs(step.loss - ref.loss).item(), grad


def _version() -> str:
    from .. import __version__

    return __version__


def run_compare(
    config: CompareConfig, progress: Callable[[str], None] = lambda msg: None
) -> CompareReport:
    """Run every variant of ``config`` on the same model and batch.

    Args:
        config: What to run.
        progress: Called with a line of text as each phase starts.

    Returns:
        The report, with real measurements on CUDA and simulated times and memory on
        the CPU (``report.simulated``); its ``optimizer`` section when
        ``config.optimizer`` is given (measured on CUDA, a CPU stand-in otherwise).

    Raises:
        ValueError: If ``config.activation`` is off and ``config.optimizer`` is None,
            neither ``spec`` nor ``workload`` is given, the optimizer section is
            asked for without ``spec``, or ``config.plan`` was made for another number
            of layers.
    """
    if not config.activation and config.optimizer is None:
        raise ValueError(
            "nothing to compare: activation=False and optimizer=None; turn on at least one"
        )
    if config.spec is None and config.workload is None:
        raise ValueError("CompareConfig needs a spec (built-in layers) or a workload")
    if config.optimizer is not None and config.spec is None:
        raise ValueError(
            "the optimizer section runs on the built-in layer kinds only (spec); pass "
            "optimizer=None with a workload of your own"
        )
    if config.activation:
        report = _run_activation(config, progress)
    else:
        report = CompareReport(
            config=_config_dict(config, None),
            device=_device_name(config.device == "cuda"),
            torch_version=TORCH_VERSION_STRING,
            simulated=False,
            noise_floor_loss=None,
            noise_floor_grad=None,
            link_d2h_gbps=None,
            link_h2d_gbps=None,
            link_duplex_gbps=None,
            results=[],
        )
    report.package_version = _version()
    if config.optimizer is not None:
        assert config.spec is not None
        report.optimizer = run_optimizer_compare(
            config.spec,
            config.optimizer,
            device=config.device,
            steps=config.steps or 5,
            warmup=config.warmup,
            progress=progress,
        )
    return report


def _device_name(cuda: bool) -> str:
    return torch.cuda.get_device_name() if cuda else "cpu (CPU stand-in)"


def _config_dict(config: CompareConfig, workload: Workload | None) -> dict[str, object]:
    spec = config.spec
    facts: dict[str, object] = {}
    if workload is not None:
        facts = {"model": workload.description, "layers": len(workload.layers)}
        facts.update(workload.facts)
        params = [p for p in workload.model.parameters()]
        facts["dtype"] = str(params[0].dtype).replace("torch.", "")
        facts["parameters"] = sum(p.numel() for p in params)
    elif spec is not None:
        facts = {
            "model": spec.kind,
            "hidden": spec.hidden,
            "heads": spec.heads,
            "seq": spec.seq,
            "batch": spec.batch,
            "layers": spec.layers,
            "dtype": str(spec.dtype).replace("torch.", ""),
        }
    return {
        **{k: None for k in ("model", "hidden", "heads", "seq", "batch", "layers", "dtype")},
        **facts,
        "offloaded": config.num_offloaded,
        "steps": config.steps,
        "warmup": config.warmup,
        "min_tensor_size_to_offload": config.min_numel,
        "deterministic": config.deterministic,
        "activation": config.activation,
        "optimizer": config.optimizer is not None,
        "plan": None if config.plan is None else config.plan.describe(),
    }


def _auto_steps(step_ms: float) -> int:
    """About one second of steps, at least 10 and at most 50."""
    return max(10, min(50, math.ceil(1000.0 / max(step_ms, 1e-3))))


def _run_activation(config: CompareConfig, progress: Callable[[str], None]) -> CompareReport:
    """The activation variants: everything but the optimizer section."""
    cuda = config.device == "cuda"
    if config.workload is not None:
        workload = config.workload
    else:
        assert config.spec is not None
        workload = spec_workload(config.spec, config.device)
    n, k = len(workload.layers), config.num_offloaded
    if not 0 <= k < n:
        raise ValueError(f"num_offloaded must be in [0, {n - 1}] for {n} layers, got {k}")
    if config.plan is not None:
        from ..plan.apply import check_plan_layers

        check_plan_layers(config.plan, n)

    def transport_factory() -> Transport:
        return CudaTransport() if cuda else HostTransport()

    link: tuple[float, float, float] | tuple[None, None, None] = (None, None, None)
    if cuda:
        progress("measuring the pinned copy bandwidth")
        link = measure_link()

    # Every step of every variant starts from this state: dropout draws the same masks.
    random_state = SameRandomState(cuda)
    progress("reference run without offloading (twice: the noise floor)")
    baseline = Installed(make_variant("none", n, k, config.min_numel), workload, random_state)
    try:
        ref = one_step(baseline, record=False, keep_grads=True)
        again = one_step(baseline, record=False, keep_grads=True)
        calls = capture_inputs(workload)
    finally:
        baseline.remove()
    noise_loss, noise_grad = _diffs(again, ref)
    steps_per_variant = config.steps
    if steps_per_variant is None:
        steps_per_variant = _auto_steps(again.ms) if cuda else 2
    del again

    results: list[VariantResult] = []
    makers = _variant_makers(config)
    for idx, (name, make) in enumerate(makers, 1):
        progress(
            f"[{idx}/{len(makers)}] {name}: {config.warmup} warm-up + {steps_per_variant} steps"
        )
        variant = make(n, k, config.min_numel, transport_factory)
        installed = Installed(variant, workload, random_state)
        try:
            result = _measure(installed, ref, config.warmup, steps_per_variant, cuda)
        finally:
            installed.remove()
        results.append(result)
        # The next variant starts from the same memory: drop this one's buffers (its
        # hooks and handlers hold reference cycles) before measuring the next peak.
        del variant, installed
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    config_dict = _config_dict(config, workload)
    config_dict["steps"] = steps_per_variant
    report = CompareReport(
        config=config_dict,
        device=_device_name(cuda),
        torch_version=TORCH_VERSION_STRING,
        simulated=not cuda,
        noise_floor_loss=noise_loss,
        noise_floor_grad=noise_grad,
        link_d2h_gbps=link[0],
        link_h2d_gbps=link[1],
        link_duplex_gbps=link[2],
        results=results,
        same_random_state=True,
    )
    progress("profiling layers for the transfer-bound floor")
    profiles = _profiles(workload, calls, config, report)
    # The floor is V2's default schedule: shown only beside a V2 row it bounds.
    v2_ran = any(r.schedule == "v2" for r in results)
    if not cuda:
        _simulate_into(report, profiles, config, floor=v2_ran)
    else:
        assert link[0] is not None
        for duplex in (False, True) if v2_ran else ():
            sim = simulate(profiles, "v2", k, link[0], link[1], duplex=duplex)
            report.floor_ms["v2-duplex" if duplex else "v2"] = sim.step_ms
        _spread_note(report)
    return report


def _variant_makers(config: CompareConfig) -> list[tuple[str, Callable[..., Variant]]]:
    """(name, factory) of each variant to run: no offloading first, the plan's row last."""
    names = list(dict.fromkeys(["none", *config.variants]))
    makers: list[tuple[str, Callable[..., Variant]]] = [
        (name, functools.partial(make_variant, name)) for name in names
    ]
    if config.plan is not None:
        from ..plan.compare import PlanVariant, plan_variant

        makers.append((PlanVariant.name, plan_variant(config.plan)))
    return makers


def _measure(installed: Installed, ref: Step, warmup: int, count: int, cuda: bool) -> VariantResult:
    """Warm-up, ``count`` measured steps and a few recorded ones of one variant."""
    variant = installed.variant
    for _ in range(warmup):
        one_step(installed, record=False)
    before = sum(t.bytes_offloaded for t in variant.transports)
    steps = [one_step(installed, record=False, keep_grads=i == 0) for i in range(count)]
    moved = sum(t.bytes_offloaded for t in variant.transports) - before
    # Copy bandwidth and stalls from a few recorded steps (medians): one step's copies
    # are too few to measure a link shared with other work.
    recorded = [one_step(installed, record=True) for _ in range(3 if cuda else 1)]
    loss_diff, grad_diff = _diffs(steps[0], ref)
    times = [s.ms for s in steps]
    result = VariantResult(
        name=variant.name,
        max_loss_diff=loss_diff,
        max_grad_diff=grad_diff,
        peak_bytes=max(s.peak for s in steps),
        step_ms=statistics.median(times),
        step_times_ms=times,
        step_spread_ms=max(times) - min(times),
        bytes_offloaded_per_step=moved // max(count, 1),
        copy_streams=variant.copy_streams,
        schedule=variant.schedule,
        offloaded_layers=variant.offloaded_layers,
        recomputed_layers=variant.recomputed_layers,
        spans=recorded[-1].spans,
        memory=recorded[-1].memory,
    )
    if cuda and variant.transports:
        _copy_figures(result, [r.spans for r in recorded])
    return result


def _spread_note(report: CompareReport) -> None:
    """Warn when a step-time difference shown is within the run-to-run spread."""
    none = report.result("none")
    close = [
        r.name
        for r in report.results
        if r is not none
        and abs(r.step_ms - none.step_ms) < max(r.step_spread_ms, none.step_spread_ms)
    ]
    if close:
        report.notes.append(
            "WARNING: the step-time differences of "
            + ", ".join(close)
            + " from no offloading are smaller than the spread of the steps (max - min): "
            "they are not measured apart; run more --steps, on an idle GPU."
        )


def _copy_figures(result: VariantResult, steps: list[list[Span]]) -> None:
    """Median over ``steps`` of the offload and reload bandwidth and of the stall time."""

    def bandwidth(spans: list[Span], lane: str) -> float | None:
        copies = [s for s in spans if s.lane == lane]
        busy = sum(s.end_ms - s.start_ms for s in copies)
        nbytes = sum(s.nbytes for s in copies)
        return nbytes / busy / 1e6 if busy > 0 else None

    for lane, attr in (("offload", "offload_gbps"), ("reload", "reload_gbps")):
        values = [v for v in (bandwidth(spans, lane) for spans in steps) if v is not None]
        if values:
            setattr(result, attr, statistics.median(values))
    result.stall_ms = statistics.median(
        sum(s.end_ms - s.start_ms for s in spans if s.lane == "stall") for spans in steps
    )


def _profiles(
    workload: Workload, calls: list, config: CompareConfig, report: CompareReport
) -> list[LayerProfile]:
    layers = workload.layers
    saved = saved_per_layer(layers, calls, config.min_numel)
    if report.simulated:
        # A layer takes at least its FLOPs at the assumed throughput, and at least one
        # kernel launch per operator (small layers are launch-bound on a GPU).
        fwd = [
            max(f / (config.sim_tflops * 1e12) * 1e3, ops * config.sim_launch_us * 1e-3)
            for f, ops in forward_cost(layers, calls)
        ]
        bwd = [2 * f for f in fwd]
    else:
        none = report.result("none")
        starts = {s.label: s for s in none.spans if s.lane == "compute"}
        fwd = [starts[f"F{j}"].end_ms - starts[f"F{j}"].start_ms for j in range(len(layers))]
        bwd = [starts[f"B{j}"].end_ms - starts[f"B{j}"].start_ms for j in range(len(layers))]
    return [
        LayerProfile(f, b, s, o, i, recast_bytes=r)
        for f, b, (s, o, r, i) in zip(fwd, bwd, saved, strict=True)
    ]


def _simulate_into(
    report: CompareReport, profiles: list[LayerProfile], config: CompareConfig, floor: bool
) -> None:
    """Simulated times and memory for each result; the V2 floor too when ``floor``."""
    k = config.num_offloaded
    gbps = config.sim_link_gbps
    report.notes.append(
        f"No GPU: the layers ran on the CPU through the stand-in transport, so the loss and "
        f"gradient differences are real, but times and memory are SIMULATED: per-layer compute "
        f"from FLOP counts at an assumed {config.sim_tflops:g} TFLOP/s (and at least "
        f"{config.sim_launch_us:g} us per operator), copies at an assumed "
        f"{gbps:g} GB/s each way."
    )
    for result in report.results:
        sim: SimResult = simulate(
            profiles,
            result.schedule,
            k,
            gbps,
            gbps,
            offloaded=result.offloaded_layers,
            recomputed=result.recomputed_layers,
        )
        result.step_ms = sim.step_ms
        result.step_times_ms = []
        result.step_spread_ms = 0.0
        result.peak_bytes = sim.peak_bytes
        result.spans = sim.spans
        result.memory = sim.memory
        if result.copy_streams:
            result.stall_ms = sim.stall_ms
    if floor:
        report.floor_ms["v2"] = simulate(profiles, "v2", k, gbps, gbps).step_ms
