"""Step time and peak memory of a per-layer plan: keep, offload or recompute each layer.

The model replays one training step on three lanes: the compute stream, and the
device-to-host and host-to-device copies (one copy stream shared by both directions,
or one stream per direction sharing the link's duplex bandwidth). Offloaded layers
follow the schedule :func:`offload_schedule` builds: the memory bound of the default
schedule (at most as many layers' activations on the device as there are layers not
offloaded) holds, and compute waits for an offload to finish where the schedule
releases its memory. Recomputed layers keep their input from their forward to their
backward, where their forward runs again just before their backward. Between the last
layer's forward and its backward, the output head and the loss take their own memory
(:attr:`Profile.head_bytes`) on top of what the layers hold.

Where the profile knows the host's time (:class:`HostCost`), a fourth lane replays it:
the host enqueues each layer's work and the compute stream runs it, no sooner than it was
enqueued. On models whose kernels are shorter than their launches the host bounds the
step, and what offloading and recomputation add to it (hooks, copies to launch, a
forward run again) counts in full, as it does in the measured step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._layer_parts import PART_CHOICES
from .._layer_stack import offload_schedule as layer_stack_schedule
from ..engine.reload_order import backward_start
from ..v2.schedule import Point, Schedule, SyncDict, validate_synchronization_dict
from .costs import Choice, HostCost, LayerCost, PartCost, Parts, Storage
from .usage import is_offloaded, use_of

__all__ = [
    "Choice",
    "Estimate",
    "HostCost",
    "LayerCost",
    "Link",
    "PartCost",
    "Parts",
    "Profile",
    "Storage",
    "check_choices",
    "estimate",
    "offload_schedule",
]


@dataclass(frozen=True)
class Link:
    """The host link: pinned-copy bandwidth in GB/s.

    Attributes:
        d2h_gbps: Device to host, alone.
        h2d_gbps: Host to device, alone.
        duplex_gbps: Both directions at once, in total (``d2h + h2d`` if None: full duplex).
        two_streams: Copies in each direction run on their own stream, so that an offload
            and a reload can overlap; otherwise one stream runs them in the order queued.
    """

    d2h_gbps: float
    h2d_gbps: float
    duplex_gbps: float | None = None
    two_streams: bool = False

    def __post_init__(self) -> None:
        for name in ("d2h_gbps", "h2d_gbps", "duplex_gbps"):
            value = getattr(self, name)
            if value is None and name == "duplex_gbps":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Link.{name} must be a positive number of GB/s, got {value!r}")

    def rates(self, both: bool) -> tuple[float, float]:
        """Bytes per ms each direction moves, while the other one is (``both``) busy or not."""
        d, h = self.d2h_gbps * 1e6, self.h2d_gbps * 1e6
        if both and self.duplex_gbps is not None:
            share = min(1.0, self.duplex_gbps / (self.d2h_gbps + self.h2d_gbps))
            return d * share, h * share
        return d, h


@dataclass(frozen=True)
class Profile:
    """What the planner knows of one model, batch and machine.

    Attributes:
        layers: One cost per layer, in forward order.
        link: The host link.
        static_bytes: Device memory allocated when the step starts (parameters, gradients,
            optimizer state, the batch): the peak is this plus the step's own memory.
        other_ms: Step time outside the layers (loss, embedding, optimizer).
        device: Where it was measured, in words.
        head_bytes: Memory the part of the step between the last layer's forward and its
            backward (the output head and the loss) takes at its peak, above what the
            layers hold then. With a large vocabulary the step's peak falls there.
        head_ms: The device's time for that part, where it is modelled apart from
            ``other_ms`` (with the host's time, :class:`HostCost`); 0 otherwise.
        head_host_ms: The host's time for that part. Where the head is the device's
            work (a large vocabulary), the host gets ahead there, and the backward's
            first layers spend that lead.
    """

    layers: tuple[LayerCost, ...]
    link: Link
    static_bytes: int = 0
    other_ms: float = 0.0
    device: str = ""
    head_bytes: int = 0
    head_ms: float = 0.0
    head_host_ms: float = 0.0

    @property
    def num_layers(self) -> int:
        return len(self.layers)


@dataclass(frozen=True)
class Estimate:
    """The model's step time (ms), peak device memory (bytes) and compute stalls (ms)."""

    step_ms: float
    peak_bytes: int
    stall_ms: float


def check_choices(
    choices: Sequence[object], num_layers: int, layers: Sequence[LayerCost] | None = None
) -> tuple[Choice | Parts, ...]:
    """Validate one choice per layer; strings are accepted, and per part choices.

    The last layer cannot be offloaded (no later forward can hide its copy), and with it
    every layer followed only by offloaded layers: each offloaded layer needs a layer
    after it that stays on the device, as in the default schedule's ``k <= n - 1``. A
    layer's choice may also be part by part (:class:`Parts`, or a mapping of part names
    to choices, the parts left out kept), for a layer whose parts were profiled.

    Args:
        choices: ``"keep"``, ``"offload"``, ``"recompute"`` or ``"recast"`` (or
            :class:`Choice`), or per part choices (no ``"recast"``), per layer.
        num_layers: The model's layers.
        layers: The layers' costs, to check per part choices against their parts.

    Returns:
        The choices as :class:`Choice` or :class:`Parts` values.

    Raises:
        TypeError: If ``choices`` is not a sequence.
        ValueError: On a wrong length, an unknown choice or part, parts for a layer
            without profiled parts, or an offloaded last layer.

    Example:
        >>> check_choices(["offload", "keep"], 2)
        (<Choice.OFFLOAD: 'offload'>, <Choice.KEEP: 'keep'>)
    """
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise TypeError(f"choices must be a sequence of choices, got {type(choices).__name__}")
    if len(choices) != num_layers:
        raise ValueError(f"choices has {len(choices)} entries for {num_layers} layers")
    out: list[Choice | Parts] = []
    for i, c in enumerate(choices):
        if isinstance(c, (Parts, Mapping)):
            out.append(_checked_parts(i, c, None if layers is None else layers[i]))
            continue
        out.append(_checked_choice(f"choices[{i}]", c))
    if out and is_offloaded(out[-1]):
        raise ValueError(
            f"choices[{num_layers - 1}]: the last layer cannot be offloaded, whole or a "
            "part of it (no later forward hides its copy); keep or recompute it"
        )
    return tuple(out)


def _checked_choice(
    name: str, choice: object, allowed: tuple[Choice, ...] = tuple(Choice)
) -> Choice:
    try:
        checked = Choice(choice)
        if checked in allowed:
            return checked
    except ValueError:
        pass
    names = ", ".join(repr(x.value) for x in allowed)
    given = choice.value if isinstance(choice, Choice) else choice
    raise ValueError(f"{name} must be one of {names}; got {given!r}") from None


def _checked_parts(i: int, given: Parts | Mapping, cost: LayerCost | None) -> Parts:
    """A layer's per part choices, checked against its profiled parts (if known)."""
    pairs = given.choices if isinstance(given, Parts) else tuple(given.items())
    named = {
        str(name): _checked_choice(f"choices[{i}][{name!r}]", c, PART_CHOICES) for name, c in pairs
    }
    if cost is None:
        if not isinstance(given, Parts):
            raise ValueError(
                f"choices[{i}]: per part choices as a mapping need the layers' costs to "
                "order them (pass a Parts value, or check them with the profile)"
            )
        return Parts(tuple(named.items()))
    names = [p.name for p in cost.parts]
    if not names:
        raise ValueError(
            f"choices[{i}]: layer {i} has no profiled parts; profile the model with "
            "parts to choose per part"
        )
    unknown = [n for n in named if n not in names]
    if unknown or (isinstance(given, Parts) and list(named) != names):
        raise ValueError(
            f"choices[{i}]: the parts must be those profiled for layer {i} "
            f"({', '.join(names)}), got {', '.join(map(repr, named))}"
        )
    return Parts(tuple((n, named.get(n, Choice.KEEP)) for n in names))


def offload_schedule(choices: Sequence[Choice | Parts]) -> SyncDict:
    """The synchronization dict of the offloaded layers of ``choices``.

    The schedule :func:`cpu_offload.offload_layers` gives an explicit set of layers: the
    default schedule generalized, where the ``i``-th of ``m`` offloaded layers (in
    forward order) finishes its offload before the forward of layer ``n-m+i`` and starts
    its reload when the backward of layer ``n-m+i-1`` starts. With the first ``k``
    layers offloaded this is the default schedule.

    Args:
        choices: Validated choices (see :func:`check_choices`).

    Returns:
        Layer id -> ``(offload_fwd, offload_num, reload_fwd, reload_num)``.

    Example:
        >>> offload_schedule([Choice.OFFLOAD, Choice.RECOMPUTE, Choice.KEEP])
        {0: (True, 2, False, 1)}
    """
    n = len(choices)
    offloaded = frozenset(j for j, c in enumerate(choices) if is_offloaded(c))
    return validate_synchronization_dict(layer_stack_schedule(offloaded, n), n)


#: Bytes left below which a copy counts as done (float rounding of the fluid model).
_DONE = 0.5


class _Copies:
    """The copy lanes as a fluid model: queued copies progress at the link's rates.

    Each lane is a FIFO of ``[earliest start, bytes left, not before, job]``; with one
    stream both directions share one FIFO. ``run_until`` advances every lane to a time;
    ``end_of`` advances until a job is done (compute is stalled meanwhile, so no new copy
    is queued).
    """

    def __init__(self, link: Link) -> None:
        self.link = link
        self.now = 0.0
        self.lanes: dict[str, deque[list]] = {"d2h": deque(), "h2d": deque()}
        self.done: dict[int, float] = {}
        self.started: dict[int, float] = {}
        self._next_job = 0

    def _lane(self, direction: str) -> deque[list]:
        return self.lanes[direction if self.link.two_streams else "d2h"]

    def queue(self, direction: str, earliest: float, nbytes: int, not_before: float) -> int:
        job = self._next_job
        self._next_job += 1
        self._lane(direction).append([earliest, float(nbytes), not_before, job, direction])
        return job

    def _step(self, limit: float) -> bool:
        """Advance to the next event, at most to ``limit``; False when nothing is left to do."""
        heads = [q[0] for q in self.lanes.values() if q]
        if not heads:
            self.now = max(self.now, limit)
            return False
        active = [h for h in heads if h[0] <= self.now and h[1] > _DONE]
        busy_dirs = {h[4] for h in active}
        d_rate, h_rate = self.link.rates(len(busy_dirs) == 2)
        events = [limit]
        for h in heads:
            if h[0] > self.now:
                events.append(h[0])
            elif h[1] > _DONE:
                rate = d_rate if h[4] == "d2h" else h_rate
                events.append(self.now + h[1] / rate)
            else:
                events.append(max(h[2], self.now))
        t = min(events)
        for h in active:
            self.started.setdefault(h[3], self.now)
            rate = d_rate if h[4] == "d2h" else h_rate
            h[1] = max(h[1] - (t - self.now) * rate, 0.0)
        self.now = t
        for q in self.lanes.values():
            # A copy whose bytes are moved is done once the compute it follows has ended.
            while q and q[0][0] <= self.now and q[0][1] <= _DONE and q[0][2] <= self.now:
                self.done[q[0][3]] = self.now
                q.popleft()
                if q:
                    q[0][0] = max(q[0][0], self.now)
        return True

    def run_until(self, t: float) -> None:
        while self.now < t:
            if not self._step(t):
                break

    def end_of(self, job: int) -> float:
        while job not in self.done:
            self._step(float("inf"))
        return self.done[job]


class _Timeline:
    """Compute-stream and host time, and device memory, of the step being replayed."""

    def __init__(self, profile: Profile) -> None:
        self.t = 0.0
        self.host = 0.0
        self.mem = 0
        self.peak = 0
        self.stall = 0.0
        self.copies = _Copies(profile.link)

    def alloc(self, nbytes: int) -> None:
        self.mem += nbytes
        self.peak = max(self.peak, self.mem)

    def free(self, nbytes: int) -> None:
        self.mem -= nbytes

    def compute(self, ms: float, workspace: int, host_ms: float = 0.0) -> tuple[float, float]:
        """Run ``ms`` of device work that the host takes ``host_ms`` to enqueue.

        The stream starts it no sooner than the host starts enqueuing it, and ends it no
        sooner than the host has enqueued all of it.
        """
        self.peak = max(self.peak, self.mem + workspace)
        start = max(self.t, self.host)
        self.host += host_ms
        self.t = max(start + ms, self.host)
        return start, self.t

    def wait_for(self, job: int) -> None:
        self.copies.run_until(self.t)
        self._wait_until(self.copies.end_of(job))

    def wait_beside(self, job: int, busy_ms: float, last_share: float) -> None:
        """Wait until a backward of ``busy_ms`` may start beside the copies of ``job``
        (NOTE [Reloads in the order backward reads] in ``engine/reload_order.py``)."""
        self.copies.run_until(self.t)
        end = self.copies.end_of(job)
        start = self.copies.started.get(job, end)  # a copy of no bytes never ran
        self._wait_until(backward_start(start, end, busy_ms, last_share))

    def _wait_until(self, end: float) -> None:
        if end > self.t:
            self.stall += end - self.t
            self.t = end


def check_profile(profile: object) -> Profile:
    """``profile`` if it is a :class:`Profile`, else ``TypeError`` naming it."""
    if not isinstance(profile, Profile):
        raise TypeError(
            f"profile must be a Profile (from profile_model() or a plan's .profile), got "
            f"{type(profile).__name__}"
        )
    return profile


def estimate(profile: Profile, choices: Sequence[object]) -> Estimate:
    """Model one training step of ``profile`` under the per-layer ``choices``.

    Args:
        profile: Layer costs and the link.
        choices: One of ``"keep"``, ``"offload"``, ``"recompute"``, ``"recast"`` per
            layer, or per part choices.

    Returns:
        The modelled step time, peak device memory (``profile.static_bytes`` plus the
        step's) and the time compute waits for copies.

    Raises:
        TypeError: If ``profile`` is not a :class:`Profile`.
        ValueError: If the choices are invalid for the profile (see :func:`check_choices`).

    Example:
        >>> layer = LayerCost(1.0, 2.0, saved_bytes=100, offload_bytes=100, input_bytes=10)
        >>> profile = Profile((layer,) * 3, Link(d2h_gbps=1e-4, h2d_gbps=1e-4))
        >>> estimate(profile, ["keep"] * 3)
        Estimate(step_ms=9.0, peak_bytes=300, stall_ms=0.0)
        >>> estimate(profile, ["recompute", "keep", "keep"]).step_ms
        10.0
    """
    layers = check_profile(profile).layers
    n = len(layers)
    plan = check_choices(choices, n, layers)
    schedule = Schedule(offload_schedule(plan))
    tl = _Timeline(profile)
    # Any offloaded layer puts every layer under the offload context.
    engaged = any(is_offloaded(c) for c in plan)
    uses = [use_of(cost, choice, engaged) for cost, choice in zip(layers, plan, strict=True)]
    offload_job: dict[int, int] = {}
    reload_job: dict[int, int] = {}

    def run_point(point: Point) -> None:
        for i in schedule.finish_at.get(point, ()):
            tl.wait_for(offload_job[i])
            tl.free(uses[i].moved)
        for i in schedule.reload_at.get(point, ()):
            back = uses[i].moved + uses[i].copied
            tl.copies.run_until(tl.t)
            tl.alloc(back)
            reload_job[i] = tl.copies.queue("h2d", tl.t, back, 0.0)

    for j, (cost, use) in enumerate(zip(layers, uses, strict=True)):
        run_point(Point(True, j))
        # A recomputed layer's (or part's) saved tensors live only during its forward.
        tl.alloc(use.resident + use.moved + use.recast)
        host_start = tl.host
        start, end = tl.compute(
            cost.forward_ms, use.forward_extra + cost.workspace_bytes, use.host_forward_ms
        )
        if use.offloaded:
            # The engine queues a layer's copies when the host has enqueued the layer
            # (at the next layer's start), or its last offloaded part (NOTE [Parts of a
            # layer] in cpu_offload/_layer_parts.py); each then waits for its tensor to
            # be saved, and the last ends after that part.
            queued = max(start, host_start + use.queued_host_share * use.host_forward_ms)
            saved = max(start + use.queued_share * cost.forward_ms, queued)
            tl.copies.run_until(queued)
            offload_job[j] = tl.copies.queue("d2h", queued, use.moved + use.copied, saved)
        # Saved casts go when the layer's copies are queued (or its forward ends, where
        # it moves nothing), and are cast again in its backward (NOTE [Casts rebuilt
        # from their source] in engine/recast.py).
        tl.free(use.recast)
    # The head and the loss run on what the layers hold at the end of the forward.
    tl.alloc(profile.head_bytes)
    tl.compute(profile.head_ms, 0, profile.head_host_ms)
    tl.free(profile.head_bytes)
    for j in reversed(range(n)):
        cost, use = layers[j], uses[j]
        run_point(Point(False, j))
        tl.alloc(use.rerun_bytes + use.recast)
        busy_ms, host_ms = use.rerun_ms + cost.backward_ms, use.host_backward_ms
        if use.offloaded:
            # The backward runs until it needs its first offloaded tensor, which comes
            # back meanwhile; then beside the rest of the layer's copies, which come back
            # in the order it reads them.
            ahead = min(use.ahead_ms, cost.backward_ms)
            if ahead > 0:
                ahead_host = host_ms * ahead / busy_ms
                tl.compute(ahead, cost.workspace_bytes, ahead_host)
                busy_ms, host_ms = busy_ms - ahead, host_ms - ahead_host
            tl.wait_beside(reload_job[j], busy_ms, use.last_share)
        tl.compute(busy_ms, cost.workspace_bytes, host_ms)
        tl.free(use.resident + use.moved + use.copied + use.recast + use.rerun_bytes)
    return Estimate(tl.t + profile.other_ms, profile.static_bytes + tl.peak, tl.stall)
