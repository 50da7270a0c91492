"""compare with dropout: every step of every variant starts from the same random state,
so offloading compares bit-identical on a model that draws random numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from cpu_offload.cli import main
from cpu_offload.compare import VARIANTS, compare_model, format_table

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EVERY_VARIANT = [v for v in VARIANTS if v != "none"]


def _encoder(device: str = "cpu") -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).to(device)


def _batch() -> torch.Tensor:
    return torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))


def test_compare_model_with_dropout_is_bit_identical() -> None:
    model = _encoder()
    assert model.training and model.layers[0].dropout.p > 0
    report = compare_model(model, _batch, variants=EVERY_VARIANT, steps=2, warmup=1)
    assert report.same_random_state
    assert report.noise_floor_loss == 0 and report.noise_floor_grad == 0
    for r in report.results:
        assert r.max_loss_diff == 0 and r.max_grad_diff == 0, r.name
    text = format_table(report)
    assert "bit-identical to no offloading: " + ", ".join(["none", *EVERY_VARIANT]) in text
    assert "DIFFERENT" not in text
    assert "random state: every step of every variant starts from the same one" in text


def test_hf_gpt2_with_dropout_is_bit_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=3, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    assert config.resid_pdrop > 0 and config.attn_pdrop > 0 and config.embd_pdrop > 0
    config.save_pretrained(tmp_path)
    out = tmp_path / "r.json"
    argv = ["compare", "--model", f"hf:{tmp_path / 'config.json'}", "--seq", "8", "--batch", "2"]
    argv += ["--variants", ",".join(EVERY_VARIANT), "--quiet", "--steps", "2", "--warmup", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bit-identical to no offloading: " + ", ".join(["none", *EVERY_VARIANT]) in text
    assert "random state: every step of every variant starts from the same one" in text
    data = json.loads(out.read_text())
    assert data["same_random_state"] is True
    assert data["noise_floor_loss"] == 0 and data["noise_floor_grad"] == 0
    assert all(r["max_loss_diff"] == 0 and r["max_grad_diff"] == 0 for r in data["results"])
