"""``cpu-offload compare``: V1 against V2 (and the alternatives) on your model, and
optimizer-state offloading fractions beside them."""

from .optimizer import (
    DEFAULT_FRACTIONS,
    OptimizerCompareConfig,
    OptimizerReport,
    OptimizerResult,
    OptimizerVariant,
    default_optimizer_variants,
    run_optimizer_compare,
)
from .overrides import CompareSelection, select_from_overrides
from .runner import CompareConfig, CompareReport, VariantResult, measure_link, run_compare
from .simulate import LayerProfile, SimResult, simulate
from .variants import VARIANTS

__all__ = [
    "DEFAULT_FRACTIONS",
    "VARIANTS",
    "CompareConfig",
    "CompareReport",
    "CompareSelection",
    "LayerProfile",
    "OptimizerCompareConfig",
    "OptimizerReport",
    "OptimizerResult",
    "OptimizerVariant",
    "SimResult",
    "VariantResult",
    "default_optimizer_variants",
    "measure_link",
    "run_compare",
    "run_optimizer_compare",
    "select_from_overrides",
    "simulate",
]
