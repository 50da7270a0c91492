"""Methods ``plan.py --parts`` measures a plan against beside the planner's own one-method
plans: Megatron-LM's selective recomputation with our offloading of the first k layers,
rows of the table a plan part by part must beat (workload D: the core attention
recomputed in every layer, the rest of the first 4 or 8 layers offloaded)."""

from __future__ import annotations

from collections.abc import Iterable

from cpu_offload.plan import Choice, Profile, estimate, part_methods
from cpu_offload.plan.costs import Parts

__all__ = ["recomputed_part_with_offload"]


def recomputed_part_with_offload(
    profile: Profile, ks: Iterable[int]
) -> dict[str, tuple[Choice | Parts, ...]]:
    """The part whose recomputation in every layer lowers the modelled peak most,
    recomputed in every layer, with the rest of the first k layers offloaded, for each k
    in ``ks`` between 1 and the number of layers less one; empty without parts.

    Returns:
        Name (``"recompute self_attention.core_attention in every layer, the rest of the
        first 4 offloaded"``) -> choices.
    """
    recomputed = [
        (name, plan, part)
        for name, plan in part_methods(profile).items()
        if isinstance(plan[0], Parts)
        for part, choice in plan[0].choices
        if choice is Choice.RECOMPUTE
    ]
    if not recomputed:
        return {}
    label, _, part = min(recomputed, key=lambda item: estimate(profile, item[1]).peak_bytes)
    n = profile.num_layers
    out: dict[str, tuple[Choice | Parts, ...]] = {}
    for k in sorted(set(ks)):
        if not 0 < k < n:
            continue
        plan_k: list[Choice | Parts] = []
        for j, layer in enumerate(profile.layers):
            rest = Choice.OFFLOAD if j < k else Choice.KEEP
            plan_k.append(
                Parts(
                    tuple(
                        (p.name, Choice.RECOMPUTE if p.name == part else rest) for p in layer.parts
                    )
                )
            )
        out[f"{label}, the rest of the first {k} offloaded"] = tuple(plan_k)
    return out
