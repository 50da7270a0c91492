"""Exact checkpoint resume of HybridDeviceOptimizer, on the CPU and on the GPU.

A run that saves ``model.state_dict()`` and ``opt.state_dict()`` after one step, loads
them into a fresh model and optimizer and steps on must give bit-identical parameters
to the run that never stopped: for fp32 models and for bf16 models with an fp32
parameter (fp32 masters for the bf16 ones, none for the fp32 one), every fraction, both
copy modes, Adam and AdamW, and either load order (model first or optimizer first).

The CPU tests treat CPU tensors as device parameters (``is_device_param``), so the
offloaded path runs with synchronous copies; the ``cuda`` tests run the real one. Run
the GPU ones with::

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python -m pytest tests/test_optim_resume.py -m cuda -q
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from cpu_offload.optim import HybridDeviceOptimizer


class _ScaledLinear(torch.nn.Module):
    """A Linear in ``dtype`` times an fp32 scale vector (a mixed-precision model)."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width).to(dtype)
        self.scale = torch.nn.Parameter(torch.ones(width))
        self.out = torch.nn.Linear(width, 4, bias=False).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.linear.weight.dtype
        hidden = torch.nn.functional.gelu(self.linear(x.to(dtype))).float() * self.scale
        return self.out(hidden.to(dtype))


def _model(width: int, dtype: torch.dtype, device: str, seed: int) -> _ScaledLinear:
    torch.manual_seed(seed)
    return _ScaledLinear(width, dtype).to(device)


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def _resume_matches(
    device: str, width: int, dtype: torch.dtype, model_first: bool, **kw: Any
) -> None:
    gen = torch.Generator(device=device).manual_seed(1)
    xs = [torch.randn(8, width, device=device, generator=gen) for _ in range(4)]
    model = _model(width, dtype, device, seed=0)
    opt = HybridDeviceOptimizer(model.parameters(), **kw)
    _step(model, opt, xs[0])
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})

    resumed = _model(width, dtype, device, seed=7)
    opt2 = HybridDeviceOptimizer(resumed.parameters(), **kw)
    # Both orders are common in training scripts: the optimizer's host copies must
    # follow the model's parameters whichever is loaded last.
    if model_first:
        resumed.load_state_dict(checkpoint["model"])
        opt2.load_state_dict(checkpoint["opt"])
    else:
        opt2.load_state_dict(checkpoint["opt"])
        resumed.load_state_dict(checkpoint["model"])
    for x in xs[1:]:
        _step(model, opt, x)
        _step(resumed, opt2, x)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


GRID = [
    pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0]),
    pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"]),
    pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16+fp32", "fp32"]),
    pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW], ids=lambda c: c.__name__),
    pytest.mark.parametrize("model_first", [True, False], ids=["model_first", "opt_first"]),
]


def _grid(func: Any) -> Any:
    for mark in reversed(GRID):
        func = mark(func)
    return func


@_grid
def test_resume_is_exact_on_cpu(
    fraction: float, overlap: bool, dtype: torch.dtype, cls: type, model_first: bool
) -> None:
    _resume_matches(
        "cpu",
        16,
        dtype,
        model_first,
        offload_fraction=fraction,
        cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls,
        param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        is_device_param=lambda p: True,
        lr=1e-3,
    )


@pytest.mark.cuda
@_grid
def test_resume_is_exact_on_gpu(
    deterministic: None,
    fraction: float,
    overlap: bool,
    dtype: torch.dtype,
    cls: type,
    model_first: bool,
) -> None:
    # Width 1024: the weight's gradient (2^20 elements) is above the early-copy
    # threshold, so the overlapped mode copies it from backward.
    _resume_matches(
        "cuda",
        1024,
        dtype,
        model_first,
        offload_fraction=fraction,
        cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls,
        param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        lr=1e-3,
    )


def test_parameter_edited_in_place_reaches_the_host_copy() -> None:
    # An in-place write outside the optimizer (no_grad) is seen by the next step, as it
    # would be by a plain optimizer that steps the parameter itself.
    for dtype in (torch.float32, torch.bfloat16):
        model, ref = _model(8, dtype, "cpu", 0), _model(8, dtype, "cpu", 0)
        opt = HybridDeviceOptimizer(
            model.parameters(),
            offload_fraction=1.0,
            is_device_param=lambda p: True,
            param_update_in_fp32=True,
            lr=1e-2,
            foreach=False,
        )
        # fp32: a plain optimizer; bf16: the same optimizer with its fp32 masters on the
        # "device" side, which updates them from the edited parameters the same way.
        plain: torch.optim.Optimizer = (
            torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
            if dtype == torch.float32
            else HybridDeviceOptimizer(
                ref.parameters(),
                offload_fraction=0.0,
                param_update_in_fp32=True,
                lr=1e-2,
                foreach=False,
            )
        )
        x = torch.randn(4, 8)
        for m, o in ((model, opt), (ref, plain)):
            _step(m, o, x)
            with torch.no_grad():
                m.scale.mul_(0.5)
                m.linear.weight.add_(1.0)
            _step(m, o, x)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b)
