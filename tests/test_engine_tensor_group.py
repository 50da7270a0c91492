"""Tensor groups on the CPU stand-in: views of one base, duplicates, permuted tensors,
kept strided slices, forced bases, wrapper subclasses, exclusions and float8.

Most tests save chosen tensors in layer 0 of a three-layer model (k=1) through a probe
autograd function, and look at what autograd hands back to that function's backward.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import pytest
import torch

from cpu_offload import HostTransport, mark_not_offload, start_offload, v2
from cpu_offload.engine.tensor_group import (
    GroupPlan,
    SavedEntry,
    TensorGroupProcessor,
    _storage_key,
)

_KEPT = "stays on the GPU"


class _Probe(torch.autograd.Function):
    """Saves the given tensors; its backward records what autograd hands back."""

    @staticmethod
    def forward(ctx, x, record, *tensors):
        ctx.save_for_backward(*tensors)
        ctx.record = record
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        ctx.record.extend(saved)
        return (grad, None) + (None,) * len(saved)


class _Run:
    """What one iteration did: the tensors backward got, bytes moved, warnings."""

    def __init__(self, saved: list[torch.Tensor], moved: int, warned: list[str]) -> None:
        self.saved = saved
        self.moved = moved
        self.warned = warned


def _save_in_layer0(
    tensors: Sequence[torch.Tensor],
    *,
    min_size: int = 256,
    inside: Callable[[], None] | None = None,
    context=None,
) -> _Run:
    """Save ``tensors`` in layer 0 of 3 (k=1), run backward, return what came back."""
    if context is None:
        transport = HostTransport()
        ctx, sync = v2.get_cpu_offload_context(
            True, 1, 3, transport=transport, min_tensor_size_to_offload=min_size
        )
    else:
        ctx, sync = context
        transport = ctx.offload_synchronizer.transport
    before = transport.bytes_offloaded
    record: list[torch.Tensor] = []
    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ctx:
            y = _Probe.apply(x, record, *tensors)
            if inside is not None:
                inside()
        y = sync(y)
        for _ in range(2):
            with ctx:
                y = y * 2.0
            y = sync(y)
        assert ctx.offload_synchronizer.layers[0].state == "offload_finished"
        y.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 4.0))
    assert transport.bytes_reloaded == transport.bytes_offloaded
    warned = [str(w.message) for w in caught if _KEPT in str(w.message)]
    return _Run(record, transport.bytes_offloaded - before, warned)


def _geometry(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def _assert_same_tensor_copy(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` is a reloaded copy of ``want``: same layout and values, other memory."""
    assert _geometry(got) == _geometry(want)
    assert torch.equal(got, want)
    assert got.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()


# -- views of one base -----------------------------------------------------------------


def _qkv(b=2, t=16, heads=4, d=8):
    qkv = torch.randn(b, t, 3, heads, d)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (b, heads, t, d), strided views
    return qkv, (q, k, v)


def test_qkv_views_offloaded_once_as_the_base():
    qkv, views = _qkv()
    run = _save_in_layer0(views)
    assert run.moved == qkv.nbytes  # one unit: the base, copied once
    assert not run.warned
    got = run.saved
    assert len(got) == 3
    storages = {g.untyped_storage().data_ptr() for g in got}
    assert len(storages) == 1  # views of one common reloaded storage
    for g, v in zip(got, views, strict=True):
        _assert_same_tensor_copy(g, v)


def test_qkv_views_direct():
    qkv, (q, k, v) = _qkv()
    processor = TensorGroupProcessor()
    plan = processor.process([SavedEntry(t, None, i) for i, t in enumerate((q, k, v))])
    assert len(plan.units) == 1
    unit = plan.units[0]
    assert unit.layout.size == tuple(qkv.shape)
    assert unit.layout.stride == qkv.stride()
    assert unit.pending_pops == 3
    assert unit.ready_seq == 2  # the copy may start once the last view was saved
    unit.reloaded = qkv.clone()
    got = [processor.restore(plan, ref) for ref in plan.refs]
    for g, t in zip(got, (q, k, v), strict=True):
        _assert_same_tensor_copy(g, t)
        assert g.untyped_storage().data_ptr() == unit.reloaded.untyped_storage().data_ptr()


def test_base_saved_with_its_views_is_one_unit():
    base = torch.randn(64, 32)
    views = [base, base[:10], base[10:].t()]
    run = _save_in_layer0(views)
    assert run.moved == base.nbytes
    assert len({g.untyped_storage().data_ptr() for g in run.saved}) == 1
    for g, v in zip(run.saved, views, strict=True):
        _assert_same_tensor_copy(g, v)


