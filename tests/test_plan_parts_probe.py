"""Profiling the parts of layers, and running part by part plans (CPU stand-in)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from test_layer_parts import Block, _assert_equal, _batches, _blocks, _saved_inside, _train
from torch import nn

from cpu_offload import HostTransport
from cpu_offload.cli.plan import _print_layers
from cpu_offload.plan import Choice, Plan, apply_plan, profile_model, save_plan
from cpu_offload.plan.methods import part_methods
from cpu_offload.plan.model import Parts
from cpu_offload.plan.profile import measure_choices

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D = 32
MIN = 64


class Core(nn.Module):
    """Attention scores and probabilities from q and k: most of what its block saves."""

    def forward(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ q.transpose(-1, -2) / D**0.5
        return torch.softmax(torch.tanh(scores), dim=-1) @ v


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.core = Core()
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.core(self.q(x), x))


class CoreBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attention = Attention()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm(x))
        return x + self.mlp(x)


def _core_blocks(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[CoreBlock() for _ in range(n)])


def _profile(model: nn.Module, x: torch.Tensor, parts: object = True):  # type: ignore[no-untyped-def]
    return profile_model(
        model,
        lambda: model(x).square().mean(),
        steps=1,
        min_tensor_size_to_offload=MIN,
        parts=parts,  # type: ignore[arg-type]
    )


def test_an_attention_block_is_split_where_its_core_saves_most() -> None:
    model = _core_blocks()
    x = torch.randn(2, 64, D)
    profile = _profile(model, x)
    names = [p.name for p in profile.layers[0].parts]
    assert names == ["norm", "attention.q", "attention.core", "attention.out", "mlp"]
    # Plain blocks: attention (nn.MultiheadAttention has no modules it calls) and MLP whole.
    plain = _profile(_blocks(), _batches(1)[0])
    assert [p.name for p in plain.layers[0].parts] == ["norm1", "attn", "norm2", "mlp"]


def test_what_a_part_saves_is_what_autograd_saves_inside_it() -> None:
    model = _core_blocks(2)
    x = torch.randn(2, 64, D)
    layer = _profile(model, x, parts=["attention.core", "mlp"]).layers[0]
    for part in layer.parts:
        module = model[0].get_submodule(part.name)
        saved = _saved_inside(module, model, x)
        weights = {p.untyped_storage()._cdata for p in model.parameters()}
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in saved.tensors}
        storages = {k: v for k, v in storages.items() if k not in weights}
        assert sum(layer.storages[i].nbytes for i in part.saved) == sum(storages.values())
        assert part.forward_ms > 0 and part.host_ms > 0
    core = layer.parts[0]
    # The core's inputs: q (the projection's output) and x (the norm's output).
    assert len(core.inputs) == 2
    # The layer's own rest (its norm's saves) is kept whatever the parts do.
    assert any(s.outside for s in layer.storages)


@pytest.mark.parametrize(
    ("parts", "error", "match"),
    [
        (["attention.kv"], ValueError, r"'attention.kv' is not a submodule of layer 0"),
        ({9: ["mlp"]}, ValueError, r"parts: layer index 9 is out of range \[0, 1\]"),
        (["mlp", "mlp.0"], ValueError, "'mlp.0' lies inside 'mlp'"),
        (["mlp", "mlp"], ValueError, r"parts\[0\]: 'mlp' is given twice"),
        ("mlp", TypeError, "parts must be True, False, a list of submodule names"),
    ],
)
def test_bad_parts_to_profile_are_named(parts, error, match) -> None:  # type: ignore[no-untyped-def]
    model = _core_blocks(2)
    with pytest.raises(error, match=match):
        _profile(model, torch.randn(2, 8, D), parts=parts)


def _part_plan(profile, n: int) -> Plan:  # type: ignore[no-untyped-def]
    """The core recomputed and the MLP offloaded in the first layers, the last kept."""
    choices: list = []
    for j, cost in enumerate(profile.layers):
        wanted = {"attention.core": Choice.RECOMPUTE, "mlp": Choice.OFFLOAD}
        if j == n - 1:
            choices.append(Choice.KEEP)
            continue
        choices.append(Parts(tuple((p.name, wanted.get(p.name, Choice.KEEP)) for p in cost.parts)))
    return Plan(tuple(choices), 1, 0.0, 0, profile)


def test_a_part_by_part_plan_applies_bit_identical() -> None:
    model = _core_blocks()
    batches = [torch.randn(2, 64, D) for _ in range(2)]
    profile = _profile(model, batches[0])
    plan = _part_plan(profile, 4)
    assert plan.describe() == "PPPK"
    want = _train(model, batches)
    transport = HostTransport()
    with apply_plan(model, plan, transport=transport, min_tensor_size_to_offload=MIN):
        got = _train(model, batches)
    _assert_equal(got, want)
    assert transport.bytes_offloaded > 0
    ms, peak = measure_choices(
        model,
        lambda: model(batches[0]).sum(),
        plan.choices,
        steps=1,
        transport=HostTransport(),
        min_tensor_size_to_offload=MIN,
    )
    assert ms > 0 and peak is None


def test_one_part_methods_name_the_parts_every_layer_has() -> None:
    model = _core_blocks(3)
    profile = _profile(model, torch.randn(2, 16, D))
    methods = part_methods(profile)
    recompute = methods["recompute attention.core in every layer"]
    assert all(isinstance(c, Parts) for c in recompute)
    offload = methods["offload mlp in every layer"]
    assert offload[-1] is Choice.KEEP and isinstance(offload[0], Parts)


def test_compare_runs_a_part_by_part_plan(tmp_path: Path) -> None:
    from cpu_offload.compare import compare_model

    model = _core_blocks()
    x = torch.randn(2, 64, D)
    plan = _part_plan(_profile(model, x), 4)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert json.loads(path.read_text())["choices"][0]["parts"][2] == ["attention.core", "recompute"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compare_model(
            model,
            lambda: x,
            lambda m, batch: m(batch).square().mean(),
            variants=[],
            plan=path,
            steps=1,
            warmup=0,
            min_tensor_size_to_offload=MIN,
        )
    row = report.result("plan")
    assert row.max_loss_diff == 0 and row.max_grad_diff == 0
    assert row.offloaded_layers == (0, 1, 2) and row.bytes_offloaded_per_step > 0
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_the_plan_command_prints_what_each_part_does(capsys: pytest.CaptureFixture[str]) -> None:
    model = _core_blocks(3)
    profile = _profile(model, torch.randn(2, 16, D))
    _print_layers(profile, _part_plan(profile, 3))
    out = capsys.readouterr().out
    assert (
        "| layer | choice | kept MiB | offloaded MiB | recomputed MiB | casts rebuilt MiB | parts |"
        in out
    )
    assert "| 0 | part by part |" in out and "attention.core recompute" in out
    assert "| 2 | keep |" in out


def test_block_parts_under_the_whole_layer_plans_still_apply() -> None:
    model = _blocks()
    batches = _batches()
    profile = _profile(model, batches[0])
    plan = Plan((Choice.OFFLOAD, Choice.RECOMPUTE, Choice.KEEP, Choice.KEEP), 1, 0.0, 0, profile)
    want = _train(model, batches)
    with apply_plan(model, plan, transport=HostTransport(), min_tensor_size_to_offload=MIN):
        _assert_equal(_train(model, batches), want)
    assert isinstance(model[0], Block)
