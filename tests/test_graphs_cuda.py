"""CUDA graphs: the whole forward and backward captured in one graph, replayed."""

from __future__ import annotations

import gc

import pytest
import torch
from test_engine_recast import SoftmaxInFp32

from cpu_offload import _compat, v2
from cpu_offload.models import run_layers

pytestmark = pytest.mark.cuda

DEV = "cuda"
N, K = 6, 2


@pytest.fixture(autouse=True)
def _no_graph_dies_in_a_capture():
    """Destroy graphs left in reference cycles before this test captures, and after it.

    Destroying a CUDA graph while another is being captured invalidates that capture
    (``benchmarks/graph_destroyed_in_capture.py``). ``make_graphed_callables`` leaves its
    graphs in reference cycles (in the ``autograd.Function`` class it defines, and for a
    module in its new ``forward``), which the garbage collector destroys whenever it
    runs, possibly inside a later capture. Run first in one xdist worker,
    ``test_make_graphed_callables[False]`` was followed by a failed offloaded capture in
    ``test_capture_memory_saved_as_without_graphs[False]``; with this collection that
    order passes. Collecting after each test keeps the cycles from the tests of later
    files too.
    """
    gc.collect()
    yield
    gc.collect()


def _layers(block: str = "linear"):
    torch.manual_seed(0)
    if block == "softmax-fp32":  # saves a cast the engine rebuilds (engine/recast.py)
        layers = torch.nn.ModuleList(SoftmaxInFp32(512) for _ in range(N))
        return layers.to(DEV, torch.bfloat16)
    return torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(N)).to(DEV)


def _inputs(count, block: str = "linear"):
    gen = torch.Generator(DEV).manual_seed(3)
    dtype = torch.bfloat16 if block == "softmax-fp32" else torch.float32
    return [torch.randn(8, 256, 512, device=DEV, generator=gen, dtype=dtype) for _ in range(count)]


def _eager_reference(layers, xs):
    out = []
    for x in xs:
        for p in layers.parameters():
            p.grad = None
        loss = run_layers(layers, x).square().mean()
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in layers.parameters()]))
    return out


@pytest.mark.parametrize("block", ["linear", "softmax-fp32"])
@pytest.mark.parametrize("eligible", [True, False])
@pytest.mark.parametrize("retain", [True, False])
def test_torch_cuda_graph_whole_step(retain, eligible, block, deterministic):
    # eligible=False: the offloaded layers save nothing worth a copy, so their points
    # touch no stream (NOTE [A layer with nothing to move]); the capture must still end
    # with every stream it forked joined back.
    if not retain and not _compat.pinned_alloc_in_capture_supported():
        pytest.skip("capture without retained buffers needs PyTorch >= 2.11")
    layers = _layers(block)
    xs = _inputs(4, block)
    ref = _eager_reference(layers, xs)
    size = {} if eligible else {"min_tensor_size_to_offload": 1 << 40}
    ctx, sync = v2.get_cpu_offload_context(
        enabled=True, num_layers=K, model_layers=N, retain_pinned_cpu_buffers=retain, **size
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
    assert (offloaded_in_capture > 0) == eligible
    recast = [state.recast_bytes for state in ctx.offload_synchronizer.layers[:K]]
    assert all(r > 0 for r in recast) == (eligible and block == "softmax-fp32"), recast
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


def _capture_reserved(layers, x, ctx=None, sync=None):
    """Bytes the captured whole step reserves in its graph pool, and the graph."""
    for p in layers.parameters():
        p.grad = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for p in layers.parameters():
                p.grad = None
            run_layers(layers, x, ctx, sync).square().mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_layers(layers, x, ctx, sync).square().mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved() - before, graph


@pytest.mark.parametrize("retain", [True, False])
def test_capture_memory_saved_as_without_graphs(retain):
    """The captured step's memory pool shrinks by the offloaded layers' activations."""
    if not retain and not _compat.pinned_alloc_in_capture_supported():
        pytest.skip("capture without retained buffers needs PyTorch >= 2.11")
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(2048, 2048) for _ in range(N)).to(DEV)
    x = torch.randn(16, 1024, 2048, device=DEV)
    plain, g1 = _capture_reserved(layers, x)
    ctx, sync = v2.get_cpu_offload_context(
        enabled=True, num_layers=K, model_layers=N, retain_pinned_cpu_buffers=retain
    )
    moved_before = ctx.offload_synchronizer.transport.bytes_offloaded
    offload, g2 = _capture_reserved(layers, x, ctx, sync)
    offloaded_per_step = (ctx.offload_synchronizer.transport.bytes_offloaded - moved_before) // 3
    # Layer 0 saved the step's input, which the caller keeps alive: offloading it frees
    # nothing. The other offloaded layers' activations live on the host during the step,
    # so the graph's pool needs that much less.
    freed = offloaded_per_step - x.numel() * x.element_size()
    assert freed > 0
    assert plain - offload >= 0.9 * freed, (plain, offload, freed)
    g2.replay()
    torch.cuda.synchronize()
