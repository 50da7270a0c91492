"""torch.compile with offloading on a GPU: Inductor, CUDA copies, bit-identical results.

The CPU tests (tests/test_compile.py) check every way of compiling with the CPU stand-in;
these check that the offload copies on their own CUDA stream keep Inductor's compiled
forward and backward exact and take memory off the GPU. Run with deterministic kernels:
``CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python3 -m pytest -m cuda tests/test_compile_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_compile import Model, loop

from cpu_offload import get_cpu_offload_context, offload_layers

pytestmark = pytest.mark.cuda

LAYERS = 6


def _models() -> tuple[Model, Model]:
    """The model with a graph break around each layer (the exact reference), and a copy."""
    torch.manual_seed(0)
    reference = Model(LAYERS, graph_breaks=True).cuda()
    model = copy.deepcopy(reference)
    model.graph_breaks = False
    return reference, model


def _train(run, model: Model, steps: int = 2):
    gen = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(64, 512, 32, device="cuda", generator=gen)
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = run(x.clone().requires_grad_()).square().mean()
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()], peak))
    return out


def _assert_exact_and_smaller(want, got) -> None:
    for i, ((loss, grads, peak), (ref_loss, ref_grads, ref_peak)) in enumerate(
        zip(got, want, strict=True)
    ):
        assert torch.equal(loss, ref_loss), (i, loss, ref_loss)
        for g, r in zip(grads, ref_grads, strict=True):
            assert torch.equal(g, r), f"step {i}: max |diff| {(g - r).abs().max()}"
        assert peak < ref_peak, (i, peak, ref_peak)


@pytest.mark.parametrize("how", ["whole", "each_layer"])
def test_offload_layers_under_inductor(how, deterministic) -> None:
    torch._dynamo.reset()
    reference, model = _models()
    if how == "whole":
        want = _train(torch.compile(reference), reference)
        handle = offload_layers(model, num_offloaded=LAYERS // 2)
        got = _train(torch.compile(model), model)
    else:
        for m in (reference, model):
            for layer in m.layers:
                layer.compile()
        want = _train(reference, reference)
        handle = offload_layers(model, num_offloaded=LAYERS // 2)
        got = _train(model, model)
    assert handle.context.offload_synchronizer.transport.bytes_offloaded > 0
    _assert_exact_and_smaller(want, got)


def test_hand_written_loop_compiled_under_inductor(deterministic) -> None:
    torch._dynamo.reset()
    reference, model = _models()
    ctx, sync = get_cpu_offload_context(True, LAYERS // 2, LAYERS)
    want = _train(torch.compile(reference), reference)
    got = _train(torch.compile(loop(model, ctx, sync)), model)
    assert ctx.offload_synchronizer.transport.bytes_offloaded > 0
    _assert_exact_and_smaller(want, got)
