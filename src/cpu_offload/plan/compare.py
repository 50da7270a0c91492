"""The ``plan`` variant of ``cpu-offload compare``: a per-layer plan run on the same layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .._layer_parts import Choice, check_parts
from .._layer_runner import PartRunner
from .._layer_wrap import Patch, patch_layer
from ..compare.variants import Variant
from ..engine.transport import Transport
from ..layers import layer_runner
from .apply import as_modelled, check_plan_layers
from .search import Plan
from .usage import is_offloaded

__all__ = ["PlanVariant", "plan_variant"]


class PlanVariant(Variant):
    """Runs each layer as ``plan`` says: kept, offloaded (its schedule), recomputed, or
    part by part.

    Each layer runs through the runner of :func:`cpu_offload.offload_layers` (the
    one-call API), so that the row measures what :func:`cpu_offload.plan.apply_plan`
    runs.

    Args:
        num_layers, num_offloaded, min_numel, transport_factory: As for
            :class:`cpu_offload.compare.variants.Variant` (``num_offloaded`` is unused:
            the plan says which layers move).
        plan: The plan; it must have ``num_layers`` choices.

    Raises:
        ValueError: If the plan has another number of layers.
    """

    name = "plan"
    offloads = True
    copy_streams = True
    schedule = "plan"

    def __init__(
        self,
        num_layers: int,
        num_offloaded: int,
        min_numel: int,
        transport_factory: Callable[[], Transport] | None = None,
        *,
        plan: Plan,
    ) -> None:
        super().__init__(num_layers, num_offloaded, min_numel, transport_factory)
        check_plan_layers(plan, num_layers)
        self.plan = plan
        kwargs: dict[str, Any] = {"min_tensor_size_to_offload": min_numel}
        offloads = any(is_offloaded(c) for c in plan.choices)
        transport = self._transport() if offloads else None
        if transport is not None:
            kwargs["transport"] = transport
        # The part names are checked against the layers in install().
        parts = {j: {n: Choice(c) for n, c in p.items()} for j, p in plan.parts.items()}
        with as_modelled():
            self.runner, _ = layer_runner(
                num_layers,
                frozenset(plan.offloaded),
                frozenset(plan.recomputed),
                parts=parts,
                recast=frozenset(plan.recast),
                **kwargs,
            )
        if transport is None and self.runner.transport is not None:
            self.transports.append(self.runner.transport)

    @property
    def offloaded_layers(self) -> tuple[int, ...]:
        # With the layers that offload a part: they follow the schedule too.
        return tuple(sorted(self.runner.offloaded))

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        return self.plan.recomputed

    def install(self, layers: list[nn.Module]) -> list[Patch]:
        """Put a part runner in front of each part the plan gives a choice."""
        parts = check_parts(self.plan.parts, layers, self.plan.offloaded + self.plan.recomputed)
        return [
            patch_layer(layers[j].get_submodule(name), PartRunner(self.runner, j, name), j)
            for j, choices in parts.items()
            for name in choices
        ]

    def call(
        self, index: int, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        return self.runner(index, forward, args, kwargs)


def plan_variant(plan: Plan) -> Callable[..., PlanVariant]:
    """A factory with :class:`Variant`'s constructor signature that runs ``plan``.

    Args:
        plan: The plan to run.

    Returns:
        ``make(num_layers, num_offloaded, min_numel, transport_factory=None)``.

    Example:
        >>> from cpu_offload.plan.model import Choice
        >>> plan = Plan((Choice.OFFLOAD, Choice.KEEP, Choice.KEEP), 1, 0.0, 0)
        >>> plan_variant(plan)(3, 0, 1).plan.describe()
        'OKK'
    """

    def make(
        num_layers: int,
        num_offloaded: int,
        min_numel: int,
        transport_factory: Callable[[], Transport] | None = None,
    ) -> PlanVariant:
        return PlanVariant(num_layers, num_offloaded, min_numel, transport_factory, plan=plan)

    return make
