"""``overlap_host_step_with_forward``: host steps that finish under the next forward.

With the option, ``step()`` returns while the host still steps the offloaded
parameters; the next forward waits for each parameter in its module's forward
pre-hook. These tests check that nothing reads a stale value: after 10 steps with two
param groups, an LR scheduler, gradient clipping and gradient accumulation, parameters
are bit-identical to the same optimizer without the option; reads through
``state_dict()`` (the optimizer's and the model's) and ``synchronize()`` right after
``step()`` see the new values; checkpoints resume exactly; any other read of a
parameter whose update is in flight waits for it (a parameter of a subclass with a
``__torch_function__`` of its own fails loudly instead). CPU tests treat CPU tensors as device parameters (the
host-step thread and the hooks run as on a GPU, copies are synchronous); ``cuda`` tests
run the real path::

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python -m pytest tests/test_optim_overlap.py -m cuda -q
"""

from __future__ import annotations

import copy
import gc
import io
import threading
import time
from typing import Any

import pytest
import torch
from optim_helpers import every_param as _every_param
from torch.nn.attention import SDPBackend, sdpa_kernel

from cpu_offload.optim import HybridDeviceOptimizer
from cpu_offload.optim._entries import Entry
from cpu_offload.optim._forward_overlap import ForwardOverlap
from cpu_offload.optim._pending import is_pending

WIDTH = 32


def _model(device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [
        torch.nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
        for _ in range(2)
    ]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 8)).to(device=device, dtype=dtype)


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    half = len(params) // 2
    return [
        {"params": params[:half]},
        {"params": params[half:], "lr": 3e-3, "weight_decay": 0.0},
    ]


def _kwargs(device: str, fraction: float, **extra: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "offload_fraction": fraction,
        "param_update_in_fp32": True,
        "lr": 1e-3,
        "weight_decay": 0.01,
        **extra,
    }
    if device == "cpu":
        kw["is_device_param"] = _every_param
    return kw


