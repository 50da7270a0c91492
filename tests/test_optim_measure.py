"""The optimizer measurements, on the CPU: timed steps, host throughput, state bytes.

``measure_optimizer`` times steps of a model with one HybridDeviceOptimizer
configuration and refuses zero steps; ``measure_host_optimizer_throughput`` measures a
host optimizer and refuses an unknown implementation; ``optimizer_device_state_bytes``
counts no device bytes for an optimizer whose state is all on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from optim_helpers import ADAMW
from optim_helpers import CpuAsDevice as _CpuAsDevice
from optim_helpers import small_model as _model
from optim_helpers import train as _train

from cpu_offload.optim import (
    measure_host_optimizer_throughput,
    measure_optimizer,
    optimizer_device_state_bytes,
)


def test_measure_optimizer_on_cpu() -> None:
    model = _model()
    result = measure_optimizer(
        model,
        lambda m: m(torch.randn(4, 8)).square().mean(),
        offload_fraction=0.0,
        steps=1,
        warmup=0,
        **ADAMW,
    )
    assert result.steps == 1 and result.step_ms > 0 and result.device == "cpu"
    assert result.to_dict()["offload_fraction"] == 0.0
    with pytest.raises(ValueError, match="steps"):
        measure_optimizer(model, lambda m: m(torch.randn(4, 8)).sum(), steps=0)


def test_host_throughput_and_state_bytes() -> None:
    assert measure_host_optimizer_throughput(1 << 12, implementation="forloop", steps=1) > 0
    with pytest.raises(ValueError, match="implementation"):
        measure_host_optimizer_throughput(10, implementation="magic")  # type: ignore[arg-type]
    model = _model()
    opt = _CpuAsDevice(model.parameters(), offload_fraction=0.5, **ADAMW)
    _train(model, opt, 1)
    assert optimizer_device_state_bytes(opt) == 0
