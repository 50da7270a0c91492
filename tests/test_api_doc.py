"""docs/api.md gives the signatures of the code: each one listed here, rendered from the
object itself (parameter names, defaults, ``*``), appears in the page verbatim."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

import cpu_offload
import cpu_offload.optim
import cpu_offload.pipeline
import cpu_offload.plan

API = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()

DOCUMENTED = [
    (cpu_offload, "get_cpu_offload_context"),
    (cpu_offload, "offload_layers"),
    (cpu_offload.plan, "profile_model"),
    (cpu_offload.plan, "search"),
    (cpu_offload.plan, "estimate"),
    (cpu_offload.plan, "apply_plan"),
    (cpu_offload.plan, "save_plan"),
    (cpu_offload.plan, "load_plan"),
    (cpu_offload.plan, "best_single_methods"),
    (cpu_offload.plan, "single_methods"),
    (cpu_offload.plan, "Plan"),
    (cpu_offload.plan, "Profile"),
    (cpu_offload.plan, "LayerCost"),
    (cpu_offload.plan, "HostCost"),
    (cpu_offload.plan, "Link"),
    (cpu_offload.plan, "Parts"),
    (cpu_offload.plan, "PartCost"),
    (cpu_offload.plan, "Storage"),
    (cpu_offload.plan, "part_methods"),
    (cpu_offload.plan, "layer_options"),
    (cpu_offload, "plan_pipeline_offload"),
    (cpu_offload, "PipelineStageOffload"),
    (cpu_offload.pipeline, "PipelineOffloadPlan"),
    (cpu_offload.pipeline, "stage_order"),
    (cpu_offload.pipeline, "PipelineAction"),
    (cpu_offload.optim, "ShardedHybridDeviceOptimizer"),
    (cpu_offload.optim, "shard_parameters"),
]


def _default(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def render(name: str, obj: Any) -> str:
    """``name(a, b=1, *, c=None, **kwargs)`` from ``obj``'s signature, without annotations."""
    parts: list[str] = []
    star = False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={_default(p.default)}")
    return f"{name}({', '.join(parts)})"


def test_render() -> None:
    def f(a, b=1, *args, c="x", **kw):  # type: ignore[no-untyped-def]
        pass

    def g(a, *, b=None):  # type: ignore[no-untyped-def]
        pass

    assert render("f", f) == 'f(a, b=1, *args, c="x", **kw)'
    assert render("g", g) == "g(a, *, b=None)"


@pytest.mark.parametrize(("module", "name"), DOCUMENTED, ids=[n for _, n in DOCUMENTED])
def test_api_page_gives_the_signature(module: Any, name: str) -> None:
    signature = render(name, getattr(module, name))
    assert f"`{signature}`" in API, f"docs/api.md should give `{signature}`"
