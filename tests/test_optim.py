"""CPU tests of cpu_offload.optim (no GPU needed).

The optimizer's split, step, early-copy and state-dict logic is exercised with CPU
tensors standing in for device parameters: ``_CpuAsDevice`` passes
``is_device_param=lambda p: True`` (real use never treats CPU tensors as device tensors,
see ``test_real_use_never_offloads_cpu_params``). Copies are then synchronous, everything
else is the code that runs on a GPU.
"""

from __future__ import annotations

import gc
import io
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import fail_on_call

from cpu_offload.optim import (
    HybridDeviceOptimizer,
    compute_offload_split,
    measure_host_optimizer_throughput,
    measure_optimizer,
    optimizer_device_state_bytes,
)
from cpu_offload.optim._args import resolve_param_copy_dtype
from cpu_offload.optim._entries import EarlyCopy, Entry
from cpu_offload.optim._fingerprint import EarlyCopyChecks
from cpu_offload.optim._fingerprint import fingerprint as _fingerprint
from cpu_offload.optim._step import device_step_pieces

# The for-loop implementations are used where a test compares against a plain optimizer:
# they are fast on tiny tensors (the fused CPU kernels have a large fixed cost) and the
# comparison only needs both sides to run the same implementation.
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}
SGD = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01, "foreach": False}


class _CpuAsDevice(HybridDeviceOptimizer):
    """Treats every parameter as a device parameter, so that CPU tensors get offloaded."""

    _early_min_numel = 0  # the test model's gradients are tiny

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, is_device_param=_every_param, **kwargs)


def _every_param(param: torch.Tensor) -> bool:
    return True


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16, bias=False),
        torch.nn.Linear(16, 16),
        torch.nn.Linear(16, 8, bias=False),
    )
    return model.to(dtype)


def _groups(model: torch.nn.Module, two_groups: bool) -> list[dict[str, Any]]:
    params = list(model.parameters())
    if not two_groups:
        return [{"params": params}]
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]


def _train(
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


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ---------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf])
def test_fraction_out_of_range(bad: float) -> None:
    with pytest.raises(ValueError, match="offload_fraction"):
        HybridDeviceOptimizer(_model().parameters(), offload_fraction=bad)


@pytest.mark.parametrize("bad", [True, "0.5", None])
def test_fraction_wrong_type(bad: Any) -> None:
    with pytest.raises(TypeError, match="offload_fraction"):
        HybridDeviceOptimizer(_model().parameters(), offload_fraction=bad)


@pytest.mark.parametrize("name", ["cpu_optimizer_cls", "gpu_optimizer_cls"])
@pytest.mark.parametrize("bad", [dict, torch.optim.AdamW([torch.zeros(1)]), "AdamW"])
def test_optimizer_class_checked(name: str, bad: Any) -> None:
    with pytest.raises(TypeError, match=name):
        HybridDeviceOptimizer(_model().parameters(), **{name: bad})


def test_empty_params() -> None:
    with pytest.raises(ValueError, match="params"):
        HybridDeviceOptimizer([])
    with pytest.raises(ValueError, match="params"):
        HybridDeviceOptimizer([{"params": []}])


def test_single_tensor_refused() -> None:
    with pytest.raises(TypeError, match="params"):
        HybridDeviceOptimizer(torch.zeros(3, requires_grad=True))


@pytest.mark.parametrize(
    "name",
    ["param_update_in_fp32", "pin_cpu_grads", "pin_cpu_params", "overlap_cpu_optimizer_d2h_h2d"],
)
def test_flags_must_be_bool(name: str) -> None:
    with pytest.raises(TypeError, match=name):
        HybridDeviceOptimizer(_model().parameters(), **{name: 1})


@pytest.mark.parametrize("given", ["auto", "master", "param"])
def test_param_copy_dtype_resolved(given: str) -> None:
    # "auto": narrowed on the host where a stream lane makes the link the bound; the
    # optimizer keeps the resolved value.
    assert resolve_param_copy_dtype(given, 0.0) == ("master" if given == "auto" else given)
    assert resolve_param_copy_dtype(given, 0.5) == ("param" if given == "auto" else given)
    opt = _CpuAsDevice(_model().parameters(), param_copy_dtype=given)
    assert opt.param_copy_dtype == ("master" if given == "auto" else given)


