"""A timeline model of offloading schedules: copies on streams against per-layer compute.

Given each layer's forward and backward time, the bytes it saves and the link's
bandwidth, :func:`simulate` replays what each variant does on the compute and copy
streams and returns the step time, the activation peak and the spans of a timeline.
It serves twice: as the *transfer-bound floor* of the benchmarks (the step time the
default schedule would reach with measured compute and bandwidth), and as the simulated
GPU of ``cpu-offload compare`` on a machine without one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .._layer_stack import check_indices, offload_schedule
from ..engine.reload_order import backward_start, last_read_share
from ..v1.handlers import layer_windows

__all__ = ["LayerProfile", "SimResult", "Span", "simulate", "SIMULATED_VARIANTS"]

#: Variants the model knows.
SIMULATED_VARIANTS = ("none", "v1-sync", "v1-async", "v2", "checkpoint", "save_on_cpu", "plan")


@dataclass(frozen=True)
class LayerProfile:
    """What one layer costs: milliseconds of compute and bytes saved for backward."""

    forward_ms: float
    backward_ms: float
    saved_bytes: int  # everything the layer keeps for backward
    offload_bytes: int  # the part offloading moves (above the size threshold)
    input_bytes: int  # the layer's input (what activation checkpointing keeps)
    #: The part offloading releases without moving: saved casts, cast again in backward
    #: (NOTE [Casts rebuilt from their source] in ``cpu_offload/engine/recast.py``).
    recast_bytes: int = 0

    @property
    def released_bytes(self) -> int:
        """What offloading takes off the device between the layer's forward and backward."""
        return self.offload_bytes + self.recast_bytes


@dataclass(frozen=True)
class Span:
    """A bar of the timeline: ``lane`` is compute, offload, reload or stall."""

    lane: str
    label: str
    start_ms: float
    end_ms: float
    nbytes: int = 0  # bytes moved, on the copy lanes


@dataclass
class SimResult:
    """Step time, activation peak and the timeline of one simulated step."""

    step_ms: float
    peak_bytes: int
    spans: list[Span] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)  # (ms, bytes)

    @property
    def stall_ms(self) -> float:
        return sum(s.end_ms - s.start_ms for s in self.spans if s.lane == "stall")


class _Sim:
    def __init__(self, d2h_gbps: float, h2d_gbps: float) -> None:
        self.t = 0.0
        self.mem = 0
        self.peak = 0
        self.d2h_ms_per_byte = 1e-6 / d2h_gbps  # GB/s -> ms per byte
        self.h2d_ms_per_byte = 1e-6 / h2d_gbps
        self.spans: list[Span] = []
        self.memory: list[tuple[float, int]] = [(0.0, 0)]

    def alloc(self, nbytes: int) -> None:
        self.mem += nbytes
        self.peak = max(self.peak, self.mem)
        self.memory.append((self.t, self.mem))

    def free(self, nbytes: int) -> None:
        self.mem -= nbytes
        self.memory.append((self.t, self.mem))

    def compute(self, label: str, ms: float) -> tuple[float, float]:
        start = self.t
        self.t += ms
        self.spans.append(Span("compute", label, start, self.t))
        return start, self.t

    def wait_until(self, when: float, label: str) -> None:
        if when > self.t:
            self.spans.append(Span("stall", label, self.t, when))
            self.t = when

    def copy(
        self,
        lane: str,
        label: str,
        free_at: float,
        earliest: float,
        nbytes: int,
        not_before_end: float = 0.0,
    ) -> float:
        per_byte = self.d2h_ms_per_byte if lane == "offload" else self.h2d_ms_per_byte
        start = max(free_at, earliest)
        end = max(start + nbytes * per_byte, not_before_end)
        self.spans.append(Span(lane, label, start, end, nbytes))
        return end


