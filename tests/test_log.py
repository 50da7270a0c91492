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
