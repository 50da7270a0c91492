"""Activation offloading for one stage of a pipeline-parallel schedule.

A pipeline stage runs the forwards and backwards of several micro-batches in a fixed
order (GPipe: all forwards, then all backwards; 1F1B: a few forwards, then one backward
and one forward in turn). Between a micro-batch's forward and its backward, its
activations wait on the device. :func:`plan_pipeline_offload` decides, from the stage's
order, which micro-batches to move to the host, when each one's device memory is freed
and when its reload starts, and what that bounds the device memory to;
:class:`PipelineStageOffload` runs a stage's layers and carries the plan out with one
:class:`~cpu_offload.v2.ManualOffloadSynchronizer` per micro-batch (each micro-batch is
one iteration of its own synchronizer, so forwards and backwards of different
micro-batches may interleave freely).

Times are counted in *actions*: the forward or backward of one micro-batch on this stage.
Work planned "at action t" runs when action t begins, before its compute.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._args import check_int
from ._compat import is_fake_or_functional
from .engine.layer_state import LayerPhase
from .engine.selection import mark_not_offload
from .engine.transport import Transport, default_transport
from .v2.context import DEFAULT_MIN_TENSOR_SIZE, get_cpu_offload_context
from .v2.manual import ManualOffloadSynchronizer

__all__ = [
    "PipelineAction",
    "PipelineOffloadPlan",
    "PipelineSchedule",
    "PipelineStageOffload",
    "plan_pipeline_offload",
    "stage_order",
]


class PipelineSchedule(str, enum.Enum):
    """Single-stage-per-rank schedules of ``torch.distributed.pipelining``."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


@dataclass(frozen=True)
class PipelineAction:
    """The forward (``forward=True``) or backward of micro-batch ``microbatch``."""

    forward: bool
    microbatch: int

    def __str__(self) -> str:
        return f"{'F' if self.forward else 'B'}{self.microbatch}"


def stage_order(
    schedule: PipelineSchedule | str, num_stages: int, stage_index: int, num_microbatches: int
) -> list[PipelineAction]:
    """The order in which one stage runs its micro-batches' forwards and backwards.

    GPipe runs every forward, then every backward, both in micro-batch order. 1F1B runs
    ``min(num_microbatches, num_stages - stage_index)`` forwards first, then a backward
    and a forward in turn, then the remaining backwards (the order of
    ``torch.distributed.pipelining.Schedule1F1B``).

    Args:
        schedule: ``"gpipe"`` or ``"1f1b"`` (or a :class:`PipelineSchedule`).
        num_stages: Stages of the pipeline (>= 1).
        stage_index: This stage, in ``[0, num_stages - 1]``.
        num_microbatches: Micro-batches per step (>= 1).

    Returns:
        ``2 * num_microbatches`` actions.

    Raises:
        ValueError: If the schedule is unknown or a count is out of range.
        TypeError: If a count is not an int.

    Example:
        >>> [str(a) for a in stage_order("1f1b", 2, 0, 4)]
        ['F0', 'F1', 'B0', 'F2', 'B1', 'F3', 'B2', 'B3']
    """
    kind = _schedule(schedule)
    s = check_int("num_stages", num_stages)
    i = check_int("stage_index", stage_index)
    m = check_int("num_microbatches", num_microbatches)
    if s < 1:
        raise ValueError(f"num_stages must be >= 1, got {s}")
    if not 0 <= i < s:
        raise ValueError(f"stage_index must be in [0, {s - 1}], got {i}")
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}")
    fwd = [PipelineAction(True, k) for k in range(m)]
    bwd = [PipelineAction(False, k) for k in range(m)]
    if kind is PipelineSchedule.GPIPE:
        return fwd + bwd
    warmup = min(m, s - i)
    order = fwd[:warmup]
    for k in range(m - warmup):
        order += [bwd[k], fwd[warmup + k]]
    return order + bwd[m - warmup :]


