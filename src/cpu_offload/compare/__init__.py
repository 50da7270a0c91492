"""``cpu-offload compare``: V1 against V2 (and the alternatives) on your model, and
optimizer-state offloading fractions beside them. :func:`compare_model` is the Python
form."""

from .._link import measure_link
from .defaults import ModelDefaults, defaults_for
from .model import DEFAULT_VARIANTS, compare_model, default_offloaded
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
from .plot import write_plot
from .report import format_table, write_json
from .runner import CompareConfig, CompareReport, VariantResult, run_compare
from .simulate import LayerProfile, SimResult, simulate
from .variants import VARIANTS
from .workload import Workload

__all__ = [
    "DEFAULT_FRACTIONS",
    "DEFAULT_VARIANTS",
    "VARIANTS",
    "CompareConfig",
    "CompareReport",
    "CompareSelection",
    "LayerProfile",
    "ModelDefaults",
    "OptimizerCompareConfig",
    "OptimizerReport",
    "OptimizerResult",
    "OptimizerVariant",
    "SimResult",
    "VariantResult",
    "Workload",
    "compare_model",
    "default_offloaded",
    "default_optimizer_variants",
    "defaults_for",
    "format_table",
    "measure_link",
    "run_compare",
    "run_optimizer_compare",
    "select_from_overrides",
    "simulate",
    "write_json",
    "write_plot",
]