@pytest.mark.parametrize("grad_copy_dtype", ["param", "master"])
def test_copy_buffers_allocated_at_construction(grad_copy_dtype: str) -> None:
    # Not inside backward, where pinned allocation would stall it.
    opt = _CpuAsDevice(
        _model(torch.bfloat16).parameters(),
        offload_fraction=1.0,
        param_update_in_fp32=True,
        param_copy_dtype="param",
        grad_copy_dtype=grad_copy_dtype,
    )
    for entry in opt._entries:
        assert entry.offloaded and entry.stage is not None and entry.grad_buf is not None
        assert entry.stage.dtype == torch.bfloat16
        widened_on_host = grad_copy_dtype == "param"
        assert entry.grad_buf.dtype == (torch.bfloat16 if widened_on_host else torch.float32)
        assert (entry.host_grad is not None) == widened_on_host


def test_our_keywords_checked() -> None:
    with pytest.raises(ValueError, match="param_copy_dtype must be 'auto', 'master' or 'param'"):
        HybridDeviceOptimizer(_model().parameters(), param_copy_dtype="fp32")
    with pytest.raises(ValueError, match="grad_copy_dtype must be 'master' or 'param'"):
        HybridDeviceOptimizer(_model().parameters(), grad_copy_dtype=torch.float32)
    with pytest.raises(TypeError, match="early_grad_copy"):
        HybridDeviceOptimizer(_model().parameters(), early_grad_copy="yes")
    with pytest.raises(TypeError, match="is_device_param must be a callable"):
        HybridDeviceOptimizer(_model().parameters(), is_device_param=True)


def test_constructor_signature_is_megatrons() -> None:
    import inspect

    sig = inspect.signature(HybridDeviceOptimizer.__init__)
    names = list(sig.parameters)[1:]
    assert names == [
        "params",
        "offload_fraction",
        "cpu_optimizer_cls",
        "gpu_optimizer_cls",
        "param_update_in_fp32",
        "pin_cpu_grads",
        "pin_cpu_params",
        "overlap_cpu_optimizer_d2h_h2d",
        "defaults",
    ]
    defaults = {k: v.default for k, v in sig.parameters.items() if k not in ("self", "defaults")}
    assert defaults == {
        "params": inspect.Parameter.empty,
        "offload_fraction": 0.5,
        "cpu_optimizer_cls": None,
        "gpu_optimizer_cls": None,
        "param_update_in_fp32": False,
        "pin_cpu_grads": True,
        "pin_cpu_params": True,
        "overlap_cpu_optimizer_d2h_h2d": True,
    }


# ---------------------------------------------------------------------- the split


def test_split_megatron_rule() -> None:
    ps = [torch.empty(10), torch.empty(30), torch.empty(60)]

    def dev(p: torch.Tensor) -> bool:
        return True

    assert compute_offload_split(ps, 0.0, is_device=dev) == [False, False, False]
    assert compute_offload_split(ps, 0.05, is_device=dev) == [True, False, False]
    assert compute_offload_split(ps, 0.1, is_device=dev) == [True, False, False]
    assert compute_offload_split(ps, 0.11, is_device=dev) == [True, True, False]
    assert compute_offload_split(ps, 0.4, is_device=dev) == [True, True, False]
    assert compute_offload_split(ps, 0.41, is_device=dev) == [True, True, True]
    assert compute_offload_split(ps, 1.0, is_device=dev) == [True, True, True]


def test_split_follows_group_order_and_skips_host_params() -> None:
    dev = [torch.empty(50, device="meta"), torch.empty(50, device="meta")]
    host = torch.empty(1000)
    groups = [{"params": [dev[1]]}, {"params": [host, dev[0]]}]
    # Default predicate: meta tensors are "not CPU", host tensors never offloaded, and the
    # threshold counts device elements only.
    assert compute_offload_split(groups, 0.5) == [True, False, False]
    assert compute_offload_split(groups, 1.0) == [True, False, True]


def test_split_argument_checks() -> None:
    with pytest.raises(ValueError, match="offload_fraction"):
        compute_offload_split([torch.empty(1)], 2.0)
    with pytest.raises(TypeError, match="params"):
        compute_offload_split([1, 2], 0.5)


def test_optimizer_uses_the_split() -> None:
    model = _model()
    params = list(model.parameters())
    for fraction in (0.0, 0.3, 0.5, 0.9, 1.0):
        opt = _CpuAsDevice(params, offload_fraction=fraction, **ADAMW)
        assert opt.offload_mask == compute_offload_split(params, fraction, is_device=lambda p: True)