def _batches(device: str, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(1)
    return [torch.randn(4, 6, WIDTH, device=device, generator=gen).to(dtype) for _ in range(n)]


def _train(
    model: torch.nn.Module,
    opt: HybridDeviceOptimizer,
    batches: list[torch.Tensor],
    micro: int = 2,
    clip: bool = True,
) -> None:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    # The math attention kernel: deterministic on every device.
    with sdpa_kernel(SDPBackend.MATH):
        _steps(model, opt, sched, batches, micro, clip)


def _steps(
    model: torch.nn.Module,
    opt: HybridDeviceOptimizer,
    sched: Any,
    batches: list[torch.Tensor],
    micro: int,
    clip: bool,
) -> None:
    for i in range(0, len(batches), micro):
        for x in batches[i : i + micro]:  # gradient accumulation
            (model(x).float().square().mean() / micro).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), name


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("last", [False, True], ids=["prefix", "suffix"])
def test_bit_identical_to_the_optimizer_without_the_option(
    deterministic: None, device: str, fraction: float, overlap: bool, last: bool
) -> None:
    dtype = torch.bfloat16
    model = _model(device, dtype)
    ref = copy.deepcopy(model)
    extra = {"overlap_cpu_optimizer_d2h_h2d": overlap, "offload_last_layers": last}
    opt = HybridDeviceOptimizer(
        _groups(model), overlap_host_step_with_forward=True, **_kwargs(device, fraction, **extra)
    )
    plain = HybridDeviceOptimizer(_groups(ref), **_kwargs(device, fraction, **extra))
    assert opt.offload_mask == plain.offload_mask and any(opt.offload_mask)
    if last and fraction < 1:
        assert opt.offload_mask[-1] and not opt.offload_mask[0]
    batches = _batches(device, dtype, 20)
    _train(model, opt, batches)
    _train(ref, plain, batches)
    opt.synchronize()
    _equal(model, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("read", ["synchronize", "opt_state_dict", "model_state_dict"])
def test_reads_right_after_step_see_the_new_values(
    deterministic: None, device: str, read: str
) -> None:
    model = _model(device, torch.float32)
    ref = copy.deepcopy(model)
    opt = HybridDeviceOptimizer(
        model.parameters(), overlap_host_step_with_forward=True, **_kwargs(device, 1.0)
    )
    plain = HybridDeviceOptimizer(ref.parameters(), **_kwargs(device, 1.0))
    batches = _batches(device, torch.float32, 6)
    _train(model, opt, batches[:4], clip=False)
    _train(ref, plain, batches[:4], clip=False)
    with sdpa_kernel(SDPBackend.MATH):
        for m, o in ((model, opt), (ref, plain)):
            m(batches[4]).square().mean().backward()
            o.step()
    # Read at once, before any forward could have waited for the parameters.
    if read == "synchronize":
        opt.synchronize()
        got = [p.detach().clone() for p in model.parameters()]
    elif read == "opt_state_dict":
        state = opt.state_dict()
        got = [p.detach().clone() for p in model.parameters()]
        assert all(float(s["step"]) == 3.0 for s in state["state"].values())
    else:
        got = [t.clone() for t in model.state_dict().values()]
    want = [p.detach() for p in ref.parameters()]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("last", [False, True], ids=["prefix", "suffix"])
@pytest.mark.parametrize("clip", [False, True], ids=["kept", "clipped"])
def test_auto_copies_early_only_the_gradients_behind_device_layers(
    deterministic: None, device: str, last: bool, clip: bool
) -> None:
    # The host steps in forward order: an early copy pays only for a parameter read
    # after a device-stepped one (offload_last_layers), whose gradient backward produces
    # while the device layers' backward still runs.
    model = _model(device, torch.bfloat16)
    ref = copy.deepcopy(model)
    kw = _kwargs(device, 0.5, offload_last_layers=last)
    opt = HybridDeviceOptimizer(_groups(model), overlap_host_step_with_forward=True, **kw)
    opt._early_min_numel = 0  # this model's gradients are all small
    plain = HybridDeviceOptimizer(_groups(ref), early_grad_copy=False, **kw)
    batches = _batches(device, torch.bfloat16, 6)
    _train(model, opt, batches, micro=1, clip=clip)
    _train(ref, plain, batches, micro=1, clip=clip)
    opt.synchronize()
    _equal(model, ref)
    timings = opt.last_step_timings
    offloaded = sum(opt.offload_mask)
    assert timings["early_copies"] == (offloaded if last else 0)
    assert timings["early_copies_reused"] == (0 if clip or not last else offloaded)


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_checkpoint_resume_is_exact(deterministic: None, device: str, fraction: float) -> None:
    kw = _kwargs(device, fraction, overlap_host_step_with_forward=True)
    model = _model(device, torch.bfloat16)
    opt = HybridDeviceOptimizer(_groups(model), **kw)
    batches = _batches(device, torch.bfloat16, 8)
    _train(model, opt, batches[:4])
    # The model's state first: it must wait for its parameters as well.
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, batches[4:])

    torch.manual_seed(5)
    resumed = _model(device, torch.bfloat16)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = HybridDeviceOptimizer(_groups(resumed), **kw)
    opt2.load_state_dict(checkpoint["opt"])
    _train(resumed, opt2, batches[4:])
    opt.synchronize()
    opt2.synchronize()
    _equal(model, resumed)


