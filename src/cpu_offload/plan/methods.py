"""The one-method plans a searched plan is measured against: a whole-layer method for
the first k layers or all of them, and one part handled alike in every layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .costs import Parts
from .model import Choice, Estimate, Profile, estimate

__all__ = ["best_single_methods", "part_methods", "single_methods"]


def single_methods(num_layers: int) -> dict[str, tuple[Choice | Parts, ...]]:
    """The one-method plans: offload the first k, recompute the first k, recompute all.

    Args:
        num_layers: Layers in the stack.

    Returns:
        Name (``"offload k=2"``, ``"recompute k=3"``, ``"recompute all"``) -> choices.

    Example:
        >>> sorted(single_methods(2))
        ['offload k=1', 'recompute all', 'recompute k=1']
    """
    n = num_layers
    out: dict[str, tuple[Choice | Parts, ...]] = {}
    for k in range(1, n):
        out[f"offload k={k}"] = (Choice.OFFLOAD,) * k + (Choice.KEEP,) * (n - k)
        out[f"recompute k={k}"] = (Choice.RECOMPUTE,) * k + (Choice.KEEP,) * (n - k)
    out["recompute all"] = (Choice.RECOMPUTE,) * n
    return out


def part_methods(profile: Profile) -> dict[str, tuple[Choice | Parts, ...]]:
    """One part recomputed, or offloaded, in every layer that has it (Megatron-LM's
    ``recompute_modules`` and ``--offload-modules`` by hand): for each part name every
    layer's profile shares.

    Args:
        profile: A profile with parts.

    Returns:
        Name (``"recompute self_attention.core_attention in every layer"``) -> choices;
        empty without parts. The last layer never offloads (it is kept).
    """
    layers = profile.layers
    if not layers or not all(c.parts for c in layers):
        return {}
    shared = [
        p.name for p in layers[0].parts if all(p.name in {q.name for q in c.parts} for c in layers)
    ]
    out: dict[str, tuple[Choice | Parts, ...]] = {}
    for name in shared:
        for choice in (Choice.RECOMPUTE, Choice.OFFLOAD):
            plan: list[Choice | Parts] = [
                Parts(tuple((p.name, choice if p.name == name else Choice.KEEP) for p in c.parts))
                for c in layers
            ]
            if choice is Choice.OFFLOAD:
                plan[-1] = Choice.KEEP
            out[f"{choice.value} {name} in every layer"] = tuple(plan)
    return out


def best_single_methods(
    profile: Profile,
    peak_bytes: int,
    candidates: Mapping[str, Sequence[Choice | Parts]] | None = None,
) -> tuple[str, Estimate] | None:
    """The fastest one-method plan whose modelled peak is at most ``peak_bytes``.

    Args:
        profile: Layer costs and the link.
        peak_bytes: Largest peak allowed.
        candidates: Name -> choices (:func:`single_methods` if None).

    Returns:
        ``(name, estimate)``, or None if none fits.

    Example:
        >>> from cpu_offload.plan.model import LayerCost, Link
        >>> layer = LayerCost(1.0, 2.0, saved_bytes=100, offload_bytes=100, input_bytes=10)
        >>> profile = Profile((layer,) * 4, Link(d2h_gbps=1.0, h2d_gbps=1.0))
        >>> best_single_methods(profile, 250)[0]
        'offload k=2'
    """
    methods: dict[str, Sequence[Choice | Parts]] = dict(
        candidates if candidates is not None else single_methods(profile.num_layers)
    )
    best: tuple[str, Estimate] | None = None
    for name, choices in methods.items():
        est = estimate(profile, choices)
        if est.peak_bytes <= peak_bytes and (best is None or est.step_ms < best[1].step_ms):
            best = (name, est)
    return best