def test_real_use_never_offloads_cpu_params() -> None:
    model, ref = _model(), _model()
    # It says so once, naming why and what to do (it once said nothing).
    with pytest.warns(UserWarning, match="offload_fraction=1.0 offloads nothing") as record:
        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, **ADAMW)
    assert len(record) == 1
    message = str(record[0].message)
    assert "none of the 4 parameters is a device parameter (they are on cpu)" in message
    assert "model.cuda()" in message and "is_device_param=lambda p: True" in message
    assert opt.offload_mask == [False] * 4
    # Host parameters are stepped in place by the host optimizer.
    stepped = [p for sub in opt.sub_optimizers for g in sub.param_groups for p in g["params"]]
    assert {id(p) for p in stepped} == {id(p) for p in model.parameters()}
    _train(model, opt, 3)
    _train(ref, torch.optim.AdamW(ref.parameters(), **ADAMW), 3)
    assert _same(model, ref)


def test_no_warning_when_something_can_move_or_nothing_is_asked() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HybridDeviceOptimizer(_model().parameters(), offload_fraction=0.0, **ADAMW)
        _CpuAsDevice(list(_model().parameters()), offload_fraction=0.5, **ADAMW)
        HybridDeviceOptimizer(
            _model().parameters(), offload_fraction=0.5, is_device_param=lambda p: True, **ADAMW
        )


# ---------------------------------------------------------------------- numerics


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
    opt = _CpuAsDevice(
        _groups(model, two_groups),
        offload_fraction=fraction,
        cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        **kwargs,
    )
    plain = cls(_groups(ref, two_groups), **kwargs)
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


# ---------------------------------------------------------------------- early copies


def _early(model: torch.nn.Module, **kw: Any) -> HybridDeviceOptimizer:
    return _CpuAsDevice(model.parameters(), offload_fraction=1.0, **ADAMW, **kw)


def test_early_copies_are_reused_when_grads_unchanged() -> None:
    model, ref = _model(), _model()
    opt = _early(model)
    _train(model, opt, 2)
    assert opt.last_step_timings["early_copies"] == 4
    assert opt.last_step_timings["early_copies_reused"] == 4
    _train(ref, torch.optim.AdamW(ref.parameters(), **ADAMW), 2)
    assert _same(model, ref)


def test_early_copies_off() -> None:
    model = _model()
    opt = _early(model, early_grad_copy=False)
    _train(model, opt, 1)
    assert opt.last_step_timings["early_copies"] == 0


def _clip(model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


def _unscale(model: torch.nn.Module) -> None:
    # What GradScaler.unscale_ does; it does not bump the version counters.
    grads = [p.grad for p in model.parameters()]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1), torch.tensor(0.25))


