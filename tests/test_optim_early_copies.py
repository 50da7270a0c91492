"""Early gradient copies: made from backward, reused by ``step()`` only if unchanged.

An offloaded parameter's gradient is copied to the host as soon as backward has it;
``step()`` reuses the copy only where the gradient has not changed since (clipping,
unscaling, writes through ``.data``, replaced gradients, one edited element, with
gradient accumulation and bf16 masters too), as its version counter and fingerprint
decide, bucket by bucket. Also: the fingerprint against its definition, the checks'
decisions on hand-made entries, and a dropped optimizer taking its gradient hooks away.
CPU tensors stand in for device parameters (``optim_helpers.CpuAsDevice``).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from optim_helpers import ADAMW
from optim_helpers import CpuAsDevice as _CpuAsDevice
from optim_helpers import same_params as _same
from optim_helpers import small_model as _model
from optim_helpers import train as _train

from cpu_offload.optim import HybridDeviceOptimizer
from cpu_offload.optim._entries import EarlyCopy, Entry
from cpu_offload.optim._fingerprint import EarlyCopyChecks
from cpu_offload.optim._fingerprint import fingerprint as _fingerprint


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
