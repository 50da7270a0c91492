"""V2's synchronizer on its own: its pack hook (NOTE [Kept tensors are detached], NOTE
[Small tensors stay at the door]) and what its forward step asks of the transport."""

from __future__ import annotations

import pytest
import torch
from helpers import V2_LAYERS, V2_MIN
from helpers import v2_context as _ctx

from cpu_offload import HostTransport, mark_activation_offload, v2
from cpu_offload.engine.saved_checks import KeptAsSaved
from cpu_offload.engine.selection import ActivationPolicy, is_marked_for_offload
from cpu_offload.v2.synchronizer import TensorId

N = V2_LAYERS
MIN = V2_MIN

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Capturing(HostTransport):
    """The CPU stand-in, reporting a CUDA graph capture on the current stream."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def capturing(self) -> bool:
        self.asked += 1
        return True


@pytest.mark.parametrize("supported", [False, True])
def test_a_capture_is_refused_only_where_pinned_memory_cannot_be_had(monkeypatch, supported):
    # Below PyTorch 2.11 a capture without retained buffers is refused at the layer's
    # forward; from 2.11 on it never is, and the forward does not query the stream.
    from cpu_offload import _compat
    from cpu_offload.v2 import synchronizer

    for module in (_compat, synchronizer):
        monkeypatch.setattr(
            module, "pinned_alloc_in_capture_supported", lambda version=None: supported
        )
    transport = _Capturing()
    sync = v2.DefaultOffloadSynchronizer(N, 1, transport=transport)
    if supported:
        assert sync.fwd_step() == 0 and transport.asked == 0
    else:
        with pytest.raises(RuntimeError, match="retain_pinned_cpu_buffers=True"):
            sync.fwd_step()
    retained = v2.DefaultOffloadSynchronizer(
        N, 1, retain_pinned_cpu_buffers=True, transport=_Capturing()
    )
    assert retained.fwd_step() == 0 and retained.transport.asked == 0


def test_pack_hook_keeps_only_weights_undetached():
    # NOTE [Kept tensors are detached]: a kept tensor goes back detached (the same
    # storage, another object), but for a leaf that requires grad (a weight).
    ctx, _ = _ctx(k=1, n=2, min_tensor_size_to_offload=1 << 40)  # nothing is offloaded
    sync = ctx.offload_synchronizer
    sync.fwd_step()
    w = torch.ones(4, requires_grad=True)
    made = w * 2
    plain = torch.ones(4)
    out = sync.pack_hook(made)
    assert isinstance(out, KeptAsSaved)
    assert out.tensor is not made and out.tensor.grad_fn is None
    assert out.tensor.data_ptr() == made.data_ptr() and out.tensor._version == made._version
    assert sync.pack_hook(w).tensor is w
    out = sync.pack_hook(plain)  # needs no grad now, but an in-place op may change that
    assert out.tensor is not plain and out.tensor.data_ptr() == plain.data_ptr()
    for t in (made, w, plain):
        assert sync.pop_tensor(sync.pack_hook(t)).data_ptr() == t.data_ptr()


def test_a_tensor_given_a_grad_fn_after_its_save_is_not_kept_alive():
    # NOTE [Kept tensors are detached]: ``h`` needs no grad when it is saved; the in-place
    # op then gives it a grad_fn whose graph reaches the node that saved it. A forward
    # without backward must still leave nothing alive.
    import gc
    import weakref

    ctx, sync = _ctx(k=1, n=2, min_tensor_size_to_offload=1 << 40)  # nothing is offloaded
    w = torch.ones(4, requires_grad=True)
    with ctx:
        h = torch.ones(4)
        z = h * w  # saves h
        h.add_(z)
    out = sync(h)
    alive = weakref.ref(h)
    del h, z, out
    ctx.offload_synchronizer.release_all()
    gc.collect()
    assert alive() is None


def test_small_tensors_stay_at_the_door(monkeypatch, caplog):
    # NOTE [Small tensors stay at the door]: below the threshold, the pack hook keeps a
    # tensor without the layer; at it, the layer takes the tensor as before.
    ctx, _ = _ctx(k=1, n=2)
    sync = ctx.offload_synchronizer
    sync.fwd_step()  # layer 0, offloaded
    layer = sync.layers[0]
    calls: list[int] = []
    push = layer.push_tensor
    monkeypatch.setattr(layer, "push_tensor", lambda t, **kw: calls.append(t.numel()) or push(t))
    w = torch.ones(MIN, requires_grad=True)
    small, big = w[: MIN - 1] * 2, w * 2
    out = sync.pack_hook(small)
    assert isinstance(out, KeptAsSaved) and out.tensor is not small
    assert out.tensor.grad_fn is None and out.tensor.data_ptr() == small.data_ptr()
    assert calls == [] and not layer.has_tensors
    assert isinstance(sync.pack_hook(big), TensorId) and calls == [MIN] and layer.has_tensors
    # With DEBUG records wanted, the layer sees every tensor and says why it keeps one.
    with caplog.at_level("DEBUG", logger="cpu_offload"):
        assert isinstance(sync.pack_hook(small), KeptAsSaved)
    assert calls == [MIN, MIN - 1]
    assert any("kept" in r.getMessage() and "layer 0" in r.getMessage() for r in caplog.records)
    sync.release_all()


@pytest.mark.parametrize("policy", [lambda t: True, is_marked_for_offload])
def test_a_policy_without_a_size_threshold_sees_every_tensor(policy):
    # Only V2's ActivationPolicy has a size threshold to test at the door.
    sync = v2.DefaultOffloadSynchronizer(2, 1, transport=HostTransport(), policy=policy)
    sync.fwd_step()
    one = torch.ones(1, requires_grad=True) * 2
    mark_activation_offload(one)
    assert isinstance(sync.pack_hook(one), TensorId)
    sync.release_all()


def test_a_layer_whose_offload_started_refuses_small_tensors_too():
    # NOTE [Small tensors stay at the door]: the door stays shut on a layer that no
    # longer collects, whatever the logging level.
    transport = HostTransport()
    policy = ActivationPolicy(MIN, transport.accepts)  # as get_cpu_offload_context makes it
    sync = v2.ManualOffloadSynchronizer(1, transport=transport, policy=policy)
    sync.fwd_step()
    assert isinstance(sync.pack_hook(torch.ones(1 << 20) * 2), TensorId)
    sync.start_offload_layer(0)
    with pytest.raises(RuntimeError, match=r"push_tensor\(\) called on layer 0 in state"):
        sync.pack_hook(torch.ones(2) * 2)
    sync.release_all()


def test_a_subclass_of_the_default_policy_decides_for_small_tensors():
    class TakesEverything(ActivationPolicy):
        def __call__(self, tensor: torch.Tensor) -> bool:
            return True

    policy = TakesEverything(1 << 20, HostTransport().accepts)
    sync = v2.DefaultOffloadSynchronizer(2, 1, transport=HostTransport(), policy=policy)
    sync.fwd_step()
    assert isinstance(sync.pack_hook(torch.ones(2, requires_grad=True) * 2), TensorId)
    sync.release_all()
