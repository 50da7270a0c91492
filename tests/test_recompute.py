"""The package's own recomputation (NOTE [A lean recomputation] in cpu_offload._recompute):
bit-identical to no recomputation, and what PyTorch's non-reentrant checkpoint promises."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

from cpu_offload import _recompute
from cpu_offload._compat import in_checkpoint_forward
from cpu_offload._recompute import run_recomputed


def _grads(
    module: nn.Module, x: torch.Tensor, run: Callable[..., Any], seed: int = 0, **kw: Any
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Loss, parameter gradients and input gradient of one step through ``run``."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    out = run(module, x, **kw)
    loss = out.float().square().mean()
    loss.backward()
    assert x.grad is not None
    grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    return loss.detach(), grads, x.grad.clone()


def _plain(module: nn.Module, x: torch.Tensor, **kw: Any) -> torch.Tensor:
    return module(x, **kw)


def _lean(module: nn.Module, x: torch.Tensor, **kw: Any) -> torch.Tensor:
    if kw:
        return run_recomputed(lambda t: module(t, **kw), x)
    return run_recomputed(module, x)


def _assert_equal(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0])
    assert len(got[1]) == len(want[1]) > 0
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.equal(g, w)
    assert torch.equal(got[2], want[2])


def _encoder(dropout: float) -> nn.Module:
    torch.manual_seed(1)
    return nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout, batch_first=True)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_bit_identical_to_no_recomputation(dropout: float) -> None:
    # With dropout, the recomputation draws the forward's masks (the RNG state is set).
    layer = _encoder(dropout)
    x = torch.randn(2, 8, 32)
    _assert_equal(_grads(layer, x, _lean, seed=5), _grads(layer, x, _plain, seed=5))


def test_multihead_attention_with_one_tensor_as_query_key_and_value() -> None:
    torch.manual_seed(2)
    attn = nn.MultiheadAttention(16, 4, batch_first=True)

    def plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x, x, x, need_weights=False)[0]

    def lean(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return run_recomputed(lambda t: m(t, t, t, need_weights=False)[0], x)

    x = torch.randn(2, 5, 16)
    _assert_equal(_grads(attn, x, lean), _grads(attn, x, plain))


def test_non_tensor_arguments_and_the_callers_rng_afterwards() -> None:
    torch.manual_seed(3)
    lin = nn.Linear(8, 8)

    def f(x: torch.Tensor, scale: float, mask: None) -> torch.Tensor:
        assert mask is None
        return nn.functional.dropout(lin(x) * scale, 0.5)

    def after(run: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(4, 8, requires_grad=True)
        torch.manual_seed(9)
        run(x).sum().backward()
        assert x.grad is not None
        # The recomputation gave the caller's RNG state back.
        return x.grad, torch.rand(3)

    got = after(lambda x: run_recomputed(f, x, 2.0, None))
    want = after(lambda x: f(x, 2.0, None))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_autocast_of_the_forward_is_the_recomputations() -> None:
    torch.manual_seed(4)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def under_autocast(run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def go(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run(m, x)  # backward runs outside autocast

        return go

    x = torch.randn(4, 16)
    got = _grads(mlp, x, under_autocast(_lean))
    want = _grads(mlp, x, under_autocast(_plain))
    _assert_equal(got, want)


def test_a_retained_graph_recomputes_for_each_backward() -> None:
    layer = _encoder(0.0)
    x = torch.randn(2, 4, 32, requires_grad=True)
    xs = x.detach().clone().requires_grad_()
    lean = run_recomputed(layer, x).sum()
    plain = layer(xs).sum()
    for _ in range(2):
        lean.backward(retain_graph=True)
        plain.backward(retain_graph=True)
    assert x.grad is not None and xs.grad is not None
    assert torch.equal(x.grad, xs.grad)


def test_grad_of_the_input_alone() -> None:
    layer = _encoder(0.0)
    x = torch.randn(2, 4, 32, requires_grad=True)
    (got,) = torch.autograd.grad(run_recomputed(layer, x).sum(), x)
    (want,) = torch.autograd.grad(layer(x).sum(), x)
    assert torch.equal(got, want)


class _Switching(nn.Module):
    """Saves a different tensor the second time it runs (a data-dependent forward)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            return x.sin()
        if self.how == "shape":
            return x[:1].sin().expand_as(x)  # saves a (1, 4) tensor for the forward's (3, 4)
        return x.sin().sin()


@pytest.mark.parametrize(
    ("how", "match"),
    [("shape", r"saved tensor 0 .* was \(torch.Size\(\[3, 4\]\)"), ("count", "saved 2 tensors")],
)
def test_a_forward_that_saves_other_tensors_again_is_refused(how: str, match: str) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    y = run_recomputed(_Switching(how), x)
    with pytest.raises(CheckpointError, match=match):
        y.sum().backward()


class _ReadsTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (first,) = ctx.saved_tensors
        (second,) = ctx.saved_tensors
        return grad * 2 + 0 * first * second


