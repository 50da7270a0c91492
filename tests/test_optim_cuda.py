"""GPU tests of cpu_offload.optim.HybridDeviceOptimizer (skipped without CUDA).

Run on a GPU machine with::

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python -m pytest tests/test_optim_cuda.py -m cuda -q

What they check (SPEC section 6): parameters within ``atol=1e-3`` of a GPU-only optimizer
(SGD and AdamW, fractions 0 / 0.5 / 1, overlap on and off, one or two param groups, 1
and 10 steps), the loss within 0.001; Adam state on the host for the first parameter and
on the GPU for the last; the host part bit-identical to the same optimizer class run on
host copies with the same gradients (also for bf16 with fp32 masters, both copy-back
dtypes, with gradient clipping and GradScaler between backward and step); exact
checkpoint resume; checkpoint interchange with plain optimizers and across fractions;
GPU memory of the optimizer state falling in proportion to the fraction; the device step
in pieces beside its gradients' casts bit-identical to one call (and used only for
PyTorch's Adam, AdamW and SGD).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from helpers import fail_on_call
from optim_helpers import hybrid_and_plain

from cpu_offload.optim import HybridDeviceOptimizer, optimizer_device_state_bytes

pytestmark = pytest.mark.cuda

ATOL = 1e-3  # Megatron's own tolerance for HDO against a GPU-only optimizer
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
SGD = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01}
CLASSES = [(torch.optim.AdamW, ADAMW), (torch.optim.SGD, SGD)]


def _model(
    width: int = 128, layers: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = []
    for i in range(layers):
        blocks.append(torch.nn.Linear(width, width, bias=i == 1))
        blocks.append(torch.nn.GELU())
    return torch.nn.Sequential(*blocks).to(device="cuda", dtype=dtype)


def _groups(model: torch.nn.Module, two_groups: bool) -> list[dict[str, Any]]:
    params = list(model.parameters())
    if not two_groups:
        return [{"params": params}]
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-4, "weight_decay": 0.0}]


def _batch(step: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    return torch.randn(32, width, device="cuda", generator=gen).to(dtype)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    p = next(model.parameters())
    return model(_batch(step, p.shape[1], p.dtype)).float().square().mean()


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0
) -> list[float]:
    losses = []
    for i in range(start, start + steps):
        loss = _loss(model, i)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _close(a: torch.nn.Module, b: torch.nn.Module, atol: float = ATOL) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=0)


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------- against GPU-only


@pytest.mark.parametrize("steps", [1, 10])
@pytest.mark.parametrize("two_groups", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize(("cls", "kwargs"), CLASSES, ids=["adamw", "sgd"])
def test_close_to_gpu_only_optimizer(
    cls: type, kwargs: dict[str, Any], fraction: float, overlap: bool, two_groups: bool, steps: int
) -> None:
    model, ref = _model(), _model()
    opt, plain = hybrid_and_plain(
        HybridDeviceOptimizer,
        _groups(model, two_groups),
        _groups(ref, two_groups),
        cls,
        kwargs,
        fraction,
        overlap,
    )
    losses = _train(model, opt, steps)
    ref_losses = _train(ref, plain, steps)
    _close(model, ref)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-3
    params = list(model.parameters())
    if cls is torch.optim.AdamW:
        if fraction > 0:
            assert opt.state[params[0]]["exp_avg"].device.type == "cpu"
        if fraction < 1:
            assert opt.state[params[-1]]["exp_avg"].is_cuda


@pytest.mark.parametrize("param_copy_dtype", ["param", "master"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_bf16_with_masters_close_to_gpu_only(fraction: float, param_copy_dtype: str) -> None:
    model, ref = _model(dtype=torch.bfloat16), _model(dtype=torch.bfloat16)
    opt = HybridDeviceOptimizer(
        model.parameters(),
        offload_fraction=fraction,
        param_update_in_fp32=True,
        param_copy_dtype=param_copy_dtype,
        **ADAMW,
    )
    gpu_only = HybridDeviceOptimizer(
        ref.parameters(), offload_fraction=0.0, param_update_in_fp32=True, **ADAMW
    )
    losses = _train(model, opt, 10)
    ref_losses = _train(ref, gpu_only, 10)
    _close(model, ref, atol=1e-2)  # one bf16 ulp at these magnitudes
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-3
    p = next(model.parameters())
    assert opt.state[p]["master_param"].device.type == "cpu"
    assert opt.state[p]["master_param"].dtype == torch.float32


# ---------------------------------------------------------------------- host part is exact


def _host_reference(
    opt: HybridDeviceOptimizer, cls: type, kwargs: dict[str, Any], fp32_masters: bool
) -> tuple[list[int], list[torch.Tensor], torch.optim.Optimizer]:
    params = [p for g in opt.param_groups for p in g["params"]]
    index = [i for i, off in enumerate(opt.offload_mask) if off]
    copies = [
        params[i].detach().cpu().to(torch.float32 if fp32_masters else params[i].dtype)
        for i in index
    ]
    return index, copies, cls(copies, fused=True, **kwargs)


def _step_both(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    ref: tuple[list[int], list[torch.Tensor], torch.optim.Optimizer],
    step: int,
    *,
    clip: bool = False,
) -> None:
    index, copies, ref_opt = ref
    params = list(model.parameters())
    _loss(model, step).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(params, 1e-2)
    for i, c in zip(index, copies, strict=True):
        c.grad = params[i].grad.detach().cpu().to(c.dtype)
    opt.step()
    ref_opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize(("cls", "kwargs"), CLASSES, ids=["adamw", "sgd"])
def test_host_part_is_bit_identical(
    cls: type, kwargs: dict[str, Any], overlap: bool, clip: bool
) -> None:
    model = _model(width=1024)  # gradients large enough for early copies
    opt = HybridDeviceOptimizer(
        model.parameters(),
        offload_fraction=0.5,
        cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        **kwargs,
    )
    ref = _host_reference(opt, cls, kwargs, fp32_masters=False)
    for step in range(3):
        _step_both(model, opt, ref, step, clip=clip)
        params = list(model.parameters())
        for i, c in zip(ref[0], ref[1], strict=True):
            # Read right after step(): the current stream sees the new values.
            assert torch.equal(params[i].cpu(), c)
    offloaded = float(sum(opt.offload_mask))
    assert opt.last_step_timings["early_copies"] == (offloaded if overlap else 0.0)
    expected_reused = 0.0 if (clip or not overlap) else offloaded
    assert opt.last_step_timings["early_copies_reused"] == expected_reused


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("grad_copy_dtype", ["param", "master"])
@pytest.mark.parametrize("param_copy_dtype", ["param", "master"])
def test_host_part_bit_identical_bf16_masters(
    param_copy_dtype: str, grad_copy_dtype: str, clip: bool
) -> None:
    model = _model(width=1024, dtype=torch.bfloat16)
    opt = HybridDeviceOptimizer(
        model.parameters(),
        offload_fraction=1.0,
        param_update_in_fp32=True,
        param_copy_dtype=param_copy_dtype,
        grad_copy_dtype=grad_copy_dtype,
        **ADAMW,
    )
    ref = _host_reference(opt, torch.optim.AdamW, ADAMW, fp32_masters=True)
    for step in range(3):
        _step_both(model, opt, ref, step, clip=clip)
    # Gradients below the early-copy threshold are copied in step() only.
    early = float(
        sum(
            off and p.numel() >= opt._early_min_numel
            for p, off in zip(model.parameters(), opt.offload_mask, strict=True)
        )
    )
    assert early > 0
    assert opt.last_step_timings["early_copies"] == early
    assert opt.last_step_timings["early_copies_reused"] == (0.0 if clip else early)
    params = list(model.parameters())
    for i, master in zip(ref[0], ref[1], strict=True):
        assert torch.equal(opt.state[params[i]]["master_param"], master)
        assert torch.equal(params[i].cpu(), master.to(torch.bfloat16))


def test_grad_scaler_between_backward_and_step() -> None:
    # GradScaler.unscale_ rewrites gradients without bumping version counters: the early
    # copies (of scaled gradients) must be rejected by the fingerprint.
    model = _model(width=1024)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, **ADAMW)
    ref = _host_reference(opt, torch.optim.AdamW, ADAMW, fp32_masters=False)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    params = list(model.parameters())
    for step in range(3):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = _loss(model, step)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        for i, c in zip(ref[0], ref[1], strict=True):
            c.grad = params[i].grad.detach().cpu()
        scaler.step(opt)
        scaler.update()
        ref[2].step()
        opt.zero_grad()
        assert opt.last_step_timings["early_copies_reused"] == 0.0
        for i, c in zip(ref[0], ref[1], strict=True):
            assert torch.equal(params[i].cpu(), c)


# ---------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_resume_is_bit_identical(
    deterministic: None, dtype: torch.dtype, fraction: float
) -> None:
    kw = {"offload_fraction": fraction, "param_update_in_fp32": True, **ADAMW}
    model = _model(dtype=dtype)
    opt = HybridDeviceOptimizer(model.parameters(), **kw)
    _train(model, opt, 3)
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 3, start=3)

    resumed = _model(dtype=dtype, seed=9)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = HybridDeviceOptimizer(resumed.parameters(), **kw)
    opt2.load_state_dict(checkpoint["opt"])
    _train(resumed, opt2, 3, start=3)
    _equal(model, resumed)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_checkpoint_interchange_with_plain_adamw(deterministic: None, fraction: float) -> None:
    model = _model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=fraction, **ADAMW)
    _train(model, opt, 3)
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    sd = checkpoint["opt"]
    for i, off in enumerate(opt.offload_mask):
        assert sd["state"][i]["exp_avg"].device.type == ("cpu" if off else "cuda")

    plain_model = _model(seed=9)
    plain_model.load_state_dict(checkpoint["model"])
    plain = torch.optim.AdamW(plain_model.parameters(), **ADAMW)
    plain.load_state_dict(sd)
    for i, p in enumerate(plain_model.parameters()):
        assert torch.equal(plain.state[p]["exp_avg"].cpu(), sd["state"][i]["exp_avg"].cpu())
        assert plain.state[p]["exp_avg"].is_cuda
    _train(model, opt, 5, start=3)
    _train(plain_model, plain, 5, start=3)
    _close(model, plain_model)

    # And back: a plain GPU AdamW checkpoint into the hybrid optimizer.
    checkpoint = _roundtrip({"model": plain_model.state_dict(), "opt": plain.state_dict()})
    hdo_model = _model(seed=7)
    hdo_model.load_state_dict(checkpoint["model"])
    hdo = HybridDeviceOptimizer(hdo_model.parameters(), offload_fraction=fraction, **ADAMW)
    hdo.load_state_dict(checkpoint["opt"])
    for p, off in zip(hdo_model.parameters(), hdo.offload_mask, strict=True):
        assert hdo.state[p]["exp_avg"].device.type == ("cpu" if off else "cuda")
    _train(plain_model, plain, 5, start=8)
    _train(hdo_model, hdo, 5, start=8)
    _close(plain_model, hdo_model)


@pytest.mark.parametrize(("before", "after"), [(0.25, 0.75), (1.0, 0.0), (0.0, 1.0)])
def test_resume_with_another_fraction(deterministic: None, before: float, after: float) -> None:
    kw = {"param_update_in_fp32": True, **ADAMW}
    model = _model(dtype=torch.bfloat16)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=before, **kw)
    _train(model, opt, 3)
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 5, start=3)
    resumed = _model(dtype=torch.bfloat16, seed=9)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = HybridDeviceOptimizer(resumed.parameters(), offload_fraction=after, **kw)
    opt2.load_state_dict(checkpoint["opt"])
    for p, off in zip(resumed.parameters(), opt2.offload_mask, strict=True):
        assert opt2.state[p]["master_param"].device.type == ("cpu" if off else "cuda")
    _train(resumed, opt2, 5, start=3)
    _close(model, resumed, atol=1e-2)


def test_dummy_step_then_load(deterministic: None) -> None:
    model = _model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, **ADAMW)
    _train(model, opt, 2)
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    fresh = _model(seed=9)
    fresh.load_state_dict(checkpoint["model"])
    opt2 = HybridDeviceOptimizer(fresh.parameters(), offload_fraction=0.5, **ADAMW)
    before = [p.detach().clone() for p in fresh.parameters()]
    opt2.dummy_step()
    for p, b in zip(fresh.parameters(), before, strict=True):
        assert torch.equal(p, b)
    assert len(opt2.state) == len(before)
    opt2.load_state_dict(checkpoint["opt"])
    _train(model, opt, 2, start=2)
    _train(fresh, opt2, 2, start=2)
    _equal(model, fresh)


# ---------------------------------------------------------------------- memory and pinning


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_state_memory_falls_with_the_fraction(dtype: torch.dtype) -> None:
    # Eight equal parameters: the split is exact at multiples of 1/8.
    measured = {}
    for fraction in (0.0, 0.25, 0.5, 1.0):
        model = _model(width=512, layers=8, dtype=dtype)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        opt = HybridDeviceOptimizer(
            model.parameters(), offload_fraction=fraction, param_update_in_fp32=True, **ADAMW
        )
        _train(model, opt, 1)
        torch.cuda.synchronize()
        measured[fraction] = (
            torch.cuda.memory_allocated() - base,
            optimizer_device_state_bytes(opt),
        )
        del opt, model
        torch.cuda.empty_cache()
    full_alloc, full_state = measured[0.0]
    param_bytes = 8 * 512 * 512 * torch.empty((), dtype=dtype).element_size()
    per_param = 12 if dtype == torch.bfloat16 else 8  # fp32 master + moments, or moments
    assert full_state >= 8 * 512 * 512 * per_param
    for fraction, (alloc, state) in measured.items():
        expected = (1 - fraction) * full_state
        assert abs(state - expected) <= 0.01 * full_state + 4096, (fraction, state, expected)
        assert abs(alloc - (1 - fraction) * full_alloc) <= 0.05 * full_alloc + param_bytes / 8
    assert measured[1.0][1] < 4096


def test_host_buffers_are_pinned_as_asked() -> None:
    model = _model(dtype=torch.bfloat16)
    # Default transfers: fp32 both ways, straight from and into the pinned fp32 buffers.
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, param_update_in_fp32=True)
    entry = opt._entries[0]
    assert entry.grad_buf is not None and entry.grad_buf.is_pinned()
    assert entry.grad_buf.dtype == torch.float32 and entry.host_grad is None
    assert entry.stage is None and entry.inner.is_pinned()
    # bf16 transfers: the bf16 buffers are pinned, the fp32 ones never cross PCIe.
    opt = HybridDeviceOptimizer(
        model.parameters(),
        offload_fraction=1.0,
        param_update_in_fp32=True,
        grad_copy_dtype="param",
        param_copy_dtype="param",
    )
    entry = opt._entries[0]
    assert entry.grad_buf is not None and entry.grad_buf.is_pinned()
    assert entry.grad_buf.dtype == torch.bfloat16
    assert entry.host_grad is not None and not entry.host_grad.is_pinned()
    assert entry.stage is not None and entry.stage.is_pinned()
    assert not entry.inner.is_pinned()
    opt = HybridDeviceOptimizer(
        model.parameters(), offload_fraction=1.0, pin_cpu_grads=False, pin_cpu_params=False
    )
    entry = opt._entries[0]
    assert entry.grad_buf is not None and not entry.grad_buf.is_pinned()
    assert not entry.inner.is_pinned()


def test_lr_scheduler_on_gpu() -> None:
    model, ref = _model(), _model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, **ADAMW)
    plain = torch.optim.AdamW(ref.parameters(), **ADAMW)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    sched_ref = torch.optim.lr_scheduler.CosineAnnealingLR(plain, T_max=5)
    for i in range(5):
        _train(model, opt, 1, start=i)
        _train(ref, plain, 1, start=i)
        sched.step()
        sched_ref.step()
    _close(model, ref)


def _pieces_and_one_call(
    fraction: float, cls: type = torch.optim.AdamW, kwargs: dict[str, Any] = ADAMW
) -> tuple[list[torch.nn.Module], list[HybridDeviceOptimizer]]:
    """Two equal bf16 models with two param groups, and their optimizers: the first steps
    its device part in pieces wherever they are allowed, the second in one call."""
    models = [_model(width=256, layers=4, dtype=torch.bfloat16) for _ in range(2)]
    opts = []
    for model, min_numel in zip(models, (1, 1 << 40), strict=True):
        opt = HybridDeviceOptimizer(
            _groups(model, two_groups=True),
            offload_fraction=fraction,
            param_update_in_fp32=True,
            cpu_optimizer_cls=cls,
            gpu_optimizer_cls=cls,
            **kwargs,
        )
        opt._cast_piece_min_numel = min_numel
        opts.append(opt)
    return models, opts


@pytest.mark.parametrize("caller_stream", [False, True])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_device_masters_stepped_in_pieces_bit_identical(
    fraction: float, caller_stream: bool
) -> None:
    """NOTE [Casting device gradients beside the device step]: the fp32 gradients cast on a
    side stream and the device optimizer stepped piece by piece give the bits of one
    call, over 10 steps with two param groups, a scheduler, clipping and accumulation."""
    models, opts = _pieces_and_one_call(fraction)
    scheds = [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) for opt in opts]
    stream = torch.cuda.Stream() if caller_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())  # the models were built on the default
    losses: list[list[float]] = [[], []]
    with torch.cuda.stream(stream):
        for step in range(10):
            for model, opt, sched, out in zip(models, opts, scheds, losses, strict=True):
                for micro in range(2):  # gradient accumulation
                    loss = _loss(model, 2 * step + micro)
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
                opt.step()
                opt.zero_grad()
                sched.step()
                out.append(loss.item())
    torch.cuda.synchronize()
    assert opts[0]._cast_stream is not None and opts[1]._cast_stream is None
    assert losses[0] == losses[1]
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    for pa, pb in zip(models[0].parameters(), models[1].parameters(), strict=True):
        for key, value in opts[0].state[pa].items():
            assert torch.equal(
                torch.as_tensor(value).cpu(), torch.as_tensor(opts[1].state[pb][key]).cpu()
            ), key


class _AdamWSubclass(torch.optim.AdamW):
    """A user's subclass: its step() might do more, so it is stepped in one call."""