def _data_write(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad.data.mul_(3.0)  # .data has its own version counter


def _replace(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = p.grad * 0.5


def _one_element(model: torch.nn.Module) -> None:
    with torch.no_grad():
        list(model.parameters())[-1].grad.view(-1)[3] += 1.0


@pytest.mark.parametrize(
    "between",
    [_clip, _unscale, _data_write, _replace, _one_element],
    ids=["clip", "unscale", "data", "replace", "one_element"],
)
def test_changes_between_backward_and_step_are_honoured(
    between: Callable[[torch.nn.Module], None],
) -> None:
    model, ref = _model(), _model()
    opt = _early(model)
    _train(model, opt, 2, between=between)
    _train(ref, torch.optim.AdamW(ref.parameters(), **ADAMW), 2, between=between)
    assert _same(model, ref)
    assert opt.last_step_timings["early_copies"] == 4
    assert opt.last_step_timings["early_copies_reused"] < 4


def _train_bf16_masters_against_no_early_copies(
    grad_copy_dtype: str,
    *,
    micro_batches: int,
    between: Callable[[torch.nn.Module], None] | None = None,
) -> HybridDeviceOptimizer:
    """Two steps of a bf16 model through host fp32 masters, with early copies and
    without; asserts the two models agree and returns the optimizer with them."""
    model, ref = _model(torch.bfloat16), _model(torch.bfloat16)
    opt = _early(model, param_update_in_fp32=True, grad_copy_dtype=grad_copy_dtype)
    plain = _CpuAsDevice(
        ref.parameters(),
        offload_fraction=1.0,
        param_update_in_fp32=True,
        early_grad_copy=False,
        **ADAMW,
    )
    for m, o in ((model, opt), (ref, plain)):
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            for _ in range(micro_batches):
                m(torch.randn(4, 8, generator=gen).bfloat16()).float().square().mean().backward()
            if between is not None:
                between(m)
            o.step()
            o.zero_grad()
    assert _same(model, ref)
    return opt


@pytest.mark.parametrize("grad_copy_dtype", ["param", "master"])
def test_gradient_accumulation_with_early_copies(grad_copy_dtype: str) -> None:
    opt = _train_bf16_masters_against_no_early_copies(grad_copy_dtype, micro_batches=3)
    assert opt.last_step_timings["early_copies_reused"] == 4


@pytest.mark.parametrize("edited", ["none", "middle", "all"])
def test_early_copies_checked_bucket_by_bucket_are_exact(
    monkeypatch: pytest.MonkeyPatch, edited: str
) -> None:
    # One bucket per parameter: the host settles each bucket's check as it reaches it,
    # and a rejection (a gradient changed through .data, which bumps no version) in a
    # middle bucket decides the later ones at once.
    import cpu_offload.optim._entries as entries_module

    monkeypatch.setattr(entries_module, "BUCKET_NUMEL", 1)
    model, ref = _model(), _model()
    opt = _early(model)
    plain = _CpuAsDevice(ref.parameters(), offload_fraction=1.0, early_grad_copy=False, **ADAMW)
    assert len(opt._host_subs) == 4
    for m, o in ((model, opt), (ref, plain)):
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            m(torch.randn(4, 8, generator=gen)).square().mean().backward()
            params = list(m.parameters())
            for p in params[1:2] if edited == "middle" else params if edited == "all" else []:
                assert p.grad is not None
                p.grad.data.mul_(0.5)
            o.step()
            o.zero_grad()
    assert _same(model, ref)
    reused = {"none": 4, "middle": 3, "all": 0}[edited]
    assert opt.last_step_timings["early_copies_reused"] == reused


@pytest.mark.parametrize("grad_copy_dtype", ["param", "master"])
def test_clipping_honoured_with_bf16_masters(grad_copy_dtype: str) -> None:
    # The early copy was widened (on the worker or by the copy itself); clipping after
    # backward must still reach the host step.
    opt = _train_bf16_masters_against_no_early_copies(
        grad_copy_dtype, micro_batches=1, between=_clip
    )
    assert opt.last_step_timings["early_copies"] == 4
    assert opt.last_step_timings["early_copies_reused"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fingerprint(dtype: torch.dtype) -> None:
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(_fingerprint(x), _fingerprint(x.clone()))
    # Power-of-2 scaling moves every element's integer by the same step, which a
    # wrapping sum over 256 elements cannot see; max and min do.
    for edit in (x * 0.25, x * 0.5, x * 3.0, -x, torch.zeros_like(x)):
        assert not torch.equal(_fingerprint(x), _fingerprint(edit))
    y = x.clone()
    y[500] = y[500].item() * 1.5
    assert not torch.equal(_fingerprint(x), _fingerprint(y))
    # Element-wise, so views at any offset match their copies (host vs device buffers).
    for view in (x[1:], x[3:10], x[:0], x[7:8], x.view(32, 32)[:, 1]):
        assert torch.equal(_fingerprint(view), _fingerprint(view.clone()))


# ---------------------------------------------------------------------- state dicts


def test_state_dict_is_keyed_like_a_plain_optimizers() -> None:
    model, ref = _model(), _model()
    opt = _CpuAsDevice(_groups(model, True), offload_fraction=0.5, **ADAMW)
    plain = torch.optim.AdamW(_groups(ref, True), **ADAMW)
    _train(model, opt, 1)
    _train(ref, plain, 1)
    sd, sd_ref = opt.state_dict(), plain.state_dict()
    assert sd["state"].keys() == sd_ref["state"].keys()
    assert [g["params"] for g in sd["param_groups"]] == [
        g["params"] for g in sd_ref["param_groups"]
    ]
    for g, g_ref in zip(sd["param_groups"], sd_ref["param_groups"], strict=True):
        assert set(g) == set(g_ref)
        if "decoupled_weight_decay" in g_ref:  # an AdamW group key from PyTorch 2.7 on
            assert g["decoupled_weight_decay"] is True
        assert {k: v for k, v in g.items() if k not in ("fused", "foreach")} == {
            k: v for k, v in g_ref.items() if k not in ("fused", "foreach")
        }
    for k, s in sd["state"].items():
        for key, value in s.items():
            assert torch.equal(value, sd_ref["state"][k][key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_checkpoint_resume_is_exact(dtype: torch.dtype, fraction: float) -> None:
    kw = {"offload_fraction": fraction, "param_update_in_fp32": True, **ADAMW}
    model = _model(dtype)
    opt = _CpuAsDevice(model.parameters(), **kw)
    _train(model, opt, 3, seed=1)
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 3, seed=2)

    resumed = _model(dtype, seed=9)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = _CpuAsDevice(resumed.parameters(), **kw)
    opt2.load_state_dict(checkpoint["opt"])
    _train(resumed, opt2, 3, seed=2)
    assert _same(model, resumed)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_checkpoint_interchange_with_plain_adamw(fraction: float) -> None:
    # HDO -> plain AdamW
    model = _model()
    opt = _CpuAsDevice(model.parameters(), offload_fraction=fraction, **ADAMW)
    _train(model, opt, 2)
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 2, seed=2)
    plain_model = _model(seed=9)
    plain_model.load_state_dict(checkpoint["model"])
    plain = torch.optim.AdamW(plain_model.parameters(), **ADAMW)
    plain.load_state_dict(checkpoint["opt"])
    _train(plain_model, plain, 2, seed=2)
    assert _same(model, plain_model)

    # plain AdamW -> HDO
    checkpoint = _roundtrip({"model": plain_model.state_dict(), "opt": plain.state_dict()})
    _train(plain_model, plain, 2, seed=3)
    hdo_model = _model(seed=9)
    hdo_model.load_state_dict(checkpoint["model"])
    hdo = _CpuAsDevice(hdo_model.parameters(), offload_fraction=fraction, **ADAMW)
    hdo.load_state_dict(checkpoint["opt"])
    _train(hdo_model, hdo, 2, seed=3)
    assert _same(plain_model, hdo_model)


@pytest.mark.parametrize(("before", "after"), [(0.25, 0.75), (1.0, 0.0), (0.0, 1.0)])
def test_resume_with_another_fraction(before: float, after: float) -> None:
    kw = {"param_update_in_fp32": True, **ADAMW}
    model = _model(torch.bfloat16)
    opt = _CpuAsDevice(model.parameters(), offload_fraction=before, **kw)
    _train(model, opt, 2)
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 2, seed=2)
    resumed = _model(torch.bfloat16, seed=9)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = _CpuAsDevice(resumed.parameters(), offload_fraction=after, **kw)
    opt2.load_state_dict(checkpoint["opt"])
    assert opt2.offload_mask != opt.offload_mask
    _train(resumed, opt2, 2, seed=2)
    assert _same(model, resumed)


def test_load_copies_and_does_not_alias() -> None:
    model = _model()
    opt = _CpuAsDevice(model.parameters(), offload_fraction=0.5, **ADAMW)
    _train(model, opt, 1)
    other = _CpuAsDevice(_model().parameters(), offload_fraction=0.5, **ADAMW)
    other.load_state_dict(opt.state_dict())
    for a, b in zip(opt.state.values(), other.state.values(), strict=True):
        assert a["exp_avg"].data_ptr() != b["exp_avg"].data_ptr()


def test_load_state_dict_mismatch() -> None:
    model = _model()
    opt = _CpuAsDevice(_groups(model, True), **ADAMW)
    one_group = torch.optim.AdamW(_model().parameters(), **ADAMW).state_dict()
    with pytest.raises(ValueError, match="different number of parameter groups"):
        opt.load_state_dict(one_group)
    sizes = torch.optim.AdamW(
        [{"params": list(_model().parameters())[:1]}, {"params": list(_model().parameters())[1:]}]
    ).state_dict()
    with pytest.raises(ValueError, match="doesn't match the size"):
        opt.load_state_dict(sizes)
    with pytest.raises(ValueError, match="state_dict"):
        opt.load_state_dict({"state": {}})


def test_checkpoint_sgd_momentum_roundtrip() -> None:
    model = _model()
    kw = {"cpu_optimizer_cls": torch.optim.SGD, "gpu_optimizer_cls": torch.optim.SGD, **SGD}
    opt = _CpuAsDevice(model.parameters(), offload_fraction=0.5, **kw)
    _train(model, opt, 2)
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 2, seed=2)
    resumed = _model(seed=9)
    resumed.load_state_dict(checkpoint["model"])
    plain = torch.optim.SGD(resumed.parameters(), **SGD)
    plain.load_state_dict(checkpoint["opt"])
    _train(resumed, plain, 2, seed=2)
    assert _same(model, resumed)


# ---------------------------------------------------------------------- measurement


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


def test_param_groups_given_as_generators_are_trained():
    # model.parameters() in a group dict is a generator: counting it must not use it up.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = _CpuAsDevice(
        [{"params": model.parameters(), "lr": 0.1}], offload_fraction=0.5, weight_decay=0.0
    )
    assert sum(len(g["params"]) for g in opt.param_groups) == 2
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_dropped_optimizer_takes_its_gradient_hooks_away():
    model = torch.nn.Linear(1024, 1024, bias=False)  # above the early-copy threshold
    for _ in range(3):
        opt = _CpuAsDevice(model.parameters(), offload_fraction=1.0, lr=1e-3)
        assert len(model.weight._post_accumulate_grad_hooks or {}) == 1
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()
        del opt
        gc.collect()
        assert len(model.weight._post_accumulate_grad_hooks or {}) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_data_edit_that_cancels_in_signed_codes_discards_the_early_copy(dtype):
    # +1 and -4 have opposite signed bf16 codes (16256, -16256): zeroing both through
    # .data (no version bump) kept a signed-code sum. The early copy must be discarded.
    c = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).to(dtype)
    c[0, 0], c[0, 1] = 1.0, -4.0
    p = torch.nn.Parameter(torch.zeros(1024, 1024, dtype=dtype))
    opt = _CpuAsDevice([p], offload_fraction=1.0, lr=1.0)
    (p * c).sum().backward()
    version = p.grad._version
    p.grad.data[0, :2] = 0.0
    assert p.grad._version == version
    opt.step()
    assert opt.last_step_timings["early_copies_reused"] == 0
    assert torch.equal(p.detach()[0, :2], torch.zeros(2, dtype=dtype))