def _schedule(schedule: PipelineSchedule | str) -> PipelineSchedule:
    try:
        return PipelineSchedule(schedule.lower() if isinstance(schedule, str) else schedule)
    except ValueError:
        allowed = ", ".join(repr(s.value) for s in PipelineSchedule)
        raise ValueError(f"schedule must be one of {allowed}, got {schedule!r}") from None


@dataclass(frozen=True)
class PipelineOffloadPlan:
    """Which micro-batches a stage offloads, when, and the device memory that implies.

    Attributes:
        order: The stage's actions, in the order they run.
        offloaded: Micro-batches whose activations go to the host.
        release_at: Action index -> micro-batches whose device memory is freed when that
            action begins (their copies to the host must have finished).
        reload_at: Action index -> micro-batches whose copies back start when that action
            begins.
        resident: Per action, the micro-batches whose activations are on the device
            while it runs (the running one included).
        resident_without_offload: The same without offloading.
    """

    order: tuple[PipelineAction, ...] = field(repr=False)
    offloaded: frozenset[int]
    release_at: dict[int, tuple[int, ...]] = field(repr=False)
    reload_at: dict[int, tuple[int, ...]] = field(repr=False)
    resident: tuple[frozenset[int], ...] = field(repr=False)
    resident_without_offload: tuple[frozenset[int], ...] = field(repr=False)

    @property
    def num_microbatches(self) -> int:
        return len(self.order) // 2

    @property
    def peak_resident(self) -> int:
        """Most micro-batches' activations on the device at once, with offloading."""
        return max(len(r) for r in self.resident)

    @property
    def peak_resident_without_offload(self) -> int:
        """Most micro-batches' activations on the device at once, without offloading."""
        return max(len(r) for r in self.resident_without_offload)

    @classmethod
    def from_order(
        cls, order: Sequence[PipelineAction], release_lag: int = 0, prefetch: int = 1
    ) -> PipelineOffloadPlan:
        """Plan for any order of actions (each micro-batch's forward before its backward).

        Micro-batch ``m`` with forward at action ``f`` and backward at ``b`` can be freed
        at action ``r = f + 1 + release_lag`` and reloaded at ``q = b - prefetch``, off the
        device during actions ``r..q-1``. Those with ``r < q`` are candidates; of them,
        the plan offloads only those needed for the lowest peak of resident micro-batches
        (the others' copies would cost link bandwidth and lower nothing), and none if
        offloading cannot lower the peak at all.

        Args:
            order: Every micro-batch ``0..M-1`` exactly once forward and once backward.
            release_lag: Actions the copies to the host may overlap before the memory is
                freed (0: freed when the next action begins).
            prefetch: Actions the copies back may overlap before the backward needs them
                (0: reloaded when its own backward begins, without overlap).

        Returns:
            The plan.

        Raises:
            ValueError: If the order is not a forward and a backward of each of
                ``0..M-1``, a backward comes before its forward, or a count is negative.
            TypeError: If an entry is not a :class:`PipelineAction` or a count is not an int.
        """
        lag = check_int("release_lag", release_lag)
        pre = check_int("prefetch", prefetch)
        if lag < 0 or pre < 0:
            raise ValueError(f"release_lag and prefetch must be >= 0, got {lag} and {pre}")
        fwd_at, bwd_at = _positions(order)
        n, ms = len(order), range(len(fwd_at))
        away = {m: (fwd_at[m] + 1 + lag, bwd_at[m] - pre) for m in ms}  # [freed, reloaded)

        def residency(offloaded: set[int]) -> tuple[frozenset[int], ...]:
            return tuple(
                frozenset(
                    m
                    for m in ms
                    if fwd_at[m] <= t <= bwd_at[m]
                    and not (m in offloaded and away[m][0] <= t < away[m][1])
                )
                for t in range(n)
            )

        offloaded = {m for m in ms if away[m][0] < away[m][1]}
        peak = max(map(len, residency(offloaded)))
        # Keep on the device every micro-batch whose trip would not lower the peak: the
        # copies cost link bandwidth and buy nothing there.
        for m in sorted(offloaded, reverse=True):
            if max(map(len, residency(offloaded - {m}))) == peak:
                offloaded.discard(m)
        without_offload = residency(set())
        if peak == max(map(len, without_offload)):
            offloaded.clear()
        release_at: dict[int, tuple[int, ...]] = {}
        reload_at: dict[int, tuple[int, ...]] = {}
        for m in sorted(offloaded):
            release_at[away[m][0]] = (*release_at.get(away[m][0], ()), m)
            reload_at[away[m][1]] = (*reload_at.get(away[m][1], ()), m)
        return cls(
            order=tuple(order),
            offloaded=frozenset(offloaded),
            release_at=release_at,
            reload_at=reload_at,
            resident=residency(offloaded),
            resident_without_offload=without_offload,
        )

    def describe(self) -> str:
        """One line per action: what runs, what is freed and reloaded, what is resident."""
        lines = []
        for t, action in enumerate(self.order):
            parts = [f"{t:3d} {action!s:>4}"]
            if t in self.release_at:
                parts.append("free " + ",".join(map(str, self.release_at[t])))
            if t in self.reload_at:
                parts.append("reload " + ",".join(map(str, self.reload_at[t])))
            parts.append("on device " + ",".join(map(str, sorted(self.resident[t]))))
            lines.append("  ".join(parts))
        return "\n".join(lines)


