"""CPU tests of cpu_offload.optim (no GPU needed): argument checks and the split.

HybridDeviceOptimizer's constructor refuses bad arguments, and ``compute_offload_split``
decides which parameters are offloaded. CPU tensors stand in for device parameters:
``_CpuAsDevice`` (``optim_helpers.CpuAsDevice``) treats every parameter as a device
parameter (``is_device_param``; real use never treats CPU tensors as device tensors, see
``test_real_use_never_offloads_cpu_params``). Copies are then synchronous, everything
else is the code that runs on a GPU. The step's numerics, early copies, state dicts,
measurements and the device step are tested in the test_optim_*.py files named after
them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from optim_helpers import ADAMW
from optim_helpers import CpuAsDevice as _CpuAsDevice
from optim_helpers import same_params as _same
from optim_helpers import small_model as _model
from optim_helpers import train as _train

from cpu_offload.optim import HybridDeviceOptimizer, compute_offload_split
from cpu_offload.optim._args import resolve_param_copy_dtype

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
