"""Saved casts rebuilt from their source instead of moved (``engine/recast.py``), on the
CPU stand-in: attention with its softmax in fp32, ``transformers``' eager attention, and
the cases where a cast must be moved after all.
"""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
from helpers import assert_bit_equal, step, v2_context
from test_engine_tensor_group import _Probe  # saves tensors, records what comes back
from torch import nn

from cpu_offload import HostTransport, mark_activation_offload, offload_layers, start_offload, v1
from cpu_offload._compat import autograd_clock
from cpu_offload.engine.layer_state import OffloadableLayerState
from cpu_offload.engine.recast import CastRef
from cpu_offload.engine.tensor_group import SavedEntry, TensorGroupProcessor

HEADS, SEQ, HIDDEN, BATCH = 4, 32, 64, 2
#: The bf16 probabilities of one layer: what each offloaded layer no longer moves.
PROBS_BYTES = BATCH * HEADS * SEQ * SEQ * 2


class SoftmaxInFp32(nn.Module):
    """Attention as Megatron-Core's local spec runs it with ``attention_softmax_in_fp32``:
    q, k, v views of one projection, scores and softmax in fp32, probabilities cast back
    to the model's dtype for the product with v."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * (h // HEADS) ** -0.5
        probs = torch.softmax(scores, dim=-1).to(x.dtype)
        return x + self.out(torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h))


def _layers(n: int = 3) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(SoftmaxInFp32() for _ in range(n)).to(torch.bfloat16)


def _input() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=gen).to(torch.bfloat16).requires_grad_()


def test_probabilities_are_cast_again_not_moved_and_bit_identical():
    layers = _layers()
    want = step(layers, _input)
    ctx, sync = v2_context(k=2, n=3)
    got = step(layers, _input, ctx, sync)
    assert_bit_equal(got, want)
    states = ctx.offload_synchronizer.layers
    assert [s.recast_bytes for s in states[:2]] == [PROBS_BYTES, PROBS_BYTES]
    moved = ctx.offload_synchronizer.transport.bytes_offloaded
    # The fp32 probabilities still travel: each layer moves more than their bytes.
    assert moved > 2 * 2 * PROBS_BYTES
    again = step(layers, _input, ctx, sync)  # the next iteration finds them again
    assert_bit_equal(again, want)
    assert ctx.offload_synchronizer.transport.bytes_offloaded == 2 * moved


def test_v1_rebuilds_a_marked_cast_of_a_marked_source():
    # V1 moves marked tensors only: a cast is rebuilt where it and its source are marked
    # and the source was saved before the cast was made.
    ctx, sync = v1.get_cpu_offload_context(True, 1, 3, True, False, False)
    x = torch.randn(4, requires_grad=True)
    record: list[torch.Tensor] = []
    with ctx:
        s = torch.randn(8, 64, requires_grad=True) * 3.0
        mark_activation_offload(s)
        y = _Probe.apply(x, [], s)
        t = s.to(torch.bfloat16)
        mark_activation_offload(t)
        want = t.detach().clone()
        y = _Probe.apply(y, record, t)
    _rest_and_backward(ctx, sync, y)
    group = ctx.offload_handler.groups[0]
    assert group.recast_bytes == 8 * 64 * 2
    assert torch.equal(record[0], want)


def _llama_eager(layers: int = 3) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    config._attn_implementation = "eager"  # softmax(..., dtype=float32).to(q.dtype)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def _llama_steps(model: nn.Module) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(2):
        tokens = torch.randint(0, 128, (BATCH, SEQ), generator=gen)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
    return out


def test_transformers_eager_attention_bit_identical(monkeypatch):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "0")
    model = _llama_eager()
    want = _llama_steps(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        handle = offload_layers(
            model, num_offloaded=2, transport=HostTransport(), min_tensor_size_to_offload=256
        )
    with handle:
        got = _llama_steps(model)
        states = handle.context.offload_synchronizer.layers
        assert [s.recast_bytes for s in states[:2]] == [PROBS_BYTES, PROBS_BYTES]
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


# -- when a cast is moved after all ------------------------------------------------------


def _rest_and_backward(ctx, sync, y: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """After layer 0's ``with`` block: its sync, layers 1 and 2 of 3, and backward."""
    y = sync(y)
    for _ in range(2):
        with ctx:
            y = y * 2.0
        y = sync(y)
    y.sum().backward()


def _in_layer0(make, k: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor], object]:
    """Run ``make()`` (returns the tensors to save) inside layer 0 of 3, save them there,
    run backward. Returns (what was saved, what backward got, layer 0's state)."""
    ctx, sync = v2_context(k=k, n=3)
    record: list[torch.Tensor] = []
    x = torch.randn(4, requires_grad=True)
    with ctx:
        tensors = make()
        saved = [t.detach().clone() for t in tensors]
        y = _Probe.apply(x, record, *tensors)
    _rest_and_backward(ctx, sync, y)
    return saved, record, ctx.offload_synchronizer.layers[0]