def test_small_dense_views_are_not_taken_as_their_base():
    big = torch.randn(64, 256)
    views = [big[0], big[5]]  # 2/64 of the base: each is copied alone
    run = _save_in_layer0(views)
    assert run.moved == 2 * 256 * 4
    for g, v in zip(run.saved, views, strict=True):
        assert torch.equal(g, v) and g.stride() == v.stride()


# -- duplicates ------------------------------------------------------------------------


def test_same_tensor_saved_twice_is_one_unit_and_one_object():
    t = torch.randn(32, 32)
    run = _save_in_layer0([t, t])
    assert run.moved == t.nbytes
    a, b = run.saved
    assert a is b
    _assert_same_tensor_copy(a, t)


def test_same_tensor_saved_twice_direct():
    t = torch.randn(32, 32)
    processor = TensorGroupProcessor()
    plan = processor.process([SavedEntry(t, None, 1), SavedEntry(t, None, 2)])
    assert len(plan.units) == 1 and plan.units[0].pending_pops == 2
    assert plan.units[0].ready_seq == 2  # the later save decides
    plan.units[0].reloaded = t.clone()
    a, b = (processor.restore(plan, r) for r in plan.refs)
    assert a is b is plan.units[0].reloaded


def test_same_tensor_pushed_twice_to_a_layer_state():
    state = v2.OffloadableLayerState(None, transport=HostTransport())
    t = torch.randn(16, 16)
    i, j = state.push_tensor(t), state.push_tensor(t)
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    a, b = state.pop_tensor(i), state.pop_tensor(j)
    assert a is b and torch.equal(a, t)
    assert state.transport.bytes_offloaded == t.nbytes


# -- layouts ---------------------------------------------------------------------------


def test_dense_permuted_tensor_keeps_its_strides():
    x = torch.randn(32, 64)
    xt = x.transpose(0, 1)  # its base x is not saved
    assert not xt.is_contiguous()
    run = _save_in_layer0([xt])
    assert run.moved == xt.nbytes
    (got,) = run.saved
    _assert_same_tensor_copy(got, xt)
    assert got.stride() == (1, 64)


def test_dense_permuted_4d_tensor_keeps_its_strides():
    t = torch.randn(2, 8, 4, 16).permute(0, 2, 1, 3)  # (b, h, t, d) from (b, t, h, d)
    run = _save_in_layer0([t])
    (got,) = run.saved
    _assert_same_tensor_copy(got, t)


def test_small_strided_slice_stays_with_one_warning_per_shape():
    big = torch.randn(64, 512)
    ctx = v2.get_cpu_offload_context(
        True, 1, 3, transport=HostTransport(), min_tensor_size_to_offload=256
    )
    s = big[:8, ::8]  # 512 elements of a base 64x larger, not dense
    first = _save_in_layer0([s], context=ctx)
    assert first.moved == 0
    assert len(first.warned) == 1
    assert "(8, 64)" in first.warned[0] and "offload_base_tensor=True" in first.warned[0]
    (got,) = first.saved
    assert got.data_ptr() == s.data_ptr() and got.stride() == s.stride()  # the same memory
    second = _save_in_layer0([big[8:16, 1::8]], context=ctx)  # same shape and strides
    assert second.moved == 0
    assert second.warned == []
    third = _save_in_layer0([big[:4, ::4]], context=ctx)  # another shape: warned once more
    assert len(third.warned) == 1


def test_start_offload_with_base_offloads_the_base():
    big = torch.randn(64, 512)
    s = big[:8, ::8]
    run = _save_in_layer0([s], inside=lambda: start_offload(s, offload_base_tensor=True))
    assert run.moved == big.nbytes
    assert run.warned == []
    (got,) = run.saved
    _assert_same_tensor_copy(got, s)
    assert got._base is not None or got.untyped_storage().nbytes() >= big.nbytes


def test_start_offload_without_base_changes_nothing():
    big = torch.randn(64, 512)
    s = big[:8, ::8]
    run = _save_in_layer0([s], inside=lambda: start_offload(s))
    assert run.moved == 0 and len(run.warned) == 1


def test_start_offload_outside_a_context_does_nothing():
    start_offload(torch.randn(4), offload_base_tensor=True)
    with pytest.raises(TypeError, match="start_offload expects tensors"):
        start_offload([torch.randn(4)])


# -- wrapper subclasses and float8 -----------------------------------------------------


def test_wrapper_subclass_offloaded_through_inner_tensors():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    t = two_tensor.TwoTensor(a, b)
    run = _save_in_layer0([t])
    assert run.moved == a.nbytes + b.nbytes
    (got,) = run.saved
    assert type(got) is two_tensor.TwoTensor
    assert got.shape == t.shape and got.stride() == t.stride()
    _assert_same_tensor_copy(got.a, a)
    _assert_same_tensor_copy(got.b, b)


