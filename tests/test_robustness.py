"""Misuse and failure paths: each ends in a clear error or a clean state, never silence."""

from __future__ import annotations

import pytest
import torch

from cpu_offload import DefaultOffloadSynchronizer, HostBufferPool, HostTransport, v2
from cpu_offload.models import run_layers


def _ctx(n=4, k=2):
    return v2.get_cpu_offload_context(
        True, k, n, transport=HostTransport(), min_tensor_size_to_offload=1
    )


def _layers(n=4):
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(n))


def test_wrong_model_layers_is_named_at_backward_and_the_next_iteration_is_clean():
    layers = _layers(4)
    ctx, sync = _ctx(n=8, k=2)  # declares 8 layers, runs 4
    out = run_layers(layers, torch.randn(4, 16), ctx, sync)
    with pytest.raises(ValueError, match="model_layers=8"):
        out.sum().backward()
    assert ctx.offload_synchronizer._forwards == 0


def test_forward_cut_short_outside_the_context_then_backward_is_refused_then_recovers():
    layers = _layers(4)
    ctx, sync = _ctx()
    x = torch.randn(4, 16)
    for layer in layers[:2]:
        with ctx:
            x = layer(x)
        x = sync(x)
    # An error between layers (outside the context) abandons this forward; the next
    # forward's ids then run 2, 3, 0, 1 and its backward is refused, naming the cause.
    out = run_layers(layers, torch.randn(4, 16), ctx, sync)
    with pytest.raises(ValueError, match="cut short"):
        out.sum().backward()
    ids = []
    for layer in layers:
        with ctx:
            ids.append(ctx.layer_id)
            x = layer(x.detach())
        x = sync(x)
    assert ids == [0, 1, 2, 3]


def test_exception_in_backward_does_not_stick():
    layers = _layers(4)
    ctx, sync = _ctx()

    class Boom(RuntimeError):
        pass

    def boom(grad):
        raise Boom

    out = run_layers(layers, torch.randn(4, 16), ctx, sync)
    out.register_hook(boom)
    with pytest.raises(Boom):
        out.sum().backward()
    ref = run_layers(layers, torch.randn(4, 16, generator=torch.Generator().manual_seed(1)))
    out = run_layers(
        layers, torch.randn(4, 16, generator=torch.Generator().manual_seed(1)), ctx, sync
    )
    assert torch.equal(out, ref)
    out.sum().backward()
    sync_ = ctx.offload_synchronizer
    # The backward's end ran: every layer was released.
    assert all(layer.state == "not_offloaded" for layer in sync_.layers)
    assert not sync_._backward_layers


@pytest.mark.parametrize("where", ["inside", "after"])
@pytest.mark.filterwarnings("ignore:num_layers=1 = model_layers - 1")
def test_in_place_change_of_a_saved_tensor_still_fails_in_backward(where):
    ctx, sync = _ctx(n=2, k=1)
    a = torch.randn(64, 64, requires_grad=True)
    b = a * 1
    with ctx:
        c = b.sin()
        if where == "inside":
            b.add_(1)
    c = sync(c)
    with ctx:
        d = c * 2
    d = sync(d)
    if where == "after":
        b.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        d.sum().backward()


def test_default_synchronizer_validates_its_dict():
    with pytest.raises(ValueError, match="out of range"):
        DefaultOffloadSynchronizer(
            4, synchronization_dict={7: (True, 9, False, 0)}, transport=HostTransport()
        )


def test_offload_stream_and_transport_exclude_each_other():
    with pytest.raises(ValueError, match="offload_stream and transport"):
        DefaultOffloadSynchronizer(
            4,
            2,
            offload_stream=object(),
            transport=HostTransport(),  # type: ignore[arg-type]
        )


def test_enabled_reports_true_under_no_grad():
    ctx, sync = _ctx()
    with torch.no_grad():
        with ctx:
            assert v2.is_cpu_offload_enabled()
    assert not v2.is_cpu_offload_enabled()


def test_entering_again_after_a_refusal_starts_a_new_iteration():
    layers = _layers(4)
    ctx, sync = _ctx()
    with ctx:
        layers[0](torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="without sync_function"):
        with ctx:
            pass
    out = run_layers(layers, torch.randn(4, 16), ctx, sync)  # not blocked
    out.sum().backward()


def test_pool_size_classes_bound_buffers_for_varying_shapes():
    pool = HostBufferPool(pin_memory=False)
    sizes = [n * 1024 + 7 for n in range(1000, 41000, 1000)]  # 40 sequence lengths
    for n in sizes:
        pool.release(pool.acquire(n))
    classes = {HostBufferPool.size_class(n) for n in sizes}
    assert pool.allocations == len(classes) < len(sizes)
    for n in reversed(sizes):  # the same shapes again: nothing new
        pool.release(pool.acquire(n))
    assert pool.allocations == len(classes)
    assert HostBufferPool.size_class(3 << 20) == 3 << 20
    assert HostBufferPool.size_class((3 << 20) + 1) - ((3 << 20) + 1) < (3 << 20) // 8
    assert HostBufferPool.size_class(100) == 512
    assert HostBufferPool.size_class(1000) == 1024
