"""The "cpu_offload" logger: DEBUG only, silent by default."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch

from cpu_offload import HostTransport, _log, mark_not_offload, offload_layers


def _on_cpu(tensor):
    return tensor.device.type == "cpu"


def test_keep_reasons():
    weight = torch.nn.Parameter(torch.zeros(4096))
    marked = torch.zeros(4096)
    mark_not_offload(marked)
    assert _log.keep_reason(weight, 1024, _on_cpu) == "parameter"
    assert _log.keep_reason(marked, 1024, _on_cpu) == "marked"
    assert _log.keep_reason(torch.zeros(8), 1024, _on_cpu) == "small (< 1024 elements)"
    assert _log.keep_reason(torch.zeros(8), 0, lambda t: False) == "not on the device"
    assert _log.keep_reason(torch.zeros(4096), 1024, _on_cpu) is None


def test_debug_records_and_nothing_above_debug(caplog, monkeypatch):
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    with caplog.at_level(logging.DEBUG, logger="cpu_offload"):
        _log.kept("layer 0", torch.zeros(2, 3), "small")
        _log.offloaded("layer 1", torch.zeros(4), 16)
        _log.moved("layer 1", "offload", 16, 1)
        layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        offload_layers(layers, 1, transport=HostTransport()).remove()
    messages = [r.getMessage() for r in caplog.records]
    assert "layer 0: kept (2, 3) float32 on cpu: small" in messages
    assert "layer 1: offloaded (4,) float32 on cpu, 16 bytes" in messages
    assert "layer 1: offload of 1 tensors, 16 bytes" in messages
    assert any(m.startswith("offload_layers: OffloadedLayers(num_layers=3") for m in messages)
    assert {r.levelno for r in caplog.records} == {logging.DEBUG}
    assert all(r.name == "cpu_offload" for r in caplog.records)


def test_nothing_printed_by_default():
    code = (
        "import torch, cpu_offload\n"
        "from cpu_offload import _log\n"
        "_log.kept('layer 0', torch.zeros(2), 'small')\n"
        "layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))\n"
        "cpu_offload.offload_layers(layers, 1).remove()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout == "" and "layer 0" not in out.stderr and "offload_layers" not in out.stderr


def test_engine_logs_offloaded_kept_and_moved_per_layer_and_iteration(caplog):
    import cpu_offload
    from cpu_offload import HostTransport

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(3)]
    )
    handle = cpu_offload.offload_layers(
        model, 1, transport=HostTransport(), min_tensor_size_to_offload=1000
    )
    with caplog.at_level(logging.DEBUG, logger="cpu_offload"):
        for _ in range(2):
            model(torch.randn(32, 64, requires_grad=True)).sum().backward()
    handle.remove()
    lines = [r.getMessage() for r in caplog.records]
    assert "iteration 1: layer 0's forward begins" in lines, lines
    assert "layer 0: kept (64, 64) float32 on cpu: parameter" in lines
    assert lines.count("layer 0: offloaded (32, 64) float32 on cpu, 8192 bytes") == 4
    assert lines.count("layer 0: offload of 2 tensors, 16384 bytes") == 2
    assert lines.count("layer 0: reload of 2 tensors, 16384 bytes") == 2
    # Layers that are not offloaded save their tensors without hooks: nothing logged.
    assert not any(line.startswith("layer 1:") for line in lines)


def test_nothing_is_logged_by_default(capsys):
    import cpu_offload
    from cpu_offload import HostTransport

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    with cpu_offload.offload_layers(
        model, 1, transport=HostTransport(), min_tensor_size_to_offload=1
    ):
        model(torch.randn(32, 64, requires_grad=True)).sum().backward()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
