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


def _model(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        blocks += [torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device="cuda", dtype=dtype)


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [
        {"params": params[:2]},
        {"params": params[2:], "lr": 3e-4, "weight_decay": 0.0, "betas": (0.8, 0.95)},
    ]


def _optimizer(
    model: torch.nn.Module, cls: type[torch.optim.Optimizer] = torch.optim.AdamW, **kwargs: Any
) -> HybridDeviceOptimizer:
    options: dict[str, Any] = {"param_update_in_fp32": True, "lr": 1e-3, "weight_decay": 0.01}
    options.update(kwargs)
    return HybridDeviceOptimizer(
        _groups(model), cpu_optimizer_cls=cls, gpu_optimizer_cls=cls, **options
    )


def _loss(model: torch.nn.Module, step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(1000 + 10 * step + micro)
    dtype = next(model.parameters()).dtype  # bf16, or fp32 for the fp32-parameter test
    x = torch.randn(32, WIDTH, device="cuda", generator=gen).to(dtype)
    return model(x).float().square().mean()


def _train(
    model: torch.nn.Module,
    opt: HybridDeviceOptimizer,
    steps: int,
    start: int = 0,
    set_to_none: bool = True,
    before_step: Any = None,
    clip: bool = True,
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
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if before_step is not None:
            before_step(model)
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


@pytest.mark.parametrize("clip", [False, True])
def test_host_lane_behind_streamed_copies_early(deterministic: None, clip: bool) -> None:
    # With the step under the forward, the host lane's buckets are read after the
    # streamed ones: their gradients are copied in backward (backward makes them first),
    # checked in step(), and copied again where clipping changed them in place.
    # Streamed entries get no host gradient or staging buffers.
    streamed = _model()
    opt = _optimizer(
        streamed, offload_fraction=1.0, stream_share=0.5, overlap_host_step_with_forward=True
    )
    opt._early_min_numel = 0  # this model's gradients are all small
    _train(streamed, opt, 1, clip=clip)  # the first forward shows the read order
    assert opt.last_step_timings["early_copies"] == 0
    _train(streamed, opt, 3, start=1, clip=clip)
    host = [e for e in opt._entries if e.offloaded and not e.streamed]
    assert len(host) == 2
    assert all(e.grad_buf is not None and e.stage is not None for e in host)
    assert all(e.grad_buf is None and e.stage is None for e in opt._entries if e.streamed)
    assert opt.last_step_timings["early_copies"] == len(host)
    assert opt.last_step_timings["early_copies_reused"] == (0 if clip else len(host))
    # Against the matching split: the streamed layers on the device, the others on the host.
    split = _model()
    split_opt = _optimizer(
        split,
        offload_fraction=0.5,
        offload_last_layers=True,
        overlap_host_step_with_forward=True,
        early_grad_copy=False,
    )
    _train(split, split_opt, 4, clip=clip)
    # Narrowed on the host with a stream lane ("auto"), on the device without: same values.
    assert (opt.param_copy_dtype, split_opt.param_copy_dtype) == ("param", "master")
    _assert_equal(streamed, split)


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


def _fully_streamed_under_forward() -> tuple[
    torch.nn.Sequential, HybridDeviceOptimizer, torch.nn.Sequential, HybridDeviceOptimizer
]:
    """A model stepped on the device, and its twin with every parameter streamed."""
    reference, streamed = _model(), _model()
    ref_opt = _optimizer(reference, offload_fraction=0.0)
    opt = _optimizer(
        streamed, offload_fraction=1.0, stream_share=1.0, overlap_host_step_with_forward=True
    )
    return reference, ref_opt, streamed, opt


def test_read_between_step_and_forward_sees_the_update(deterministic: None) -> None:
    reference, ref_opt, streamed, opt = _fully_streamed_under_forward()
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
    reference, ref_opt, streamed, opt = _fully_streamed_under_forward()
    _train(reference, ref_opt, 6, set_to_none=False)
    _train(streamed, opt, 6, set_to_none=False)
    _assert_equal(streamed, reference)


def _sleep_on(stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(4_000_000)  # a few ms of GPU time


@pytest.mark.parametrize("contiguous_grads", [True, False])
def test_busy_caller_stream_does_not_corrupt_the_lane(
    deterministic: None, monkeypatch: pytest.MonkeyPatch, contiguous_grads: bool
) -> None:
    # The caller's stream is kept busy before step() (so the lane's compute stream, which
    # waits for it, starts late while its copies in run ahead) and while the lane
    # queues (so that lane work queued on the caller's stream would run late): work
    # that the allocation of a slot queues on compute (deterministic mode fills new
    # memory with NaN) landing on top of a finished copy in, a step count made on the
    # caller's stream, or a non-contiguous gradient made contiguous on the caller's
    # stream after the point compute waits for, would corrupt the results.
    caller = torch.cuda.current_stream()
    original = stream_module.StateStream._host_state

    def busy_host_state(self: Any, *args: Any) -> Any:
        _sleep_on(caller)
        return original(self, *args)

    def before_step(model: torch.nn.Module) -> None:
        _sleep_on(caller)
        if not contiguous_grads:
            for p in model.parameters():
                assert p.grad is not None
                p.grad = p.grad.t().contiguous().t()  # the same values, transposed strides
                assert not p.grad.is_contiguous()

    monkeypatch.setattr(stream_module.StateStream, "_host_state", busy_host_state)
    monkeypatch.setattr(stream_module, "CHUNK_NUMEL", 4096)
    reference, ref_opt, streamed, opt = _fully_streamed_under_forward()
    _train(reference, ref_opt, 4)
    _train(streamed, opt, 4, before_step=before_step)
    _assert_equal(streamed, reference)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.AdamW, {}),
        (torch.optim.Adam, {"amsgrad": True, "maximize": True, "weight_decay": 0.0}),
    ],
    ids=["adamw", "adam-amsgrad-maximize"],
)
def test_fp32_parameters_unpinned_host_copies(
    deterministic: None, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    # fp32 parameters (the host copy is the state's own fp32), pin_cpu_params=False (the
    # streamed host copies are pinned anyway), Adam's amsgrad and maximize.
    reference, streamed = _model(dtype=torch.float32), _model(dtype=torch.float32)
    ref_opt = _optimizer(reference, cls, offload_fraction=0.0, **kwargs)
    opt = _optimizer(
        streamed, cls, offload_fraction=1.0, stream_share=1.0, pin_cpu_params=False, **kwargs
    )
    assert all(e.inner.is_pinned() for e in opt._entries if e.streamed)
    _train(reference, ref_opt, 6)
    _train(streamed, opt, 6)
    assert opt.last_step_timings["streamed_numel"] == LAYERS * WIDTH * WIDTH
    assert opt.last_step_timings["host_numel"] == 0
    _assert_equal(streamed, reference)


def test_state_is_whole_when_step_returns(deterministic: None) -> None:
    # Without the host step under the next forward, step() returns with every
    # parameter and the whole state updated, streamed or not: a reader of opt.state
    # right after step() sees this step's moments.
    reference, streamed = _model(), _model()
    ref_opt = _optimizer(reference, offload_fraction=0.0)
    opt = _optimizer(streamed, offload_fraction=1.0, stream_share=1.0)
    caller = torch.cuda.current_stream()
    for model, optimizer in ((reference, ref_opt), (streamed, opt)):
        _loss(model, 0, 0).backward()
        _sleep_on(caller)  # the lane's compute waits for this before it starts
        optimizer.step()
    for p_ref, p in zip(reference.parameters(), streamed.parameters(), strict=True):
        moments = opt.state[p]
        assert not moments["exp_avg"].is_cuda
        assert torch.equal(moments["exp_avg"], ref_opt.state[p_ref]["exp_avg"].cpu())
        assert torch.equal(moments["master_param"], ref_opt.state[p_ref]["master_param"].cpu())


def test_lower_precision_host_copies_are_refused_at_construction() -> None:
    # bf16 parameters without fp32 masters have bf16 host copies: nothing to stream.
    with pytest.raises(ValueError, match=r"stream_share=0.5 .*param_update_in_fp32=True"):
        _optimizer(_model(), offload_fraction=1.0, stream_share=0.5, param_update_in_fp32=False)


def test_parameter_without_gradient_is_not_stepped(deterministic: None) -> None:
    def drop_one(model: torch.nn.Module) -> None:
        model[2].weight.grad = None  # a frozen layer this step: no update, no state change

    reference, ref_opt, streamed, opt = _fully_streamed_under_forward()
    _train(reference, ref_opt, 4, before_step=drop_one)
    _train(streamed, opt, 4, before_step=drop_one)
    assert opt.last_step_timings["streamed_numel"] == (LAYERS - 1) * WIDTH * WIDTH
    assert not opt.state[streamed[2].weight]  # never stepped: no state
    _assert_equal(streamed, reference)


def test_dummy_step_load_and_add_param_group(deterministic: None) -> None:
    def build(seed: int, fraction: float, share: float) -> Any:
        model = _model(seed=seed)
        params = list(model.parameters())
        opt = HybridDeviceOptimizer(
            params[:2],
            offload_fraction=fraction,
            stream_share=share,
            param_update_in_fp32=True,
            lr=1e-3,
            weight_decay=0.01,
        )
        opt.add_param_group({"params": params[2:], "lr": 3e-4})  # rebuilt: all streamed
        return model, opt

    reference, ref_opt = build(0, 0.0, 0.0)
    streamed, opt = build(0, 1.0, 1.0)
    assert all(e.streamed for e in opt._entries)
    _train(reference, ref_opt, 2)
    _train(streamed, opt, 2)
    buf = io.BytesIO()
    torch.save({"model": streamed.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    fresh, fresh_opt = build(9, 1.0, 1.0)
    fresh.load_state_dict(saved["model"])
    before = [p.detach().clone() for p in fresh.parameters()]
    fresh_opt.dummy_step()  # state made, parameters unchanged
    for p, b in zip(fresh.parameters(), before, strict=True):
        assert torch.equal(p, b)
    fresh_opt.load_state_dict(saved["opt"])
    _train(reference, ref_opt, 2, start=2)
    _train(fresh, fresh_opt, 2, start=2)
    _assert_equal(fresh, reference)


def test_a_lane_failing_part_way_raises_its_own_error(
    deterministic: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lane queues one bucket and fails; marking the streamed parameters for their
    # readers then fails too. The caller gets the lane's error, the marking's as a note,
    # and reads of the parameters after it do not hang.
    import sys

    import cpu_offload.optim._forward_overlap as overlap_module

    model = _model()
    opt = _optimizer(
        model, offload_fraction=1.0, stream_share=0.5, overlap_host_step_with_forward=True
    )
    queue = stream_module.StateStream.queue
    mark = overlap_module.ForwardOverlap.mark_queued

    def failing_queue(self: Any, subs: Any, before_step: Any) -> int:
        queue(self, subs[:1], before_step)
        raise RuntimeError("the lane failed")

    def failing_mark(self: Any, entries: Any) -> None:
        mark(self, entries)
        raise RuntimeError("marking failed")

    monkeypatch.setattr(stream_module.StateStream, "queue", failing_queue)
    monkeypatch.setattr(overlap_module.ForwardOverlap, "mark_queued", failing_mark)
    _loss(model, 0, 0).backward()
    if sys.version_info >= (3, 11):
        with pytest.raises(RuntimeError, match="the lane failed") as info:
            opt.step()
        assert any("marking failed" in note for note in info.value.__notes__)
    else:
        with (
            pytest.warns(RuntimeWarning, match="marking failed"),
            pytest.raises(RuntimeError, match="the lane failed"),
        ):
            opt.step()
    for p in model.parameters():
        assert torch.isfinite(p.float()).all()
    torch.cuda.synchronize()
