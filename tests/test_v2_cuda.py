"""V2 on a real GPU: numerics, memory, overlap, steady state, real attention layers.

Run with deterministic kernels:
``CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python3 -m pytest -m cuda``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_bit_equal, step

from cpu_offload import v2
from cpu_offload.models import ModelSpec, build_layers

pytestmark = pytest.mark.cuda

DEV = "cuda"


def _linear_stack(n: int = 12, width: int = 1024) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n)).to(DEV)


def _linear_input() -> torch.Tensor:
    return torch.randn(16, 1024, 1024, device=DEV, generator=torch.Generator(DEV).manual_seed(1))


def test_default_schedule_linear_bit_exact_and_memory(deterministic):
    layers = _linear_stack()
    ref = step(layers, _linear_input)
    ctx, sync = v2.get_cpu_offload_context(enabled=True, num_layers=3, model_layers=12)
    got = step(layers, _linear_input, ctx, sync)
    assert_bit_equal(ref, got)
    offloaded = ctx.offload_synchronizer.transport.bytes_offloaded
    assert offloaded == 3 * 16 * 1024 * 1024 * 4  # each offloaded layer saved its input
    saved = ref.peak_bytes - got.peak_bytes
    assert saved >= 0.9 * offloaded, (ref.peak_bytes, got.peak_bytes, offloaded)


def test_manual_synchronization_bit_exact(deterministic):
    layers = _linear_stack()
    ref = step(layers, _linear_input)
    stream = torch.cuda.Stream()
    ctx, sync, manual = v2.get_cpu_offload_context(
        enabled=True, model_layers=12, manual_synchronization=True, offload_stream=stream
    )

    def run(x):
        for i, layer in enumerate(layers):
            with ctx:
                x = layer(x)
            x = sync(x)
            manual.start_offload_layer(i)
        for i in range(12):
            manual.release_activation_forward_gpu_memory(i)
        for i in reversed(range(12)):
            manual.start_reload_layer(i)
        return x

    for p in layers.parameters():
        p.grad = None
    loss = run(_linear_input()).square().mean()
    loss.backward()
    assert torch.equal(loss.detach(), ref.loss)
    for p, g in zip(layers.parameters(), ref.grads, strict=True):
        assert torch.equal(p.grad, g)
    assert manual.transport.bytes_reloaded == manual.transport.bytes_offloaded > 0


@pytest.mark.parametrize("kind", ["gpt", "encoder", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_attention_layers_bit_exact_and_freed(kind, dtype, deterministic):
    # Activations large against the parameters: the offloaded run's peak comes later in
    # backward, where more parameter gradients exist, so small activations would hide
    # the saving behind gradient memory.
    spec = ModelSpec(kind=kind, hidden=256, heads=4, seq=1024, batch=8, layers=6, dtype=dtype)
    layers = build_layers(spec, DEV)

    def make():
        return spec.make_input(DEV)

    ref = step(layers, make)
    ctx, sync = v2.get_cpu_offload_context(
        enabled=True, num_layers=3, model_layers=6, min_tensor_size_to_offload=1024
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no saved tensor may be left on the GPU
        got = step(layers, make, ctx, sync)
    assert_bit_equal(ref, got)
    offloaded = ctx.offload_synchronizer.transport.bytes_offloaded
    assert offloaded > 0
    assert ref.peak_bytes - got.peak_bytes >= 0.9 * offloaded, (
        ref.peak_bytes,
        got.peak_bytes,
        offloaded,
    )


def test_copies_overlap_compute_on_offload_stream():
    layers = _linear_stack(8, 4096)

    def make():
        return torch.randn(8, 1024, 4096, device=DEV)

    ctx, sync = v2.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=8)
    step(layers, make, ctx, sync)  # warm-up
    copy_stream = ctx.offload_synchronizer.transport.stream.cuda_stream
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(layers, make, ctx, sync)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    copies = [e for e in events if "Memcpy DtoH" in e.name or "Memcpy HtoD" in e.name]
    kernels = [e for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    assert copies, "no host copies seen"
    assert kernels
    # The copies run on a stream other than the kernels' and overlap them in time.
    kernel_streams = {getattr(k, "stream", None) for k in kernels}
    overlap = 0.0
    for c in copies:
        c0, c1 = c.time_range.start, c.time_range.end
        for k in kernels:
            overlap += max(0.0, min(c1, k.time_range.end) - max(c0, k.time_range.start))
    copy_time = sum(c.time_range.end - c.time_range.start for c in copies)
    assert overlap >= 0.5 * copy_time, (overlap, copy_time)
    assert copy_stream != 0
    assert kernel_streams


def test_fifty_steps_no_memory_growth():
    spec = ModelSpec(kind="gpt", hidden=256, heads=4, seq=256, batch=4, layers=6)
    layers = build_layers(spec, DEV)
    ctx, sync = v2.get_cpu_offload_context(enabled=True, num_layers=3, model_layers=6)
    pool = ctx.offload_synchronizer.transport.pool
    readings = []
    for _ in range(50):
        step(layers, lambda: spec.make_input(DEV), ctx, sync)
        torch.cuda.synchronize()
        readings.append((torch.cuda.memory_allocated(), pool.allocations, pool.allocated_bytes))
    assert all(r == readings[0] for r in readings[1:]), readings[:3] + readings[-3:]
    assert readings[0][1] > 0


def test_exception_in_layer_leaves_no_hooks_and_training_continues(deterministic):
    layers = _linear_stack(6)
    ref = step(layers, _linear_input)
    ctx, sync = v2.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=6)

    class Boom(RuntimeError):
        pass

    x = _linear_input()
    with pytest.raises(Boom):
        for i, layer in enumerate(layers):
            with ctx:
                x = layer(x)
                if i == 3:
                    raise Boom
            x = sync(x)
    del x
    assert not v2.is_cpu_offload_enabled()
    # A tensor saved now is not offloaded: no hooks were left behind.
    a = torch.randn(1024, 1024, device=DEV, requires_grad=True)
    (a * a).sum().backward()
    got = step(layers, _linear_input, ctx, sync)
    assert_bit_equal(ref, got)


def test_offload_stream_must_be_cuda_stream():
    with pytest.raises(TypeError, match="offload_stream"):
        v2.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, offload_stream=1)


class _TwoStreamAttention(torch.nn.Module):
    """q and k are read on the current stream, v on a side stream; all three are views
    of one projection, so one reload copy serves reads on two streams in backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.side = torch.cuda.Stream()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            vv = v * v  # saved on the side stream; its backward runs there
        torch.cuda.current_stream().wait_stream(self.side)
        return q * k + vv