def simulate(
    profiles: list[LayerProfile],
    variant: str,
    num_offloaded: int,
    d2h_gbps: float,
    h2d_gbps: float | None = None,
    *,
    duplex: bool = False,
    offloaded: Iterable[int] = (),
    recomputed: Iterable[int] = (),
) -> SimResult:
    """Replay one training step of ``variant`` with ``num_offloaded`` of the layers.

    Args:
        profiles: One entry per layer, in forward order.
        variant: One of :data:`SIMULATED_VARIANTS`.
        num_offloaded: k, the layers offloaded (or checkpointed), from the first.
        d2h_gbps: Device-to-host bandwidth, GB/s.
        h2d_gbps: Host-to-device bandwidth, GB/s (``d2h_gbps`` if None).
        duplex: V2 copies both directions on separate streams (otherwise one stream, as
            the default schedule uses).
        offloaded: For ``"plan"``: the offloaded layers (V2's schedule for that set,
            as :func:`cpu_offload.offload_layers` builds it); ``num_offloaded`` is unused.
        recomputed: For ``"plan"``: the layers recomputed in backward.

    Returns:
        The simulated step.

    Raises:
        ValueError: On an unknown variant, a ``num_offloaded`` or layer index out of
            range, or a layer both offloaded and recomputed.

    Example:
        >>> layer = LayerProfile(1.0, 2.0, saved_bytes=100, offload_bytes=100, input_bytes=10)
        >>> simulate([layer] * 3, "plan", 0, 1e-4, offloaded=[0], recomputed=[1]).peak_bytes
        210
    """
    n, k = len(profiles), num_offloaded
    if variant not in SIMULATED_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(SIMULATED_VARIANTS)}; got {variant!r}")
    if not 0 <= k <= n:
        raise ValueError(f"num_offloaded must be in [0, {n}], got {k}")
    sim = _Sim(d2h_gbps, h2d_gbps if h2d_gbps is not None else d2h_gbps)
    p = profiles
    if variant in ("none", "v1-sync", "save_on_cpu", "checkpoint"):
        _serial(sim, p, variant, k)
    elif variant == "v2":
        _per_layer(sim, p, frozenset(range(k)), frozenset(), duplex)
    elif variant == "plan":
        moved, rerun = (
            check_indices("offloaded", offloaded, n),
            check_indices("recomputed", recomputed, n),
        )
        if moved & rerun:
            raise ValueError(f"layers {sorted(moved & rerun)} are both offloaded and recomputed")
        _per_layer(sim, p, moved, rerun, duplex)
    else:
        _v1_async(sim, p, k)
    return SimResult(sim.t, sim.peak, sim.spans, sim.memory)


def _serial(sim: _Sim, p: list[LayerProfile], variant: str, k: int) -> None:
    # Variants whose copies (or recomputation) run on the compute stream itself.
    n = len(p)
    for j in range(n):
        moved = j < k and variant != "none"
        if moved and variant == "checkpoint":
            sim.alloc(p[j].input_bytes)
            sim.compute(f"F{j}", p[j].forward_ms)
            continue
        sim.alloc(p[j].saved_bytes)
        sim.compute(f"F{j}", p[j].forward_ms)
        if moved:
            start = sim.t
            sim.t = sim.copy("offload", f"L{j}", start, start, _sent(p[j], variant))
            sim.free(p[j].released_bytes)
    for j in reversed(range(n)):
        moved = j < k and variant != "none"
        if moved and variant == "checkpoint":
            sim.alloc(p[j].saved_bytes)
            sim.compute(f"R{j}", p[j].forward_ms)
            sim.compute(f"B{j}", p[j].backward_ms)
            sim.free(p[j].saved_bytes + p[j].input_bytes)
            continue
        if moved:
            sim.alloc(p[j].released_bytes)
            start = sim.t
            sim.t = sim.copy("reload", f"L{j}", start, start, _sent(p[j], variant))
        sim.compute(f"B{j}", p[j].backward_ms)
        sim.free(p[j].saved_bytes)


def _sent(layer: LayerProfile, variant: str) -> int:
    # torch's save_on_cpu copies every saved tensor, the saved casts included.
    return layer.released_bytes if variant == "save_on_cpu" else layer.offload_bytes


