"""Saved casts rebuilt from their source on a real GPU (NOTE [Casts rebuilt from their
source] in ``engine/recast.py``): bit-identical, fewer bytes on the link, no higher peak.
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import assert_bit_equal, step
from test_engine_recast import BATCH, HEADS, SoftmaxInFp32

from cpu_offload import v2
from cpu_offload.engine import tensor_group

pytestmark = pytest.mark.cuda

SEQ, HIDDEN = 1024, 512


def _layers(n: int) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(SoftmaxInFp32(HIDDEN) for _ in range(n))
    return layers.to("cuda", torch.bfloat16)


def _input() -> torch.Tensor:
    gen = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    return x.requires_grad_()


def _step(layers, ctx, sync):  # type: ignore[no-untyped-def]
    """One step, and its peak of the bytes tensors asked for: ``max_memory_allocated``
    counts whole cached blocks, which the earlier tests of the process decide. Their
    garbage is collected first: freed mid-step, it would lower the peak read."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    result = step(layers, _input, ctx, sync)
    return result, torch.cuda.memory_stats()["requested_bytes.all.peak"] - base


def _no_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine as before: every saved cast moved like any tensor."""
    monkeypatch.setattr(tensor_group, "casts_among", lambda *args: {})


@pytest.mark.parametrize("k", [1, 3])
def test_rebuilt_casts_bit_identical_fewer_bytes_no_higher_peak(k, deterministic, monkeypatch):
    layers = _layers(4)
    want = step(layers, _input)
    ctx, sync = v2.get_cpu_offload_context(True, k, 4)
    step(layers, _input, ctx, sync)  # warm-up: the allocator and the peak watch settle
    transport = ctx.offload_synchronizer.transport
    before = transport.bytes_offloaded
    got, got_peak = _step(layers, ctx, sync)
    assert_bit_equal(got, want)
    moved = transport.bytes_offloaded - before
    probs = BATCH * HEADS * SEQ * SEQ * 2
    states = ctx.offload_synchronizer.layers
    assert [s.recast_bytes for s in states[:k]] == [probs] * k

    with monkeypatch.context() as patch:
        _no_casts(patch)
        ctx, sync = v2.get_cpu_offload_context(True, k, 4)
        step(layers, _input, ctx, sync)
        transport = ctx.offload_synchronizer.transport
        before = transport.bytes_offloaded
        moving, moving_peak = _step(layers, ctx, sync)
        moved_all = transport.bytes_offloaded - before
    assert_bit_equal(moving, want)
    assert moved_all - moved == k * probs
    assert got_peak <= moving_peak, (got_peak, moving_peak)


@pytest.mark.parametrize("k", [1, 3])
def test_recast_layers_bit_identical_and_lower_by_their_casts(k, deterministic):
    # NOTE [A kept layer's casts]: kept layers let their casts go at their forward's
    # end and cast them again in backward; nothing crosses the link.
    from cpu_offload import offload_layers

    layers = _layers(4)
    want = step(layers, _input)
    _, kept_peak = _step(layers, None, None)
    with offload_layers(layers, recast=range(k)) as handle:
        step(layers, _input)  # warm-up
        got, got_peak = _step(layers, None, None)
        kept = list(handle._runner.recast.values())
        freed: list[int] = []  # each forward's casts, taken before its backward
        step(layers, _input, between=lambda: freed.extend(k.recast_bytes for k in kept))
    assert_bit_equal(got, want)
    probs = BATCH * HEADS * SEQ * SEQ * 2
    assert freed == [probs] * k
    # Each recast layer's cast is gone from its forward's end to its own backward.
    assert kept_peak - got_peak >= (k - 1) * probs
    assert got_peak < kept_peak


def test_profile_times_the_host_of_layers_kept_with_their_casts_rebuilt():
    from cpu_offload.plan import Choice, estimate, profile_model

    layers = _layers(4)
    x = _input()

    def run() -> torch.Tensor:
        h = x
        for layer in layers:
            h = layer(h)
        return h.float().square().mean()

    profile = profile_model(layers, run, steps=2, recompute=False)
    for cost in profile.layers:
        assert cost.recast_bytes > 0 and cost.host is not None
        recast = (cost.host.recast_forward_ms, cost.host.recast_backward_ms)
        assert None not in recast and min(recast) >= 0 and sum(recast) > 0
    keep = estimate(profile, [Choice.KEEP] * 4)
    recast = estimate(profile, [Choice.RECAST] * 3 + [Choice.KEEP])
    assert recast.peak_bytes < keep.peak_bytes
