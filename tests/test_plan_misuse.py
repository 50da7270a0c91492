"""Misuse of the planner and of offload_layers, on the CPU: each is refused where it
happens, naming the argument, and leaves nothing behind that breaks the next call."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from cpu_offload import HostTransport, offload_layers
from cpu_offload.plan import (
    Choice,
    LayerCost,
    Link,
    Plan,
    Profile,
    apply_plan,
    estimate,
    load_plan,
    profile_model,
    save_plan,
    search,
)
from cpu_offload.plan.io import PlanFileError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _linears(n: int = 4, width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


def _profile() -> Profile:
    layer = LayerCost(1.0, 2.0, saved_bytes=100, offload_bytes=100, input_bytes=10)
    return Profile((layer,) * 3, Link(1.0, 1.0))


# -- Plan ------------------------------------------------------------------------------------


def test_a_plan_built_with_strings_is_applied_as_it_says() -> None:
    plan = Plan(("offload", "recompute", "keep", "keep"), 1 << 20, 0.0, 0)  # type: ignore[arg-type]
    assert plan.choices[:2] == (Choice.OFFLOAD, Choice.RECOMPUTE)
    assert (plan.offloaded, plan.recomputed, plan.describe()) == ((0,), (1,), "ORKK")
    model = _linears()
    transport = HostTransport()
    with apply_plan(model, plan, transport=transport, min_tensor_size_to_offload=1):
        model(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert transport.bytes_offloaded > 0


@pytest.mark.parametrize(
    ("choices", "error", "match"),
    [
        (("offload", "later"), ValueError, r"choices\[1\] must be one of"),
        (("keep", "offload"), ValueError, "last layer cannot be offloaded"),
        ("KO", TypeError, "choices must be a sequence"),
        (None, TypeError, "choices must be a sequence"),
    ],
)
def test_a_plan_that_cannot_be_applied_is_refused_when_made(
    choices: object, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        Plan(choices, 100, 0.0, 0)  # type: ignore[arg-type]


# -- save_plan / load_plan -------------------------------------------------------------------


@pytest.mark.parametrize("bad", [{"choices": ["keep"]}, "plan.json"])
def test_save_plan_refuses_what_is_not_a_plan_and_keeps_the_file(
    tmp_path: Path, bad: object
) -> None:
    path = tmp_path / "plan.json"
    save_plan(Plan((Choice.OFFLOAD, Choice.KEEP), 100, 1.0, 90), path)
    before = path.read_text()
    with pytest.raises(TypeError, match="plan must be a Plan"):
        save_plan(bad, path)  # type: ignore[arg-type]
    assert path.read_text() == before
    assert load_plan(path).describe() == "OK"
    assert os.listdir(tmp_path) == ["plan.json"]  # no temporary file left


def test_save_plan_keeps_the_file_when_the_plan_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cpu_offload.plan import io

    path = tmp_path / "plan.json"
    save_plan(Plan((Choice.OFFLOAD, Choice.KEEP), 100, 1.0, 90), path)
    before = path.read_text()

    def fail(plan: Plan) -> None:
        raise ValueError("a profile field that JSON cannot hold")

    monkeypatch.setattr(io, "plan_to_dict", fail)
    with pytest.raises(ValueError, match="JSON cannot hold"):
        save_plan(Plan((Choice.KEEP, Choice.KEEP), 100, 1.0, 90), path)
    monkeypatch.undo()
    assert path.read_text() == before


def test_a_plan_and_its_profile_must_have_as_many_layers() -> None:
    with pytest.raises(ValueError, match="the plan's profile has 3 layers"):
        Plan((Choice.KEEP,) * 2, 100, 0.0, 0, _profile())
    assert Plan((Choice.KEEP,) * 3, 100, 0.0, 0, _profile()).describe() == "KKK"


def test_a_plan_needs_a_positive_budget() -> None:
    with pytest.raises(ValueError, match="budget_bytes must be > 0"):
        Plan((Choice.KEEP,), 0, 0.0, 0)
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        Plan((Choice.KEEP,), 1.5, 0.0, 0)  # type: ignore[arg-type]


def test_load_plan_refuses_a_zero_budget(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    save_plan(Plan((Choice.OFFLOAD, Choice.KEEP), 100, 1.0, 90), path)
    path.write_text(path.read_text().replace('"budget_bytes": 100', '"budget_bytes": 0'))
    with pytest.raises(PlanFileError, match=r"budget_bytes must be > 0"):
        load_plan(path)


# -- profile_model, estimate, search, apply_plan ---------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_tensor_size_to_offload": -1}, ValueError, "min_tensor_size_to_offload must be >= 0"),
        (
            {"min_tensor_size_to_offload": 1.5},
            TypeError,
            "min_tensor_size_to_offload must be an int",
        ),
        ({"recompute": "no"}, TypeError, "recompute must be a bool"),
        ({"link": "fast"}, TypeError, "link must be a Link"),
    ],
)
def test_profile_model_names_a_bad_argument(kwargs: dict, error: type, match: str) -> None:
    model = _linears()
    x = torch.randn(8, 32)
    with pytest.raises(error, match=match):
        profile_model(model, lambda: model(x).square().mean(), steps=1, **kwargs)


def test_profile_model_needs_a_loss_tensor_from_step() -> None:
    model = _linears()
    with pytest.raises(
        TypeError, match="step\\(\\) must run the model's forward and return the loss"
    ):
        profile_model(model, lambda: 1.0, steps=1)  # type: ignore[arg-type,return-value]
    x = torch.randn(8, 32)
    assert profile_model(model, lambda: model(x).sum(), steps=1).num_layers == 4


def test_estimate_and_search_need_a_profile() -> None:
    with pytest.raises(TypeError, match="profile must be a Profile"):
        estimate(None, ["keep"] * 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="profile must be a Profile"):
        search(None, 100)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [(-1, ValueError, "exact_max_layers must be >= 0"), ("x", TypeError, "must be an int")],
)
def test_search_checks_exact_max_layers(value: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        search(_profile(), 150, exact_max_layers=value)  # type: ignore[arg-type]
    assert (
        search(_profile(), 150, exact_max_layers=0).describe() == search(_profile(), 150).describe()
    )


def test_apply_plan_names_a_plan_that_is_not_one_first() -> None:
    with pytest.raises(TypeError, match="plan must be a cpu_offload.plan.Plan"):
        apply_plan(_linears(), None, memory_budget=10)  # type: ignore[arg-type]


# -- offload_layers --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"offloaded": [1, 1]}, {"recomputed": [2, 2]}])
def test_a_layer_index_given_twice_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="layer index . is given twice"):
        offload_layers(_linears(), transport=HostTransport(), **kwargs)


def test_a_layer_listed_with_its_own_submodule_is_refused() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)])
    with pytest.raises(ValueError, match="entry 1 of the layer stack is a submodule of entry 0"):
        offload_layers([model[0], model[0][0], model[1], model[2]], num_offloaded=1)
    offload_layers(model, num_offloaded=1, transport=HostTransport()).remove()


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.layers[0](x)  # layer 0 runs again: tied weights


def test_a_layer_reused_after_the_last_is_named_in_offload_layers_terms() -> None:
    torch.manual_seed(0)
    model = _Tied()
    with offload_layers(model, 1, transport=HostTransport(), min_tensor_size_to_offload=1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the empty-iteration warning of the cut forward
            with pytest.raises(ValueError, match="offload_layers wrapped 3 layers") as info:
                model(torch.randn(4, 16)).sum().backward()
    assert "model_layers" not in str(info.value)


def test_reassign_between_two_layers_of_a_forward_is_named() -> None:
    model = _linears()
    handle = offload_layers(model, 1, transport=HostTransport(), min_tensor_size_to_offload=1)
    hook = model[2].register_forward_pre_hook(lambda *_: handle.reassign(offloaded=[0, 1]))
    with pytest.raises(RuntimeError, match=r"reassign\(\) was called in the middle of a forward"):
        model(torch.randn(4, 32)).sum().backward()
    hook.remove()
    want = _linears()
    x = torch.randn(4, 32, requires_grad=True)
    model(x).sum().backward()  # the next step runs the new assignment
    want(x).sum().backward()
    for a, b in zip(model.parameters(), want.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert handle.offloaded == (0, 1)
    handle.remove()


# -- the command line ------------------------------------------------------------------------


def test_cli_refuses_a_budget_too_large_for_a_float() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    run = subprocess.run(
        [sys.executable, "-m", "cpu_offload", "plan", "--budget", "1e400GiB", "--no-measure"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 2
    assert "--budget '1e400GiB' is too large" in run.stderr
