"""The ``plan`` variant of ``cpu-offload compare``: a per-layer plan run on the same layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import v2
from ..compare.variants import Variant
from ..engine.transport import Transport
from .model import Choice, offload_schedule
from .search import Plan

__all__ = ["PlanVariant", "plan_variant"]


class PlanVariant(Variant):
    """Runs each layer as ``plan`` says: kept, offloaded (its schedule) or recomputed.

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
        if len(plan.choices) != num_layers:
            raise ValueError(f"the plan has {len(plan.choices)} layers, the model {num_layers}")
        self.plan = plan
        self.ctx: Any = None
        self.sync: Any = None
        if plan.offloaded:
            transport = self._transport()
            self.ctx, self.sync = v2.get_cpu_offload_context(  # type: ignore[misc]
                True,
                len(plan.offloaded),
                num_layers,
                synchronization_dict=offload_schedule(plan.choices),
                min_tensor_size_to_offload=min_numel,
                transport=transport,
            )
            if transport is None:
                self.transports.append(self.ctx.offload_synchronizer.transport)

    def run_layer(self, index: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        recompute = self.plan.choices[index] is Choice.RECOMPUTE
        if self.ctx is None:
            return checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        # Every layer runs under the context, so that the schedule counts all of them.
        with self.ctx:
            x = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        return self.sync(x)


def plan_variant(plan: Plan) -> Callable[..., PlanVariant]:
    """A factory with :class:`Variant`'s constructor signature that runs ``plan``.

    Example:
        >>> plan = Plan((Choice.OFFLOAD, Choice.KEEP), 1, 0.0, 0)
        >>> plan_variant(plan)(2, 0, 1).plan.describe()
        'OK'
    """

    def make(
        num_layers: int,
        num_offloaded: int,
        min_numel: int,
        transport_factory: Callable[[], Transport] | None = None,
    ) -> PlanVariant:
        return PlanVariant(num_layers, num_offloaded, min_numel, transport_factory, plan=plan)

    return make