def test_fingerprint_sees_zeroing_scaling_and_single_edits():
    g = torch.randn(70_000, generator=torch.Generator().manual_seed(1)).bfloat16()
    base = _fingerprint(g)
    assert torch.equal(base, _fingerprint(g.clone()))
    for edit in (
        lambda t: t.mul_(2.0),
        lambda t: t.mul_(0.5),
        lambda t: t.__setitem__(slice(0, 2), 0.0),
        lambda t: t.__setitem__(69_999, t[69_999] + 1.0),
        lambda t: t.neg_(),
    ):
        t = g.clone()
        edit(t)
        assert not torch.equal(_fingerprint(t), base)


def _fingerprint_by_bytes(t: torch.Tensor) -> list[int]:
    # The definition, one byte at a time: unsigned codes of min(width, 4) bytes summed,
    # max and min of the signed codes of the element's width.
    flat = t.detach().reshape(-1).contiguous()
    raw = bytes(flat.view(torch.uint8).tolist())
    width = min(flat.element_size(), 4)
    total = sum(int.from_bytes(raw[i : i + width], "little") for i in range(0, len(raw), width))
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32}.get(flat.element_size(), torch.int64)
    ints = flat.view(signed)
    return [total, int(ints.max()), int(ints.min())]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.int64,
        torch.complex64,
        torch.complex128,
    ],
)
def test_fingerprint_matches_its_definition(dtype: torch.dtype) -> None:
    # Long enough for two int32 rows and a remainder; views at odd offsets and strides.
    x = (torch.randn(2 * (1 << 15) + 11, generator=torch.Generator().manual_seed(2)) * 300).to(
        dtype
    )
    for view in (x, x[3:], x[::7]):
        assert _fingerprint(view).tolist() == _fingerprint_by_bytes(view)