class _SlowAdamW(torch.optim.AdamW):
    """A host optimizer slow enough that a read not waiting for it would see old values."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        time.sleep(0.05)
        return super().step(closure)


def _slow_pair(fraction: float = 1.0, device: str = "cpu") -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, device=device)
    extra = torch.nn.Linear(8, 8, device=device)
    ref_model, ref_extra = copy.deepcopy(model), copy.deepcopy(extra)
    kw = _kwargs(device, fraction, cpu_optimizer_cls=_SlowAdamW)
    opt = HybridDeviceOptimizer(
        [*model.parameters(), *extra.parameters()], overlap_host_step_with_forward=True, **kw
    )
    plain = HybridDeviceOptimizer([*ref_model.parameters(), *ref_extra.parameters()], **kw)
    return model, extra, opt, ref_model, ref_extra, plain


def _step_reference_then_overlapped(x: torch.Tensor, pair: tuple[Any, ...]) -> None:
    """One step of the reference, then of the overlapped optimizer, whose host step
    (50 ms) then still runs when the test reads."""
    model, _, opt, ref_model, _, plain = pair
    for m, o in ((ref_model, plain), (model, opt)):
        m(x).sum().backward()
        o.step()


@pytest.mark.parametrize("device", DEVICES)
def test_a_read_outside_any_module_sees_the_new_value(device: str) -> None:
    # extra's weight is read by the training loop itself, never by a module: the read
    # waits for its update, as a module's forward does.
    model, extra, opt, ref_model, ref_extra, plain = _slow_pair(device=device)
    x = torch.randn(2, 8, device=device)
    for _ in range(3):
        for m, e, o in ((model, extra, opt), (ref_model, ref_extra, plain)):
            torch.nn.functional.linear(m(x), e.weight).sum().backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    for got, want in zip(
        [*model.parameters(), *extra.parameters()],
        [*ref_model.parameters(), *ref_extra.parameters()],
        strict=True,
    ):
        assert torch.equal(got, want)


def _plain_parameter(p: torch.Tensor) -> torch.Tensor:
    # A copy is a parameter of the own class, not of the pending one.
    assert type(p) is torch.nn.Parameter
    return p.detach()


@pytest.mark.parametrize(
    "read",
    [
        lambda p: p.detach().clone(),
        lambda p: p.data.clone(),
        lambda p: p.cpu(),
        lambda p: p.sum(),
        lambda p: p.norm(),
        lambda p: p[0],
        lambda p: torch.tensor(p.tolist()),
        lambda p: torch.zeros_like(p).lerp_(p, 0.5),
        lambda p: _plain_parameter(copy.deepcopy(p)),
        lambda p: _plain_parameter(_roundtrip(p)),
    ],
    ids=["clone", "data", "cpu", "sum", "norm", "index", "tolist", "ema", "deepcopy", "save"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_every_read_right_after_step_waits_for_the_new_value(read: Any, device: str) -> None:
    # On CUDA the copy back runs on a side stream: the read waits for the host step and
    # orders the current stream after the copy.
    pair = _slow_pair(device=device)
    model, extra, opt, ref_model, _, plain = pair
    _step_reference_then_overlapped(torch.randn(2, 8, device=device), pair)
    assert is_pending(model.weight)
    got, want = read(model.weight), read(ref_model.weight)
    assert type(model.weight) is torch.nn.Parameter  # its own class once it landed
    assert torch.equal(got, want)
    opt.synchronize()


def test_threads_reading_one_pending_parameter_all_wait() -> None:
    pair = _slow_pair()
    model, extra, opt, ref_model, _, plain = pair
    _step_reference_then_overlapped(torch.randn(2, 8), pair)
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            results.append(model.weight.detach().clone())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 4
    assert all(torch.equal(r, ref_model.weight.detach()) for r in results)
    assert type(model.weight) is torch.nn.Parameter
    opt.synchronize()


def test_zero_grad_and_metadata_do_not_wait() -> None:
    model, extra, opt, *_ = _slow_pair()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    assert model.weight.shape == (8, 8) and model.weight.requires_grad
    assert model.weight.grad is None and {model.weight: 1}[model.weight] == 1
    assert model.weight.size(0) == 8 and model.weight.dtype == torch.float32
    assert is_pending(model.weight)  # nothing above waited for it (a wait unmarks it)
    opt.synchronize()
    assert not is_pending(model.weight) and type(model.weight) is torch.nn.Parameter


class _Clamped(torch.nn.Parameter):
    """A parameter whose own override clamps what ``copy_`` writes into it."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_:
            _Clamped.calls += 1
            args = (args[0], args[1].clamp(-0.05, 0.05), *args[2:])
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_subclass_override_runs_as_without_the_option() -> None:
    results = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        weight = _Clamped(torch.randn(8, 8) * 0.01)
        opt = HybridDeviceOptimizer(
            [*model.parameters(), weight],
            overlap_host_step_with_forward=overlap,
            **_kwargs("cpu", 1.0, lr=0.1),
        )
        _Clamped.calls = 0
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            opt.synchronize()  # weight is read outside any module: waited for by hand
            (model(x) @ weight).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        results[overlap] = (weight.detach().clone(), _Clamped.calls)
    assert results[True][1] == results[False][1] == 3
    assert torch.equal(results[True][0], results[False][0])