def test_wrapper_subclass_direct():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    a = torch.randn(16, 16)
    t = two_tensor.TwoTensor(a, a)  # the same inner tensor twice: one unit
    processor = TensorGroupProcessor()
    plan = processor.process([SavedEntry(t, None, 1)])
    assert len(plan.units) == 1
    assert plan.units[0].pending_pops == 2
    plan.units[0].reloaded = a.clone()
    got = processor.restore(plan, plan.refs[0])
    assert type(got) is two_tensor.TwoTensor
    assert got.a is got.b is plan.units[0].reloaded
    assert torch.equal(got.a, a)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_round_trip_bit_exact(dtype):
    t = (torch.randn(32, 32) * 100).to(dtype)
    run = _save_in_layer0([t])
    assert run.moved == t.numel()  # one byte per element
    (got,) = run.saved
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    assert got.data_ptr() != t.data_ptr()


# -- never offloaded -------------------------------------------------------------------


def test_weights_marked_and_small_tensors_are_never_offloaded():
    linear = torch.nn.Linear(64, 64)
    weight = torch.randn(64, 64)
    weight.is_weight = True
    marked = torch.randn(64, 64)
    mark_not_offload(marked)
    control = torch.randn(32, 32)
    kept = [
        linear.weight,
        linear.weight.t(),
        weight,
        weight[:, :32],
        marked,
        marked[1:],
        marked.t(),
        torch.randn(255),  # below the threshold of 256 elements
    ]
    run = _save_in_layer0([*kept, control])
    assert run.moved == control.nbytes  # only the control moved
    for got, t in zip(run.saved, kept, strict=False):
        assert got.data_ptr() == t.data_ptr(), _geometry(t)
    assert run.saved[-1].data_ptr() != control.data_ptr()
    assert run.warned == []


def test_parameter_in_a_real_layer_is_not_offloaded():
    linear = torch.nn.Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)
    transport = HostTransport()
    ctx, sync = v2.get_cpu_offload_context(
        True, 1, 3, transport=transport, min_tensor_size_to_offload=64
    )
    with ctx:
        y = linear(x)  # saves x and weight.t()
    y = sync(y)
    for _ in range(2):
        with ctx:
            y = y * 2.0
        y = sync(y)
    assert transport.bytes_offloaded == x.nbytes
    y.sum().backward()
    # Against the same graph without offloading: the difference must be exactly
    # zero (a closed-form reference sums in another order and differs by rounding).
    x_ref = x.detach().clone().requires_grad_(True)
    (linear(x_ref) * 2.0 * 2.0).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_threshold_counts_elements():
    t8 = torch.ones(256, dtype=torch.uint8)
    t64 = torch.ones(255, dtype=torch.float64)  # more bytes, fewer elements
    run = _save_in_layer0([t8, t64], min_size=256)
    assert run.moved == 256


def _single_views() -> list[tuple[str, torch.Tensor, bool]]:
    """Views saved without their base, dense or not, whole or partial, forced or not."""
    base = torch.randn(8, 16, 32)
    out = [
        ("reshape", base.view(128, 32), False),
        ("reshape forced", base.view(128, 32), True),
        ("permuted", base.permute(2, 0, 1), False),
        ("slice", base[:4], False),
        ("slice forced", base[:4], True),
        ("strided slice", base[:, ::2], False),
        ("column", base[..., 0], False),
        ("expanded", base[:1].expand(8, 16, 32), False),
        ("dtype view", base.view(torch.int32), False),
        ("same as base", base.view(8, 16, 32), False),
        ("transposed", base.transpose(1, 2), False),
    ]
    return [(name, t, forced) for name, t, forced in out]


@pytest.mark.parametrize(
    ("name", "view", "forced"), _single_views(), ids=[n for n, _, _ in _single_views()]
)
def test_a_view_saved_alone_is_planned_as_the_grouping_rule_plans_it(name, view, forced):
    # process() answers a dense view saved without its base before the grouping rule
    # (_plan_root): both must give the same units and the same references.
    entries = [SavedEntry(view, None, 1, forced)]
    processor = TensorGroupProcessor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = processor.process(entries)
        leaves: list = []
        processor._flatten(view, entries[0], leaves)
        leaves[0].key = _storage_key(view)
        rule = GroupPlan()
        root = view if view._base is None else view._base  # view(dtype) has no _base
        refs = processor._plan_root(root, [0], leaves, rule, False)
    assert [(u.layout, u.tensor) for u in fast.units] == [(u.layout, u.tensor) for u in rule.units]
    assert fast.refs == [refs[0]]
    assert fast.view_base_bytes == rule.view_base_bytes