def _positions(order: Sequence[PipelineAction]) -> tuple[list[int], list[int]]:
    for a in order:
        if not isinstance(a, PipelineAction):
            raise TypeError(f"order entries must be PipelineAction, got {type(a).__name__}")
    m = len(order) // 2
    fwd = {a.microbatch: t for t, a in enumerate(order) if a.forward}
    bwd = {a.microbatch: t for t, a in enumerate(order) if not a.forward}
    expected = set(range(m))
    if len(order) % 2 or set(fwd) != expected or set(bwd) != expected:
        raise ValueError(
            "order must hold one forward and one backward of each micro-batch 0..M-1, got "
            + " ".join(map(str, order))
        )
    late = [k for k in range(m) if bwd[k] < fwd[k]]
    if late:
        raise ValueError(f"order: the backward of micro-batch {late[0]} comes before its forward")
    return [fwd[k] for k in range(m)], [bwd[k] for k in range(m)]


def plan_pipeline_offload(
    schedule: PipelineSchedule | str,
    num_stages: int,
    stage_index: int,
    num_microbatches: int,
    *,
    release_lag: int = 0,
    prefetch: int = 1,
) -> PipelineOffloadPlan:
    """Plan a stage's offloading for a GPipe or 1F1B schedule.

    A micro-batch waiting for its backward is moved to the host and freed ``release_lag``
    actions after its forward, and reloaded ``prefetch`` actions before its backward; one
    whose backward follows too soon stays. At most ``1 + release_lag + prefetch``
    micro-batches' activations are then on the device at once (``plan.peak_resident``),
    against ``plan.peak_resident_without_offload`` (GPipe: all micro-batches; 1F1B:
    ``num_stages - stage_index``).

    Args:
        schedule: ``"gpipe"`` or ``"1f1b"``.
        num_stages, stage_index, num_microbatches: As for :func:`stage_order`.
        release_lag: See :meth:`PipelineOffloadPlan.from_order`.
        prefetch: See :meth:`PipelineOffloadPlan.from_order`.

    Returns:
        The :class:`PipelineOffloadPlan`.

    Raises:
        ValueError / TypeError: As :func:`stage_order` and
            :meth:`PipelineOffloadPlan.from_order`.

    Example:
        >>> plan = plan_pipeline_offload("gpipe", 2, 0, 8)
        >>> plan.peak_resident, plan.peak_resident_without_offload
        (2, 8)
    """
    order = stage_order(schedule, num_stages, stage_index, num_microbatches)
    return PipelineOffloadPlan.from_order(order, release_lag=release_lag, prefetch=prefetch)