def _source() -> torch.Tensor:
    a = torch.randn(8, 64, requires_grad=True)
    return torch.softmax(a * 3.0, dim=-1)  # softmax saves its fp32 output here


def test_a_cast_saved_after_its_source_is_rebuilt():
    def make():
        s = _source()
        return [s, s.to(torch.bfloat16)]

    saved, got, state = _in_layer0(make)
    assert state.recast_bytes == 8 * 64 * 2
    for g, want in zip(got, saved, strict=True):
        assert g.dtype == want.dtype and torch.equal(g, want)


def test_source_changed_without_autograd_between_cast_and_save_is_moved():
    # s is saved (by _Save) only after the cast, and changed in between under no_grad:
    # the cast holds the old values, so it cannot be rebuilt from the saved s.
    def make():
        a = torch.randn(8, 64, requires_grad=True)
        s = a * 3.0  # mul saves its inputs, not s
        t = s.to(torch.bfloat16)
        with torch.no_grad():
            s.mul_(2.0)
        return [s, t]

    saved, got, state = _in_layer0(make)
    assert state.recast_bytes == 0
    assert torch.equal(got[1], saved[1])
    assert not torch.equal(got[1], got[0].to(torch.bfloat16))


def test_cast_changed_after_the_cast_is_moved():
    def make():
        s = _source()
        t = s.to(torch.bfloat16)
        with torch.no_grad():
            t.add_(1.0)
        return [s, t]

    saved, got, state = _in_layer0(make)
    assert state.recast_bytes == 0
    assert torch.equal(got[1], saved[1])


def test_source_changed_in_place_after_saving_still_fails_backward():
    ctx, sync = v2_context(k=1, n=3)
    x = torch.randn(4, requires_grad=True)
    with ctx:
        s = _source()
        t = s.to(torch.bfloat16)
        y = _Probe.apply(x, [], s, t)
        with torch.no_grad():
            s.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _rest_and_backward(ctx, sync, y)


def test_a_view_of_a_cast_is_rebuilt_several_views_are_moved():
    def make():
        s = _source()
        t = s.to(torch.bfloat16)
        return [s, t.view(2, 4, 64)]  # matmul saves such a view of the probabilities

    saved, got, state = _in_layer0(make)
    assert state.recast_bytes == 8 * 64 * 2
    assert all(torch.equal(g, w) for g, w in zip(got, saved, strict=True))
    assert got[1].shape == (2, 4, 64)

    def two_views():
        s = _source()
        t = s.to(torch.bfloat16)
        return [s, t[:4], t[4:]]  # each would rebuild all of t

    saved, got, state = _in_layer0(two_views)
    assert state.recast_bytes == 0
    assert all(torch.equal(g, w) for g, w in zip(got, saved, strict=True))


def test_the_cast_is_let_go_when_the_copies_start_before_the_source():
    state = OffloadableLayerState(None, transport=HostTransport())
    s = _source()
    i = state.push_tensor(s)  # softmax saves its output as it is made
    t = s.to(torch.bfloat16)
    j = state.push_tensor(t.view(2, 4, 64))  # the matmul after it saves a view of the cast
    want = t.clone()
    cast, source = weakref.ref(t), weakref.ref(s)
    del s, t
    state.start_offload()
    assert state.recast_bytes == 8 * 64 * 2
    assert cast() is None, "the engine still holds the saved cast"
    assert source() is not None  # until its copy is waited for and it is released
    state.release_activation_forward_gpu_memory()
    assert source() is None
    state.start_reload()
    assert torch.equal(state.pop_tensor(j), want.view(2, 4, 64))
    assert state.pop_tensor(i).dtype == torch.float32
    state.release_all_memory()


def test_a_source_finished_late_is_never_used():
    # start_offload(s) says s was written after it was saved, maybe behind its version
    # counter (.data): the cast made before that write must be moved, not rebuilt.
    ctx, sync = v2_context(k=1, n=3)
    x = torch.randn(4, requires_grad=True)
    record: list[torch.Tensor] = []
    with ctx:
        s = _source()  # saved by softmax here
        t = s.to(torch.bfloat16)
        want = t.detach().clone()
        s.data.mul_(0.5)
        start_offload(s)
        y = _Probe.apply(x, record, t)
    _rest_and_backward(ctx, sync, y)
    state = ctx.offload_synchronizer.layers[0]
    assert state.recast_bytes == 0
    assert torch.equal(record[0], want)


def _pushed_cast(budget: int = 0, saves: int = 1):  # type: ignore[no-untyped-def]
    state = OffloadableLayerState(None, transport=HostTransport())
    state.keep_budget = budget
    s = _source()
    i = state.push_tensor(s)
    t = s.to(torch.bfloat16)
    js = [state.push_tensor(t) for _ in range(saves)]
    return state, s, t.detach().clone(), i, js