def _entry_with_early_copy(seed: int) -> Entry:
    param = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(seed)))
    param.grad = torch.randn(64, generator=torch.Generator().manual_seed(seed + 100))
    entry = Entry(param, 0, host=True, offloaded=True, inner=param.detach().clone(), master=False)
    grad = param.grad
    entry.early = EarlyCopy(weakref.ref(grad), grad._version, None, _fingerprint(grad), False)
    return entry


def test_early_copy_checks_are_decided_bucket_by_bucket() -> None:
    buckets = [[_entry_with_early_copy(0), _entry_with_early_copy(1)], [_entry_with_early_copy(2)]]
    checks = EarlyCopyChecks(buckets)
    assert (checks.made, checks.candidates, checks.kept) == (3, 3, 0)
    # Unchanged gradients: each bucket is decided when the host reaches it.
    assert checks.settle(0) == buckets[0]
    assert checks.kept == 2
    assert checks.settle(1) == buckets[1]
    assert checks.settle(1) == []
    assert checks.kept == 3 and all(e.early is not None for b in buckets for e in b)


def test_a_rejected_early_copy_decides_every_later_bucket() -> None:
    buckets = [[_entry_with_early_copy(i)] for i in range(3)]
    # Changed without a new version (through .data): only the fingerprint sees it.
    buckets[0][0].param.grad.data.mul_(0.5)
    buckets[2][0].param.grad.data.zero_()
    checks = EarlyCopyChecks(buckets)
    assert checks.candidates == 3
    decided = checks.settle(0)
    assert decided == [buckets[0][0], buckets[1][0], buckets[2][0]]
    assert [b[0].early is None for b in buckets] == [True, False, True]
    assert checks.kept == 1 and checks.settle(1) == [] and checks.settle(2) == []


