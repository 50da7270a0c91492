"""What one layer's choice asks of a training step: the figures the model replays.

Every choice, whole-layer (:class:`Choice`) or part by part (:class:`Parts`), comes down
to the same few numbers (:class:`Use`): the bytes the layer keeps on the device from its
forward to its backward, the bytes it offloads, and what recomputing adds to its
backward. A :class:`Parts` choice is worked out on the layer's distinct storages, so that
a storage two parts save (a norm's output that three projections take) is kept if any
part keeps it, and a recomputed part's inputs stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.reload_order import last_read_share
from .costs import Choice, HostCost, LayerCost, PartCost, Parts

__all__ = ["Use", "is_offloaded", "layer_bytes", "use_of"]


@dataclass(frozen=True)
class Use:
    """What one layer's choice asks of a step.

    Attributes:
        resident: Bytes kept on the device from the layer's forward to its backward.
        moved: Bytes offloaded: gone between the schedule's offload and reload points.
        recast: Bytes gone at the end of the layer's forward (when its copies are
            queued), rebuilt in backward from tensors it keeps or moves, without a
            copy (saved casts: NOTE [Casts rebuilt from their source] in
            ``cpu_offload/engine/recast.py``).
        copied: Bytes copied to the host and back although the device keeps them too (a
            storage an offloaded part saves and the layer keeps elsewhere): link time,
            and a second device copy from the reload to the layer's backward.
        forward_extra: Bytes its forward holds for a while on top of its temporaries (a
            recomputed layer's or part's activations, dropped at its end).
        rerun_ms: The device's time its backward adds (recomputation, casts rebuilt).
        rerun_bytes: Bytes the recomputation allocates again in backward, until the
            layer's backward ends.
        host_forward_ms: The host's time for its forward.
        host_backward_ms: The host's time for its backward.
        offloaded: Whether it counts as offloaded for the schedule.
        ahead_ms: The device's time its backward runs before it needs a tensor it
            offloaded: the backward of the parts that save only after the last storage
            it moves. 0 for a whole offloaded layer, whose last saved tensor is the first
            its backward needs.
        last_share: The share of the rest of its backward that waits for the last of its
            copies back (NOTE [Reloads in the order backward reads] in
            ``cpu_offload/engine/reload_order.py``); the rest runs beside them.
        queued_share: The share of its forward, on the device's clock, that has run when
            the engine queues its copies: 1 for a whole offloaded layer (at its end), less
            where its last offloaded part runs before the rest of it (NOTE [Parts of a
            layer] in ``cpu_offload/_layer_parts.py``).
        queued_host_share: The same share on the host's clock.
    """

    resident: int
    moved: int
    copied: int = 0
    recast: int = 0
    forward_extra: int = 0
    rerun_ms: float = 0.0
    rerun_bytes: int = 0
    host_forward_ms: float = 0.0
    host_backward_ms: float = 0.0
    offloaded: bool = False
    ahead_ms: float = 0.0
    last_share: float = 1.0
    queued_share: float = 1.0
    queued_host_share: float = 1.0


def is_offloaded(choice: Choice | Parts) -> bool:
    """Whether ``choice`` makes its layer an offloaded layer of the schedule."""
    if isinstance(choice, Parts):
        return choice.offloads
    return choice is Choice.OFFLOAD


def use_of(cost: LayerCost, choice: Choice | Parts, engaged: bool) -> Use:
    """The figures of ``choice`` on the layer ``cost``.

    Args:
        cost: The layer's profile.
        choice: A validated choice (:func:`cpu_offload.plan.model.check_choices`).
        engaged: Whether the plan offloads any layer (every layer then runs under the
            offload context, which costs the host its share).
    """
    if isinstance(choice, Parts):
        return _use_of_parts(cost, choice, engaged)
    host = cost.host
    host_f = 0.0 if host is None else host.forward(choice, engaged)
    host_b = 0.0 if host is None else host.backward(choice, engaged)
    if choice is Choice.OFFLOAD:
        return Use(
            cost.saved_bytes - cost.offload_bytes - cost.recast_bytes,
            cost.offload_bytes,
            recast=cost.recast_bytes,
            rerun_ms=cost.recast_ms,
            host_forward_ms=host_f,
            host_backward_ms=host_b,
            offloaded=True,
            last_share=last_read_share(cost.input_bytes, cost.offload_bytes),
        )
    if choice is Choice.RECAST:
        # NOTE [A kept layer's casts] in cpu_offload/engine/kept_layer.py.
        return Use(
            cost.saved_bytes - cost.recast_bytes,
            0,
            recast=cost.recast_bytes,
            rerun_ms=cost.recast_ms,
            host_forward_ms=host_f,
            host_backward_ms=host_b,
        )
    if choice is Choice.RECOMPUTE:
        alloc = cost.recompute_alloc_bytes
        return Use(
            cost.input_bytes,
            0,
            forward_extra=alloc,
            rerun_ms=cost.rerun_ms,
            rerun_bytes=alloc,
            host_forward_ms=host_f,
            host_backward_ms=host_b,
        )
    return Use(cost.saved_bytes, 0, host_forward_ms=host_f, host_backward_ms=host_b)


def _use_of_parts(cost: LayerCost, parts: Parts, engaged: bool) -> Use:
    storages = cost.storages
    kept = {i for i, s in enumerate(storages) if s.outside}
    offload: set[int] = set()
    recomputed: set[int] = set()
    rerun_ms = rerun_host_ms = 0.0
    for part, (_, choice) in zip(cost.parts, parts.choices, strict=True):
        if choice is Choice.OFFLOAD:
            offload.update(part.saved)
        elif choice is Choice.RECOMPUTE:
            recomputed.update(part.saved)
            kept.update(part.inputs)  # the checkpoint keeps the part's inputs
            rerun_ms += part.forward_ms
            rerun_host_ms += part.host_ms
        else:
            kept.update(part.saved)
    # The engine copies what an offloaded part saves; where the layer keeps it too, the
    # copy frees nothing and comes back as a second device copy. One the engine cannot
    # move stays.
    copies = {i for i in offload if storages[i].offload_bytes > 0}
    movable = copies - kept
    copied = sum(storages[i].offload_bytes for i in copies & kept)
    kept |= offload - copies
    # A saved cast whose source the engine gets too is rebuilt from it, not moved.
    recast = {i for i in movable if storages[i].recast_of in copies}
    movable -= recast
    moved = sum(storages[i].offload_bytes for i in movable)
    resident = sum(storages[i].nbytes for i in kept) + sum(storages[i].nbytes for i in movable)
    resident -= moved
    # A recomputed part's saved tensors the layer keeps no other way live only during
    # its forward; in backward its recomputation makes all of them again (its inputs
    # are the checkpoint's).
    forward_extra = sum(storages[i].nbytes for i in recomputed - kept - copies)
    rerun_inputs = {
        i
        for p, (_, c) in zip(cost.parts, parts.choices, strict=True)
        if c is Choice.RECOMPUTE
        for i in p.inputs
    }
    rerun_bytes = sum(storages[i].nbytes for i in recomputed - rerun_inputs)
    host_f = host_b = 0.0
    host = cost.host
    if host is not None:
        # The engine's host time scales with the share of the layer's bytes it moves,
        # a recomputation's with the share of the layer's forward it runs again: in its
        # forward too, where the checkpoint's hooks take each tensor the part saves (a
        # Llama with a norm recomputed in every layer, 52.4 ms measured, was modelled at
        # 55.3 ms with the whole layer's checkpoint overhead in each layer's forward).
        moved_share = (moved + copied) / cost.offload_bytes if cost.offload_bytes else 0.0
        rerun_share = _rerun_share(cost, host, rerun_host_ms, rerun_ms)
        engaged_f = host.engaged_forward_ms if engaged or parts.offloads else 0.0
        engaged_b = host.engaged_backward_ms if engaged or parts.offloads else 0.0
        # Each part on its own pays a fixed cost (its own checkpoint, or its own hooks and
        # groups), which the whole layer's cost holds once: the shares are of the rest
        # (cpu_offload.plan._parts_host).
        n_rerun = sum(1 for _, c in parts.choices if c is Choice.RECOMPUTE)
        n_sent = sum(1 for _, c in parts.choices if c is Choice.OFFLOAD)
        host_f = (
            host.forward_ms
            + engaged_f
            + _shared(
                moved_share,
                host.offload_forward_ms - host.engaged_forward_ms,
                n_sent,
                host.part_offload_forward_ms,
            )
            + _shared(
                rerun_share, host.recompute_forward_ms, n_rerun, host.part_recompute_forward_ms
            )
        )
        host_b = (
            host.backward_ms
            + engaged_b
            + _shared(
                moved_share,
                host.offload_backward_ms - host.engaged_backward_ms,
                n_sent,
                host.part_offload_backward_ms,
            )
            + _shared(
                rerun_share, host.recompute_backward_ms, n_rerun, host.part_recompute_backward_ms
            )
        )
    queued_share, queued_host_share = _queued_shares(cost, parts)
    return Use(
        resident,
        moved,
        copied,
        recast=sum(storages[i].nbytes for i in recast),
        forward_extra=forward_extra,
        rerun_ms=rerun_ms,
        rerun_bytes=rerun_bytes,
        host_forward_ms=host_f,
        host_backward_ms=host_b,
        offloaded=parts.offloads,
        ahead_ms=_ahead_ms(cost, copies),
        last_share=_last_share(cost, parts, copies - recast),
        queued_share=queued_share,
        queued_host_share=queued_host_share,
    )


def _shared(share: float, whole_ms: float, parts: int, fixed_ms: float) -> float:
    """The host time ``parts`` parts add that make up ``share`` of a layer whose whole
    costs ``whole_ms`` (one fixed cost of ``fixed_ms`` in it): their share of the rest,
    and a fixed cost each."""
    return share * max(whole_ms - fixed_ms, 0.0) + parts * fixed_ms


def _rerun_share(cost: LayerCost, host: HostCost, rerun_host_ms: float, rerun_ms: float) -> float:
    """The share of the layer's forward that its recomputed parts run again: on the
    host's clock, or on the device's where the parts' host times are not known (0, as
    for parts never timed with gradients on), against the whole layer's recomputation,
    which the profile scales with the parts' (``plan/_clock.py``, NOTE [Recomputation
    at the pace of steady training])."""
    whole_ms = host.own_forward_ms or host.forward_ms
    if rerun_host_ms > 0 and whole_ms > 0:
        return min(rerun_host_ms / whole_ms, 1.0)
    if rerun_ms > 0 and cost.rerun_ms > 0:
        return min(rerun_ms / cost.rerun_ms, 1.0)
    return 0.0


def _ahead_ms(cost: LayerCost, sent: set[int]) -> float:
    """The layer's backward time before it needs the first of the storages ``sent`` to
    the host (numbered in the order its forward made them).

    The backward runs the parts in reverse; the parts that saved only after the last
    storage sent run theirs before that storage is needed, so its reload overlaps them.
    Their share of the layer's backward is taken as their share of its forward. "After"
    is the order the forward first used each storage in: in a block whose branches take
    one input side by side (a parallel residual), a part of one branch can count as
    after a part of the other and its backward still run later, which the model misses.
    """
    if not sent:
        return 0.0
    later = _share_after(cost, max(sent), [p.forward_ms for p in cost.parts])
    return 0.0 if later is None else cost.backward_ms * later


def _last_share(cost: LayerCost, parts: Parts, sent: set[int]) -> float:
    """The share of the layer's backward after :func:`_ahead_ms` that waits for the last
    of the storages ``sent`` back (NOTE [Reloads in the order backward reads] in
    ``cpu_offload/engine/reload_order.py``), with ``parts`` its choices.

    What comes back last is the first storage the forward saved of those sent. The
    backward of the parts that saved only before it runs after it is back. Of the
    offloaded parts that saved it, the one the forward ran last (saved the latest
    storage) waits the share of its time that its bytes are of what it sent, the others
    wholly. The parts that saved after it run beside the copies, and a part that saved
    nothing counts as the others do. A whole layer's bytes spread over its backward
    (:func:`last_read_share`); a part's over its own: with the MLP of a Llama layer
    offloaded, its attention's backward waits for the MLP's copies (H200: each layer's
    backward took its 3.7 ms of copies back and 1.7 ms more, which the bytes' spread
    over the whole layer modelled as 0.2 ms more). The order is the storages', with the
    limits :func:`_ahead_ms` names.
    """
    if not sent:
        return 1.0
    first, last = min(sent), max(sent)
    storages = cost.storages
    holders = [
        p
        for p, (_, c) in zip(cost.parts, parts.choices, strict=True)
        if c is Choice.OFFLOAD and first in p.saved
    ]
    reader = max(holders, key=lambda p: max(p.saved), default=None)
    waiting = rest = 0.0  # the times of the parts not ahead of the copies, and waiting
    for part in cost.parts:
        if not part.saved or _saves_after(part, last):
            continue
        rest += part.forward_ms
        if part is reader:
            own = sum(storages[i].offload_bytes for i in part.saved if i in sent)
            waiting += part.forward_ms * storages[first].offload_bytes / own
        elif part in holders or max(part.saved) < first:
            waiting += part.forward_ms
    return min(waiting / rest, 1.0) if rest > 0 else 1.0


def _queued_shares(cost: LayerCost, parts: Parts) -> tuple[float, float]:
    """The shares of the layer's forward, on the device's clock and on the host's, that
    have run when its last offloaded part has (NOTE [Parts of a layer] in
    ``cpu_offload/_layer_parts.py``): all but the parts that save only after the last
    storage an offloaded part saves (:func:`_share_after`). A clock on which the parts
    were not timed counts as the other; (1, 1) where neither was. The order is the
    storages', with the limits :func:`_ahead_ms` names: an offloaded part that saves only
    the layer's input counts as run first, however late it runs.
    """
    sent = [
        max(p.saved)
        for p, (_, c) in zip(cost.parts, parts.choices, strict=True)
        if c is Choice.OFFLOAD and p.saved
    ]
    if not sent:
        return 1.0, 1.0
    device = _share_after(cost, max(sent), [p.forward_ms for p in cost.parts])
    host = _share_after(cost, max(sent), [p.host_ms for p in cost.parts])
    if device is None:
        device = 0.0 if host is None else host
    return 1.0 - device, 1.0 - (device if host is None else host)


def _share_after(cost: LayerCost, last: int, times: list[float]) -> float | None:
    """The share of ``times`` (one per part) of the parts that save only after storage
    ``last``; None where they add up to nothing."""
    total = sum(times)
    if total <= 0:
        return None
    return sum(t for p, t in zip(cost.parts, times, strict=True) if _saves_after(p, last)) / total


def _saves_after(part: PartCost, last: int) -> bool:
    """Whether ``part`` saves something, and all of it after storage ``last``."""
    return bool(part.saved) and min(part.saved) > last


def layer_bytes(cost: LayerCost, choice: Choice | Parts) -> tuple[int, int, int, int]:
    """``(kept, offloaded, recomputed, rebuilt)`` bytes of one layer under ``choice``: what
    stays on the device until its backward, what is moved to the host, what is
    recomputed, and the saved casts let go and cast again in backward.

    Example:
        >>> layer = LayerCost(1.0, 2.0, 100, offload_bytes=60, input_bytes=10, recast_bytes=20)
        >>> layer_bytes(layer, Choice.OFFLOAD), layer_bytes(layer, Choice.RECAST)
        ((20, 60, 0, 20), (80, 0, 0, 20))
        >>> layer_bytes(layer, Choice.RECOMPUTE)
        (10, 0, 90, 0)
    """
    use = use_of(cost, choice, False)
    return use.resident, use.moved + use.copied, use.rerun_bytes, use.recast