def test_a_cast_saved_twice_comes_back_as_one_tensor():
    state, s, want, i, (j, k) = _pushed_cast(saves=2)
    del s
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    first, second = state.pop_tensor(j), state.pop_tensor(k)
    assert first is second and torch.equal(first, want)
    state.pop_tensor(i)
    state.release_all_memory()


def test_a_source_changed_after_saving_fails_the_read_of_its_cast():
    # The source stays on the device (a budget keeps it) and changes after the layer:
    # rebuilding the cast from it would give other values than autograd saved.
    state, s, _, _, (j,) = _pushed_cast(budget=1 << 30)
    state.start_offload()
    assert state.budget_kept_bytes > 0
    with torch.no_grad():
        s.mul_(2.0)
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    with pytest.raises(RuntimeError, match="rebuilds a saved cast of it"):
        state.pop_tensor(j)
    state.release_all_memory()


class _TwoOut(torch.autograd.Function):
    """Two outputs saved by their own backward: the cast must follow output 1."""

    @staticmethod
    def forward(ctx, a):
        first, second = a * 2.0, a * 3.0
        ctx.save_for_backward(first, second)
        return first, second

    @staticmethod
    def backward(ctx, g1, g2):
        first, second = ctx.saved_tensors
        return g1 * first + g2 * second


@pytest.mark.parametrize(
    ("make", "keep"),
    [
        # the cast follows output 1 of a node with two saved outputs; a view at an offset
        pytest.param(lambda a: _TwoOut.apply(a)[1], lambda t: t[8:], id="second-output"),
        # a dense source with permuted strides (exp saves it): the cast keeps them
        pytest.param(lambda a: (a * 3.0).t().exp(), lambda t: t, id="permuted"),
        pytest.param(lambda a: torch.softmax(a * 3.0, -1), lambda t: t[8:], id="offset-view"),
    ],
)
def test_casts_of_other_outputs_and_layouts_come_back_exactly(make, keep):
    def tensors():
        source = make(torch.randn(64, 64, requires_grad=True))
        return [keep(source.to(torch.bfloat16))]

    saved, got, state = _in_layer0(tensors)
    assert state.recast_bytes == 64 * 64 * 2
    assert torch.equal(got[0], saved[0])
    assert got[0].stride() == saved[0].stride()


# -- the processor directly -------------------------------------------------------------


def _entries(*tensors: torch.Tensor, clocks: list[int]) -> list[SavedEntry]:
    return [
        SavedEntry(t, None, i, version=t._version, clock=c)
        for i, (t, c) in enumerate(zip(tensors, clocks, strict=True))
    ]


def test_processor_makes_a_cast_ref_and_restores_the_same_bits():
    clock = autograd_clock()
    s = _source()
    t = s.to(torch.bfloat16)
    plan = TensorGroupProcessor().process(_entries(s, t, clocks=[clock, autograd_clock()]))
    assert len(plan.units) == 1 and isinstance(plan.refs[1], CastRef)
    assert plan.units[0].pending_pops == 2  # the cast reads its source's reload
    plan.units[0].reloaded = s.detach().clone()
    got = TensorGroupProcessor.restore(plan, plan.refs[1])
    assert got.dtype == torch.bfloat16 and torch.equal(got, t)
    assert got.stride() == t.stride()


def test_processor_moves_a_cast_of_unknown_order():
    s = _source()
    t = s.to(torch.bfloat16)
    plan = TensorGroupProcessor().process(_entries(s, t, clocks=[-1, -1]))
    assert len(plan.units) == 2 and plan.recast_bytes == 0


def test_processor_moves_a_cast_made_before_its_source_was_saved():
    s = _source()
    t = s.to(torch.bfloat16)
    later = autograd_clock()  # as if s had been saved only now, after the cast
    plan = TensorGroupProcessor().process(_entries(s, t, clocks=[later, later]))
    assert len(plan.units) == 2 and plan.recast_bytes == 0


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda s: s.to(torch.float64)[:2], id="small-view"),  # < half of it
        pytest.param(lambda s: s.detach().to(torch.bfloat16), id="no-autograd-edge"),
        pytest.param(lambda s: s.view(-1).to(torch.bfloat16), id="cast-of-a-view"),
    ],
)
def test_processor_moves_what_is_not_a_whole_cast_of_a_saved_tensor(make):
    clock = autograd_clock()
    s = _source()
    t = make(s)
    plan = TensorGroupProcessor().process(_entries(s, t, clocks=[clock, autograd_clock()]))
    assert plan.recast_bytes == 0
    assert not any(isinstance(ref, CastRef) for ref in plan.refs)
