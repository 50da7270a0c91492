"""The ``plan`` variant of ``cpu-offload compare``: a per-layer plan run on the same layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..compare.variants import Variant
from ..engine.transport import Transport
from ..layers import layer_runner
from .apply import as_modelled, check_plan_layers
from .search import Plan

__all__ = ["PlanVariant", "plan_variant"]


class PlanVariant(Variant):
    """Runs each layer as ``plan`` says: kept, offloaded (its schedule) or recomputed.

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
        transport = self._transport() if plan.offloaded else None
        if transport is not None:
            kwargs["transport"] = transport
        with as_modelled():
            self.runner, _ = layer_runner(
                num_layers, frozenset(plan.offloaded), frozenset(plan.recomputed), **kwargs
            )
        if transport is None and self.runner.transport is not None:
            self.transports.append(self.runner.transport)

    @property
    def offloaded_layers(self) -> tuple[int, ...]:
        return self.plan.offloaded

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        return self.plan.recomputed

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
