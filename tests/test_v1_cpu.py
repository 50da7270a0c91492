"""V1 (legacy) through the CPU stand-in: marked tensors only, bit-exact, layer windows,
the handlers' static copies, the base classes and the argument checks.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from helpers import assert_bit_equal, step, top_saved_tensor_hooks
from torch import nn

import cpu_offload
from cpu_offload import HostTransport, is_cpu_offload_enabled, is_current_layer_offloaded, v1
from cpu_offload.engine.selection import is_marked_for_offload
from cpu_offload.models import run_layers
from cpu_offload.v1 import (
    AsyncDoubleBufferGroupOffloadHandler,
    CpuOffloadHookWithOffloadHandler,
    CpuOffloadSavedTensorHook,
    OffloadHandler,
    SynchronizedGroupOffloadHandler,
    layer_windows,
    mark_activation_offload,
)

N = 4
ROWS, WIDTH = 128, 64
X_BYTES = ROWS * WIDTH * 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Marked(nn.Module):
    """Linear + GELU whose input is marked for V1 offloading (Linear saves its input)."""

    def __init__(self, mark: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.mark = mark

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mark:
            mark_activation_offload(x)
        return torch.nn.functional.gelu(self.linear(x))


def _layers(mark: bool = True) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(_Marked(mark) for _ in range(N))


def _make() -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))


def _ctx(k: int, double_buffering: bool = False, n: int = N):
    return v1.get_cpu_offload_context(True, k, n, True, False, double_buffering)


# -- numerics --------------------------------------------------------------------------


@pytest.mark.parametrize("double_buffering", [False, True])
@pytest.mark.parametrize("k", [0, 1, N - 1, N])
def test_bit_exact_over_iterations(k, double_buffering):
    layers = _layers()
    ref = step(layers, _make)
    ctx, commit = _ctx(k, double_buffering)
    assert isinstance(ctx, CpuOffloadHookWithOffloadHandler)
    handler = ctx.offload_handler
    assert isinstance(handler, AsyncDoubleBufferGroupOffloadHandler)
    assert isinstance(handler.transport, HostTransport)
    for i in range(1, 4):
        assert_bit_equal(ref, step(layers, _make, ctx, commit))
        # Only the marked inputs of the k offloaded layers moved.
        assert handler.transport.bytes_offloaded == i * k * X_BYTES
        assert handler.transport.bytes_reloaded == i * k * X_BYTES
        assert all(g.state == "not_offloaded" for g in handler.groups)


def test_unmarked_tensors_do_not_move():
    layers = _layers(mark=False)
    ref = step(layers, _make)
    ctx, commit = _ctx(N)
    assert_bit_equal(ref, step(layers, _make, ctx, commit))
    assert ctx.offload_handler.transport.bytes_offloaded == 0


def test_attribute_set_by_hand_is_enough():
    layers = _layers(mark=False)
    ref = step(layers, _make)
    ctx, commit = _ctx(2)

    def make():
        x = _make()
        x.activation_offloading = True  # only the first layer's input
        return x

    assert_bit_equal(ref, step(layers, make, ctx, commit))
    assert ctx.offload_handler.transport.bytes_offloaded == X_BYTES


def test_double_buffering_reuses_reload_buffers():
    layers = _layers()
    ctx, commit = _ctx(N, double_buffering=True)
    handler = ctx.offload_handler
    step(layers, _make, ctx, commit)
    buffers = [[t.data_ptr() for t in side] for side in handler._buffers]
    assert all(len(side) == 1 for side in buffers)
    step(layers, _make, ctx, commit)
    assert [[t.data_ptr() for t in side] for side in handler._buffers] == buffers


def test_exception_inside_the_context_then_exact():
    layers = _layers()
    ref = step(layers, _make)
    ctx, commit = _ctx(2)
    x = _make()
    with pytest.raises(ZeroDivisionError):
        for i, layer in enumerate(layers):
            with ctx:
                x = layer(x)
                if i == 2:
                    raise ZeroDivisionError
            x = commit(x)
    del x
    assert top_saved_tensor_hooks() is None
    assert not is_cpu_offload_enabled() and not ctx.inside_context
    assert_bit_equal(ref, step(layers, _make, ctx, commit))


def test_queries_and_inside_context():
    ctx, commit = _ctx(1)
    assert not ctx.inside_context and not is_cpu_offload_enabled()
    seen = []
    x = torch.randn(4, requires_grad=True)
    for _ in range(N):
        with ctx:
            seen.append(
                (ctx.inside_context, is_cpu_offload_enabled(), is_current_layer_offloaded())
            )
            x = x * 2
        assert not ctx.inside_context and not is_cpu_offload_enabled()
        x = commit(x)
    assert seen == [(True, True, True)] + [(True, True, False)] * (N - 1)
    assert not is_current_layer_offloaded()
    x.sum().backward()


def test_synchronized_handler_through_the_hook():
    layers = _layers()
    ref = step(layers, _make)
    handler = SynchronizedGroupOffloadHandler(2, is_marked_for_offload)
    ctx = CpuOffloadHookWithOffloadHandler(handler)

    def commit(x):
        return v1.GroupCommitFunction.apply(x, handler)

    tags = []
    push = handler.tensor_push

    def recording_push(tensor, **kwargs):
        tag = push(tensor, **kwargs)
        if not isinstance(tag, torch.Tensor):
            tags.append(tag)
        return tag

    handler.tensor_push = recording_push
    got = step(layers, _make, ctx, commit)
    assert_bit_equal(ref, got)
    assert tags == [(0, 0), (1, 0)]  # (group, index): only the two marked inputs
    assert handler.tensor_tag_to_state == {}  # every copy was handed back


# -- layer windows ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "n", "expected"),
    [
        (3, 8, [2, 5, 7]),
        (3, 6, [1, 3, 5]),
        (5, 5, [0, 1, 2, 3, 4]),
        (1, 4, [3]),
        (2, 4, [1, 3]),
        (2, 5, [2, 4]),
        (0, 4, []),
    ],
)
def test_layer_windows(k, n, expected):
    assert layer_windows(k, n) == expected
    if k:
        assert expected[-1] == n - 1  # the last group is released at the last layer
        assert all(w >= i for i, w in enumerate(expected))  # never before its own layer


# -- marks -----------------------------------------------------------------------------


def test_mark_activation_offload_skips_none():
    a, b = torch.randn(2), torch.randn(2)
    mark_activation_offload(None, a, None, b)
    assert a.activation_offloading is True and b.activation_offloading is True
    assert is_marked_for_offload(a)


def test_mark_activation_offload_false_sets_the_not_offload_mark():
    a = torch.randn(2)
    mark_activation_offload(a, offload=False)
    assert not getattr(a, "activation_offloading", False)
    assert a._cpu_offload_skip is True
    mark_activation_offload(a)  # marked both ways: never offloaded
    assert not is_marked_for_offload(a)
    with pytest.raises(TypeError, match="offload must be a bool"):
        mark_activation_offload(a, offload=1)
    with pytest.raises(TypeError, match="tensors or None"):
        mark_activation_offload([a])


def test_parameters_are_never_offloaded_even_marked():
    p = nn.Parameter(torch.randn(4))
    mark_activation_offload(p)
    assert not is_marked_for_offload(p)


# -- disabled, arguments ---------------------------------------------------------------


def test_disabled_returns_nullcontext_and_identity():
    for result in (v1.get_cpu_offload_context(), v1.get_cpu_offload_context(False, 9, 2)):
        ctx, commit = result
        assert isinstance(ctx, contextlib.nullcontext)
        t = torch.randn(3, requires_grad=True)
        assert commit(t) is t
        with ctx:
            assert not is_cpu_offload_enabled()


def test_offload_weights_deprecated():
    with pytest.warns(DeprecationWarning, match="offload_weights"):
        ctx, _ = v1.get_cpu_offload_context(True, 1, 2, True, True)
    assert isinstance(ctx, CpuOffloadHookWithOffloadHandler)
    with pytest.warns(DeprecationWarning):
        ctx, commit = v1.get_cpu_offload_context(True, 1, 2, False, True)
    assert isinstance(ctx, contextlib.nullcontext)


def test_nothing_to_offload():
    with pytest.raises(ValueError, match="nothing to offload"):
        v1.get_cpu_offload_context(True, 1, 2, False, False)


@pytest.mark.parametrize(
    ("args", "word"),
    [
        ((1, 1, 2), "enabled"),
        ((True, 1.0, 2), "num_layers"),
        ((True, True, 2), "num_layers"),
        ((True, 1, "2"), "model_layers"),
        ((True, 1, 2, "yes"), "offload_activations"),
        ((True, 1, 2, True, None), "offload_weights"),
        ((True, 1, 2, True, False, 0), "double_buffering"),
    ],
)
def test_bad_types(args, word):
    with pytest.raises(TypeError, match=word):
        v1.get_cpu_offload_context(*args)


@pytest.mark.parametrize(("k", "n"), [(3, 2), (-1, 2), (0, 0)])
def test_bad_ranges(k, n):
    with pytest.raises(ValueError):
        v1.get_cpu_offload_context(True, k, n)


# -- base classes and static copies ----------------------------------------------------


def test_saved_tensor_hook_base_is_abstract():
    hook = CpuOffloadSavedTensorHook()
    a = torch.randn(4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="on_save_for_backward"):
        with hook:
            assert hook.inside_context
            a.exp()
    assert not hook.inside_context
    assert not is_cpu_offload_enabled()
    assert top_saved_tensor_hooks() is None
    with pytest.raises(NotImplementedError, match="on_get_saved_tensor"):
        hook.on_get_saved_tensor(None)


def test_offload_handler_base_is_abstract():
    handler = OffloadHandler()
    with pytest.raises(NotImplementedError, match="tensor_push"):
        handler.tensor_push(torch.randn(2))
    with pytest.raises(NotImplementedError, match="tensor_pop"):
        handler.tensor_pop((0, 0))
    assert handler.is_current_group_offloaded() is False


def _bits(t: torch.Tensor) -> torch.Tensor:
    # float8 has no equality kernel everywhere: compare its bytes.
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(16, 32),
        lambda: torch.randn(16, 32).t(),
        lambda: torch.randn(2, 8, 4, 16).permute(0, 2, 1, 3),
        lambda: torch.randn(64, 64).to(torch.float8_e4m3fn),
    ],
)
def test_static_offload_reload_keeps_strides(make):
    src = make()
    device, cpu_copy = SynchronizedGroupOffloadHandler.offload(src, pin_memory=False)
    assert device == src.device
    assert cpu_copy.stride() == src.stride()
    assert cpu_copy.data_ptr() != src.data_ptr()
    back = SynchronizedGroupOffloadHandler.reload((device, cpu_copy))
    assert back.stride() == src.stride() and back.dtype == src.dtype
    assert torch.equal(_bits(back), _bits(src))
    buffer = torch.empty_like(src)
    again = SynchronizedGroupOffloadHandler.reload((device, cpu_copy), copy_buffer=buffer)
    assert again is buffer and torch.equal(_bits(again), _bits(src))


def test_static_offload_of_a_strided_slice_is_compacted():
    src = torch.randn(16, 32)[:, ::4]
    device, cpu_copy = SynchronizedGroupOffloadHandler.offload(src, pin_memory=False)
    assert cpu_copy.is_contiguous()
    assert torch.equal(SynchronizedGroupOffloadHandler.reload((device, cpu_copy)), src)


# -- names -----------------------------------------------------------------------------


def test_is_cpu_offload_layer_alias():
    assert v1.is_cpu_offload_layer is v1.is_current_layer_offloaded
    assert cpu_offload.is_cpu_offload_layer is cpu_offload.is_current_layer_offloaded
    assert "is_cpu_offload_layer" in v1.__all__ and "is_cpu_offload_layer" in cpu_offload.__all__


def test_group_commit_is_identity_with_grad():
    handler = SynchronizedGroupOffloadHandler(0)
    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = v1.group_prefetch_offload_commit(x, handler)
    assert torch.equal(y, x) and y.grad_fn is not None
    assert handler.current_group == 1
    y.sum().backward()
    assert handler.current_group == 0
    assert torch.equal(x.grad, torch.ones(4))


def test_backward_of_a_stale_forward_is_exact_or_an_error():
    layers = _layers()

    def grads(ctx=None, commit=None):
        for p in layers.parameters():
            p.grad = None
        first = run_layers(layers, _make(), ctx, commit)
        second = run_layers(layers, _make() * 3, ctx, commit)  # noqa: F841 - kept alive
        first.square().mean().backward()
        return [p.grad.clone() for p in layers.parameters()]

    ref = grads()
    ctx, commit = _ctx(2)
    try:
        got = grads(ctx, commit)
    except RuntimeError:
        return  # a clear error is acceptable
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(r, g), f"gradient {i} differs"
