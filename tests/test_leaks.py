"""Forward passes with grad enabled and no backward leave memory flat under both backends.

A pack hook that returns a saved tensor unchanged keeps it alive for good when the tensor
is its own node's output (see NOTE [Kept tensors are detached]): a validation loop that
forgot ``torch.no_grad`` would then grow by one iteration of activations per batch.
"""

from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch
from torch import nn

import cpu_offload
from cpu_offload import HostTransport, v1, v2
from cpu_offload.models import ModelSpec, build_layers, run_layers

SPEC = ModelSpec(kind="gpt", hidden=128, heads=4, seq=128, batch=4, layers=6)
FORWARDS = 50


class _Marking(nn.Module):
    """Marks its input for V1 (as Megatron-Core's linear layers do), then runs ``inner``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cpu_offload.mark_activation_offload(x)
        return self.inner(x)


def _contexts(backend: str, device: str):
    n = SPEC.layers
    kwargs = {} if device == "cuda" else {"transport": HostTransport()}
    if backend == "v1":
        return v1.get_cpu_offload_context(True, 2, n, **kwargs)
    if backend == "v2":
        return v2.get_cpu_offload_context(True, 2, n, min_tensor_size_to_offload=1024, **kwargs)
    return None, None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _saved_bytes_per_forward(layers: nn.ModuleList, x: torch.Tensor) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_layers(layers, x)
    return total


def _forwards_without_backward(layers, make, ctx, sync, measure, count):
    """``count`` forwards with grad enabled and no backward; ``measure()`` after each."""
    seen = []
    for _ in range(count):
        out = run_layers(layers, make(), ctx, sync)
        del out
        gc.collect()
        seen.append(measure())
    return seen


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
@pytest.mark.parametrize("backend", ["none", "v1", "v2"])
def test_forwards_without_backward_leave_cpu_memory_flat(backend):
    layers = nn.ModuleList(_Marking(layer) for layer in build_layers(SPEC, "cpu"))
    make = lambda: SPEC.make_input("cpu")  # noqa: E731
    per_forward = _saved_bytes_per_forward(layers, make())
    ctx, sync = _contexts(backend, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the k-of-n overlap advice is not under test
        _forwards_without_backward(layers, make, ctx, sync, _rss_bytes, 5)  # warm-up
        rss = _forwards_without_backward(layers, make, ctx, sync, _rss_bytes, FORWARDS)
    growth = rss[-1] - rss[0]
    # A leak keeps every forward's activations: FORWARDS * per_forward. Flat means the
    # allocator's reuse bound, a few forwards' worth at most.
    assert growth < 4 * per_forward, (
        f"{backend}: RSS grew {growth / 2**20:.1f} MiB over {FORWARDS} forwards "
        f"({per_forward / 2**20:.1f} MiB saved per forward)"
    )


@pytest.mark.parametrize("backend", ["v1", "v2"])
def test_training_steps_after_forwards_without_backward_are_exact(backend):
    from helpers import assert_bit_equal, step

    layers = nn.ModuleList(_Marking(layer) for layer in build_layers(SPEC, "cpu"))
    make = lambda: SPEC.make_input("cpu")  # noqa: E731
    ref = step(layers, make)
    ctx, sync = _contexts(backend, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            run_layers(layers, make(), ctx, sync)
        assert_bit_equal(ref, step(layers, make, ctx, sync))
        assert_bit_equal(ref, step(layers, make, ctx, sync))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["none", "v1", "v2"])
def test_forwards_without_backward_leave_gpu_memory_flat(backend):
    layers = nn.ModuleList(_Marking(layer) for layer in build_layers(SPEC, "cuda"))
    make = lambda: SPEC.make_input("cuda")  # noqa: E731
    per_forward = _saved_bytes_per_forward(layers, make())
    ctx, sync = _contexts(backend, "cuda")

    def allocated() -> int:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _forwards_without_backward(layers, make, ctx, sync, allocated, 3)
        seen = _forwards_without_backward(layers, make, ctx, sync, allocated, FORWARDS)
    # V2 keeps the last iteration's kept tensors until the next one starts: at most one
    # forward's worth above the first measurement, and no growth after it.
    assert max(seen) - seen[0] <= per_forward, (backend, seen[:3], seen[-3:])
    assert seen[-1] <= seen[1], (backend, seen[:3], seen[-3:])