def test_stale_early_copies_are_no_candidates() -> None:
    replaced, bumped, gone = (_entry_with_early_copy(i) for i in range(3))
    replaced.param.grad = replaced.param.grad.clone()
    bumped.param.grad.mul_(2.0)
    gone.param.grad = None
    checks = EarlyCopyChecks([[replaced, bumped, gone]])
    assert (checks.made, checks.candidates) == (3, 0)
    assert checks.settle_all() == [] and all(e.early is None for e in (replaced, bumped, gone))


def test_gradient_copies_are_queued_before_the_device_step_without_side_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the current stream, a copy queued after the device step would wait for it.
    import cpu_offload.optim._step as step_module

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = HybridDeviceOptimizer(
        model.parameters(),
        offload_fraction=0.5,
        overlap_cpu_optimizer_d2h_h2d=False,
        is_device_param=lambda p: True,
        lr=0.1,
    )
    order: list[str] = []
    real_send = step_module.send_grad
    monkeypatch.setattr(
        step_module, "send_grad", lambda *a, **k: (order.append("copy"), real_send(*a, **k))[1]
    )
    device_opt = opt.sub_optimizers[-1]
    real_step = device_opt.step
    monkeypatch.setattr(
        device_opt, "step", lambda *a, **k: (order.append("device"), real_step(*a, **k))[1]
    )
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert order[-1] == "device" and order.count("copy") == sum(opt.offload_mask)


def _master_entry(numel: int, grad: bool = True, master: bool = True) -> Entry:
    param = torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16 if master else None))
    if grad:
        param.grad = torch.ones_like(param)
    inner = param.detach().float() if master else param
    return Entry(param, 0, host=False, offloaded=False, inner=inner, master=master)


def test_device_step_pieces_cut_by_elements_in_order() -> None:
    entries = [_master_entry(100) for _ in range(4)]
    assert device_step_pieces(entries, 4, 100) == [[e] for e in entries]
    assert device_step_pieces(entries, 4, 150) == [entries[:2], entries[2:]]  # 400 // 150
    assert device_step_pieces(entries, 2, 1) == [entries[:2], entries[2:]]
    # Whole entries, in order, covering all, none below the minimum: a large first entry
    # takes a piece alone, and a short remainder joins the piece before it.
    for sizes in ([300, 50, 50], [100, 100, 100, 100, 1], [50] * 9):
        cut = [_master_entry(n) for n in sizes]
        pieces = device_step_pieces(cut, 4, 100)
        assert pieces is not None and 2 <= len(pieces) <= 4
        assert [e for piece in pieces for e in piece] == cut
        assert all(sum(e.param.numel() for e in piece) >= 100 for piece in pieces)
    uneven = [_master_entry(300), _master_entry(50), _master_entry(50)]
    assert device_step_pieces(uneven, 4, 100) == [uneven[:1], uneven[1:]]


def test_device_step_pieces_only_where_they_change_nothing() -> None:
    entries = [_master_entry(100) for _ in range(4)]
    assert device_step_pieces(entries, 4, 1000) is None  # one piece would hold everything
    assert device_step_pieces(entries, 1, 1) is None
    # Parameters without a gradient are left out (the optimizer skips them anyway).
    no_grad = [_master_entry(100, grad=False), *entries]
    assert device_step_pieces(no_grad, 4, 100) == [[e] for e in entries]
    # A parameter stepped in place would be stepped by every piece's call: no pieces.
    assert device_step_pieces([*entries, _master_entry(10, master=False)], 4, 100) is None
    assert device_step_pieces([*entries, _master_entry(10, grad=False, master=False)], 4, 100)
    # A sparse gradient: no pieces.
    sparse = _master_entry(100)
    sparse.param.grad = torch.ones(100, dtype=torch.bfloat16).to_sparse()
    assert device_step_pieces([*entries, sparse], 4, 100) is None


