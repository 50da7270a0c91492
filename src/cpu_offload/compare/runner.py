"""Running the variants side by side and measuring them.

On a GPU every figure is measured: numerics against no offloading, the peak of
``torch.cuda.max_memory_allocated`` over the step, median step time, the bandwidth of
each copy from CUDA events, the time the compute stream stalled waiting on copies, and
a timeline of one step. Without a GPU the layers run on the CPU through the stand-in
transport: numerics are real, while times and memory come from the timeline model of
:mod:`cpu_offload.compare.simulate`, fed with FLOP counts and assumed device figures.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._compat import TORCH_VERSION_STRING
from .._selection import ActivationPolicy
from .._tensor_group import SavedEntry, TensorGroupProcessor
from .._transport import CudaTransport, HostTransport, Transport
from ..models import ModelSpec, build_layers
from ._rows import row_by_name
from .optimizer import OptimizerCompareConfig, OptimizerReport, run_optimizer_compare
from .simulate import LayerProfile, SimResult, Span, simulate
from .variants import Variant, make_variant

__all__ = ["CompareConfig", "CompareReport", "VariantResult", "run_compare", "measure_link"]

_GB = 1e9


@dataclass
class CompareConfig:
    """What ``cpu-offload compare`` runs.

    ``activation`` runs the activation variants (``variants``, no offloading always
    first) on ``num_offloaded`` of the model's layers; ``optimizer``, when given, runs the
    optimizer-offloading configurations on the same model, for the same ``steps`` and
    ``warmup``. At least one of the two must be on.
    """

    spec: ModelSpec
    num_offloaded: int
    variants: Sequence[str]
    steps: int = 5
    warmup: int = 2
    min_numel: int = 256 * 1024
    device: str = "cuda"
    deterministic: bool = True
    sim_tflops: float = 400.0  # assumed device throughput for the simulated mode
    sim_link_gbps: float = 50.0  # assumed link bandwidth for the simulated mode
    sim_launch_us: float = 6.0  # assumed time of one kernel launch for the simulated mode
    timeline_variants: Sequence[str] = ("v2", "v1-async")
    activation: bool = True
    optimizer: OptimizerCompareConfig | None = None


@dataclass
class VariantResult:
    """Everything measured for one variant."""

    name: str
    max_loss_diff: float
    max_grad_diff: float
    peak_bytes: int
    step_ms: float
    step_times_ms: list[float] = field(default_factory=list)
    offload_gbps: float | None = None
    reload_gbps: float | None = None
    stall_ms: float | None = None
    bytes_offloaded_per_step: int = 0
    spans: list[Span] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class CompareReport:
    """The comparison: one result per variant plus the context to read them.

    Without the activation variants (``CompareConfig.activation=False``) ``results`` is
    empty and the noise floors are None; ``optimizer`` holds the optimizer section when
    it ran.
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

    def result(self, name: str) -> VariantResult:
        """The result of the activation variant called ``name``.

        Raises:
            KeyError: If there is no such variant.
        """
        return row_by_name(self.results, name)


# -- one step ------------------------------------------------------------------------


@dataclass
class _Step:
    loss: torch.Tensor
    grads: list[torch.Tensor]
    ms: float
    peak: int
    spans: list[Span]
    memory: list[tuple[float, int]]