class _Tagged(torch.Tensor):
    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        _Tagged.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_another_subclass_in_the_same_call_keeps_its_override() -> None:
    pair = _slow_pair()
    model, _, opt, ref_model, _, plain = pair
    _step_reference_then_overlapped(torch.randn(2, 8), pair)
    tag = torch.ones(8, 8).as_subclass(_Tagged)
    _Tagged.seen = []
    out = torch.add(model.weight, tag)
    assert type(out) is _Tagged and "add" in _Tagged.seen
    assert torch.equal(out.as_subclass(torch.Tensor), (ref_model.weight + 1).detach())
    opt.synchronize()


@pytest.mark.parametrize("first_step_eager", [True, False])
def test_compiled_forwards_wait_and_stay_exact(first_step_eager: bool) -> None:
    model, extra, opt, ref_model, ref_extra, plain = _slow_pair()
    compiled = torch.compile(model, backend="eager")
    for i in range(3):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
        run = model if (first_step_eager and i == 0) else compiled
        if run is compiled and i == 1 and first_step_eager:
            # Compiling sets PyTorch's process-wide is_compiling flag, which changes the
            # host AdamW's arithmetic on the host-step thread: not while it runs.
            opt.synchronize()
        run(x).sum().backward()
        opt.step()
        opt.zero_grad()
        ref_model(x).sum().backward()
        plain.step()
        plain.zero_grad()
    opt.synchronize()
    for got, want in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(got, want)


def test_a_dropped_optimizer_leaves_no_pending_parameter() -> None:
    pair = _slow_pair()
    model, extra, opt, ref_model, _, plain = pair
    _step_reference_then_overlapped(torch.randn(2, 8), pair)
    assert is_pending(model.weight) and is_pending(model.bias)
    del opt, pair  # the pair held it too
    gc.collect()
    # Its host step still runs: a read waits for it and sees the new value.
    assert torch.equal(model.weight.detach().clone(), ref_model.weight.detach())
    assert type(model.weight) is torch.nn.Parameter and not model.weight.__dict__
    # A parameter no one read gets its own class back once the host step is over.
    deadline = time.monotonic() + 10.0
    while is_pending(model.bias) and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
    assert type(model.bias) is torch.nn.Parameter and not model.bias.__dict__
    assert torch.equal(model.bias.detach(), ref_model.bias.detach())


def test_the_whole_model_pickles_once_its_forward_was_learned() -> None:
    model, extra, opt, *_ = _slow_pair()
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    copy_ = _roundtrip(model)  # while pending: waits, and its hooks travel as no-ops
    opt.synchronize()
    for got, want in zip(copy_.parameters(), model.parameters(), strict=True):
        assert type(got) is torch.nn.Parameter and torch.equal(got, want)
    assert copy_.state_dict().keys() == model.state_dict().keys()


def test_host_step_timings_count_the_work_done_under_the_forward() -> None:
    model, extra, opt, *_ = _slow_pair()
    for i in range(4):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        if i > 0:
            # The previous step's host work (a 50 ms sleep per bucket) finished under
            # this one, or in a synchronize() in between: counted once, here.
            assert opt.last_step_timings["host_step_s"] >= 0.05
            assert opt.last_step_timings["host_step_s"] < 0.1 + 0.05
        opt.zero_grad()
        if i == 1:
            opt.synchronize()
            opt.state_dict()


