"""V1 on a real GPU: synchronous and asynchronous handlers, bit-exact and saving memory."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import assert_bit_equal, step

from cpu_offload import v1
from cpu_offload.models import ModelSpec, build_layers

pytestmark = pytest.mark.cuda

DEV = "cuda"
SPEC = ModelSpec(kind="gpt", hidden=256, heads=4, seq=512, batch=4, layers=6)


class _Marking:
    """Wraps a V1 context: marks every tensor the layer produces, as TE's modules do."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._mode = None

    def __enter__(self):
        self.ctx.__enter__()
        self._mode = _MarkOutputs()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return self.ctx.__exit__(*exc)


class _MarkOutputs(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            v1.mark_activation_offload(out)
        elif isinstance(out, tuple):
            v1.mark_activation_offload(*[o for o in out if isinstance(o, torch.Tensor)])
        return out


def _make():
    return SPEC.make_input(DEV)


@pytest.mark.parametrize("double_buffering", [False, True])
def test_async_handler_bit_exact_and_saves_memory(double_buffering, deterministic):
    layers = build_layers(SPEC, DEV)
    ref = step(layers, _make)
    ctx, commit = v1.get_cpu_offload_context(True, 3, 6, True, False, double_buffering)
    for _ in range(3):  # several iterations: buffers reused, state reset each time
        got = step(layers, _make, _Marking(ctx), commit)
        assert_bit_equal(ref, got)
    handler = ctx.offload_handler
    per_step = handler.transport.bytes_offloaded // 3
    assert per_step > 0
    assert ref.peak_bytes - got.peak_bytes >= 0.5 * per_step, (ref.peak_bytes, got.peak_bytes)


def test_synchronized_handler_bit_exact(deterministic):
    layers = build_layers(SPEC, DEV)
    ref = step(layers, _make)
    handler = v1.SynchronizedGroupOffloadHandler(
        num_offload_group=3, tensor_need_offloading_checker=lambda t: t.numel() >= 1024
    )
    ctx = v1.CpuOffloadHookWithOffloadHandler(handler)
    commit = functools.partial(v1.group_prefetch_offload_commit, offload_handler=handler)
    got = step(layers, _make, ctx, commit)
    assert_bit_equal(ref, got)
    assert handler.current_group == 0
    assert not handler.tensor_tag_to_state


def test_static_offload_reload_roundtrip():
    x = torch.randn(64, 128, device=DEV).t()  # permuted, dense
    state = v1.SynchronizedGroupOffloadHandler.offload(x)
    assert state[1].is_pinned() and state[1].stride() == x.stride()
    y = v1.SynchronizedGroupOffloadHandler.reload(state)
    torch.cuda.synchronize()
    assert torch.equal(x, y) and y.stride() == x.stride()
