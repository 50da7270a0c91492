"""The planner on a model of the user's: ``plan --model module:factory``, and compare's
``plan`` row (``--plan``, ``compare_model(plan=...)``), bit-identical to no offloading."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import cli_usage_error

from cpu_offload import HostTransport
from cpu_offload.cli import main
from cpu_offload.compare import compare_model, format_table
from cpu_offload.plan import Choice, Plan, apply_plan, load_plan, save_plan
from cpu_offload.plan.search import LETTERS

# A user's model: attention blocks that take a keyword argument and return a tuple.
FACTORY = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x, *, scale):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + scale * self.mlp(x), None


class Net(nn.Module):
    def __init__(self, width=32, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x, _ = block(x, scale=0.5)
        return self.head(x)


def make(seq=16, batch=2, dtype=None):
    torch.manual_seed(0)
    model = Net()

    def make_batch():
        gen = torch.Generator().manual_seed(0)
        return torch.randn(batch, seq, 32, generator=gen), torch.randint(0, 10, (batch, seq), generator=gen)

    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    return model, make_batch, loss_fn
"""

FAST = ["--quiet", "--steps", "1"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_plan_factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_plan_factory"


def _train(model, make_batch, loss_fn):  # type: ignore[no-untyped-def]
    out = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, make_batch())
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    return out


def _assert_equal(got, want) -> None:  # type: ignore[no-untyped-def]
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_plan_on_a_user_model_applied_is_bit_identical(
    factory: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", f"{factory}:make", "--budget", "0.6", "--min-tensor-size", "256"]
    assert main([*argv, *FAST, "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert "the 4 layers of user_plan_factory:make" in out and "| plan " in out
    plan = load_plan(path)
    assert len(plan.choices) == 4 and plan.choices != (Choice.KEEP,) * 4
    make = importlib.import_module(factory).make
    want = _train(*make())
    model, make_batch, loss_fn = make()
    transport = HostTransport()
    with apply_plan(model, plan, transport=transport, min_tensor_size_to_offload=256):
        got = _train(model, make_batch, loss_fn)
    _assert_equal(got, want)
    assert (transport.bytes_offloaded > 0) == bool(plan.offloaded)

    # The same plan as compare's plan row, on the same model.
    argv = ["compare", "--model", f"{factory}:make", "--variants", "v2", "--plan", str(path)]
    assert main([*argv, *FAST, "--warmup", "0", "--min-tensor-size", "256"]) == 0
    assert "bit-identical to no offloading: none, v2, plan" in capsys.readouterr().out


@pytest.mark.parametrize("letters", ["OKRK", "RORK", "KKKK", "COKC"])
def test_compare_model_plan_row(factory: str, letters: str, tmp_path: Path) -> None:
    by_letter = {letter: c for c, letter in LETTERS.items()}
    plan = Plan(tuple(by_letter[c] for c in letters), 1, 0.0, 0)
    model, make_batch, loss_fn = importlib.import_module(factory).make()
    save_plan(plan, tmp_path / "p.json")
    for given in (plan, tmp_path / "p.json", str(tmp_path / "p.json")):
        report = compare_model(
            model, make_batch, loss_fn, variants=[], steps=1, warmup=0, plan=given,
            min_tensor_size_to_offload=256,
        )  # fmt: skip
        row = report.result("plan")
        assert row.max_loss_diff == 0 and row.max_grad_diff == 0
        assert row.offloaded_layers == plan.offloaded
        assert row.recomputed_layers == plan.recomputed
        assert (row.bytes_offloaded_per_step > 0) == ("O" in letters)
        assert report.config["plan"] == letters
    assert "bit-identical to no offloading: none, plan" in format_table(report)
    assert not any("forward" in b.__dict__ for b in model.blocks), "a wrapper was left behind"


def test_compare_model_plan_errors(factory: str, tmp_path: Path) -> None:
    model, make_batch, loss_fn = importlib.import_module(factory).make()
    with pytest.raises(ValueError, match="made for 3 layers, but the model has 4"):
        compare_model(model, make_batch, loss_fn, plan=Plan((Choice.KEEP,) * 3, 1, 0.0, 0))
    with pytest.raises(TypeError, match="plan must be a cpu_offload.plan.Plan or the path"):
        compare_model(model, make_batch, loss_fn, plan=["keep"] * 4)  # type: ignore[arg-type]
    with pytest.raises(OSError):
        compare_model(model, make_batch, loss_fn, plan=tmp_path / "missing.json")


def test_cli_plan_errors_exit_2(
    factory: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    three = tmp_path / "three.json"
    save_plan(Plan((Choice.OFFLOAD, Choice.KEEP, Choice.KEEP), 1, 0.0, 0), three)
    err = cli_usage_error(["compare", "--model", f"{factory}:make", "--plan", str(three)], capsys)
    assert "--plan: the plan was made for 3 layers, but the model has 4" in err
    err = cli_usage_error(["compare", "--plan", str(tmp_path / "missing.json")], capsys)
    assert "--plan" in err and "no such file" in err
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    err = cli_usage_error(["compare", "--quiet", "--layers", "3", "--plan", str(bad)], capsys)
    assert "--plan" in err and "bad.json" in err
    err = cli_usage_error(["compare", "--optimizer-only", "--plan", str(three)], capsys)
    assert "--plan" in err and "--optimizer-only" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nosuchkind"], "choose a built-in kind"),
        (["--model", "no_such_module_xyz:make"], "cannot import 'no_such_module_xyz'"),
        (["--model", "hf:/no/such/config.json"], "does not exist"),
        (["--model", "os.path:join", "--hidden", "64"], "--hidden applies to the built-in"),
        (["--model", "os.path:join", "--layers", "3"], "--layers applies to the built-in"),
    ],
)
def test_plan_model_errors_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in cli_usage_error(["plan", "--budget", "0.5", "--quiet", *args], capsys)
