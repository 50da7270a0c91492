"""Helpers shared by the CPU tests of HybridDeviceOptimizer (test_optim*.py).

``CpuAsDevice`` treats every parameter as a device parameter, so that CPU tensors are
offloaded with synchronous copies; ``small_model``, ``param_groups``, ``train`` and
``same_params`` build the tests' small model, group and train it, and compare two
models bit for bit. The test files import them under a leading underscore.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cpu_offload.optim import HybridDeviceOptimizer

# The for-loop implementations are used where a test compares against a plain optimizer:
# they are fast on tiny tensors (the fused CPU kernels have a large fixed cost) and the
# comparison only needs both sides to run the same implementation.
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}
SGD = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01, "foreach": False}


class CpuAsDevice(HybridDeviceOptimizer):
    """Treats every parameter as a device parameter, so that CPU tensors get offloaded."""

    _early_min_numel = 0  # the test model's gradients are tiny

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, is_device_param=every_param, **kwargs)


def every_param(param: torch.Tensor) -> bool:
    """``is_device_param`` that treats every parameter, CPU tensors too, as a device one."""
    return True


def hybrid_and_plain(
    hybrid: Callable[..., HybridDeviceOptimizer],
    groups: list[dict[str, Any]],
    ref_groups: list[dict[str, Any]],
    cls: type,
    kwargs: dict[str, Any],
    fraction: float,
    overlap: bool,
) -> tuple[HybridDeviceOptimizer, torch.optim.Optimizer]:
    """The pair the numerics tests compare: ``hybrid`` over ``groups`` with ``cls`` on
    both sides, and the plain ``cls`` over ``ref_groups``, with the same ``kwargs``."""
    opt = hybrid(
        groups,
        offload_fraction=fraction,
        cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        **kwargs,
    )
    return opt, cls(ref_groups, **kwargs)


def small_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16, bias=False),
        torch.nn.Linear(16, 16),
        torch.nn.Linear(16, 8, bias=False),
    )
    return model.to(dtype)


def param_groups(model: torch.nn.Module, two_groups: bool) -> list[dict[str, Any]]:
    params = list(model.parameters())
    if not two_groups:
        return [{"params": params}]
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    seed: int = 1,
    between: Callable[[torch.nn.Module], None] | None = None,
    scheduler: Any = None,
) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen).to(dtype)
        loss = model(x).float().square().mean()
        loss.backward()
        if between is not None:
            between(model)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