class _Recorder:
    """Events on the compute stream at layer boundaries, and memory at each of them."""

    def __init__(self, cuda: bool, base: int) -> None:
        self.cuda = cuda
        self.base = base
        self.marks: list[tuple[str, object, int]] = []

    def mark(self, label: str) -> None:
        mem = torch.cuda.memory_allocated() - self.base if self.cuda else 0
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((label, ev, mem))
        else:
            self.marks.append((label, time.perf_counter(), mem))

    def backward_hook(self, label: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self.mark(label)

        return hook

    def elapsed(self, start: object, end: object) -> float:
        if self.cuda:
            return start.elapsed_time(end)  # type: ignore[attr-defined]
        return (end - start) * 1e3  # type: ignore[operator]


def _one_step(
    variant: Variant,
    layers: nn.ModuleList,
    make_input: Callable[[], torch.Tensor],
    record: bool,
    keep_grads: bool = False,
) -> _Step:
    cuda = next(layers.parameters()).is_cuda
    for p in layers.parameters():
        # Gradients stay allocated between steps (zero_grad(set_to_none=False)), so the
        # peak above the step's start is activations and temporaries alone, whichever
        # moment of backward each variant peaks at.
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    for t in variant.transports:
        t.timeline = [] if (record and cuda) else None
    base = 0
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    x = make_input()  # before the first mark: making the batch is not part of the step
    rec = _Recorder(cuda, base)
    rec.mark("start")
    for j, layer in enumerate(layers):
        if record:
            rec.mark(f"F{j}")
        x = variant.run_layer(j, layer, x)
        if record and x.grad_fn is not None:
            x.grad_fn.register_prehook(rec.backward_hook(f"B{j}"))
    if record:
        rec.mark("loss")
    loss = x.float().square().mean()
    del x
    loss.backward()
    rec.mark("end")
    peak = 0
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    start_ev = rec.marks[0][1]
    ms = rec.elapsed(start_ev, rec.marks[-1][1])
    spans: list[Span] = []
    memory: list[tuple[float, int]] = []
    if record:
        spans, memory = _timeline(rec, variant)
    for t in variant.transports:
        t.timeline = None
    return _Step(
        loss.detach().float(),
        # Only the steps compared keep their gradients, in their own dtype: a copy of
        # every gradient per step would take more memory than the model on a big one.
        [p.grad.clone() for p in layers.parameters() if p.grad is not None] if keep_grads else [],
        ms,
        peak,
        spans,
        memory,
    )


def _timeline(rec: _Recorder, variant: Variant) -> tuple[list[Span], list[tuple[float, int]]]:
    start = rec.marks[0][1]
    times = [(label, rec.elapsed(start, ev), mem) for label, ev, mem in rec.marks]
    memory = [(t, m) for _, t, m in times]
    spans: list[Span] = []
    fwd = [(lbl, t) for lbl, t, _ in times if lbl.startswith("F") or lbl == "loss"]
    for (lbl, t0), (_, t1) in zip(fwd, fwd[1:], strict=False):
        spans.append(Span("compute", lbl, t0, t1))
    bwd = [(lbl, t) for lbl, t, _ in times if lbl.startswith("B")] + [("end", times[-1][1])]
    for (lbl, t0), (_, t1) in zip(bwd, bwd[1:], strict=False):
        spans.append(Span("compute", lbl, t0, t1))
    for transport in variant.transports:
        for span in transport.timeline or ():
            spans.append(
                Span(
                    span.kind,
                    f"{span.nbytes / 2**20:.0f} MiB",
                    rec.elapsed(start, span.start),
                    rec.elapsed(start, span.end),
                    span.nbytes,
                )
            )
    return spans, memory


# -- link and layer profiles -----------------------------------------------------------


def measure_link(nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float, float]:
    """Pinned-memory copy bandwidth in GB/s: device-to-host, host-to-device, both at once."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            s1.wait_stream(torch.cuda.current_stream())
            s2.wait_stream(torch.cuda.current_stream())
            fn()
            torch.cuda.current_stream().wait_stream(s1)
            torch.cuda.current_stream().wait_stream(s2)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    def d2h() -> None:
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)

    def both() -> None:
        d2h()
        h2d()

    d = nbytes / timed(d2h) / 1e6
    h = nbytes / timed(h2d) / 1e6
    b = 2 * nbytes / timed(both) / 1e6
    return d, h, b


class _Collect:
    """Pack hook that keeps every saved tensor in a list."""

    def __init__(self, into: list[torch.Tensor]) -> None:
        self.into = into

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.into.append(tensor)
        return tensor


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _saved_per_layer(
    layers: nn.ModuleList, x: torch.Tensor, min_numel: int
) -> list[tuple[int, int, int]]:
    """(saved bytes, offloadable bytes, input bytes) of each layer, from one forward."""
    out = []
    policy = ActivationPolicy(min_numel, lambda t: t.device == x.device)
    processor = TensorGroupProcessor()
    for layer in layers:
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(_Collect(saved), _identity):
            y = layer(x)
        storages: dict[int, int] = {}
        for t in saved:
            if isinstance(t, nn.Parameter) or (
                t._base is not None and isinstance(t._base, nn.Parameter)
            ):
                continue
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        entries = [SavedEntry(t, None, i) for i, t in enumerate(saved) if policy(t)]
        plan = processor.process(entries) if entries else None
        offload = sum(u.nbytes for u in plan.units) if plan else 0
        out.append((sum(storages.values()), offload, x.numel() * x.element_size()))
        x = y.detach().requires_grad_(True)
    return out


class _OpCounter(TorchDispatchMode):
    """Counts the operators a forward runs: each is at least one kernel launch."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _forward_cost(layers: nn.ModuleList, x: torch.Tensor) -> list[tuple[int, int]]:
    """(FLOPs, operators) of each layer's forward."""
    from torch.utils.flop_counter import FlopCounterMode

    out = []
    for layer in layers:
        flops = FlopCounterMode(display=False)
        ops = _OpCounter()
        with flops, ops:
            y = layer(x)
        out.append((flops.get_total_flops(), ops.ops))
        x = y.detach()
    return out


# -- the comparison --------------------------------------------------------------------


def _diffs(step: _Step, ref: _Step) -> tuple[float, float]:
    """Largest absolute difference of the loss and of any gradient element."""
    grad = max(
        (
            (x.float() - y.float()).abs().max().item()
            for x, y in zip(step.grads, ref.grads, strict=True)
        ),
        default=0.0,
    )
    return abs(step.loss - ref.loss).item(), grad


def run_compare(
    config: CompareConfig, progress: Callable[[str], None] = lambda msg: None
) -> CompareReport:
    """Run every variant of ``config`` on the same layers and batch.

    Args:
        config: What to run.
        progress: Called with a line of text as each phase starts.

    Returns:
        The report, with real measurements on CUDA and simulated times and memory on
        the CPU (``report.simulated``); its ``optimizer`` section when
        ``config.optimizer`` is given (measured on CUDA, a CPU stand-in otherwise).

    Raises:
        ValueError: If ``config.activation`` is off and ``config.optimizer`` is None.
    """
    if not config.activation and config.optimizer is None:
        raise ValueError(
            "nothing to compare: activation=False and optimizer=None; turn on at least one"
        )
    if config.activation:
        report = _run_activation(config, progress)
    else:
        report = CompareReport(
            config=_config_dict(config),
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
    if config.optimizer is not None:
        report.optimizer = run_optimizer_compare(
            config.spec,
            config.optimizer,
            device=config.device,
            steps=config.steps,
            warmup=config.warmup,
            progress=progress,
        )
    return report


def _device_name(cuda: bool) -> str:
    return torch.cuda.get_device_name() if cuda else "cpu (CPU stand-in)"


def _config_dict(config: CompareConfig) -> dict[str, object]:
    spec = config.spec
    return {
        "model": spec.kind,
        "hidden": spec.hidden,
        "heads": spec.heads,
        "seq": spec.seq,
        "batch": spec.batch,
        "layers": spec.layers,
        "offloaded": config.num_offloaded,
        "dtype": str(spec.dtype).replace("torch.", ""),
        "steps": config.steps,
        "min_tensor_size_to_offload": config.min_numel,
        "deterministic": config.deterministic,
        "activation": config.activation,
        "optimizer": config.optimizer is not None,
    }


def _run_activation(config: CompareConfig, progress: Callable[[str], None]) -> CompareReport:
    """The activation variants: everything but the optimizer section."""
    cuda = config.device == "cuda"
    spec = config.spec
    device = torch.device(config.device)
    layers = build_layers(spec, device)
    batch = spec.make_input("cpu")  # one batch, copied to the device for every step

    def make_input() -> torch.Tensor:
        return batch.to(device)

    n, k = spec.layers, config.num_offloaded

    def transport_factory() -> Transport:
        return CudaTransport() if cuda else HostTransport()

    link: tuple[float, float, float] | tuple[None, None, None] = (None, None, None)
    if cuda:
        progress("measuring the pinned copy bandwidth")
        link = measure_link()

    progress("reference run without offloading (twice: the noise floor)")
    baseline = make_variant("none", n, k, config.min_numel)
    ref = _one_step(baseline, layers, make_input, record=False, keep_grads=True)
    noise_loss, noise_grad = _diffs(
        _one_step(baseline, layers, make_input, record=False, keep_grads=True), ref
    )

    results: list[VariantResult] = []
    names = list(dict.fromkeys(["none", *config.variants]))
    for idx, name in enumerate(names, 1):
        progress(f"[{idx}/{len(names)}] {name}: {config.warmup} warm-up + {config.steps} steps")
        variant = make_variant(
            name,
            n,
            k,
            config.min_numel,
            transport_factory if name in ("v2", "v1-async", "v1-async-db") else None,
        )
        steps: list[_Step] = []
        for _ in range(config.warmup):
            _one_step(variant, layers, make_input, record=False)
        before = sum(t.bytes_offloaded for t in variant.transports)
        for i in range(config.steps):
            steps.append(_one_step(variant, layers, make_input, record=False, keep_grads=i == 0))
        moved = sum(t.bytes_offloaded for t in variant.transports) - before
        # Copy bandwidth and stalls from a few recorded steps (medians): one step's
        # copies are too few to measure a link shared with other work.
        recorded = [
            _one_step(variant, layers, make_input, record=True) for _ in range(3 if cuda else 1)
        ]
        timed = recorded[-1]
        loss_diff, grad_diff = _diffs(steps[0], ref)
        steps[0].grads.clear()
        result = VariantResult(
            name=name,
            max_loss_diff=loss_diff,
            max_grad_diff=grad_diff,
            peak_bytes=max(s.peak for s in steps),
            step_ms=statistics.median(s.ms for s in steps),
            step_times_ms=[s.ms for s in steps],
            bytes_offloaded_per_step=moved // max(config.steps, 1),
            spans=timed.spans,
            memory=timed.memory,
        )
        if cuda and variant.transports:
            _copy_figures(result, [r.spans for r in recorded])
        results.append(result)
        # The next variant starts from the same memory: drop this one's buffers (its
        # hooks and handlers hold reference cycles) before measuring the next peak.
        del variant, steps, timed, recorded
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    report = CompareReport(
        config=_config_dict(config),
        device=_device_name(cuda),
        torch_version=TORCH_VERSION_STRING,
        simulated=not cuda,
        noise_floor_loss=noise_loss,
        noise_floor_grad=noise_grad,
        link_d2h_gbps=link[0],
        link_h2d_gbps=link[1],
        link_duplex_gbps=link[2],
        results=results,
    )
    progress("profiling layers for the transfer-bound floor")
    profiles = _profiles(layers, make_input(), config, report)
    if not cuda:
        _simulate_into(report, profiles, config)
    else:
        assert link[0] is not None
        for duplex in (False, True):
            sim = simulate(profiles, "v2", k, link[0], link[1], duplex=duplex)
            report.floor_ms["v2-duplex" if duplex else "v2"] = sim.step_ms
    return report


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
    layers: nn.ModuleList, x: torch.Tensor, config: CompareConfig, report: CompareReport
) -> list[LayerProfile]:
    saved = _saved_per_layer(layers, x, config.min_numel)
    if report.simulated:
        # A layer takes at least its FLOPs at the assumed throughput, and at least one
        # kernel launch per operator (small layers are launch-bound on a GPU).
        fwd = [
            max(f / (config.sim_tflops * 1e12) * 1e3, ops * config.sim_launch_us * 1e-3)
            for f, ops in _forward_cost(layers, x)
        ]
        bwd = [2 * f for f in fwd]
    else:
        none = report.result("none")
        starts = {s.label: s for s in none.spans if s.lane == "compute"}
        fwd = [starts[f"F{j}"].end_ms - starts[f"F{j}"].start_ms for j in range(len(layers))]
        bwd = [starts[f"B{j}"].end_ms - starts[f"B{j}"].start_ms for j in range(len(layers))]
    return [LayerProfile(f, b, s, o, i) for f, b, (s, o, i) in zip(fwd, bwd, saved, strict=True)]


def _simulate_into(
    report: CompareReport, profiles: list[LayerProfile], config: CompareConfig
) -> None:
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
        sim: SimResult = simulate(profiles, result.name.replace("-db", ""), k, gbps, gbps)
        result.step_ms = sim.step_ms
        result.step_times_ms = []
        result.peak_bytes = sim.peak_bytes
        result.spans = sim.spans
        result.memory = sim.memory
        if result.name.startswith(("v1-async", "v2")):
            result.stall_ms = sim.stall_ms
    report.floor_ms["v2"] = simulate(profiles, "v2", k, gbps, gbps).step_ms
