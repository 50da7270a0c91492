"""Plan activation memory per layer: keep, offload or recompute, for a memory budget.

:func:`profile_model` measures a model in a few steps (with ``parts=True`` also the parts
of each layer), :func:`search` chooses per layer, or per part of a layer (:class:`Parts`),
the plan whose modelled step is fastest within a budget (:func:`estimate` is the model),
:func:`apply_plan` runs it through :func:`cpu_offload.offload_layers`, and
:func:`save_plan` / :func:`load_plan` keep it between runs.
"""

from __future__ import annotations

from .apply import apply_plan
from .budget import BudgetCheck, PlanOverBudget
from .io import PlanFileError, load_plan, save_plan
from .methods import best_single_methods, part_methods, single_methods
from .model import (
    Choice,
    Estimate,
    HostCost,
    LayerCost,
    Link,
    PartCost,
    Parts,
    Profile,
    Storage,
    estimate,
)
from .profile import profile_model
from .search import NoPlanFits, Plan, layer_options, search

__all__ = [
    "BudgetCheck",
    "Choice",
    "Estimate",
    "HostCost",
    "LayerCost",
    "Link",
    "NoPlanFits",
    "PartCost",
    "Parts",
    "Plan",
    "PlanFileError",
    "PlanOverBudget",
    "Profile",
    "Storage",
    "apply_plan",
    "best_single_methods",
    "estimate",
    "layer_options",
    "load_plan",
    "part_methods",
    "profile_model",
    "save_plan",
    "search",
    "single_methods",
]
