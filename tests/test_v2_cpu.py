"""V2 through the CPU stand-in: bit-exact numerics, steady state, the modes, the misuse
errors and clean failure (no GPU needed). The arguments of ``get_cpu_offload_context``
are tested in test_v2_arguments.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import V2_LAYERS, V2_MIN, assert_bit_equal, step, top_saved_tensor_hooks
from helpers import v2_context as _ctx

from cpu_offload import (
    HostTransport,
    is_cpu_offload_enabled,
    is_current_layer_offloaded,
    mark_activation_offload,
    v2,
)
from cpu_offload.models import MODEL_KINDS, ModelSpec, build_layers

N = V2_LAYERS
MIN = V2_MIN


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _spec(kind: str) -> ModelSpec:
    return ModelSpec(kind=kind, hidden=64, heads=4, seq=64, batch=2, layers=N)


def _top_hooks():
    return top_saved_tensor_hooks()


_MODELS: dict[str, tuple] = {}


def _model(kind: str):
    """Layers, input maker and the reference step without offloading (built once)."""
    if kind not in _MODELS:
        spec = _spec(kind)
        layers = build_layers(spec, "cpu")

        def make():
            return spec.make_input("cpu", seed=1)

        _MODELS[kind] = (layers, make, step(layers, make))
    return _MODELS[kind]


# -- numerics --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("k", [0, 1, N - 2, N - 1])
def test_bit_exact_against_no_offloading(kind, k):
    layers, make, ref = _model(kind)
    if k == N - 1:
        with pytest.warns(UserWarning, match="model_layers - 1"):
            ctx, sync = v2.get_cpu_offload_context(
                True, k, N, transport=HostTransport(), min_tensor_size_to_offload=MIN
            )
    else:
        ctx, sync = _ctx(k)
    transport = ctx.offload_synchronizer.transport
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = step(layers, make, ctx, sync)
    assert_bit_equal(ref, got)
    # Plain PyTorch attention saves only layouts that can be restored exactly.
    assert not [w for w in caught if "stays on the GPU" in str(w.message)]
    if k == 0:
        assert transport.bytes_offloaded == 0
    else:
        assert transport.bytes_offloaded > 0
        assert transport.bytes_reloaded == transport.bytes_offloaded
    # Everything was released at the end of backward.
    assert all(s.state == "not_offloaded" for s in ctx.offload_synchronizer.layers)
    assert ctx.offload_synchronizer.get_offloaded_total_size_mb() == 0


@pytest.mark.parametrize("kind", ["gpt", "linear"])
def test_more_offloaded_layers_move_more_bytes(kind):
    layers, make, ref = _model(kind)
    moved = []
    for k in range(N):
        ctx, sync = _ctx(k)
        assert_bit_equal(ref, step(layers, make, ctx, sync))
        moved.append(ctx.offload_synchronizer.transport.bytes_offloaded)
    assert moved[0] == 0
    # Identical layers: each offloaded layer moves the same amount.
    assert moved == [k * moved[1] for k in range(N)]


@pytest.mark.parametrize("kind", ["gpt", "mha"])
def test_consecutive_iterations_and_pool_steady_state(kind):
    layers, make, ref = _model(kind)
    ctx, sync = _ctx(2)
    transport = ctx.offload_synchronizer.transport
    assert_bit_equal(ref, step(layers, make, ctx, sync))
    allocations, per_iteration = transport.pool.allocations, transport.bytes_offloaded
    assert allocations > 0
    for i in range(2, 5):
        assert_bit_equal(ref, step(layers, make, ctx, sync))
        assert transport.pool.allocations == allocations
        assert transport.bytes_offloaded == i * per_iteration


def test_retained_buffers_bit_exact_and_fixed():
    layers, make, ref = _model("gpt")
    ctx, sync = _ctx(2, retain_pinned_cpu_buffers=True)
    layer0 = ctx.offload_synchronizer.layers[0]
    assert_bit_equal(ref, step(layers, make, ctx, sync))
    ptrs = [b.data_ptr() for b in layer0._buffers.retained]
    assert ptrs
    for _ in range(2):
        assert_bit_equal(ref, step(layers, make, ctx, sync))
        assert [b.data_ptr() for b in layer0._buffers.retained] == ptrs


def test_retained_buffers_shape_change_fails_cleanly():
    spec = _spec("linear")
    layers, make, ref = _model("linear")
    ctx, sync = _ctx(2, retain_pinned_cpu_buffers=True)
    assert_bit_equal(ref, step(layers, make, ctx, sync))
    bigger = ModelSpec(kind="linear", hidden=64, seq=65, batch=2, layers=N)
    with pytest.raises(RuntimeError, match="retain_pinned_cpu_buffers"):
        step(layers, lambda: bigger.make_input("cpu"), ctx, sync)
    # Raised while entering: no hook left pushed, no offloading active.
    assert _top_hooks() is None
    assert not is_cpu_offload_enabled()
    assert not ctx.inside_context
    # The next iteration with the old shapes starts at layer 0 and is exact.
    assert_bit_equal(ref, step(layers, make, ctx, sync))
    assert spec.seq == 64


# -- the modes -------------------------------------------------------------------------


def test_manual_synchronization():
    layers, make, ref = _model("gpt")
    ctx, sync, manual = _ctx(manual_synchronization=True)
    assert isinstance(manual, v2.ManualOffloadSynchronizer)
    assert ctx.offload_synchronizer is manual

    def run(x):
        for i, layer in enumerate(layers):
            with ctx:
                x = layer(x)
            x = sync(x)
            if i < N - 1:  # the last layer is left alone: not offloaded
                manual.start_offload_layer(i)
        for i in range(N - 1):
            manual.release_activation_forward_gpu_memory(i)
        assert manual.get_offloaded_total_size_mb() > 0
        for i in reversed(range(N - 1)):
            manual.start_reload_layer(i)
        return x

    for _ in range(2):
        for p in layers.parameters():
            p.grad = None
        loss = run(make()).float().square().mean()
        loss.backward()
        assert torch.equal(loss.detach(), ref.loss)
        for p, g in zip(layers.parameters(), ref.grads, strict=True):
            assert torch.equal(p.grad, g)
    t = manual.transport
    assert t.bytes_reloaded == t.bytes_offloaded > 0


def test_manual_synchronization_without_calls_offloads_nothing():
    layers, make, ref = _model("linear")
    ctx, sync, manual = _ctx(manual_synchronization=True)
    assert_bit_equal(ref, step(layers, make, ctx, sync))
    assert manual.transport.bytes_offloaded == 0


def test_manual_excludes_synchronization_dict():
    with pytest.raises(ValueError, match="exclude each other"):
        _ctx(manual_synchronization=True, synchronization_dict={0: (True, 2, False, 1)})


@pytest.mark.parametrize(
    "schedule",
    [
        {0: (True, 2, False, 1), 1: (True, 3, False, 2)},
        {0: (False, 3, False, 1), 2: (True, 3, False, 2)},
        {1: (True, 3, True, 3)},  # reloaded right away, during the forward
    ],
)
def test_synchronization_dict_mode(schedule):
    layers, make, ref = _model("gpt")
    ctx, sync = _ctx(None, synchronization_dict=schedule)
    sched = ctx.offload_synchronizer.schedule
    assert sched.offloaded == frozenset(schedule)
    assert_bit_equal(ref, step(layers, make, ctx, sync))
    assert ctx.offload_synchronizer.transport.bytes_offloaded > 0
    assert [ctx.offload_synchronizer.is_layer_offloaded(i) for i in range(N)] == [
        i in schedule for i in range(N)
    ]


def test_double_buffering_accepted():
    layers, make, ref = _model("linear")
    with pytest.warns(UserWarning, match="double_buffering=True has no effect"):
        ctx, sync = v2.get_cpu_offload_context(
            True, 2, N, True, False, True, transport=HostTransport(), min_tensor_size_to_offload=MIN
        )
    assert_bit_equal(ref, step(layers, make, ctx, sync))


def test_mark_activation_offload_is_harmless():
    layers, make, ref = _model("linear")
    ctx, sync = _ctx(2)
    baseline = step(layers, make, ctx, sync)
    moved = ctx.offload_synchronizer.transport.bytes_offloaded
    ctx, sync = _ctx(2)

    def marking_sync(x):
        mark_activation_offload(x, None)
        return sync(x)

    assert_bit_equal(baseline, step(layers, make, ctx, marking_sync))
    assert_bit_equal(ref, baseline)
    assert ctx.offload_synchronizer.transport.bytes_offloaded == moved


# -- misuse ----------------------------------------------------------------------------


def _leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def test_entering_twice_without_sync():
    ctx, sync = _ctx()
    x = _leaf(4, 4)
    with ctx:
        y = x * 2
    with pytest.raises(RuntimeError, match="without sync_function"):
        with ctx:
            pass
    assert _top_hooks() is None
    y = sync(y)
    with ctx:  # fine again after sync
        y = y * 2
    assert sync(y).requires_grad


def test_nested_with_is_an_error():
    ctx, _ = _ctx()
    with ctx:
        with pytest.raises(RuntimeError, match="already entered"):
            with ctx:
                pass
        assert ctx.inside_context


def test_sync_inside_the_context():
    ctx, sync = _ctx()
    with ctx:
        y = _leaf(4) * 2
        with pytest.raises(RuntimeError, match="outside the CPU offload context"):
            sync(y)


def test_sync_before_any_layer():
    _, sync = _ctx()
    with pytest.raises(RuntimeError, match="before any layer ran"):
        sync(_leaf(4))


def test_sync_twice_for_one_layer():
    ctx, sync = _ctx()
    with ctx:
        y = _leaf(4) * 2
    sync(y)
    with pytest.raises(RuntimeError, match="before any layer ran"):
        sync(y)


def test_sync_needs_requires_grad():
    ctx, sync = _ctx()
    with ctx:
        y = torch.randn(4) * 2
    with pytest.raises(ValueError, match="requires_grad"):
        sync(y)
    with pytest.raises(TypeError, match="expects a tensor"):
        sync([y])


def test_sync_on_a_leaf_returns_a_view_with_grad_fn():
    ctx, sync = _ctx()
    x = _leaf(4)
    with ctx:
        pass
    out = sync(x)
    assert out.grad_fn is not None and torch.equal(out, x)


def test_only_offloaded_layers_run_with_saved_tensor_hooks():
    # A layer that is not offloaded saves its tensors exactly as without the context:
    # no hook runs for them (is_cpu_offload_enabled still answers True).
    ctx, sync = _ctx(2)
    hooked = []
    x = _leaf(4)
    for _ in range(N):
        with ctx:
            hooked.append(top_saved_tensor_hooks() is not None)
            assert is_cpu_offload_enabled()
            x = x * 2
        x = sync(x)
    assert hooked == [True, True] + [False] * (N - 2)
    x.sum().backward()


def test_a_replaced_synchronizer_receives_the_tensors():
    ctx, sync = _ctx(1)
    other, _ = _ctx(1)
    ctx.offload_synchronizer = other.offload_synchronizer
    x = _leaf(64, 64)
    for _ in range(N):
        with ctx:
            x = x * x.exp()
        x = sync(x)
    x.sum().backward()
    assert other.offload_synchronizer.transport.bytes_offloaded > 0


def test_inside_context_and_queries():
    ctx, sync = _ctx(1)
    assert not ctx.inside_context
    assert not is_cpu_offload_enabled() and not is_current_layer_offloaded()
    seen = []
    x = _leaf(4)
    for _ in range(N):
        with ctx:
            seen.append(
                (ctx.inside_context, is_cpu_offload_enabled(), is_current_layer_offloaded())
            )
            x = x * 2
        assert not ctx.inside_context
        assert not is_cpu_offload_enabled() and not is_current_layer_offloaded()
        x = sync(x)
    assert seen == [(True, True, True)] + [(True, True, False)] * (N - 1)
    x.sum().backward()


def test_exception_inside_the_context_leaves_nothing_behind():
    layers, make, ref = _model("gpt")
    ctx, sync = _ctx(2)
    synchronizer = ctx.offload_synchronizer
    transport = synchronizer.transport
    assert _top_hooks() is None

    class Boom(Exception):
        pass

    x = make()
    with pytest.raises(Boom):
        for i, layer in enumerate(layers):
            with ctx:
                x = layer(x)
                if i == 2:
                    raise Boom
            x = sync(x)
    del x
    assert transport.bytes_offloaded > 0  # layer 0 was on its way out
    assert _top_hooks() is None
    assert not is_cpu_offload_enabled() and not ctx.inside_context
    assert all(s.state == "not_offloaded" and not s.has_tensors for s in synchronizer.layers)
    # The failed iteration's host buffers are back in the pool.
    free = sum(len(b) for b in transport.pool._free.values())
    assert free == transport.pool.allocations > 0
    # A tensor saved now, outside any context, is not intercepted.
    moved = transport.bytes_offloaded
    a = _leaf(64, 64)
    b = (a * a.exp()).sum()
    assert transport.bytes_offloaded == moved
    b.backward()
    assert transport.bytes_offloaded == moved
    # The next iteration starts at layer 0 and is exact.
    assert_bit_equal(ref, step(layers, make, ctx, sync))
    assert synchronizer.layers[0].state == "not_offloaded"


def test_no_grad_is_pass_through():
    layers, make, ref = _model("linear")
    ctx, sync = _ctx(2)
    synchronizer = ctx.offload_synchronizer
    with torch.no_grad():
        x = make()
        for _ in range(3):  # more forwards than layers: none is counted
            for layer in layers:
                with ctx:
                    assert ctx.inside_context
                    x = layer(x)
                assert sync(x) is x
    assert synchronizer.current_layer is None
    assert synchronizer._forwards == 0
    assert synchronizer.transport.bytes_offloaded == 0
    # A training step afterwards is unaffected.
    assert_bit_equal(ref, step(layers, make, ctx, sync))


def test_backward_of_a_stale_iteration():
    layers, make, ref = _model("linear")
    ctx, sync = _ctx(2)
    from cpu_offload.models import run_layers

    old = run_layers(layers, make(), ctx, sync)
    new = run_layers(layers, make(), ctx, sync)  # the next forward began
    with pytest.raises(RuntimeError, match="earlier iteration") as info:
        old.square().mean().backward()
    assert "run backward before the next forward" in str(info.value)
    del old, new
    # A fresh full iteration still works.
    assert_bit_equal(ref, step(layers, make, ctx, sync))


def test_saved_tensors_read_twice_in_backward():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            (x_again,) = ctx.saved_tensors
            return grad * 2 + 0 * x * x_again

    ctx, sync = _ctx(1, 3)
    x = _leaf(32, 32)
    with ctx:
        y = Twice.apply(x * 1.0)
    y = sync(y)
    for _ in range(2):
        with ctx:
            y = y * 1.0
        y = sync(y)
    assert ctx.offload_synchronizer.transport.bytes_offloaded > 0
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((32, 32), 2.0))


class _StreamCalls(HostTransport):
    """The stand-in, counting the calls that would reach a CUDA stream."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def current_stream(self):
        self.calls.append("current_stream")
        return super().current_stream()

    def record(self):
        self.calls.append("record")
        return super().record()

    def offload_all(self, copies):
        self.calls.append("offload_all")
        return super().offload_all(copies)

    def reload_all(self, copies):
        self.calls.append("reload_all")
        return super().reload_all(copies)


@pytest.mark.parametrize("threshold", [1 << 62, MIN])
def test_a_layer_with_nothing_to_move_touches_no_stream(threshold):
    # NOTE [A layer with nothing to move]: with nothing eligible, the offloaded layers
    # go through every point of the schedule without a stream call; with a threshold
    # the same model reaches, the same steps make them (the count is not vacuous).
    layers, make, ref = _model("gpt")
    transport = _StreamCalls()
    ctx, sync = _ctx(k=2, transport=transport, min_tensor_size_to_offload=threshold)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nothing offloaded, when so
        for _ in range(2):
            assert_bit_equal(step(layers, make, ctx, sync), ref)
    moved = ctx.offload_synchronizer.layers[0].moved_bytes
    if threshold == MIN:
        assert moved > 0 and {"offload_all", "reload_all", "current_stream"} <= set(transport.calls)
    else:
        assert moved == 0 and transport.calls == []