class _FakeStream:
    """Stands in for a CUDA stream on the CPU: logs what is queued on it."""

    device = torch.device("cpu")

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event: str) -> None:
        self.log.append(f"{self.name} waits for {event}")

    def record_event(self) -> str:
        event = f"event {sum(e.startswith(self.name + ' records') for e in self.log)}"
        self.log.append(f"{self.name} records {event}")
        return event


def _fake_cuda_streams(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run the piecewise device step on CPU tensors, logging its streams' work in order.

    The casts are logged as ``cast`` inside the side stream's block; the device
    optimizer's steps as ``step``.
    """
    import contextlib

    import cpu_offload.optim._step as step_module

    log: list[str] = []
    current, side = _FakeStream("current", log), _FakeStream("side", log)

    @contextlib.contextmanager
    def on_stream(stream: _FakeStream):  # type: ignore[no-untyped-def]
        log.append(f"on {stream.name}")
        yield
        log.append(f"off {stream.name}")

    monkeypatch.setattr(step_module, "_one_cuda_device", lambda entries: torch.device("cpu"))
    monkeypatch.setattr(step_module, "OnCudaStream", on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: side)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return log


def _bf16_pair(min_numels: tuple[int, int]) -> tuple[list[torch.nn.Module], list[Any]]:
    models = []
    for _ in min_numels:
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4))).bfloat16())
    opts = []
    for model, min_numel in zip(models, min_numels, strict=True):
        params = list(model.parameters())
        opt = HybridDeviceOptimizer(
            [{"params": params[:3]}, {"params": params[3:], "lr": 3e-4, "weight_decay": 0.0}],
            offload_fraction=0.0,
            param_update_in_fp32=True,
            is_device_param=lambda p: True,
            **ADAMW,
        )
        opt._cast_piece_min_numel = min_numel
        opts.append(opt)
    return models, opts


def _logged_steps(
    model: torch.nn.Module, opt: Any, log: list[str], steps: int, start: int = 0
) -> None:
    device_opt = opt._device_sub.optimizer
    device_opt.__dict__.pop("step", None)  # wrapped by an earlier call
    real_step = device_opt.step

    def logged_step(*args: Any, **kwargs: Any) -> Any:
        log.append("step")
        return real_step(*args, **kwargs)

    device_opt.step = logged_step
    for i in range(start, start + steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i)).bfloat16()
        model(x).float().square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
        opt.step()
        opt.zero_grad()


def test_device_step_in_pieces_order_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [Casting device gradients beside the device step], on the CPU with logged
    stand-in streams: the order of the waits, and the bits of one call."""
    log = _fake_cuda_streams(monkeypatch)
    (model, ref), (opt, one) = _bf16_pair((1, 1 << 40))
    _logged_steps(model, opt, log, 1)
    assert log == ["step"]  # the first step creates the state in one call
    log.clear()
    _logged_steps(model, opt, log, 1, start=1)
    assert log == [
        "side waits for current",  # after backward and the fp32 gradients' allocation
        "on side",
        "side records event 0",
        "side records event 1",
        "side records event 2",
        "side records event 3",
        "off side",
        *[entry for i in range(4) for entry in (f"current waits for event {i}", "step")],
        "current waits for side",
    ]
    _logged_steps(model, opt, log, 2, start=2)
    _logged_steps(ref, one, [], 4)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    for pa, pb in zip(model.parameters(), ref.parameters(), strict=True):
        for key, value in opt.state[pa].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(one.state[pb][key])), key


def test_device_step_in_pieces_failure_clears_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    log = _fake_cuda_streams(monkeypatch)
    (model, _), (opt, _) = _bf16_pair((1, 1 << 40))
    _logged_steps(model, opt, log, 1)
    device_opt = opt._device_sub.optimizer
    fail_on_call(device_opt, "step", 2)  # the second piece fails
    log.clear()
    model(torch.ones(4, 16).bfloat16()).float().sum().backward()
    with pytest.raises(RuntimeError, match="injected failure"):
        opt.step()
    assert log[-1] == "current waits for side"  # before anything the casts use is freed
    assert all(e.inner.grad is None for e in opt._entries if e.master)