@pytest.mark.parametrize(
    ("cls", "kwargs", "pieces"),
    [
        (torch.optim.AdamW, ADAMW, True),
        (torch.optim.SGD, SGD, True),
        (_AdamWSubclass, ADAMW, False),
    ],
    ids=["adamw", "sgd-momentum", "adamw-subclass"],
)
def test_device_pieces_only_for_known_classes(
    cls: type, kwargs: dict[str, Any], pieces: bool
) -> None:
    models, opts = _pieces_and_one_call(0.0, cls, kwargs)
    for model, opt in zip(models, opts, strict=True):
        _train(model, opt, 3)
    assert (opts[0]._cast_stream is not None) == pieces
    assert opts[1]._cast_stream is None
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_device_pieces_failure_leaves_no_fp32_gradient() -> None:
    (model, _), (opt, _) = _pieces_and_one_call(0.0)
    _train(model, opt, 2)  # the state exists: the next step runs in pieces
    assert opt._cast_stream is not None
    device_opt = opt._device_sub.optimizer
    fail_on_call(device_opt, "step", 2)  # the second piece fails
    _loss(model, 5).backward()
    with pytest.raises(RuntimeError, match="injected failure"):
        opt.step()
    # No master keeps a gradient that a later step would apply without writing it back.
    assert all(e.inner.grad is None for e in opt._entries if e.master)
    del device_opt.step
    opt.zero_grad()
    _train(model, opt, 1, start=6)  # the next step recovers
    assert all(torch.isfinite(p).all() for p in model.parameters())
