"""The device step: gradient copies queued before it, and its pieces beside the casts.

Without side streams, offloaded gradients' copies are queued before the device
optimizer's step (a copy queued after it would wait for it). With fp32 masters the
device step is cut into pieces (``device_step_pieces``: whole entries in order, and only
where that changes nothing), each stepped after its gradients' casts on a side stream
(NOTE [Casting device gradients beside the device step]); stand-in streams on the CPU
log the order of the waits, the values are bit-identical to one call, and a failing
piece clears the gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import fail_on_call
from optim_helpers import ADAMW

from cpu_offload.optim import HybridDeviceOptimizer
from cpu_offload.optim._entries import Entry
from cpu_offload.optim._step import device_step_pieces


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
