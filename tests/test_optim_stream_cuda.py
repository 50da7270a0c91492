"""GPU tests of ``stream_share``: offloaded state stepped on the GPU, streamed from the host.

A streamed parameter is stepped by the host optimizer class's fused CUDA kernel on its
host state, so a run with every offloaded parameter streamed is bit-identical to the
same optimizer stepping everything on the device (fraction 0), and a run that streams
some and steps the rest on the host is bit-identical to the split that puts the streamed
ones on the device and the others on the host. Checked over 10 steps with two param
groups, a scheduler, clipping and gradient accumulation; with the host step under the
next forward and without; across chunk sizes; resume from a state dict; a read of a
parameter between ``step()`` and the next forward; in-place ``zero_grad``; a caller's
stream busy while the lane queues.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import cpu_offload.optim._stream as stream_module
from cpu_offload.optim import HybridDeviceOptimizer, optimizer_device_state_bytes

pytestmark = pytest.mark.cuda

WIDTH = 128
LAYERS = 4


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        blocks += [torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device="cuda", dtype=torch.bfloat16)


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [
        {"params": params[:2]},
        {"params": params[2:], "lr": 3e-4, "weight_decay": 0.0, "betas": (0.8, 0.95)},
    ]


def _optimizer(model: torch.nn.Module, **kwargs: Any) -> HybridDeviceOptimizer:
    return HybridDeviceOptimizer(
        _groups(model),
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True,
        lr=1e-3,
        weight_decay=0.01,
        **kwargs,
    )


def _loss(model: torch.nn.Module, step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(1000 + 10 * step + micro)
    x = torch.randn(32, WIDTH, device="cuda", generator=gen).to(torch.bfloat16)
    return model(x).float().square().mean()


def _train(
    model: torch.nn.Module,
    opt: HybridDeviceOptimizer,
    steps: int,
    start: int = 0,
    set_to_none: bool = True,
) -> list[torch.Tensor]:
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(start):
        scheduler.step()
    losses = []
    for i in range(start, start + steps):
        for micro in range(2):  # gradient accumulation
            loss = _loss(model, i, micro)
            loss.backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        scheduler.step()
    opt.synchronize()
    return losses


def _assert_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("chunk", [None, 1000])
@pytest.mark.parametrize("under_forward", [False, True])
def test_fully_streamed_equals_device_step(
    deterministic: None, monkeypatch: pytest.MonkeyPatch, under_forward: bool, chunk: int | None
) -> None:
    if chunk is not None:
        # Many chunks per parameter, the ring reused, a short last chunk.
        monkeypatch.setattr(stream_module, "CHUNK_NUMEL", chunk)
    reference, streamed = _model(), _model()
    ref_opt = _optimizer(reference, offload_fraction=0.0)
    opt = _optimizer(
        streamed,
        offload_fraction=1.0,
        stream_share=1.0,
        overlap_host_step_with_forward=under_forward,
    )
    ref_losses = _train(reference, ref_opt, 10)
    losses = _train(streamed, opt, 10)
    assert opt.last_step_timings["streamed_numel"] == LAYERS * WIDTH * WIDTH
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    _assert_equal(streamed, reference)
    # The state stayed in host memory.
    assert optimizer_device_state_bytes(opt) == 0
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    for index, saved in ref_state.items():
        for key in ("exp_avg", "exp_avg_sq", "master_param", "step"):
            assert torch.equal(state[index][key].cpu(), saved[key].cpu()), (index, key)


@pytest.mark.parametrize("under_forward", [False, True])
def test_half_streamed_equals_the_matching_split(deterministic: None, under_forward: bool) -> None:
    # Host order is the forward's with the step under the forward (streamed: the first
    # two layers), reversed parameter order without it (streamed: the last two). The
    # reference puts exactly the streamed layers on the device, the others on the host.
    reference, streamed = _model(), _model()
    ref_opt = _optimizer(
        reference,
        offload_fraction=0.5,
        offload_last_layers=under_forward,
        overlap_host_step_with_forward=under_forward,
    )
    opt = _optimizer(
        streamed,
        offload_fraction=1.0,
        stream_share=0.5,
        overlap_host_step_with_forward=under_forward,
    )
    _train(reference, ref_opt, 10)
    _train(streamed, opt, 10)
    assert opt.last_step_timings["streamed_numel"] == 2 * WIDTH * WIDTH
    streamed_mask = [e.streamed for e in opt._entries]
    assert streamed_mask == [not off for off in ref_opt.offload_mask]
    _assert_equal(streamed, reference)


def test_resume_from_state_dict_is_exact(deterministic: None) -> None:
    whole, first = _model(), _model()
    whole_opt = _optimizer(whole, offload_fraction=1.0, stream_share=0.75)
    _train(whole, whole_opt, 8)
    first_opt = _optimizer(first, offload_fraction=1.0, stream_share=0.75)
    _train(first, first_opt, 4)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed = _model(seed=1)
    resumed.load_state_dict(saved["model"])
    resumed_opt = _optimizer(resumed, offload_fraction=1.0, stream_share=0.75)
    resumed_opt.load_state_dict(saved["opt"])
    _train(resumed, resumed_opt, 4, start=4)
    _assert_equal(resumed, whole)


def test_read_between_step_and_forward_sees_the_update(deterministic: None) -> None:
    reference, streamed = _model(), _model()
    ref_opt = _optimizer(reference, offload_fraction=0.0)
    opt = _optimizer(
        streamed, offload_fraction=1.0, stream_share=1.0, overlap_host_step_with_forward=True
    )
    _train(reference, ref_opt, 2)
    _train(streamed, opt, 2)
    for model, optimizer in ((reference, ref_opt), (streamed, opt)):
        model.zero_grad()
        _loss(model, 99, 0).backward()
        optimizer.step()
    # Read at once, outside any module's forward, on another stream than the lane's.
    first = streamed[0].weight
    read = [first.detach().clone(), (first.float() * 2).sum()]
    assert torch.equal(read[0], reference[0].weight)
    assert torch.equal(read[1], (reference[0].weight.float() * 2).sum())
    _train(reference, ref_opt, 2, start=3)
    _train(streamed, opt, 2, start=3)
    _assert_equal(streamed, reference)


def test_zero_grad_in_place_waits_for_the_lane(deterministic: None) -> None:
    reference, streamed = _model(), _model()
    ref_opt = _optimizer(reference, offload_fraction=0.0)
    opt = _optimizer(
        streamed, offload_fraction=1.0, stream_share=1.0, overlap_host_step_with_forward=True
    )
    _train(reference, ref_opt, 6, set_to_none=False)
    _train(streamed, opt, 6, set_to_none=False)
    _assert_equal(streamed, reference)


def test_busy_caller_stream_does_not_corrupt_the_lane(
    deterministic: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keep the caller's stream busy while the lane queues, so that the lane's compute
    # stream (which waits for the caller before its first chunk) runs late: work the lane
    # queued on the caller's stream, or allocation work on compute (deterministic mode
    # fills new memory with NaN) behind the first copies into a slot, would then land on
    # top of data already copied. The results must hold.
    caller = torch.cuda.current_stream()
    original = stream_module.StateStream._proxy

    def busy_caller(self: Any, *args: Any) -> Any:
        with torch.cuda.stream(caller):
            torch.cuda._sleep(2_000_000)
        return original(self, *args)

    monkeypatch.setattr(stream_module.StateStream, "_proxy", busy_caller)
    monkeypatch.setattr(stream_module, "CHUNK_NUMEL", 4096)
    reference, streamed = _model(), _model()
    ref_opt = _optimizer(reference, offload_fraction=0.0)
    opt = _optimizer(
        streamed, offload_fraction=1.0, stream_share=1.0, overlap_host_step_with_forward=True
    )
    _train(reference, ref_opt, 4)
    _train(streamed, opt, 4)
    _assert_equal(streamed, reference)
