"""Choosing keep, offload or recompute per layer: the fastest modelled step within a budget.

Each layer's options are the three whole-layer choices and, where its parts were
profiled, the part by part choices that no other option beats on every count
(:func:`layer_options`). Small searches are exhaustive (with a bound that skips plans
whose compute alone is slower than the best found); larger ones start from structured
plans (the first ``m`` layers offloaded, the layers that free the most bytes per
millisecond recomputed, one part by part option on the first layers) and improve them by
changing one layer at a time and by swapping two alike layers' choices until nothing
improves. Every plan is scored by :func:`cpu_offload.plan.model.estimate`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .._args import check_int
from .costs import LayerCost, Parts, offload_layers_arguments
from .model import Choice, Estimate, Link, Profile, check_choices, check_profile, estimate
from .usage import Use, is_offloaded, use_of

__all__ = ["NoPlanFits", "Plan", "brute_force", "layer_options", "search"]

#: Stacks up to this many layers are searched exhaustively by default (3**8 plans).
EXACT_MAX_LAYERS = 8
#: Part by part options kept per layer (the best by bytes freed per millisecond added,
#: half of them offloaded layers of the schedule and half not, where there are enough).
MAX_PART_OPTIONS = 16


class NoPlanFits(ValueError):
    """No per-layer plan keeps the modelled peak within the budget."""


@dataclass(frozen=True)
class Plan:
    """A choice per layer and what the model says of it.

    Attributes:
        choices: Keep, offload or recompute, per layer in forward order, or a choice per
            part of the layer (:class:`cpu_offload.plan.model.Parts`).
        budget_bytes: The device-memory budget the plan was made for.
        step_ms: Modelled step time.
        peak_bytes: Modelled peak device memory.
        profile: The profile it was made from (saved with it, so that it can be made
            again for another budget without profiling), or None.
    """

    choices: tuple[Choice | Parts, ...]
    budget_bytes: int
    step_ms: float
    peak_bytes: int
    profile: Profile | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Checked here, so that a plan built by hand with "offload" or "recompute" as
        # strings is applied as it says, and one that cannot be applied (or saved and
        # loaded again) fails now.
        # Not a sequence: check_choices names the type before it counts.
        n = len(self.choices) if isinstance(self.choices, Sequence) else 0
        layers = None if self.profile is None else self.profile.layers
        if layers is not None and len(layers) != n:
            raise ValueError(
                f"choices has {n} entries, but the plan's profile has {len(layers)} layers"
            )
        checked = check_choices(self.choices, n, layers)
        object.__setattr__(self, "choices", checked)
        _check_budget(self.budget_bytes)

    @property
    def offloaded(self) -> tuple[int, ...]:
        """Indices of the layers offloaded whole."""
        return offload_layers_arguments(self.choices)["offloaded"]

    @property
    def recomputed(self) -> tuple[int, ...]:
        """Indices of the layers recomputed whole."""
        return offload_layers_arguments(self.choices)["recomputed"]

    @property
    def parts(self) -> dict[int, dict[str, str]]:
        """Layer index -> {part name: choice} of the layers planned part by part, in the
        form :func:`cpu_offload.offload_layers` takes (kept parts left out)."""
        return offload_layers_arguments(self.choices)["parts"]

    @property
    def recast(self) -> tuple[int, ...]:
        """Indices of the layers kept with their saved casts rebuilt in backward."""
        return offload_layers_arguments(self.choices)["recast"]

    def describe(self) -> str:
        """One letter per layer: ``K`` keep, ``O`` offload, ``R`` recompute, ``C`` keep
        with its saved casts rebuilt, ``P`` part by part (see
        :meth:`cpu_offload.plan.model.Parts.describe`)."""
        return "".join(LETTERS[c] if isinstance(c, Choice) else "P" for c in self.choices)


#: Each whole-layer choice's letter in :meth:`Plan.describe`.
LETTERS = {Choice.KEEP: "K", Choice.OFFLOAD: "O", Choice.RECOMPUTE: "R", Choice.RECAST: "C"}
_ORDER = {Choice.OFFLOAD: 0, Choice.KEEP: 1, Choice.RECAST: 2, Choice.RECOMPUTE: 3}


def _order(choice: Choice | Parts) -> tuple[int, str]:
    if isinstance(choice, Parts):
        return (4, choice.describe())
    return (_ORDER[choice], "")


def _key(choices: tuple[Choice | Parts, ...], est: Estimate) -> tuple:
    # Fastest first (to a nanosecond: equal steps summed in another order stay equal);
    # then the fewest layers changed, the lowest peak, and earlier offloads (more compute
    # after them to hide their copies), so that every search breaks ties the same way.
    changed = sum(c is not Choice.KEEP for c in choices)
    return (round(est.step_ms, 6), changed, est.peak_bytes, tuple(_order(c) for c in choices))


def _check_budget(budget_bytes: object) -> int:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int (bytes), got {type(budget_bytes).__name__}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
    return budget_bytes


class _Scorer:
    """Estimates with a cache, keeping the best plan within the budget."""

    def __init__(self, profile: Profile, budget: int) -> None:
        self.profile = profile
        self.budget = budget
        self.cache: dict[tuple[Choice | Parts, ...], Estimate] = {}
        self.best: tuple[tuple, tuple[Choice | Parts, ...], Estimate] | None = None
        self.lowest_peak: int | None = None

    def __call__(self, choices: tuple[Choice | Parts, ...]) -> Estimate:
        est = self.cache.get(choices)
        if est is None:
            est = estimate(self.profile, choices)
            self.cache[choices] = est
            if self.lowest_peak is None or est.peak_bytes < self.lowest_peak:
                self.lowest_peak = est.peak_bytes
            if est.peak_bytes <= self.budget:
                key = _key(choices, est)
                if self.best is None or key < self.best[0]:
                    self.best = (key, choices, est)
        return est

    def rank(self, choices: tuple[Choice | Parts, ...]) -> tuple:
        """Order for the local search: fitting plans by key, others by their excess."""
        est = self(choices)
        excess = max(est.peak_bytes - self.budget, 0)
        return (excess, *_key(choices, est))

    def result(self) -> Plan:
        if self.best is None:
            lowest = self.lowest_peak or 0
            raise NoPlanFits(
                f"no plan fits a budget of {self.budget:,} bytes ({self.budget / 2**30:.2f} GiB): "
                f"the lowest modelled peak is {lowest:,} bytes ({lowest / 2**30:.2f} GiB), "
                "with every layer recomputed or offloaded; raise the budget or shrink the "
                "batch"
            )
        _, choices, est = self.best
        return Plan(choices, self.budget, est.step_ms, est.peak_bytes, self.profile)


def _valid(choices: tuple[Choice | Parts, ...]) -> bool:
    return not choices or not is_offloaded(choices[-1])


_WHOLE = (Choice.KEEP, Choice.OFFLOAD, Choice.RECOMPUTE)


def all_part_choices(cost: LayerCost) -> list[Parts]:
    """Every part by part choice of a layer, all parts kept left out (that is keeping it)."""
    names = [p.name for p in cost.parts]
    out = []
    for combo in itertools.product(_WHOLE, repeat=len(names)):
        if any(c is not Choice.KEEP for c in combo):
            out.append(Parts(tuple(zip(names, combo, strict=True))))
    return out


def _figures(use: Use) -> tuple[float, ...]:
    # What a plan's step and peak grow with, each: of two options that are offloaded
    # layers of the schedule alike, one no worse on all of them is never the worse choice.
    return (
        use.resident,
        use.resident + use.moved + use.recast,
        use.moved + use.copied,
        use.copied,
        use.forward_extra,
        use.rerun_bytes,
        use.rerun_ms,
        use.host_forward_ms,
        use.host_backward_ms,
        -use.ahead_ms,
        use.last_share,
        use.queued_share,
        use.queued_host_share,
    )


def layer_options(
    cost: LayerCost, link: Link | None = None, limit: int = MAX_PART_OPTIONS, *, last: bool = False
) -> list[Choice | Parts]:
    """A layer's options for the search: keep, offload, recompute, keep with its saved
    casts rebuilt (where the profile found any), and the part by part choices (where
    its parts were profiled) that no other option beats on every count.

    Options are compared only with options that are, or are not, offloaded layers of
    the schedule alike (an offloaded layer moves the others' offload and reload points,
    whatever it moves itself). Of the part by part options left, the ``limit`` that free
    the most bytes per millisecond they add (of recomputation, and of copies over
    ``link`` where given) are kept, half of them offloaded layers where there are enough.

    Args:
        cost: The layer's profile.
        link: The host link, to count copies as time.
        limit: Most part by part options (>= 0).
        last: The layer is the last one, which cannot be offloaded, whole or in part.

    Returns:
        The options, the whole-layer choices first.

    Raises:
        ValueError: If ``limit`` is negative.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be an int >= 0, got {limit!r}")
    whole: list[Choice | Parts] = [c for c in _WHOLE if not (last and c is Choice.OFFLOAD)]
    if cost.recast_bytes > 0:
        whole.append(Choice.RECAST)
    if not cost.parts:
        return whole
    uses = {c: use_of(cost, c, True) for c in [*whole, *all_part_choices(cost)]}
    uses = {c: u for c, u in uses.items() if not (last and u.offloaded)}
    figures = {c: (u.offloaded, _figures(u)) for c, u in uses.items()}

    def beaten(option: Choice | Parts) -> bool:
        flag, f = figures[option]
        return any(
            other_flag == flag and g != f and all(a <= b for a, b in zip(g, f, strict=True))
            for other, (other_flag, g) in figures.items()
            if other is not option
        )

    taken = {figures[c] for c in whole}
    unique: dict[tuple, Parts] = {}
    for option in uses:
        if isinstance(option, Parts) and not beaten(option) and figures[option] not in taken:
            unique.setdefault(figures[option], option)  # one option per set of figures
    rate = link.d2h_gbps * 1e6 if link is not None else None  # bytes per ms

    def value(option: Parts) -> tuple[float, float, str]:
        use = uses[option]
        freed = cost.saved_bytes - use.resident
        copies = use.moved + use.copied
        added_ms = use.rerun_ms + (copies / rate if rate else 0.0)
        return (-freed / max(added_ms, 1e-6), copies, option.describe())

    ranked = sorted(unique.values(), key=value)
    # Both kinds in the menu: an offloaded layer and a layer that is not are not
    # interchangeable in a plan, however their bytes compare.
    offloaded = [p for p in ranked if uses[p].offloaded]
    not_offloaded = [p for p in ranked if not uses[p].offloaded]
    share = min(len(offloaded), max(limit // 2, limit - len(not_offloaded)))
    best = offloaded[:share] + not_offloaded[: limit - share]
    return [*whole, *sorted(best, key=value)]


def _options(profile: Profile, parts: bool) -> list[list[Choice | Parts]]:
    n = profile.num_layers
    return [
        layer_options(c, profile.link, last=j == n - 1)
        if parts
        else [w for w in _WHOLE if not (j == n - 1 and w is Choice.OFFLOAD)]
        for j, c in enumerate(profile.layers)
    ]


def brute_force(profile: Profile, budget_bytes: int) -> Plan:
    """The best plan over every choice of every layer (the reference of the search):
    the three whole-layer choices and, where a layer's parts were profiled, every part
    by part choice.

    Args:
        profile: Layer costs and the link.
        budget_bytes: Largest modelled peak allowed.

    Returns:
        The fastest fitting plan (ties: the fewest layers not kept, then the lowest
        peak, then offload before keep before recompute before part by part, layer by
        layer).

    Raises:
        NoPlanFits: If no plan fits.

    Example:
        >>> from cpu_offload.plan.model import LayerCost, Link
        >>> layer = LayerCost(1.0, 2.0, saved_bytes=100, offload_bytes=100, input_bytes=10)
        >>> profile = Profile((layer,) * 2, Link(1.0, 1.0))
        >>> brute_force(profile, 150).describe()
        'OK'
    """
    scorer = _Scorer(profile, _check_budget(budget_bytes))
    menus: list[list[Choice | Parts]] = [
        [*_WHOLE, *([Choice.RECAST] if c.recast_bytes > 0 else []), *all_part_choices(c)]
        for c in profile.layers
    ]
    for combo in itertools.product(*menus):
        if _valid(combo):
            scorer(combo)
    return scorer.result()


def _exhaustive(scorer: _Scorer, options: list[list[Choice | Parts]]) -> None:
    """Every valid plan, skipping branches whose compute alone is slower than the best."""
    layers = scorer.profile.layers
    n = len(layers)
    base = sum(c.forward_ms + c.backward_ms for c in layers) + scorer.profile.other_ms
    reruns = [
        [use_of(cost, c, True).rerun_ms for c in menu]
        for cost, menu in zip(layers, options, strict=True)
    ]

    def walk(prefix: tuple[Choice | Parts, ...], compute_ms: float) -> None:
        if scorer.best is not None and compute_ms > scorer.best[0][0] + 1e-6:
            return  # recomputation alone already makes it slower than the best
        if len(prefix) == n:
            if _valid(prefix):
                scorer(prefix)
            return
        j = len(prefix)
        for choice, extra in zip(options[j], reruns[j], strict=True):
            walk((*prefix, choice), compute_ms + extra)

    walk((), base)


def _part_seeds(
    options: list[list[Choice | Parts]],
) -> Iterable[tuple[Choice | Parts, ...]]:
    """One part by part option on the first ``r`` layers (or all but the last) that have
    it, the first ``m`` of the others offloaded whole."""
    n = len(options)
    shared = [o for o in options[0] if isinstance(o, Parts)]
    for option in shared:
        having = [j for j in range(n) if option in options[j]]
        for r in range(1, len(having) + 1):
            chosen = set(having[:r])
            free = [j for j in range(n) if j not in chosen]
            for m in range(len(free) + 1):
                off = set(free[:m])
                plan = tuple(
                    option if j in chosen else Choice.OFFLOAD if j in off else Choice.KEEP
                    for j in range(n)
                )
                if _valid(plan):
                    yield plan


def _seeds(profile: Profile, recast: bool) -> Iterable[tuple[Choice | Parts, ...]]:
    """Structured plans: offload the first ``m`` free layers, recompute the ``r`` best,
    and (``recast``) the same with every kept layer's saved casts rebuilt."""
    layers = profile.layers
    n = len(layers)
    # Bytes freed per ms of recomputation: the cheapest layers to recompute first.
    by_value = sorted(
        range(n),
        key=lambda j: (
            -(layers[j].saved_bytes - layers[j].input_bytes) / max(layers[j].rerun_ms, 1e-9)
        ),
    )
    for r in range(n + 1):
        recomputed = set(by_value[:r])
        # The recomputed set by value, the first r layers or the last r layers.
        for rec in (recomputed, set(range(r)), set(range(n - r, n))):
            free = [j for j in range(n) if j not in rec]
            for m in range(len(free) + 1):
                off = set(free[:m])
                plan = tuple(
                    Choice.RECOMPUTE if j in rec else Choice.OFFLOAD if j in off else Choice.KEEP
                    for j in range(n)
                )
                if _valid(plan):
                    yield plan
                    if recast:
                        yield tuple(
                            Choice.RECAST if c is Choice.KEEP and layers[j].recast_bytes > 0 else c
                            for j, c in enumerate(plan)
                        )


def _neighbours(
    choices: tuple[Choice | Parts, ...], options: list[list[Choice | Parts]]
) -> Iterable[tuple[Choice | Parts, ...]]:
    n = len(choices)
    for j in range(n):
        for c in options[j]:
            if c != choices[j]:
                yield (*choices[:j], c, *choices[j + 1 :])
    for i in range(n):
        for j in range(i + 1, n):
            a, b = choices[i], choices[j]
            if a != b and a in options[j] and b in options[i]:
                swapped = list(choices)
                swapped[i], swapped[j] = b, a
                yield tuple(swapped)


def _local_search(
    scorer: _Scorer, start: tuple[Choice | Parts, ...], options: list[list[Choice | Parts]]
) -> None:
    current = start
    current_rank = scorer.rank(current)
    while True:
        best_rank, best = current_rank, current
        for plan in _neighbours(current, options):
            if _valid(plan):
                rank = scorer.rank(plan)
                if rank < best_rank:
                    best_rank, best = rank, plan
        if best is current:
            return
        current, current_rank = best, best_rank


def search(
    profile: Profile,
    budget_bytes: int,
    *,
    exact_max_layers: int = EXACT_MAX_LAYERS,
    parts: bool = True,
) -> Plan:
    """The fastest modelled plan whose modelled peak stays within ``budget_bytes``.

    Keeping every layer is returned as soon as it fits. Searches of at most as many
    plans as ``3 ** exact_max_layers`` are exhaustive over each layer's options
    (:func:`layer_options`; with three options per layer the result equals
    :func:`brute_force`); larger ones use structured starting plans and local search.

    Args:
        profile: Layer costs and the link.
        budget_bytes: Largest modelled peak device memory allowed, in bytes.
        exact_max_layers: Largest stack of three options per layer searched
            exhaustively.
        parts: Choose finer than whole layers: part by part where the profile has a
            layer's parts, and keeping a layer with its saved casts rebuilt
            (:attr:`Choice.RECAST`) where it found any. False: keep, offload or
            recompute each whole layer.

    Returns:
        The plan.

    Raises:
        TypeError: If ``profile`` is not a :class:`Profile`, ``budget_bytes`` or
            ``exact_max_layers`` not an int, or ``parts`` not a bool.
        ValueError: If ``budget_bytes`` is not positive or ``exact_max_layers`` negative.
        NoPlanFits: If no plan fits the budget (the message gives the lowest peak found).

    Example:
        >>> from cpu_offload.plan.model import LayerCost, Link
        >>> layer = LayerCost(1.0, 2.0, saved_bytes=100, offload_bytes=100, input_bytes=10)
        >>> profile = Profile((layer,) * 4, Link(d2h_gbps=1.0, h2d_gbps=1.0))
        >>> search(profile, 10_000).describe()
        'KKKK'
        >>> search(profile, 250).describe()
        'OOKK'
    """
    scorer = _Scorer(check_profile(profile), _check_budget(budget_bytes))
    if check_int("exact_max_layers", exact_max_layers) < 0:
        raise ValueError(f"exact_max_layers must be >= 0, got {exact_max_layers}")
    n = profile.num_layers
    if n == 0:
        raise ValueError("the profile has no layers")
    if not isinstance(parts, bool):
        raise TypeError(f"parts must be a bool, got {type(parts).__name__}")
    keep = (Choice.KEEP,) * n
    if scorer(keep).peak_bytes <= scorer.budget:
        return scorer.result()
    options = _options(profile, parts)
    if math.prod(len(o) for o in options) <= 3**exact_max_layers:
        _exhaustive(scorer, options)
        return scorer.result()
    seeds = sorted(set(_seeds(profile, parts)), key=scorer.rank)
    part_seeds = sorted(set(_part_seeds(options)), key=scorer.rank)
    for seed in [*seeds[:8], *part_seeds[:8]]:
        _local_search(scorer, seed, options)
    if scorer.best is not None:
        # Polish the best fitting plan too (it may not descend from the top seeds).
        _local_search(scorer, scorer.best[1], options)
    return scorer.result()