def test_reloaded_views_read_on_two_streams_bit_exact(deterministic):
    # Backward runs each node on its forward's stream. The two branches get their
    # gradient from the same node, so whichever runs second does not inherit the first
    # one's wait for the reload: each stream must wait for the copy itself. The reload
    # is large (about 4 ms) and started just before backward, and the memory it lands
    # in is filled with NaN first, so a read that does not wait shows in the gradients.
    torch.manual_seed(0)
    layer = _TwoStreamAttention(4096).to(DEV)
    x = torch.randn(4096, 4096, device=DEV, requires_grad=True)

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        loss.backward()
        out = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
        x.grad = None
        layer.zero_grad(set_to_none=True)
        return out

    ref = grads(layer(x).square().sum())
    ctx, sync, manual = v2.get_cpu_offload_context(
        enabled=True, model_layers=1, manual_synchronization=True, min_tensor_size_to_offload=1
    )
    for _ in range(3):
        with ctx:
            y = layer(x)
        y = sync(y)
        manual.start_offload_layer(0)
        manual.release_activation_forward_gpu_memory(0)
        # The offloaded projection's memory is free now: poison it, so that the reload
        # buffer (same size, allocated next) starts out as NaN.
        torch.full((4096, 3 * 4096), float("nan"), device=DEV)
        manual.start_reload_layer(0)
        got = grads(y.square().sum())
        assert manual.transport.bytes_offloaded > 4096 * 3 * 4096 * 4
        for g, r in zip(got, ref, strict=True):
            assert torch.equal(g, r)


def test_save_events_are_recycled_once_and_results_stay_exact(deterministic):
    # NOTE [Recycled save events]: after the first steps, saves reuse the events of
    # earlier ones instead of making new ones, and the results stay bit-identical.
    layers = _linear_stack(6)
    ref = step(layers, _linear_input)
    ctx, sync = v2.get_cpu_offload_context(enabled=True, num_layers=3, model_layers=6)
    transport = ctx.offload_synchronizer.transport
    for _ in range(3):
        got = step(layers, _linear_input, ctx, sync)
        assert_bit_equal(ref, got)
    free = transport._free_events
    assert free, "no save event was given back"
    assert len({id(e) for e in free}) == len(free)  # each event given back once
    before = list(free)
    event = transport.record()  # a recycled event, recorded again
    assert any(event is e for e in before)
    transport.recycle([event, event, None])
    assert sum(e is event for e in transport._free_events) == 1