@pytest.mark.parametrize("others", [True, False])
def test_a_saved_tensor_unpacked_twice_is_refused(others: bool) -> None:
    # Also where it is the only tensor the call saved (nothing else left to read).
    x = torch.randn(3, requires_grad=True)
    y = run_recomputed(lambda t: _ReadsTwice.apply(t.sin() if others else t + 1), x)
    with pytest.raises(CheckpointError, match="unpacked twice"):
        y.sum().backward()


def test_a_read_outside_backward_recomputes_for_itself() -> None:
    # grad_fn._saved_* outside a backward pass: each read recomputes, nothing is kept.
    runs: list[int] = []

    def f(t: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        return t.sin().exp()

    x = torch.randn(4, requires_grad=True)
    y = run_recomputed(f, x)
    first, second = y.grad_fn._saved_result, y.grad_fn._saved_result  # type: ignore[union-attr]
    assert torch.equal(first, second) and torch.equal(first, x.sin().exp())
    assert len(runs) == 3
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, (x.cos() * x.sin().exp()).detach())


def test_a_backward_inside_the_forward_is_refused() -> None:
    def f(t: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(t.sin().cos().sum(), t, retain_graph=True)
        return t.cos() * g

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(CheckpointError, match="during that layer's own forward"):
        run_recomputed(f, x)


def test_the_forwards_device_context_is_the_recomputations() -> None:
    def f(t: torch.Tensor) -> torch.Tensor:
        return (t * torch.ones(4)).sin()  # the factory follows torch.device

    with torch.device("meta"):
        x = torch.randn(4, requires_grad=True)
        y = run_recomputed(f, x)
    y.sum().backward()  # outside the context
    assert x.grad is not None and x.grad.device.type == "meta"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    """Weak references to every recomputed call made while the test runs."""
    made: list[weakref.ref] = []
    real = _recompute._Recomputation.__init__

    def recorded(self: Any, *args: Any) -> None:
        real(self, *args)
        made.append(weakref.ref(self))

    monkeypatch.setattr(_recompute._Recomputation, "__init__", recorded)
    return made


def test_nothing_stays_alive_after_backward(calls: list[weakref.ref]) -> None:
    layer = _encoder(0.0)
    x = torch.randn(2, 4, 32, requires_grad=True)
    y = run_recomputed(layer, x)
    assert len(calls) == 1 and calls[0]() is not None
    y.sum().backward()
    del y
    gc.collect()
    assert calls[0]() is None


@pytest.mark.parametrize("how", ["no backward", "exception in the forward"])
def test_nothing_stays_alive_without_a_backward(how: str, calls: list[weakref.ref]) -> None:
    layer = _encoder(0.0)
    x = torch.randn(2, 4, 32, requires_grad=True)
    if how == "no backward":
        y = run_recomputed(layer, x)
        del y
    else:

        def fails(t: torch.Tensor) -> torch.Tensor:
            layer(t)
            raise RuntimeError("out of memory, say")

        with pytest.raises(RuntimeError, match="out of memory"):
            run_recomputed(fails, x)
    gc.collect()
    assert len(calls) == 1 and calls[0]() is None
    # The next step is exact.
    _assert_equal(_grads(layer, x, _lean), _grads(layer, x, _plain))


def test_no_grad_runs_the_call_as_it_is() -> None:
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        out = run_recomputed(lin, torch.randn(2, 4))
    assert not out.requires_grad


def test_inputs_are_saved_through_the_hooks_around_the_call() -> None:
    # What lets the offload engine move a recomputed layer's inputs to the host: they are
    # saved under the hooks that surround the call, and read back through them.
    seen: list[int] = []
    back: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.numel())
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        back.append(t.numel())
        return t

    x = torch.randn(5, 7, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = run_recomputed(lambda t: t.sin().cos(), x)
    assert seen == [35]
    y.sum().backward()
    assert back == [35]


def test_in_checkpoint_forward_inside_the_forward_only() -> None:
    where: list[bool] = []

    def f(t: torch.Tensor) -> torch.Tensor:
        where.append(in_checkpoint_forward())
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    run_recomputed(f, x).sum().backward()
    assert where == [True, False]  # the forward, then the recomputation in backward


@pytest.mark.parametrize("outer", ["lean", "torch"])
def test_nested_with_pytorchs_checkpoint(outer: str) -> None:
    torch.manual_seed(6)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)

    def inner_torch(t: torch.Tensor) -> torch.Tensor:
        return b(checkpoint(a, t, use_reentrant=False).relu())

    def inner_lean(t: torch.Tensor) -> torch.Tensor:
        return b(run_recomputed(a, t).relu())

    def both(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if outer == "lean":
            return run_recomputed(inner_torch, x)
        return checkpoint(inner_lean, x, use_reentrant=False)

    def plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return b(a(x).relu())

    model = nn.ModuleList([a, b])
    x = torch.randn(4, 8)
    _assert_equal(_grads(model, x, both), _grads(model, x, plain))
