"""Plans saved as JSON and loaded back; bad files name the wrong field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from cpu_offload.plan.io import (
    FORMAT,
    VERSION,
    PlanFileError,
    load_plan,
    plan_from_dict,
    plan_to_dict,
    save_plan,
)
from cpu_offload.plan.model import (
    Choice,
    HostCost,
    LayerCost,
    Link,
    PartCost,
    Parts,
    Profile,
    Storage,
)
from cpu_offload.plan.search import Plan, search


def _plan() -> Plan:
    layers = (
        LayerCost(1.0, 2.0, 1000, 900, 100, recompute_ms=1.1, workspace_bytes=50),
        LayerCost(
            1.5, 2.5, 2000, 2000, 100, host=HostCost(0.5, 1.0, 0.25, 0.5, 0.1, 0.75, 0.125, 0.0625)
        ),
        LayerCost(1.0, 2.0, 1000, 900, 100),
    )
    profile = Profile(
        layers,
        Link(0.001, 0.002, 0.0025, two_streams=True),
        77,
        0.25,
        "a test device",
        head_bytes=321,
        head_ms=1.5,
        head_host_ms=0.25,
    )
    return search(profile, 3000)


def test_round_trip_keeps_plan_and_profile(tmp_path: Path) -> None:
    plan = _plan()
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    loaded = load_plan(path)
    assert loaded == plan
    assert loaded.profile == plan.profile
    data = json.loads(path.read_text())
    assert (data["format"], data["version"]) == (FORMAT, VERSION)
    # The profile in the file is enough to plan again for another budget.
    assert loaded.profile is not None
    assert search(loaded.profile, 2500) == search(plan.profile, 2500)  # type: ignore[arg-type]


def test_a_file_written_before_the_head_was_measured_loads_with_none() -> None:
    data = plan_to_dict(_plan())
    assert data["profile"]["head_bytes"] == 321
    del data["profile"]["head_bytes"], data["profile"]["head_ms"], data["profile"]["head_host_ms"]
    loaded = plan_from_dict(data)
    assert loaded.profile is not None and loaded.profile.head_bytes == 0
    assert (loaded.profile.head_ms, loaded.profile.head_host_ms) == (0.0, 0.0)


def test_a_file_written_before_the_host_was_measured_loads_with_none() -> None:
    data = plan_to_dict(_plan())
    assert data["profile"]["layers"][1]["host"]["offload_forward_ms"] == 0.25
    assert data["profile"]["layers"][0]["host"] is None
    del data["profile"]["layers"][1]["host"]
    loaded = plan_from_dict(data)
    assert loaded.profile is not None
    assert [c.host for c in loaded.profile.layers] == [None, None, None]


def test_a_file_written_before_the_engines_share_was_measured_loads_with_zero() -> None:
    data = plan_to_dict(_plan())
    host = data["profile"]["layers"][1]["host"]
    assert (host["engaged_forward_ms"], host["engaged_backward_ms"]) == (0.125, 0.0625)
    del host["engaged_forward_ms"], host["engaged_backward_ms"]
    loaded = plan_from_dict(data)
    assert loaded.profile is not None
    cost = loaded.profile.layers[1].host
    assert cost == HostCost(0.5, 1.0, 0.25, 0.5, 0.1, 0.75)
    # The fields without a default stay required.
    del data["profile"]["layers"][1]["host"]["forward_ms"]
    with pytest.raises(ValueError, match="forward_ms"):
        plan_from_dict(data)


def test_round_trip_without_profile() -> None:
    plan = Plan((Choice.RECOMPUTE, Choice.KEEP), 10, 2.5, 7)
    data = plan_to_dict(plan)
    assert "profile" not in data
    loaded = plan_from_dict(json.loads(json.dumps(data)))
    assert loaded == plan and loaded.profile is None


def _broken(edit) -> dict:  # type: ignore[no-untyped-def]
    data = copy.deepcopy(plan_to_dict(_plan()))
    edit(data)
    return data


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.pop("version"), "missing field plan.version"),
        (lambda d: d.update(version=2), "plan.version 2 is not supported"),
        (lambda d: d.update(format="other"), "plan.format must be 'cpu-offload-plan'"),
        (lambda d: d.update(choices="keep"), "plan.choices must be a list"),
        (lambda d: d["choices"].__setitem__(1, "drop"), r"plan.choices\[1\] must be one of"),
        (lambda d: d.update(num_layers=4), "plan.choices has 3 entries for 4 layers"),
        (lambda d: d["choices"].__setitem__(2, "offload"), "the last layer cannot be offloaded"),
        (lambda d: d.update(budget_bytes=-1), "plan.budget_bytes must be an int >= 0"),
        (lambda d: d["modelled"].update(step_ms="fast"), "plan.modelled.step_ms must be a number"),
        (
            lambda d: d["profile"]["layers"][1].update(forward_ms=-1.0),
            r"plan.profile.layers\[1\].forward_ms must be >= 0",
        ),
        (
            lambda d: d["profile"]["layers"][0].pop("saved_bytes"),
            r"missing field plan.profile.layers\[0\].saved_bytes",
        ),
        (
            lambda d: d["profile"]["layers"][0].update(offload_bytes=10**6),
            r"plan.profile.layers\[0\].offload_bytes \+ recast_bytes \(1000000 \+ 0\) must be "
            r"at most saved_bytes",
        ),
        (
            lambda d: d["profile"]["layers"][0].update(recast_bytes=-1),
            r"plan.profile.layers\[0\].recast_bytes must be an int >= 0",
        ),
        (
            lambda d: d["profile"]["link"].update(d2h_gbps=0),
            "plan.profile.link.d2h_gbps must be > 0",
        ),
        (
            lambda d: d["profile"]["link"].update(two_streams="yes"),
            "plan.profile.link.two_streams must be true or false",
        ),
        (lambda d: d["profile"]["layers"].pop(), "plan.profile.layers has 2 entries"),
        (
            lambda d: d["profile"]["layers"][1]["host"].update(recompute_backward_ms=-0.5),
            r"plan.profile.layers\[1\].host.recompute_backward_ms must be >= 0",
        ),
        (
            lambda d: d["profile"]["layers"][1]["host"].pop("forward_ms"),
            r"missing field plan.profile.layers\[1\].host.forward_ms",
        ),
    ],
)
def test_bad_fields_are_named(edit, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanFileError, match=match):
        plan_from_dict(_broken(edit))


def test_not_an_object() -> None:
    with pytest.raises(PlanFileError, match="plan must be a JSON object, got list"):
        plan_from_dict([])


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(PlanFileError, match="bad.json: not JSON"):
        load_plan(path)
    path.write_text(json.dumps({"format": FORMAT}))
    with pytest.raises(PlanFileError, match="bad.json: missing field plan.version"):
        load_plan(path)


def _parts_plan() -> Plan:
    storages = (Storage(100, 100), Storage(40, 0, outside=True), Storage(50, 50, recast_of=0))
    parts = (
        PartCost("core", 0.5, 0.25, saved=(0, 2), inputs=(1,)),
        PartCost("mlp", 1.0, 0.5, saved=(), inputs=(0,)),
    )
    layer = LayerCost(1.0, 2.0, 190, 100, 10, storages=storages, parts=parts, recast_bytes=50)
    profile = Profile((layer, layer), Link(0.001, 0.001), 10, 0.25, "a test device")
    choice = Parts((("core", Choice.RECOMPUTE), ("mlp", Choice.KEEP)))
    return Plan((choice, Choice.KEEP), 500, 4.5, 150, profile)


def test_round_trip_keeps_part_by_part_choices_and_the_parts() -> None:
    plan = _parts_plan()
    data = json.loads(json.dumps(plan_to_dict(plan)))
    assert data["choices"][0] == {"parts": [["core", "recompute"], ["mlp", "keep"]]}
    loaded = plan_from_dict(data)
    assert loaded == plan and loaded.profile == plan.profile
    # Without the profile, the choices alone load too.
    del data["profile"]
    assert plan_from_dict(data).choices == plan.choices


def test_a_file_written_before_casts_were_rebuilt_loads_with_none() -> None:
    data = plan_to_dict(_parts_plan())
    for layer in data["profile"]["layers"]:
        del layer["recast_bytes"]
        layer["storages"] = [item[:3] for item in layer["storages"]]
    loaded = plan_from_dict(data)
    assert loaded.profile is not None
    for cost in loaded.profile.layers:
        assert cost.recast_bytes == 0 and all(s.recast_of is None for s in cost.storages)


def test_a_file_written_before_parts_were_profiled_loads_without_them() -> None:
    data = plan_to_dict(_plan())
    for layer in data["profile"]["layers"]:
        del layer["storages"], layer["parts"]
    loaded = plan_from_dict(data)
    assert loaded.profile is not None
    assert all(c.parts == () and c.storages == () for c in loaded.profile.layers)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda d: d["choices"].__setitem__(0, {"parts": [["core", "drop"]]}),
            r"plan.choices\[0\].parts: 'core' has no choice 'drop'",
        ),
        (
            lambda d: d["choices"].__setitem__(0, {"layers": []}),
            r"plan.choices\[0\] must be a choice or \{\"parts\"",
        ),
        (
            lambda d: d["choices"].__setitem__(0, {"parts": [["attn", "recompute"]]}),
            r"the parts must be those profiled for layer 0 \(core, mlp\)",
        ),
        (
            lambda d: d["profile"]["layers"][0]["storages"].__setitem__(0, [10, 20, True]),
            r"plan.profile.layers\[0\].storages\[0\] must be \[bytes, offload bytes <= bytes",
        ),
        (
            lambda d: d["profile"]["layers"][0]["storages"].__setitem__(2, [50, 50, False, 3]),
            r"plan.profile.layers\[0\].storages\[2\] must be .*index of another storage it is "
            r"a cast of, or null\], got \[50, 50, False, 3\]",
        ),
        (
            lambda d: d["profile"]["layers"][0]["storages"].__setitem__(2, [50, 50, False, 2]),
            r"plan.profile.layers\[0\].storages\[2\] must be .*got \[50, 50, False, 2\]",
        ),
        (
            lambda d: d["profile"]["layers"][0]["parts"][0].update(saved=[5]),
            r"plan.profile.layers\[0\].parts\[0\].saved must list storage indices in \[0, 2\]",
        ),
    ],
)
def test_bad_part_fields_are_named(edit, match: str) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(json.dumps(plan_to_dict(_parts_plan())))
    edit(data)
    with pytest.raises(PlanFileError, match=match):
        plan_from_dict(data)
