"""Choosing keep, offload or recompute per layer: the fastest modelled step within a budget.

Small stacks are searched exhaustively (with a bound that skips plans whose compute alone
is slower than the best found); larger ones start from structured plans (the first
``m`` layers offloaded, the layers that free the most bytes per millisecond recomputed)
and improve them by moving one layer at a time and by swapping two layers' choices
until nothing improves. Every plan is scored by :func:`cpu_offload.plan.model.estimate`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .model import Choice, Estimate, Profile, estimate

__all__ = ["NoPlanFits", "Plan", "best_single_methods", "brute_force", "search", "single_methods"]

#: Stacks up to this many layers are searched exhaustively by default (3**8 plans).
EXACT_MAX_LAYERS = 8


class NoPlanFits(ValueError):
    """No per-layer plan keeps the modelled peak within the budget."""


@dataclass(frozen=True)
class Plan:
    """A choice per layer and what the model says of it.

    Attributes:
        choices: Keep, offload or recompute, per layer in forward order.
        budget_bytes: The device-memory budget the plan was made for.
        step_ms: Modelled step time.
        peak_bytes: Modelled peak device memory.
        profile: The profile it was made from (saved with it, so that it can be made
            again for another budget without profiling), or None.
    """

    choices: tuple[Choice, ...]
    budget_bytes: int
    step_ms: float
    peak_bytes: int
    profile: Profile | None = field(default=None, compare=False, repr=False)

    @property
    def offloaded(self) -> tuple[int, ...]:
        """Indices of the offloaded layers."""
        return tuple(i for i, c in enumerate(self.choices) if c is Choice.OFFLOAD)

    @property
    def recomputed(self) -> tuple[int, ...]:
        """Indices of the recomputed layers."""
        return tuple(i for i, c in enumerate(self.choices) if c is Choice.RECOMPUTE)

    def describe(self) -> str:
        """One letter per layer: ``K`` keep, ``O`` offload, ``R`` recompute."""
        return "".join(c.value[0].upper() for c in self.choices)


_ORDER = {Choice.OFFLOAD: 0, Choice.KEEP: 1, Choice.RECOMPUTE: 2}


def _key(choices: tuple[Choice, ...], est: Estimate) -> tuple:
    # Fastest first (to a nanosecond: equal steps summed in another order stay equal);
    # then the fewest layers changed, the lowest peak, and earlier offloads (more compute
    # after them to hide their copies), so that every search breaks ties the same way.
    changed = sum(c is not Choice.KEEP for c in choices)
    return (round(est.step_ms, 6), changed, est.peak_bytes, tuple(_ORDER[c] for c in choices))


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
        self.cache: dict[tuple[Choice, ...], Estimate] = {}
        self.best: tuple[tuple, tuple[Choice, ...], Estimate] | None = None
        self.lowest_peak: int | None = None

    def __call__(self, choices: tuple[Choice, ...]) -> Estimate:
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

    def rank(self, choices: tuple[Choice, ...]) -> tuple:
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


def _valid(choices: tuple[Choice, ...]) -> bool:
    return not choices or choices[-1] is not Choice.OFFLOAD


def brute_force(profile: Profile, budget_bytes: int) -> Plan:
    """The best plan over all ``3**n`` per-layer choices (the reference of the search).

    Args:
        profile: Layer costs and the link.
        budget_bytes: Largest modelled peak allowed.

    Returns:
        The fastest fitting plan (ties: the fewest layers not kept, then the lowest
        peak, then offload before keep before recompute, layer by layer).

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
    for combo in itertools.product(list(Choice), repeat=profile.num_layers):
        if _valid(combo):
            scorer(combo)
    return scorer.result()


