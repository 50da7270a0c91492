"""Bad input to the engine: tensors it cannot move stay on the device, arguments that make
no sense are refused naming the argument, and a context belongs to one thread.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_bit_equal, error_in_another_thread, step

import cpu_offload
from cpu_offload import (
    DefaultOffloadSynchronizer,
    HostTransport,
    ManualOffloadSynchronizer,
    OffloadableLayerState,
    OffloadSynchronizer,
    v1,
    v2,
)
from cpu_offload.v2.synchronizer import TensorId

# -- push_tensor ids -----------------------------------------------------------------------


@pytest.mark.parametrize("cls", [OffloadSynchronizer, DefaultOffloadSynchronizer])
def test_push_tensor_returns_an_int_id_that_pop_tensor_takes_back(cls):
    sync = cls(2, transport=HostTransport(), policy=lambda t: t.numel() >= 16)
    big, small = torch.randn(8, 8), torch.randn(2)
    assert sync.fwd_step() == 0
    tid = sync.push_tensor(big)
    kept = sync.push_tensor(small)
    assert isinstance(tid, int) and not isinstance(tid, torch.Tensor)
    assert tid == 0 and tid.layer == 0 and tid.iteration == sync.iteration
    assert kept is small  # not a candidate: the tensor itself, at no cost
    assert sync.fwd_step() == 1
    second = sync.push_tensor(big)
    # The default schedule offloads the first num_layers - 1 = 1 layer only.
    assert isinstance(second, int) == (cls is OffloadSynchronizer)
    sync.bwd_step(1)
    sync.bwd_step(0)
    assert torch.equal(sync.pop_tensor(tid), big)
    assert sync.pop_tensor(kept) is small
    sync.finish_part_of_bwd()


def test_manual_synchronizer_ids_through_a_whole_offload():
    sync = ManualOffloadSynchronizer(1, transport=HostTransport(), policy=lambda t: True)
    t = torch.randn(64, 64)
    sync.fwd_step()
    tid = sync.push_tensor(t)
    assert isinstance(tid, int)
    sync.start_offload_layer(0)
    sync.release_activation_forward_gpu_memory(0)
    assert sync.get_offloaded_total_size_mb() == pytest.approx(t.numel() * 4 / 2**20)
    sync.start_reload_layer(0)
    assert torch.equal(sync.pop_tensor(tid), t)


def test_pop_tensor_refuses_what_push_tensor_did_not_return():
    sync = OffloadSynchronizer(1, transport=HostTransport())
    sync.fwd_step()
    with pytest.raises(TypeError, match="pop_tensor takes what push_tensor or pack_hook returned"):
        sync.pop_tensor(0)
    with pytest.raises(TypeError, match="pop_tensor takes what push_tensor or pack_hook returned"):
        sync.pop_tensor("x")


def test_tensor_id_repr_and_copy():
    import copy
    import pickle

    tid = TensorId(3, layer=1, iteration=7)
    assert repr(tid) == "TensorId(3, layer=1, iteration=7)"
    for clone in (copy.copy(tid), pickle.loads(pickle.dumps(tid))):
        assert clone == 3 and clone.layer == 1 and clone.iteration == 7


def test_layer_state_push_returns_int():
    state = OffloadableLayerState(None, transport=HostTransport())
    tid = state.push_tensor(torch.randn(4, 4))
    assert type(tid) is int


# -- tensors the engine cannot move ----------------------------------------------------------


class _SparseMM(torch.nn.Module):
    """Multiplies by a sparse matrix that requires grad (saved for backward as sparse)."""

    def forward(self, x):
        # The sparse operand is an activation here: a fresh sparse tensor from the input.
        s = (x.relu() * (x > 0.5)).to_sparse().requires_grad_()
        return torch.sparse.mm(s, torch.ones(64, 64)) + x


@pytest.mark.parametrize("backend", ["v1", "v2"])
def test_sparse_tensors_saved_in_an_offloaded_layer_stay_on_the_device(backend):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([_SparseMM(), torch.nn.Linear(64, 64), _SparseMM()])
    make = lambda: torch.randn(32, 64, generator=torch.Generator().manual_seed(2))  # noqa: E731
    ref = step(layers, make)
    if backend == "v2":
        ctx, sync = v2.get_cpu_offload_context(
            True, 2, 3, transport=HostTransport(), min_tensor_size_to_offload=0
        )
    else:
        ctx, sync = v1.get_cpu_offload_context(True, 2, 3, transport=HostTransport())
        layers = torch.nn.ModuleList(torch.nn.Sequential(_Mark(), layer) for layer in layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_bit_equal(ref, step(layers, make, ctx, sync))


class _Mark(torch.nn.Module):
    def forward(self, x):
        cpu_offload.mark_activation_offload(x)
        return x


def test_sparse_and_nested_tensors_are_not_candidates():
    from cpu_offload.engine.selection import ActivationPolicy, is_marked_for_offload

    policy = ActivationPolicy(0, lambda t: True)
    sparse = torch.randn(8, 8).to_sparse()
    cpu_offload.mark_activation_offload(sparse)
    assert not policy(sparse) and not is_marked_for_offload(sparse)
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    assert not policy(nested)
    assert policy(torch.randn(8, 8))


# -- arguments that make no sense ----------------------------------------------------------


@pytest.mark.parametrize("bad", ["x", 7, object()])
@pytest.mark.parametrize(
    "make",
    [
        lambda t: v2.get_cpu_offload_context(True, 1, 2, transport=t),
        lambda t: v2.get_cpu_offload_context(False, 1, 2, transport=t),
        lambda t: v1.get_cpu_offload_context(True, 1, 2, transport=t),
        lambda t: v1.get_cpu_offload_context(False, 1, 2, transport=t),
        lambda t: OffloadSynchronizer(2, transport=t),
        lambda t: OffloadableLayerState(None, transport=t),
        lambda t: v1.AsyncDoubleBufferGroupOffloadHandler(1, 2, transport=t),
    ],
    ids=["v2", "v2-disabled", "v1", "v1-disabled", "synchronizer", "layer-state", "handler"],
)
def test_transport_must_be_a_transport(make, bad):
    with pytest.raises(TypeError, match="transport must be a cpu_offload Transport"):
        make(bad)


@pytest.mark.parametrize(
    ("layer_id", "error"), [(-1, ValueError), (7, ValueError), (2, ValueError), ("0", TypeError)]
)
def test_bwd_step_checks_the_layer_id(layer_id, error):
    sync = DefaultOffloadSynchronizer(2, transport=HostTransport())
    sync.fwd_step()
    sync.fwd_step()
    with pytest.raises(error, match="layer_id"):
        sync.bwd_step(layer_id)


def test_double_buffering_warns_under_v2_once_per_context():
    with pytest.warns(UserWarning, match="double_buffering=True has no effect") as record:
        v2.get_cpu_offload_context(True, 1, 3, True, False, True, transport=HostTransport())
    assert len([w for w in record if "double_buffering" in str(w.message)]) == 1
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v2.get_cpu_offload_context(False, 1, 3, True, False, True)  # disabled: silent


# -- one thread per context ----------------------------------------------------------------


def _pair(which: str):
    if which == "v2":
        return v2.get_cpu_offload_context(True, 1, 3, transport=HostTransport())
    return v1.get_cpu_offload_context(True, 1, 3, transport=HostTransport())


def _enter_and_leave(ctx) -> None:
    with ctx:
        pass


def _layer(ctx, sync, x: torch.Tensor) -> torch.Tensor:
    with ctx:
        x = torch.sigmoid(x)
    return sync(x)


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_a_context_entered_by_a_second_thread_at_once_is_refused(which):
    ctx, sync = _pair(which)
    x = torch.randn(4, 4, requires_grad=True)
    with ctx:
        x = torch.sigmoid(x)
        error = error_in_another_thread(lambda: _enter_and_leave(ctx))
    assert "belongs to one thread" in str(error)
    x = sync(x)
    x = _layer(ctx, sync, x)  # the owner goes on
    x = _layer(ctx, sync, x)
    x.sum().backward()


def test_v2_layer_pending_in_another_thread_is_refused():
    ctx, sync = v2.get_cpu_offload_context(True, 1, 3, transport=HostTransport())
    with ctx:
        y = torch.sigmoid(torch.randn(2, 8, requires_grad=True))
    error = error_in_another_thread(lambda: _enter_and_leave(ctx))
    assert "belongs to one thread" in str(error)
    sync(y)  # the owner continues its iteration


def test_sync_from_a_second_thread_inside_the_context_is_refused():
    ctx, sync = v2.get_cpu_offload_context(True, 1, 3, transport=HostTransport())
    with ctx:
        y = torch.sigmoid(torch.randn(2, 8, requires_grad=True))
        error = error_in_another_thread(lambda: sync(y))
    assert "belongs to one thread" in str(error)
    sync(y)


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_nested_with_in_one_thread_names_the_nesting(which):
    ctx, sync = _pair(which)
    x = torch.randn(4, 4, requires_grad=True)
    with ctx:
        x = torch.sigmoid(x)
        with pytest.raises(RuntimeError, match="nested"), ctx:
            pass
    x = sync(x)
    x = _layer(ctx, sync, x)
    x = _layer(ctx, sync, x)
    x.sum().backward()


def test_v2_warns_once_when_a_whole_iteration_offloaded_nothing():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
    make = lambda: torch.randn(8, 16, generator=torch.Generator().manual_seed(2))  # noqa: E731
    ref = step(layers, make)
    ctx, sync = v2.get_cpu_offload_context(True, 1, 3, transport=HostTransport())
    with pytest.warns(UserWarning, match="offloaded nothing") as record:
        for _ in range(3):
            assert_bit_equal(ref, step(layers, make, ctx, sync))
    ours = [w for w in record if "offloaded nothing" in str(w.message)]
    assert len(ours) == 1 and "min_tensor_size_to_offload" in str(ours[0].message)
    ctx, sync = v2.get_cpu_offload_context(
        True, 1, 3, transport=HostTransport(), min_tensor_size_to_offload=1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(layers, make, ctx, sync)  # something moves: silent