class _OwnOverride(torch.nn.Parameter):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_subclass_with_its_own_override_still_fails_loudly() -> None:
    # Its functions are not run with its override off: a read outside any module's
    # forward is caught where backward reaches it.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    extra = _OwnOverride(torch.randn(8, 8))
    opt = HybridDeviceOptimizer(
        [*model.parameters(), extra], overlap_host_step_with_forward=True, **_kwargs("cpu", 1.0)
    )
    x = torch.randn(2, 8)

    def loss() -> torch.Tensor:
        return torch.nn.functional.linear(model(x), extra).sum()

    loss().backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="synchronize"):
        loss().backward()
    # After an explicit synchronize() the same read is fine.
    opt.zero_grad()
    opt.synchronize()
    loss().backward()
    opt.step()
    opt.synchronize()


class _FailingAdamW(torch.optim.AdamW):
    calls = 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        _FailingAdamW.calls += 1
        if _FailingAdamW.calls > 1:
            raise ValueError("host step failed")
        return super().step(closure)


def test_a_failing_host_step_is_reported_not_hung() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    _FailingAdamW.calls = 0
    opt = HybridDeviceOptimizer(
        model.parameters(),
        cpu_optimizer_cls=_FailingAdamW,
        overlap_host_step_with_forward=True,
        **_kwargs("cpu", 1.0, overlap_cpu_optimizer_d2h_h2d=False),
    )
    x = torch.randn(2, 8)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="host optimizer step") as info:
        model(x)
    assert isinstance(info.value.__cause__, ValueError)
    opt.synchronize()  # the failure was reported once; nothing is pending any more


def test_option_is_checked_and_off_by_default() -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="overlap_host_step_with_forward"):
        HybridDeviceOptimizer(model.parameters(), overlap_host_step_with_forward="yes")
    with pytest.raises(TypeError, match="offload_last_layers"):
        HybridDeviceOptimizer(model.parameters(), offload_last_layers=1)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.0)
    assert opt.overlap_host_step_with_forward is False and opt.offload_last_layers is False


def test_dropped_optimizer_removes_its_global_hook() -> None:
    import gc

    hooks = torch.nn.modules.module._global_forward_pre_hooks
    gc.collect()
    opt = HybridDeviceOptimizer(
        torch.nn.Linear(4, 4).parameters(),
        offload_fraction=0.0,
        overlap_host_step_with_forward=True,
    )
    ours = [k for k, h in hooks.items() if getattr(h, "_owner", lambda: None)() is opt._overlap]
    assert len(ours) == 1
    del opt
    gc.collect()
    assert ours[0] not in hooks


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_state_holds_every_parameter_once_synchronized(fraction: float) -> None:
    # The host buckets are stepped after step() returns, so their state may not exist
    # yet when step() builds the state view: synchronize() must show it.
    model = _model("cpu", torch.float32)
    kw = _kwargs("cpu", fraction, overlap_host_step_with_forward=True)
    opt = HybridDeviceOptimizer(_groups(model), **kw)
    model(_batches("cpu", torch.float32, 1)[0]).sum().backward()
    opt.step()
    opt.synchronize()
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(opt.state) == len(params)
    assert all(p in opt.state and int(opt.state[p]["step"]) == 1 for p in params)


def test_streamed_entries_count_as_stepped_on_the_device() -> None:
    # The rule behind early_grad_copy="auto": a host-stepped parameter the forward reads
    # after a streamed one has its gradient copied in backward, as after a device one.
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    entries = [
        Entry(p, 0, host=True, offloaded=True, inner=p.detach().clone(), master=False)
        for p in model.parameters()
    ]
    overlap = ForwardOverlap(None)
    overlap.track(entries)
    model(torch.randn(2, 4))  # the first forward shows the read order
    overlap.finish_learning()
    assert not any(overlap.read_after_device_param(e) for e in entries)
    for entry in entries[2:4]:  # the second layer's weight and bias
        entry.streamed = True
    overlap.track(entries)
    after = [overlap.read_after_device_param(e) for e in entries]
    assert after == [False, False, False, True, True, True]
