"""compare on a model of the user's: the Python API, --model module:factory and hf:config."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from helpers import cli_usage_error
from torch import nn

from cpu_offload import __version__
from cpu_offload.cli import main
from cpu_offload.compare import compare_model, default_offloaded, format_table

FAST = ["--quiet", "--steps", "1", "--warmup", "0"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Block(nn.Module):
    """Takes a keyword argument and returns a tuple, as many user layers do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x, *, scale):
        return torch.tanh(self.fc(x)) * scale, None


class _Net(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x, _ = block(x, scale=0.5)
        return self.head(x)


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, 64, generator=gen), torch.randint(0, 10, (8, 16), generator=gen)


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def test_python_api_on_a_user_model_every_variant_bit_identical():
    torch.manual_seed(0)
    model = _Net()
    report = compare_model(model, _batch, _loss, steps=1, warmup=0, variants=["v2", "v1-async"])
    assert [r.name for r in report.results] == ["none", "v2", "v1-async"]
    for r in report.results:
        assert r.max_loss_diff == 0 and r.max_grad_diff == 0, r.name
    assert report.result("v2").bytes_offloaded_per_step > 0
    assert report.result("v2").peak_bytes < report.result("none").peak_bytes
    assert report.config["layers"] == 4 and report.config["offloaded"] == 2
    assert report.package_version == __version__
    assert not any("forward" in b.__dict__ for b in model.blocks), "a wrapper was left behind"
    assert "bit-identical to no offloading: none, v2, v1-async" in format_table(report)


def test_python_api_checks_its_arguments():
    with pytest.raises(ValueError, match="variants: unknown v3"):
        compare_model(_Net(), _batch, _loss, variants=["v3"])
    with pytest.raises(ValueError, match=r"num_offloaded must be an int in \[0, 3\]"):
        compare_model(_Net(), _batch, _loss, num_offloaded=4)
    with pytest.raises(TypeError, match="make_batch must be callable"):
        compare_model(_Net(), "batch", _loss)
    with pytest.raises(ValueError, match="could not find the layer stack of Linear"):
        compare_model(nn.Linear(2, 2), _batch, _loss)


def test_default_offloaded_fits_the_layers():
    assert [default_offloaded(n) for n in (1, 2, 3, 4, 16)] == [0, 1, 1, 2, 2]


FACTORY = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


def make(seq=8, batch=4, dtype=None):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(32) for _ in range(3)])

    def make_batch():
        return torch.randn(batch, seq, 32, generator=torch.Generator().manual_seed(0))

    return model, make_batch


def not_a_pair():
    return 3


def needs_width(width, seq=8):
    return make(seq=seq)


def needs_seq(seq):
    return make(seq=seq)


def raises():
    raise RuntimeError("no weights here")


def no_parameters():
    return nn.Sequential(nn.ReLU(), nn.ReLU()), lambda: torch.ones(2, 32)


def batch_of_text():
    model, _ = make()
    return model, lambda: "some text"


def batch_raises():
    model, _ = make()

    def make_batch():
        raise KeyError("labels")

    return model, make_batch


def long_batch():
    model, _ = make()
    return model, lambda: torch.ones(4, 8, 32, dtype=torch.long)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.blocks = nn.Sequential(*[Block(32) for _ in range(3)])

    def forward(self, ids):
        return self.blocks(self.embed(ids))


def token_ids():
    torch.manual_seed(0)
    return Embed(), lambda: torch.arange(32).reshape(4, 8) % 16
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "user_factory_mod.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_factory_mod"


def test_cli_model_factory(factory_module, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["compare", "--model", f"{factory_module}:make", "--seq", "16", *FAST]
    assert main([*argv, "--variants", "v2,checkpoint", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bit-identical to no offloading: none, v2, checkpoint" in text
    assert "optimizer section runs on the built-in layer kinds only" in text
    data = json.loads(out.read_text())
    assert data["config"]["layers"] == 3 and data["config"]["offloaded"] == 1
    assert data["config"]["seq"] is None  # the factory's own sizes are not known
    assert data["package_version"] == __version__
    v2 = next(r for r in data["results"] if r["name"] == "v2")
    assert v2["bytes_offloaded_per_step"] > 0 and v2["copy_streams"] and v2["schedule"] == "v2"


def test_cli_hf_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ).save_pretrained(tmp_path)
    argv = ["compare", "--model", f"hf:{tmp_path / 'config.json'}", "--seq", "16"]
    assert main([*argv, "--batch", "2", "--layers", "3", "--variants", "v2", *FAST]) == 0
    text = capsys.readouterr().out
    assert "LlamaForCausalLM" in text and "x3" in text
    assert "bit-identical to no offloading: none, v2" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nosuchkind"], "choose a built-in kind"),
        (["--model", "no_such_module_xyz:make"], "cannot import 'no_such_module_xyz'"),
        (["--model", "hf:/no/such/config.json"], "does not exist"),
        (["--model", "os.path:join", "--hidden", "64"], "--hidden applies to the built-in"),
        (["--model", "os.path:join", "--optimizer-only"], "built-in kinds only"),
    ],
)
def test_cli_model_errors(args, message, capsys):
    assert message in cli_usage_error(["compare", *args, "--quiet"], capsys)


def test_cli_factory_returning_something_else(factory_module, capsys):
    err = cli_usage_error(["compare", "--model", f"{factory_module}:not_a_pair"], capsys)
    assert "must return (model, make_batch)" in err


@pytest.mark.parametrize(
    "factory, message",
    [
        ("needs_width", "the factory needs 'width', which the command line does not pass"),
        ("needs_seq", "the factory needs 'seq'"),
        ("raises", "the factory raised RuntimeError: no weights here"),
        ("no_parameters", "has no parameters to train"),
        ("batch_of_text", "make_batch must return a tensor, or a tuple, list or dict of tensors"),
        ("batch_raises", "make_batch raised KeyError: 'labels'"),
        ("long_batch", "the first forward of the factory's model on its batch (int64) failed"),
    ],
)
@pytest.mark.parametrize("command", ["compare", "plan"])
def test_cli_factory_failures_exit_2_naming_model(
    factory_module, factory, message, command, capsys
):
    argv = [command, "--model", f"{factory_module}:{factory}", "--quiet"]
    if command == "plan":
        argv += ["--budget", "0.5"]
    err = cli_usage_error(argv, capsys)
    assert f"cpu-offload {command}: error: --model '{factory_module}:{factory}'" in err
    assert message in err
    assert "Traceback" not in err


def test_cli_factory_long_batch_shows_the_original_error(factory_module, capsys):
    err = cli_usage_error(["compare", "--model", f"{factory_module}:long_batch"], capsys)
    assert "holds no floating-point tensor" in err and "RuntimeError:" in err


def test_cli_factory_seq_is_passed_when_given(factory_module, capsys):
    argv = ["compare", "--model", f"{factory_module}:needs_seq", "--seq", "4", "--variants", "v2"]
    assert main([*argv, *FAST]) == 0
    assert "bit-identical to no offloading: none, v2" in capsys.readouterr().out
    err = cli_usage_error(["compare", "--model", f"{factory_module}:needs_seq"], capsys)
    assert "pass --seq" in err


def test_cli_factory_with_token_ids_runs(factory_module, capsys):
    argv = ["compare", "--model", f"{factory_module}:token_ids", "--variants", "v2", *FAST]
    assert main(argv) == 0
    assert "bit-identical to no offloading: none, v2" in capsys.readouterr().out
