"""V1 misuse: each sequence fails where it happens, naming the cause, and training resumes.

Also V1's warning for an iteration in which nothing was marked, so nothing moved.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_bit_equal, step
from torch import nn

from cpu_offload import HostTransport, mark_activation_offload, v1
from cpu_offload.models import run_layers

N = 4


class _Marked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mark_activation_offload(x)
        return torch.sigmoid(self.linear(x))


def _layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(_Marked() for _ in range(N))


def _make() -> torch.Tensor:
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(3))


def _ctx(k: int = 2, n: int = N):
    return v1.get_cpu_offload_context(True, k, n, transport=HostTransport())


def _check_recovers(layers, ctx, commit, ref) -> None:
    for _ in range(3):
        assert_bit_equal(ref, step(layers, _make, ctx, commit))
    assert all(g.state == "not_offloaded" for g in ctx.offload_handler.groups)


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=...)"])
def test_partial_backward_then_exact_steps(how):
    layers = _layers()
    ref = step(layers, _make)
    ctx, commit = _ctx()
    out = run_layers(layers, _make(), ctx, commit)
    last = list(layers[-1].parameters())
    if how == "autograd.grad":
        grads = torch.autograd.grad(out.sum(), last)
    else:
        for p in last:
            p.grad = None
        out.sum().backward(inputs=last)
        grads = [p.grad for p in last]
    plain = torch.autograd.grad(run_layers(layers, _make()).sum(), last)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))
    _check_recovers(layers, ctx, commit, ref)


def test_commit_twice_fails_at_the_second_commit_then_exact_steps():
    layers = _layers()
    ref = step(layers, _make)
    ctx, commit = _ctx()
    x = _make()
    with ctx:
        x = layers[0](x)
    x = commit(x)
    with pytest.raises(RuntimeError, match="called twice for one layer"):
        commit(x)
    _check_recovers(layers, ctx, commit, ref)


def test_commit_before_any_layer_fails_there_then_exact_steps():
    layers = _layers()
    ref = step(layers, _make)
    ctx, commit = _ctx()
    with pytest.raises(RuntimeError, match="before any layer ran"):
        commit(_make().requires_grad_())
    _check_recovers(layers, ctx, commit, ref)


def test_commit_inside_the_context_fails_there_then_exact_steps():
    layers = _layers()
    ref = step(layers, _make)
    ctx, commit = _ctx()
    with pytest.raises(RuntimeError, match="inside the CPU offload context"), ctx:
        commit(layers[0](_make()))
    assert not ctx.inside_context
    _check_recovers(layers, ctx, commit, ref)


def test_model_layers_too_large_is_named_at_backward_and_the_state_is_clean():
    layers = _layers()
    ref = step(layers, _make)
    ctx, commit = _ctx(k=2, n=N + 2)  # declares 6 layers, runs 4
    out = run_layers(layers, _make(), ctx, commit)
    with pytest.raises(ValueError, match=f"model_layers={N + 2}"):
        out.sum().backward()
    handler = ctx.offload_handler
    assert handler.current_group == 0
    assert all(g.state == "not_offloaded" for g in handler.groups)
    # The same layers under a context of the right size train exactly.
    ctx, commit = _ctx()
    _check_recovers(layers, ctx, commit, ref)


def test_model_layers_too_small_is_named_in_backward_then_exact_steps():
    layers = _layers()
    ref = step(layers, _make)
    ctx, commit = _ctx(k=1, n=N - 2)  # declares 2 layers, runs 4
    out = run_layers(layers, _make(), ctx, commit)
    with pytest.raises(RuntimeError, match="model_layers"):
        out.sum().backward()
    assert ctx.offload_handler.current_group == 0
    ctx, commit = _ctx()
    _check_recovers(layers, ctx, commit, ref)


def test_handler_driven_by_other_hooks_is_not_order_checked():
    # Callers that use a handler with their own hooks, never entering our context,
    # commit as before.
    handler = v1.SynchronizedGroupOffloadHandler(1)
    x = torch.randn(4, 4, requires_grad=True)
    y = v1.GroupCommitFunction.apply(x, handler)
    y = v1.GroupCommitFunction.apply(y, handler)
    y.sum().backward()
    assert handler.current_group == 0


# -- nothing marked, nothing moved ------------------------------------------------------


class _Unmarked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(x))


def test_nothing_marked_warns_once_per_context():
    torch.manual_seed(0)
    layers = nn.ModuleList(_Unmarked() for _ in range(N))
    ref = step(layers, _make)
    ctx, commit = _ctx()
    with pytest.warns(UserWarning, match="offloaded nothing") as record:
        for _ in range(3):
            assert_bit_equal(ref, step(layers, _make, ctx, commit))
    ours = [w for w in record if "offloaded nothing" in str(w.message)]
    assert len(ours) == 1
    assert "mark_activation_offload" in str(ours[0].message)
    assert "NVTE_CPU_OFFLOAD_V1" in str(ours[0].message)
    assert ours[0].filename.endswith("helpers.py") or ours[0].filename == __file__


@pytest.mark.parametrize("k", [0, 2])
def test_no_warning_when_something_moves_or_nothing_is_asked(k):
    layers = _layers() if k else nn.ModuleList(_Unmarked() for _ in range(N))
    ctx, commit = _ctx(k=k)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            step(layers, _make, ctx, commit)
