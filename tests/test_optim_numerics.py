"""HybridDeviceOptimizer steps to the values a plain optimizer gives (CPU tests).

For every offload fraction, with and without overlap, one or two param groups, AdamW and
SGD, parameters are bit-identical to a plain optimizer's, offloaded ones stepped through
host copies that hold their state; bf16 models with fp32 masters match plain AdamW on
fp32 masters for every copy dtype; and the default classes, LR schedulers, closures,
missing gradients, ``zero_grad``, ``dummy_step`` and ``add_param_group`` behave as on a
plain optimizer. CPU tensors stand in for device parameters
(``optim_helpers.CpuAsDevice``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from optim_helpers import ADAMW, SGD, hybrid_and_plain
from optim_helpers import CpuAsDevice as _CpuAsDevice
from optim_helpers import param_groups as _groups
from optim_helpers import same_params as _same
from optim_helpers import small_model as _model
from optim_helpers import train as _train

from cpu_offload.optim import compute_offload_split


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("two_groups", [False, True])
@pytest.mark.parametrize(
    ("cls", "kwargs"), [(torch.optim.AdamW, ADAMW), (torch.optim.SGD, SGD)], ids=["adamw", "sgd"]
)
def test_matches_plain_optimizer(
    fraction: float, overlap: bool, two_groups: bool, cls: type, kwargs: dict[str, Any]
) -> None:
    model, ref = _model(), _model()
    opt, plain = hybrid_and_plain(
        _CpuAsDevice,
        _groups(model, two_groups),
        _groups(ref, two_groups),
        cls,
        kwargs,
        fraction,
        overlap,
    )
    _train(model, opt, 3)
    _train(ref, plain, 3)
    assert _same(model, ref)
    # Offloaded parameters are stepped through host copies, never in place.
    stepped = {id(p) for sub in opt.sub_optimizers for g in sub.param_groups for p in g["params"]}
    for p, off in zip(model.parameters(), opt.offload_mask, strict=True):
        assert (id(p) in stepped) is not off


def test_host_state_sits_on_host_copies() -> None:
    model = _model()
    opt = _CpuAsDevice(model.parameters(), offload_fraction=0.5, **ADAMW)
    _train(model, opt, 1)
    params = list(model.parameters())
    assert opt.offload_mask[0] and not opt.offload_mask[-1]
    # The state of the first parameter belongs to a host copy holding the same values.
    state = opt.state[params[0]]
    assert set(state) >= {"exp_avg", "exp_avg_sq", "step"}
    owners = [inner for sub in opt.sub_optimizers for inner, s in sub.state.items() if s is state]
    assert len(owners) == 1
    assert owners[0] is not params[0] and torch.equal(owners[0], params[0])
    # The last parameter is stepped in place by the device-side optimizer.
    assert params[-1] in opt.sub_optimizers[-1].state


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("param_copy_dtype", ["param", "master"])
@pytest.mark.parametrize("grad_copy_dtype", ["param", "master"])
@pytest.mark.parametrize("overlap", [True, False])
def test_bf16_with_fp32_masters(
    fraction: float, param_copy_dtype: str, grad_copy_dtype: str, overlap: bool
) -> None:
    model, ref = _model(torch.bfloat16), _model(torch.bfloat16)
    opt = _CpuAsDevice(
        model.parameters(),
        offload_fraction=fraction,
        param_update_in_fp32=True,
        param_copy_dtype=param_copy_dtype,
        grad_copy_dtype=grad_copy_dtype,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        **ADAMW,
    )
    # Reference: plain AdamW on fp32 master copies, narrowed into the bf16 model.
    ref_params = list(ref.parameters())
    masters = [p.detach().float() for p in ref_params]
    plain = torch.optim.AdamW(masters, **ADAMW)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(3):
        model(torch.randn(4, 8, generator=gen_a).bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(torch.randn(4, 8, generator=gen_b).bfloat16()).float().square().mean().backward()
        for m, p in zip(masters, ref_params, strict=True):
            m.grad = p.grad.float()
        plain.step()
        with torch.no_grad():
            for m, p in zip(masters, ref_params, strict=True):
                p.copy_(m)
                p.grad = None
    assert _same(model, ref)
    for p, m in zip(model.parameters(), masters, strict=True):
        assert opt.state[p]["master_param"].dtype == torch.float32
        assert torch.equal(opt.state[p]["master_param"], m)
        assert opt.state[p]["exp_avg"].dtype == torch.float32


def test_default_classes_are_fused_adamw_where_supported() -> None:
    from cpu_offload._compat import fused_optimizer_supported

    opt = _CpuAsDevice(_model().parameters(), offload_fraction=0.5, lr=1e-3)
    assert all(isinstance(s, torch.optim.AdamW) for s in opt.sub_optimizers)
    expected = True if fused_optimizer_supported("cpu") else None
    assert all(s.defaults["fused"] is expected for s in opt.sub_optimizers)
    # An explicit implementation choice is respected.
    opt = _CpuAsDevice(_model().parameters(), lr=1e-3, foreach=False)
    assert all(s.defaults["fused"] is None for s in opt.sub_optimizers)


def test_lr_scheduler_reaches_sub_optimizers() -> None:
    model, ref = _model(), _model()
    opt = _CpuAsDevice(_groups(model, True), offload_fraction=0.5, **ADAMW)
    plain = torch.optim.AdamW(_groups(ref, True), **ADAMW)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched_ref = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    _train(model, opt, 4, scheduler=sched)
    _train(ref, plain, 4, scheduler=sched_ref)
    assert _same(model, ref)
    assert all(s.param_groups[0]["lr"] < ADAMW["lr"] for s in opt.sub_optimizers)


def test_closure_and_missing_grads() -> None:
    model, ref = _model(), _model()
    frozen = list(model.parameters())[1]
    opt = _CpuAsDevice(model.parameters(), offload_fraction=1.0, **ADAMW)
    plain = torch.optim.AdamW(ref.parameters(), **ADAMW)
    x = torch.randn(4, 8)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        frozen.grad = None  # a parameter without a gradient is skipped
        return loss

    def closure_ref() -> torch.Tensor:
        plain.zero_grad()
        loss = ref(x).square().mean()
        loss.backward()
        list(ref.parameters())[1].grad = None
        return loss

    for _ in range(2):
        assert torch.equal(opt.step(closure), plain.step(closure_ref))
    assert _same(model, ref)
    assert frozen not in opt.state


def test_zero_grad() -> None:
    model = _model()
    opt = _CpuAsDevice(model.parameters(), offload_fraction=0.5, **ADAMW)
    model(torch.randn(2, 8)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_step_creates_state_without_changing_params(dtype: torch.dtype) -> None:
    model = _model(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    opt = _CpuAsDevice(model.parameters(), offload_fraction=0.5, param_update_in_fp32=True, **ADAMW)
    grad = torch.ones_like(before[0])
    list(model.parameters())[0].grad = grad
    opt.dummy_step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert len(opt.state) == 4 and all(float(s["step"]) == 1.0 for s in opt.state.values())
    assert list(model.parameters())[0].grad is grad
    assert all(p.grad is None for p in list(model.parameters())[1:])
    assert all(g["lr"] == ADAMW["lr"] for g in opt.param_groups)


def test_add_param_group_recomputes_split_and_keeps_state() -> None:
    model, ref = _model(), _model()
    ps, rs = list(model.parameters()), list(ref.parameters())
    opt = _CpuAsDevice(ps[:2], offload_fraction=0.5, **ADAMW)
    plain = torch.optim.AdamW(rs[:2], **ADAMW)
    _train(model, opt, 2)
    _train(ref, plain, 2)
    opt.add_param_group({"params": ps[2:], "lr": 1e-3})
    plain.add_param_group({"params": rs[2:], "lr": 1e-3})
    assert opt.offload_mask == compute_offload_split(ps, 0.5, is_device=lambda p: True)
    _train(model, opt, 2)
    _train(ref, plain, 2)
    assert _same(model, ref)