def _per_layer(
    sim: _Sim,
    p: list[LayerProfile],
    offloaded: frozenset[int],
    recomputed: frozenset[int],
    duplex: bool,
) -> None:
    # V2's schedule for any set of offloaded layers (the default one for the first k),
    # as offload_layers builds it, with recomputed layers run again before their backward.
    n = len(p)
    finish_at: dict[tuple[bool, int], list[int]] = {}
    reload_at: dict[int, list[int]] = {}
    for layer, (fwd, when, _, reload) in offload_schedule(offloaded, n).items():
        finish_at.setdefault((fwd, when), []).append(layer)
        reload_at.setdefault(reload, []).append(layer)
    d2h_free = h2d_free = 0.0
    offload_end: dict[int, float] = {}
    reload_start: dict[int, float] = {}
    reload_end: dict[int, float] = {}

    def finish(point: tuple[bool, int]) -> None:
        for i in finish_at.get(point, ()):
            sim.wait_until(offload_end[i], f"wait offload L{i}")
            sim.free(p[i].offload_bytes)

    for j in range(n):
        finish((True, j))
        if j in recomputed:
            sim.alloc(p[j].input_bytes)
            sim.compute(f"F{j}", p[j].forward_ms)
            continue
        sim.alloc(p[j].saved_bytes)
        start, end = sim.compute(f"F{j}", p[j].forward_ms)
        if j in offloaded:
            offload_end[j] = sim.copy("offload", f"L{j}", d2h_free, start, p[j].offload_bytes, end)
            d2h_free = offload_end[j]
            if not duplex:
                h2d_free = d2h_free
            sim.free(p[j].recast_bytes)  # let go when the copies are queued
    for j in reversed(range(n)):
        finish((False, j))
        for i in reload_at.get(j, ()):
            sim.alloc(p[i].offload_bytes)
            reload_start[i] = max(h2d_free, sim.t)
            reload_end[i] = sim.copy("reload", f"L{i}", h2d_free, sim.t, p[i].offload_bytes)
            h2d_free = reload_end[i]
            if not duplex:
                d2h_free = h2d_free
        if j in recomputed:
            sim.alloc(p[j].saved_bytes)
            sim.compute(f"R{j}", p[j].forward_ms)
            sim.compute(f"B{j}", p[j].backward_ms)
            sim.free(p[j].saved_bytes + p[j].input_bytes)
            continue
        if j in offloaded:
            _wait_beside(sim, p[j], reload_start[j], reload_end[j], f"wait reload L{j}")
            sim.alloc(p[j].recast_bytes)  # cast again as its backward reads it
        sim.compute(f"B{j}", p[j].backward_ms)
        sim.free(p[j].saved_bytes)


def _wait_beside(sim: _Sim, layer: LayerProfile, start: float, end: float, label: str) -> None:
    # The copies back come in the order the backward reads them: it runs beside them
    # (NOTE [Reloads in the order backward reads] in engine/reload_order.py).
    share = last_read_share(layer.input_bytes, layer.offload_bytes)
    sim.wait_until(backward_start(start, end, layer.backward_ms, share), label)


def _v1_async(sim: _Sim, p: list[LayerProfile], k: int) -> None:
    n = len(p)
    windows = layer_windows(k, n)
    release_at: dict[int, list[int]] = {}
    for group, window in enumerate(windows):
        release_at.setdefault(window, []).append(group)
    d2h_free = h2d_free = 0.0
    offload_end: dict[int, float] = {}
    reload_start: dict[int, float] = {}
    reload_end: dict[int, float] = {}
    for j in range(n):
        sim.alloc(p[j].saved_bytes)
        start, end = sim.compute(f"F{j}", p[j].forward_ms)
        if j < k:
            offload_end[j] = sim.copy("offload", f"L{j}", d2h_free, start, p[j].offload_bytes, end)
            d2h_free = offload_end[j]
            sim.free(p[j].recast_bytes)  # let go when the copies are queued
        for group in release_at.get(j, ()):
            sim.wait_until(offload_end[group], f"wait offload L{group}")
            sim.free(p[group].offload_bytes)
    for j in reversed(range(n)):
        for group in sorted(release_at.get(j, ()), reverse=True):
            sim.alloc(p[group].offload_bytes)
            reload_start[group] = max(h2d_free, sim.t)
            reload_end[group] = sim.copy(
                "reload", f"L{group}", h2d_free, sim.t, p[group].offload_bytes
            )
            h2d_free = reload_end[group]
        if j < k:
            _wait_beside(sim, p[j], reload_start[j], reload_end[j], f"wait reload L{j}")
            sim.alloc(p[j].recast_bytes)  # cast again as its backward reads it
        sim.compute(f"B{j}", p[j].backward_ms)
        sim.free(p[j].saved_bytes)
