"""``cpu-offload compare``: V1 against V2 (and the alternatives) on your model."""

from .runner import CompareConfig, CompareReport, VariantResult, measure_link, run_compare
from .simulate import LayerProfile, SimResult, simulate
from .variants import VARIANTS

__all__ = [
    "VARIANTS",
    "CompareConfig",
    "CompareReport",
    "LayerProfile",
    "SimResult",
    "VariantResult",
    "measure_link",
    "run_compare",
    "simulate",
]