def _exhaustive(scorer: _Scorer) -> None:
    """Every valid plan, skipping branches whose compute alone is slower than the best."""
    layers = scorer.profile.layers
    n = len(layers)
    base = sum(c.forward_ms + c.backward_ms for c in layers) + scorer.profile.other_ms

    def walk(prefix: tuple[Choice, ...], compute_ms: float) -> None:
        if scorer.best is not None and compute_ms > scorer.best[0][0] + 1e-6:
            return  # recomputation alone already makes it slower than the best
        if len(prefix) == n:
            if _valid(prefix):
                scorer(prefix)
            return
        cost = layers[len(prefix)]
        for choice in Choice:
            extra = cost.rerun_ms if choice is Choice.RECOMPUTE else 0.0
            walk((*prefix, choice), compute_ms + extra)

    walk((), base)


def _seeds(profile: Profile) -> Iterable[tuple[Choice, ...]]:
    """Structured plans: offload the first ``m`` free layers, recompute the ``r`` best."""
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


def _neighbours(choices: tuple[Choice, ...]) -> Iterable[tuple[Choice, ...]]:
    n = len(choices)
    for j in range(n):
        for c in Choice:
            if c is not choices[j]:
                yield (*choices[:j], c, *choices[j + 1 :])
    for i in range(n):
        for j in range(i + 1, n):
            if choices[i] is not choices[j]:
                swapped = list(choices)
                swapped[i], swapped[j] = swapped[j], swapped[i]
                yield tuple(swapped)


def _local_search(scorer: _Scorer, start: tuple[Choice, ...]) -> None:
    current = start
    current_rank = scorer.rank(current)
    while True:
        best_rank, best = current_rank, current
        for plan in _neighbours(current):
            if _valid(plan):
                rank = scorer.rank(plan)
                if rank < best_rank:
                    best_rank, best = rank, plan
        if best is current:
            return
        current, current_rank = best, best_rank


def search(
    profile: Profile, budget_bytes: int, *, exact_max_layers: int = EXACT_MAX_LAYERS
) -> Plan:
    """The fastest modelled plan whose modelled peak stays within ``budget_bytes``.

    Keeping every layer is returned as soon as it fits. Stacks of up to
    ``exact_max_layers`` layers are searched exhaustively (the result equals
    :func:`brute_force`); larger ones by structured starting plans and local search.

    Args:
        profile: Layer costs and the link.
        budget_bytes: Largest modelled peak device memory allowed, in bytes.
        exact_max_layers: Largest stack searched exhaustively.

    Returns:
        The plan.

    Raises:
        TypeError: If ``budget_bytes`` is not an int.
        ValueError: If ``budget_bytes`` is not positive.
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
    scorer = _Scorer(profile, _check_budget(budget_bytes))
    n = profile.num_layers
    if n == 0:
        raise ValueError("the profile has no layers")
    keep = (Choice.KEEP,) * n
    if scorer(keep).peak_bytes <= scorer.budget:
        return scorer.result()
    if n <= exact_max_layers:
        _exhaustive(scorer)
        return scorer.result()
    seeds = sorted(set(_seeds(profile)), key=scorer.rank)
    for seed in seeds[:8]:
        _local_search(scorer, seed)
    if scorer.best is not None:
        # Polish the best fitting plan too (it may not descend from the top seeds).
        _local_search(scorer, scorer.best[1])
    return scorer.result()


def single_methods(num_layers: int) -> dict[str, tuple[Choice, ...]]:
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
    out: dict[str, tuple[Choice, ...]] = {}
    for k in range(1, n):
        out[f"offload k={k}"] = (Choice.OFFLOAD,) * k + (Choice.KEEP,) * (n - k)
        out[f"recompute k={k}"] = (Choice.RECOMPUTE,) * k + (Choice.KEEP,) * (n - k)
    out["recompute all"] = (Choice.RECOMPUTE,) * n
    return out


def best_single_methods(
    profile: Profile, peak_bytes: int, candidates: dict[str, Sequence[Choice]] | None = None
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
    methods: dict[str, Sequence[Choice]] = dict(
        candidates if candidates is not None else single_methods(profile.num_layers)
    )
    best: tuple[str, Estimate] | None = None
    for name, choices in methods.items():
        est = estimate(profile, choices)
        if est.peak_bytes <= peak_bytes and (best is None or est.step_ms < best[1].step_ms):
            best = (name, est)
    return best
