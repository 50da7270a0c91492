"""HybridDeviceOptimizer's state dicts: keyed like a plain optimizer's, resumed exactly.

The state dict has a plain optimizer's keys and param groups; a checkpoint resumes
bit-identically (fp32, and bf16 with fp32 masters, at every fraction and at another
fraction than it was saved with), loads into plain AdamW and back, and into plain SGD
with momentum; loading copies the state, and a mismatched state dict is refused. CPU
tensors stand in for device parameters (``optim_helpers.CpuAsDevice``);
test_optim_resume.py resumes on the GPU too.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from optim_helpers import ADAMW, SGD
from optim_helpers import CpuAsDevice as _CpuAsDevice
from optim_helpers import param_groups as _groups
from optim_helpers import same_params as _same
from optim_helpers import small_model as _model
from optim_helpers import train as _train


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _resumed_as_plain(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    plain_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Train ``model`` with ``opt`` for two steps, checkpoint both, and train two more; a
    fresh model with a plain ``plain_cls`` optimizer resumes from the checkpoint and trains
    the same two steps. Returns the resumed model and its optimizer."""
    _train(model, opt, 2)
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 2, seed=2)
    resumed = _model(seed=9)
    resumed.load_state_dict(checkpoint["model"])
    plain = plain_cls(resumed.parameters(), **kwargs)
    plain.load_state_dict(checkpoint["opt"])
    _train(resumed, plain, 2, seed=2)
    return resumed, plain


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
    plain_model, plain = _resumed_as_plain(model, opt, torch.optim.AdamW, ADAMW)
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
    resumed, _ = _resumed_as_plain(model, opt, torch.optim.SGD, SGD)
    assert _same(model, resumed)
