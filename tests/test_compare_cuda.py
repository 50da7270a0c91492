"""compare and plan on a GPU: dropout compares bit-identical, plan then compare with the
defaults, and sizes that cannot fit are refused before anything is allocated.

Run with deterministic kernels:
``CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python3 -m pytest -m cuda tests/test_compare_cuda.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import cli_usage_error
from torch import nn

from cpu_offload.cli import main
from cpu_offload.compare import VARIANTS, compare_model, format_table

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic")]

EVERY_VARIANT = [v for v in VARIANTS if v != "none"]


def test_compare_model_with_dropout_on_the_gpu_is_bit_identical() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).cuda()

    def make_batch() -> torch.Tensor:
        return torch.randn(4, 128, 256, generator=torch.Generator().manual_seed(0))

    report = compare_model(
        model,
        make_batch,
        variants=EVERY_VARIANT,
        steps=2,
        warmup=1,
        min_tensor_size_to_offload=1024,
    )
    assert report.same_random_state and not report.simulated
    assert report.noise_floor_loss == 0 and report.noise_floor_grad == 0
    # PyTorch's own save_on_cpu brings tensors back contiguous, where a strided view was
    # saved, and the GPU's backward kernels may then round differently: only the
    # variants of this package (and recomputation) must be exact.
    exact = [r.name for r in report.results if r.name != "save_on_cpu"]
    for r in report.results:
        if r.name in exact:
            assert r.max_loss_diff == 0 and r.max_grad_diff == 0, r.name
    assert report.result("v2").bytes_offloaded_per_step > 0
    text = format_table(report)
    assert "bit-identical to no offloading: " + ", ".join(exact) in text
    assert "(CPU and CUDA generators)" in text


def test_hf_gpt2_with_dropout_on_the_gpu_is_bit_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(
        vocab_size=512, n_positions=256, n_embd=256, n_layer=4, n_head=4, bos_token_id=0,
        eos_token_id=0,
    ).save_pretrained(tmp_path)  # fmt: skip
    argv = ["compare", "--model", f"hf:{tmp_path / 'config.json'}", "--seq", "256"]
    argv += ["--variants", ",".join(EVERY_VARIANT), "--min-tensor-size", "1024"]
    assert main([*argv, "--quiet", "--steps", "2", "--warmup", "1"]) == 0
    text = capsys.readouterr().out
    assert "bit-identical to no offloading: " + ", ".join(["none", *EVERY_VARIANT]) in text


def test_plan_then_compare_with_the_defaults_on_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--budget", "0.6", "--quiet", "--no-measure", "--save", "p.json"]) == 0
    argv = ["compare", "--plan", "p.json", "--variants", "v2", "--no-optimizer", "--quiet"]
    assert main([*argv, "--steps", "2", "--warmup", "1"]) == 0
    assert "bit-identical to no offloading: none, v2, plan" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["compare"], ["plan", "--budget", "0.5"]])
def test_a_model_larger_than_the_gpu_is_refused_before_allocating(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.max_memory_allocated()
    err = cli_usage_error([*command, "--hidden", "100000", "--quiet"], capsys)
    assert "--hidden" in err and "GPU memory" in err and "Traceback" not in err
    assert torch.cuda.max_memory_allocated() == before
