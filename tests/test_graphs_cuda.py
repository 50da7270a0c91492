"""CUDA graphs: the whole forward and backward captured in one graph, replayed."""

from __future__ import annotations

import pytest
import torch

from cpu_offload import _compat, v2
from cpu_offload.models import run_layers

pytestmark = pytest.mark.cuda

DEV = "cuda"
N, K = 6, 2


def _layers():
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(N)).to(DEV)


def _inputs(count):
    gen = torch.Generator(DEV).manual_seed(3)
    return [torch.randn(8, 256, 512, device=DEV, generator=gen) for _ in range(count)]


def _eager_reference(layers, xs):
    out = []
    for x in xs:
        for p in layers.parameters():
            p.grad = None
        loss = run_layers(layers, x).square().mean()
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in layers.parameters()]))
    return out


@pytest.mark.parametrize("retain", [True, False])
def test_torch_cuda_graph_whole_step(retain, deterministic):
    if not retain and not _compat.pinned_alloc_in_capture_supported():
        pytest.skip("capture without retained buffers needs PyTorch >= 2.11")
    layers = _layers()
    xs = _inputs(4)
    ref = _eager_reference(layers, xs)
    ctx, sync = v2.get_cpu_offload_context(
        enabled=True, num_layers=K, model_layers=N, retain_pinned_cpu_buffers=retain
    )
    static_x = xs[0].clone()
    for p in layers.parameters():
        p.grad = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: allocates the retained buffers
            for p in layers.parameters():
                p.grad = None
            run_layers(layers, static_x, ctx, sync).square().mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    for p in layers.parameters():
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = run_layers(layers, static_x, ctx, sync).square().mean()
        static_loss.backward()
    offloaded_in_capture = ctx.offload_synchronizer.transport.bytes_offloaded
    assert offloaded_in_capture > 0
    for x, (loss, grads) in zip(xs, ref, strict=True):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_loss, loss)
        for p, g in zip(layers.parameters(), grads, strict=True):
            assert torch.equal(p.grad, g)


@pytest.mark.parametrize("retain", [True, False])
def test_make_graphed_callables(retain, deterministic):
    if not retain and not _compat.pinned_alloc_in_capture_supported():
        pytest.skip("capture without retained buffers needs PyTorch >= 2.11")
    layers = _layers()
    xs = _inputs(3)
    ref = _eager_reference(layers, xs)
    ctx, sync = v2.get_cpu_offload_context(
        enabled=True, num_layers=K, model_layers=N, retain_pinned_cpu_buffers=retain
    )

    class Model(torch.nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def forward(self, x):
            return run_layers(self.layers, x, ctx, sync)

    model = Model(layers)
    graphed = torch.cuda.make_graphed_callables(model, (xs[0].clone(),))
    for x, (loss, grads) in zip(xs, ref, strict=True):
        for p in layers.parameters():
            p.grad = None
        out = graphed(x)
        got = out.square().mean()
        got.backward()
        torch.cuda.synchronize()
        assert torch.equal(got.detach(), loss)
        for p, g in zip(layers.parameters(), grads, strict=True):
            assert torch.equal(p.grad, g)


def test_capture_memory_saved_as_without_graphs():
    """Replaying the captured step keeps the offloaded layers' memory off the GPU."""
    layers = _layers()
    x = _inputs(1)[0]
    ctx, sync = v2.get_cpu_offload_context(
        enabled=True, num_layers=K, model_layers=N, retain_pinned_cpu_buffers=True
    )
    for _ in range(2):
        run_layers(layers, x, ctx, sync).square().mean().backward()
    torch.cuda.synchronize()
    assert ctx.offload_synchronizer.transport.pool.allocations > 0
    assert ctx.offload_synchronizer.get_offloaded_total_size_mb() == 0.0
