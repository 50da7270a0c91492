"""The duplex schedule on a real GPU: exact numerics, peak memory, steady state.

Run with deterministic kernels:
``CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python3 -m pytest -m cuda tests/test_duplex_cuda.py``.
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


def _model(kind: str = "gpt", dtype: torch.dtype = torch.float32, layers: int = 6):
    spec = ModelSpec(kind=kind, hidden=256, heads=4, seq=1024, batch=8, layers=layers, dtype=dtype)
    return build_layers(spec, DEV), (lambda: spec.make_input(DEV))


@pytest.mark.parametrize("kind", ["gpt", "encoder", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_duplex_real_attention_layers_bit_exact(kind, dtype, deterministic):
    layers, make = _model(kind, dtype)
    ref = step(layers, make)
    ctx, sync = v2.get_cpu_offload_context(
        enabled=True, num_layers=3, model_layers=6, min_tensor_size_to_offload=1024, duplex=True
    )
    transport = ctx.offload_synchronizer.transport
    assert transport.duplex and transport.reload_stream is not transport.stream
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no saved tensor may be left on the GPU
        for _ in range(2):  # the second step reuses the first one's host buffers
            assert_bit_equal(ref, step(layers, make, ctx, sync))
    assert transport.bytes_reloaded == transport.bytes_offloaded > 0


def test_duplex_peak_not_above_the_default_schedule(deterministic):
    layers, make = _model("gpt", torch.bfloat16)
    peaks = {}
    for duplex in (False, True):
        ctx, sync = v2.get_cpu_offload_context(
            enabled=True, num_layers=3, model_layers=6, duplex=duplex
        )
        step(layers, make, ctx, sync)  # warm-up: pools and allocator caches
        got = step(layers, make, ctx, sync)
        peaks[duplex] = got.peak_bytes
        del ctx, sync
    assert peaks[True] <= peaks[False], peaks


# Reloads start during the forward (layers 0 and 1), while later layers' offloads run:
# both directions are in flight at once, on their two streams.
_OVERLAPPING = {0: (True, 2, True, 4), 1: (True, 3, True, 5), 3: (True, 5, False, 5)}


@pytest.mark.parametrize("retain", [False, True])
def test_duplex_overlapping_schedule_bit_exact_over_iterations(retain, deterministic):
    layers, make = _model("gpt", torch.bfloat16)
    ref = step(layers, make)
    ctx, sync = v2.get_cpu_offload_context(
        enabled=True,
        model_layers=6,
        retain_pinned_cpu_buffers=retain,
        synchronization_dict=_OVERLAPPING,
        duplex=True,
    )
    pool = ctx.offload_synchronizer.transport.pool
    allocations = []
    for _ in range(4):  # host buffers are reused by later iterations' offloads
        assert_bit_equal(ref, step(layers, make, ctx, sync))
        allocations.append(pool.allocations)
    assert allocations[1:] == allocations[:1] * 3


def test_duplex_no_memory_growth_with_changing_sequence_length():
    torch.manual_seed(0)
    layers = build_layers(ModelSpec(kind="gpt", hidden=256, heads=4, layers=6), DEV)
    ctx, sync = v2.get_cpu_offload_context(enabled=True, num_layers=3, model_layers=6, duplex=True)
    pool = ctx.offload_synchronizer.transport.pool
    readings = []
    for i in range(30):
        seq = (256, 384, 512)[i % 3]
        step(layers, lambda s=seq: torch.randn(4, s, 256, device=DEV), ctx, sync)
        torch.cuda.synchronize()
        readings.append((torch.cuda.memory_allocated(), pool.allocations, pool.allocated_bytes))
    assert ctx.offload_synchronizer.transport.bytes_offloaded > 0
    # After one round of every length, neither GPU memory nor the pinned pool grows.
    assert all(r == readings[3] for r in readings[3:]), readings[:6] + readings[-3:]