_ON_DEVICE = (LayerPhase.OFFLOAD_STARTED, LayerPhase.RELOAD_STARTED)


class PipelineStageOffload(nn.Module):
    """A pipeline stage's layers, run with the activation offloading of a plan.

    Use it as the stage's module and attach it to the stage (``module.attach(
    PipelineStage(module, ...))``). Each forward is the next forward of the plan; each layer runs under the
    offload context of its micro-batch, whose copies to the host start as the layer
    ends. When an action begins (a forward here, or the backward reaching this stage's
    output), the micro-batches the plan names are freed and reloaded. Results are
    bit-identical to running the layers without it. Forwards without grad (evaluation)
    and on meta or fake tensors (shape inference) run the layers plainly and do not count.

    Args:
        layers: The stage's layers, each taking and returning one tensor.
        plan: From :func:`plan_pipeline_offload` for this stage.
        transport: What moves the bytes (shared by all micro-batches); the default
            transport when None.
        min_tensor_size_to_offload: Smallest tensor to offload, in elements.

    Raises:
        TypeError: If ``layers`` holds something that is not a module, or ``plan`` is
            not a :class:`PipelineOffloadPlan`.
        ValueError: If ``layers`` is empty.

    Example:
        >>> plan = plan_pipeline_offload("1f1b", 2, 0, 4)
        >>> stage = PipelineStageOffload([torch.nn.Linear(8, 8)], plan)
        >>> for m in range(2):
        ...     _ = stage(torch.randn(2, 8))
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        plan: PipelineOffloadPlan,
        *,
        transport: Transport | None = None,
        min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE,
    ) -> None:
        super().__init__()
        if not isinstance(plan, PipelineOffloadPlan):
            raise TypeError(f"plan must be a PipelineOffloadPlan, got {type(plan).__name__}")
        layers = list(layers)
        if not layers:
            raise ValueError("layers must hold at least one module")
        for layer in layers:
            if not isinstance(layer, nn.Module):
                raise TypeError(f"layers must be nn.Modules, got {type(layer).__name__}")
        self.layers = nn.ModuleList(layers)
        self.plan = plan
        self.transport = transport if transport is not None else default_transport()
        self._contexts: list[tuple[Any, Callable[[torch.Tensor], torch.Tensor]]] = []
        self.synchronizers: list[ManualOffloadSynchronizer] = []
        for _ in range(plan.num_microbatches):
            made: Any = get_cpu_offload_context(
                enabled=True,
                model_layers=len(layers),
                manual_synchronization=True,
                min_tensor_size_to_offload=min_tensor_size_to_offload,
                transport=self.transport,
            )
            ctx, sync, manual = made
            assert isinstance(manual, ManualOffloadSynchronizer)
            self._contexts.append((ctx, sync))
            self.synchronizers.append(manual)
        self._next = 0  # index of the next action in plan.order
        self._attached = False  # see attach()
        self._announced: int | None = None  # micro-batch of the schedule's forward now
        #: Per action of the last step: the micro-batches holding device activations
        #: while it ran (what ``plan.resident`` predicts).
        self.observed_resident: list[frozenset[int]] = []

    def reset(self) -> None:
        """Drop every micro-batch's tensors and restart at the plan's first action.

        Call it after a step that raised part-way, before the next one.
        """
        for sync in self.synchronizers:
            sync.release_all()
        self._next = 0
        self.observed_resident = []

    def attach(self, stage: Any) -> None:
        """Take the micro-batch of each forward from ``stage``, a pipelining stage.

        ``torch.distributed.pipelining`` runs the stage's module outside its schedule
        too (to infer shapes on the first step); once attached, only the forwards the
        schedule runs (``stage.forward_one_chunk``) are actions of the plan, checked
        against their micro-batch index, and the others run the layers plainly.

        Args:
            stage: A ``torch.distributed.pipelining.PipelineStage`` whose module is (or
                contains) this one.

        Raises:
            TypeError: If ``stage`` has no ``forward_one_chunk`` or its module does not
                contain this one.
        """
        submod = getattr(stage, "submod", None)
        if not callable(getattr(stage, "forward_one_chunk", None)) or not isinstance(
            submod, nn.Module
        ):
            raise TypeError(f"stage must be a pipelining stage, got {type(stage).__name__}")
        if not any(m is self for m in submod.modules()):
            raise TypeError("stage's module does not contain this PipelineStageOffload")
        original = stage.forward_one_chunk

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self._announced = fwd_chunk_id
            try:
                return original(fwd_chunk_id, *args, **kwargs)
            finally:
                self._announced = None

        stage.forward_one_chunk = forward_one_chunk
        self._attached = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = not torch.is_grad_enabled() or x.is_meta or is_fake_or_functional(x)
        if plain or (self._attached and self._announced is None):
            # Evaluation, or a pipeline tracing shapes: nothing to save, not an action.
            for layer in self.layers:
                x = layer(x)
            return x
        if self._next == len(self.plan.order):
            self._next = 0  # the previous step ran every action: a new step begins
        m = self._begin(forward=True, microbatch=self._announced)
        # The stage keeps its input for the backward anyway: copying it would free nothing.
        mark_not_offload(x)
        ctx, sync = self._contexts[m]
        manual = self.synchronizers[m]
        offload = m in self.plan.offloaded
        for i, layer in enumerate(self.layers):
            with ctx:
                x = layer(x)
            x = sync(x)
            if offload:
                manual.start_offload_layer(i)  # copies run while the next layers compute
        out = x.view_as(x)
        assert out.grad_fn is not None
        out.grad_fn.register_prehook(_BackwardBegins(self, m))
        return out

    def _begin(self, forward: bool, microbatch: int | None) -> int:
        """Start the next action of the plan: check it, free and reload what it names."""
        t = self._next
        if t >= len(self.plan.order):
            raise RuntimeError(
                f"{'a forward' if forward else f'the backward of micro-batch {microbatch}'} "
                f"ran after all {len(self.plan.order)} actions of the plan: build the plan "
                "with the schedule and number of micro-batches the stage runs"
            )
        expected = self.plan.order[t]
        if expected.forward != forward or (
            microbatch is not None and microbatch != expected.microbatch
        ):
            got = f"{'a forward' if forward else 'the backward'} of micro-batch {microbatch}"
            if microbatch is None:
                got = "a forward"
            self.reset()
            raise RuntimeError(
                f"the pipeline ran {got} where the offload plan expects {expected} (action "
                f"{t}): build the plan with the schedule the stage runs "
                "(PipelineOffloadPlan.from_order for other schedules)"
            )
        if t == 0:
            self.observed_resident = []
        self._next = t + 1
        for m in self.plan.release_at.get(t, ()):
            manual = self.synchronizers[m]
            for i in range(len(self.layers)):
                manual.release_activation_forward_gpu_memory(i)
        for m in self.plan.reload_at.get(t, ()):
            manual = self.synchronizers[m]
            for i in reversed(range(len(self.layers))):  # the first needed goes first
                manual.start_reload_layer(i)
        resident = {k for k, s in enumerate(self.synchronizers) if _holds_device_tensors(s)}
        self.observed_resident.append(frozenset(resident | {expected.microbatch}))
        return expected.microbatch


def _holds_device_tensors(sync: ManualOffloadSynchronizer) -> bool:
    return any(
        layer.phase in _ON_DEVICE or (layer.phase is LayerPhase.NOT_OFFLOADED and layer.has_tensors)
        for layer in sync.layers
    )


class _BackwardBegins:
    """Gradient pre-hook on a stage output: the backward of its micro-batch begins."""

    __slots__ = ("microbatch", "stage")

    def __init__(self, stage: PipelineStageOffload, microbatch: int) -> None:
        self.stage = stage
        self.microbatch = microbatch

    def __call__(self, grad_outputs: Any) -> None:
        self.stage._begin(forward=False, microbatch=self.microbatch)
