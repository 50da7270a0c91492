"""A kept layer's saved tensors (``engine/kept_layer.py``, NOTE [A kept layer's casts]):
each lives as long as autograd's saved variable does, as without the package, and its
checks fail where PyTorch's would."""

from __future__ import annotations

import weakref

import pytest
import torch
from test_engine_recast import SoftmaxInFp32
from torch import nn

from cpu_offload import offload_layers
from cpu_offload.engine.kept_layer import KeptLayer


class _ReadsTwice(torch.autograd.Function):
    """Reads ``ctx.saved_tensors`` twice in its backward, as some custom kernels do."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (first,) = ctx.saved_tensors
        (second,) = ctx.saved_tensors
        return grad * first * 0.5 + grad * second * 0.5


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReadsTwice.apply(self.lin(x))


def _grads(layers: nn.ModuleList, x: torch.Tensor, backwards: int) -> list[torch.Tensor]:
    for p in layers.parameters():
        p.grad = None
    y = x
    for layer in layers:
        y = layer(y)
    loss = y.float().square().mean()
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    return [p.grad.clone() for p in layers.parameters()]


@pytest.mark.parametrize("backwards", [1, 2], ids=["one backward", "retain_graph"])
def test_reads_twice_and_a_retained_graph_as_without_the_package(backwards: int) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(_Block() for _ in range(2))
    x = torch.randn(4, 16)
    want = _grads(layers, x, backwards)
    with offload_layers(layers, recast=[0, 1], min_tensor_size_to_offload=1):
        got = _grads(layers, x, backwards)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_retained_graph_rebuilds_its_casts_again() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(SoftmaxInFp32() for _ in range(2)).to(torch.bfloat16)
    x = torch.randn(2, 32, 64).to(torch.bfloat16)
    want = _grads(layers, x, 2)
    with offload_layers(layers, recast=[0, 1], min_tensor_size_to_offload=1) as handle:
        got = _grads(layers, x, 2)
        assert all(k.recast_bytes > 0 for k in handle._runner.recast.values())
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_saved_tensor_goes_when_autograd_lets_it_go_not_at_the_layers_end() -> None:
    # exp's output is saved by exp and by the Linear after it; once both nodes ran, the
    # gradient of exp's input is made, and the output must be gone, as without hooks.
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)
            self.seen: list[weakref.ref[torch.Tensor]] = []
            self.alive_then: list[bool] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.first(x)
            b = a.exp()
            self.seen.append(weakref.ref(b))
            a.register_hook(lambda g: self.alive_then.append(self.seen[-1]() is not None))
            return self.second(b)

    block = Block()
    layers = nn.ModuleList([block, nn.Linear(16, 16)])
    _grads(layers, torch.randn(4, 16), 1)
    assert block.alive_then == [False]  # without the package
    with offload_layers(layers, recast=[0], min_tensor_size_to_offload=1):
        _grads(layers, torch.randn(4, 16), 1)
    assert block.alive_then == [False, False]


@pytest.mark.parametrize(
    ("changed", "match"),
    [
        # The cast, held elsewhere too: PyTorch refuses it without the package.
        ("cast", "modified by an inplace operation.*in layer 0"),
        # Its source: the product's backward reads the cast first; rebuilt from the
        # changed source it would be wrong.
        ("source", "rebuilds a saved cast of it"),
    ],
)
def test_a_change_after_the_forward_fails_the_read_of_a_rebuilt_cast(
    changed: str, match: str
) -> None:
    layer = KeptLayer("layer 0", min_numel=1)
    x = torch.randn(8, 8, requires_grad=True)
    v = torch.randn(8, 8, dtype=torch.bfloat16, requires_grad=True)
    with layer.saving():
        made = {"source": x.softmax(-1)}
        made["cast"] = made["source"].to(torch.bfloat16)
        y = (made["cast"] @ v).sum()
    layer.finish()
    assert layer.recast_bytes == made["cast"].numel() * 2
    with torch.no_grad():
        made[changed].mul_(2)
    with pytest.raises(RuntimeError, match=match):
        y.backward()


def test_a_forward_that_raised_leaves_the_next_one_clean() -> None:
    layer = KeptLayer("layer 0", min_numel=1)
    x = torch.randn(8, 8, requires_grad=True)
    v = torch.randn(8, 8, dtype=torch.bfloat16, requires_grad=True)  # so the cast is saved

    def forward() -> torch.Tensor:
        return (x.softmax(-1).to(torch.bfloat16) @ v).float().sum()

    with pytest.raises(ValueError), layer.saving():
        forward()
        raise ValueError("in the forward")
    layer.abandon()
    with pytest.raises(RuntimeError, match="outside the layer's forward"):
        with torch.autograd.graph.saved_tensors_hooks(*layer._hooks):
            x.exp()
    with layer.saving():
        y = forward()
    layer.finish()
    assert layer.recast_bytes == 8 * 8 * 2
    y.backward()
    assert torch.equal(x.grad, torch.autograd.grad(forward(), x)[0])


def test_a_cast_of_a_rebuilt_cast_stays_as_it_is() -> None:
    layer = KeptLayer("layer 0", min_numel=1)
    x = torch.randn(8, 8, requires_grad=True)
    v = torch.randn(8, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def forward() -> torch.Tensor:
        half = x.softmax(-1).to(torch.bfloat16)  # a cast of the softmax, saved by @ v
        first = (half @ v).float().sum()
        full = half.to(torch.float32)  # a cast of that cast, saved by @ w and by * w
        return first + (full @ w).sum() + (full * w).sum()

    with layer.saving():
        y = forward()
    layer.finish()
    assert layer.recast_bytes == 8 * 8 * 2  # the first cast only
    y.backward()
    grads = [t.grad.clone() for t in (x, v, w)]
    want = torch.autograd.grad(forward(), (x, v, w))
    assert all(torch.equal(a, b) for a, b in zip(grads, want, strict=True))


def test_a_cast_changed_through_its_base_after_a_view_of_it_was_saved_fails() -> None:
    # bmm saves the probabilities as a 3-D view, which dies at the forward's end; the
    # cast itself lives on here and is changed: PyTorch refuses that without hooks.
    layer = KeptLayer("layer 0", min_numel=1)
    x = torch.randn(2, 8, 8, requires_grad=True)
    v = torch.randn(2, 8, 8, dtype=torch.bfloat16, requires_grad=True)
    with layer.saving():
        cast = x.softmax(-1).to(torch.bfloat16)
        y = torch.bmm(cast.view(2, 8, 8), v).sum()
    layer.finish()
    assert layer.recast_bytes == cast.numel() * 2
    with torch.no_grad():
        cast.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*in layer 0"):
        y.backward()


def test_a_nested_tensor_is_kept_as_it_is() -> None:
    # A strided nested tensor is a plain torch.Tensor of strided layout without sizes.
    def forward(parts: list[torch.Tensor]) -> torch.Tensor:
        nested = torch.nested.as_nested_tensor([t * 1 for t in parts])
        cast = nested.softmax(-1).to(torch.float64)  # softmax and mul save nested tensors
        return torch.cat((cast * cast).unbind()).float().sum()

    parts = [torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)]
    want = torch.autograd.grad(forward(parts), parts)
    layer = KeptLayer("layer 0", min_numel=1)
    with layer.saving():
        y = forward(parts)
    layer.finish()
    assert layer.recast_bytes == 0
    y.backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(parts, want, strict=True))
