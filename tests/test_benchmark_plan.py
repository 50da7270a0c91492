"""``benchmarks/plan.py`` pieces that run without a GPU: the profile's runners are
recorded (its pace factor goes into the results) and the report shows the factor."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from cpu_offload.plan import profile_model

ROOT = Path(__file__).parent.parent


def _plan_script() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("plan_benchmark", ROOT / "benchmarks/plan.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_the_profiles_runner_is_recorded_with_its_pace() -> None:
    plan = _plan_script()
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(2)])
    x = torch.randn(8, 16)
    with plan._runners() as runners:
        profile_model(
            model, lambda: model(x).sum(), steps=1, host=True, min_tensor_size_to_offload=64
        )
    assert len(runners) == 1 and runners[0].pace_factor == 1.0  # the CPU stand-in's
    assert plan.HostAndDevice.profile is not None  # put back
    with plan._runners() as later:
        pass
    assert later == []


def test_the_report_shows_the_pace_and_the_warm_up() -> None:
    plan = _plan_script()
    gib = 2**30
    result = {
        "workload": "compare",
        "layers": 8,
        "none": {"measured": [22.5, 3 * gib], "modelled": [22.4, 3 * gib]},
        "pace_factor": 1.0621,
        "rows": [],
        "singles": {},
    }
    text = plan.markdown([result], "NVIDIA H200", 5, 3, 2, 0.3)
    assert "after 2 and 0.3 s of untimed steps back to back" in text
    assert "modelled 22.4 ms, 3.00 GiB; device times scaled by 1.062 to steady pace)" in text
    del result["pace_factor"]  # results written before the factor was recorded
    assert "modelled 22.4 ms, 3.00 GiB)" in plan.markdown([result], "d", 5, 3, 2)


class _Runner:
    """What ``_paces`` reads of a profile's runner: its scale moves when it rebuilds."""

    pace_factor = 1.06
    recompute_scale = 1.25

    def rebuild(self, pace: str) -> str:
        assert pace == "calm"
        return "calm rounds' profile"

    def at_steady_pace(self, profile: str) -> str:
        self.recompute_scale = 0.75  # solved again, for the calm rounds' profile
        return f"{profile}, at steady pace"


def test_the_calm_profile_s_scale_is_recorded_beside_the_main_one() -> None:
    plan = _plan_script()
    pace, calm_host, calm_scale = plan._paces(_Runner(), parts=False)
    assert pace == (1.06, 1.25)  # read before the calm profile's solve overwrote it
    assert calm_host == "calm rounds' profile, at steady pace" and calm_scale == 0.75
    assert plan._paces(_Runner(), parts=True) == ((1.06, 1.25), None, None)
    assert plan._paces(None, parts=False) == (None, None, None)


def _methods_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "plan_methods", ROOT / "benchmarks/_plan_methods.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_selective_recomputation_beside_offloading_of_the_first_k() -> None:
    # The core's scores are the largest storage: recomputing the core in every layer
    # frees most, and the rest of the first k layers is offloaded, never the last layer.
    from test_plan_parts import LAYER, _parts

    from cpu_offload.plan import Choice, Link, Profile

    K, R, OFF = Choice.KEEP, Choice.RECOMPUTE, Choice.OFFLOAD
    profile = Profile((LAYER,) * 4, Link(d2h_gbps=1.0, h2d_gbps=1.0))
    methods = _methods_script().recomputed_part_with_offload(profile, [0, 1, 3, 4, 3])
    assert list(methods) == [
        "recompute core in every layer, the rest of the first 1 offloaded",
        "recompute core in every layer, the rest of the first 3 offloaded",
    ]
    first_three = methods["recompute core in every layer, the rest of the first 3 offloaded"]
    assert first_three == (_parts(OFF, R, OFF),) * 3 + (_parts(K, R, K),)
    no_parts = Profile((dataclasses.replace(LAYER, parts=()),) * 4, profile.link)
    assert _methods_script().recomputed_part_with_offload(no_parts, [2]) == {}
    one = Profile((LAYER,), profile.link)  # one layer: nothing to offload, no k fits
    assert _methods_script().recomputed_part_with_offload(one, [1, 2]) == {}
