"""``offload_layers(recast=...)``: kept layers whose saved casts are cast again in backward
(NOTE [A kept layer's casts] in ``cpu_offload/engine/kept_layer.py``), on the CPU."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import assert_bit_equal, step
from test_engine_recast import (
    PROBS_BYTES,
    SoftmaxInFp32,
    _input,
    _layers,
    _llama_eager,
    _llama_steps,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from cpu_offload import HostTransport, offload_layers
from cpu_offload.engine.kept_layer import KeptLayer
from cpu_offload.engine.recast import CastRef

MIN = 1024


@pytest.fixture(params=["v1", "v2"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1" if request.param == "v1" else "0")
    return request.param


def _watch_casts(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Record, as each kept layer's forward ends, weak references to the tensors it saved
    that are casts and to the others."""
    seen: dict[str, list] = {"casts": [], "others": []}
    real_finish = KeptLayer.finish

    def finish(self: KeptLayer) -> None:
        forward = self._current
        tensors = list(forward.tensors) if forward is not None else []
        cells = list(forward.cells) if forward is not None else []
        refs = [weakref.ref(t) for t in tensors]
        del tensors
        real_finish(self)
        for ref, cell in zip(refs, cells, strict=True):
            seen["casts" if isinstance(cell.cast, CastRef) else "others"].append(ref)

    monkeypatch.setattr(KeptLayer, "finish", finish)
    return seen


def _casts_gone(handle: object, indices: list[int], seen: dict[str, list]) -> None:
    """Between forward and backward: layers ``indices`` let their saved casts go (nothing
    else held the bf16 probabilities), and hold the rest."""
    for index in indices:
        assert handle._runner.recast[index].recast_bytes == PROBS_BYTES  # type: ignore[attr-defined]
    gc.collect()
    assert len(seen["casts"]) == len(indices)
    assert all(ref() is None for ref in seen["casts"])
    seen["casts"].clear()


def test_recast_layers_are_bit_identical_and_let_their_casts_go(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = _layers()
    want = step(layers, _input)
    seen = _watch_casts(monkeypatch)
    # Any backend: nothing is offloaded here, so no offload context is made at all.
    with offload_layers(layers, recast=[0, 1], min_tensor_size_to_offload=MIN) as handle:
        assert handle.recast == (0, 1) and handle.context is None
        for _ in range(2):
            got = step(layers, _input, between=lambda: _casts_gone(handle, [0, 1], seen))
            assert_bit_equal(got, want)
        assert "recast=[0, 1]" in repr(handle)
        # Between forwards the layers hold nothing: what they saved went with its graph.
        assert all(k._current is None for k in handle._runner.recast.values())
        assert all(ref() is None for ref in seen["others"])
    assert_bit_equal(step(layers, _input), want)  # removed: the layers run as before


def test_recast_beside_offloaded_and_recomputed_layers(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = _layers(4)
    want = step(layers, _input)
    seen = _watch_casts(monkeypatch)
    with offload_layers(
        layers,
        num_offloaded=1,
        recomputed=[3],
        recast=[1, 2],
        min_tensor_size_to_offload=MIN,
        transport=HostTransport(),
    ) as handle:
        for _ in range(2):
            got = step(layers, _input, between=lambda: _casts_gone(handle, [1, 2], seen))
            assert_bit_equal(got, want)
        assert handle.backend == backend


def test_reassign_moves_the_recast_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = _layers()
    want = step(layers, _input)
    seen = _watch_casts(monkeypatch)
    with offload_layers(layers, recast=[0], min_tensor_size_to_offload=MIN) as handle:
        assert_bit_equal(step(layers, _input, between=lambda: _casts_gone(handle, [0], seen)), want)
        handle.reassign(recast=[2])
        assert handle.recast == (2,)
        assert_bit_equal(step(layers, _input, between=lambda: _casts_gone(handle, [2], seen)), want)
        handle.reassign(recomputed=[0])
        assert handle.recast == ()
        assert_bit_equal(step(layers, _input), want)


def test_a_recast_layer_without_casts_keeps_everything() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3))
    make = lambda: torch.randn(8, 64, requires_grad=True)  # noqa: E731
    torch.manual_seed(3)
    want = step(layers, make)
    with offload_layers(layers, recast=[0, 1, 2], min_tensor_size_to_offload=1) as handle:
        torch.manual_seed(3)
        got = step(
            layers,
            make,
            between=lambda: (
                [k.recast_bytes for k in handle._runner.recast.values()] == [0, 0, 0]
                or pytest.fail("a cast was found")
            ),
        )
    assert_bit_equal(got, want)


def test_eager_llama_with_every_layer_recast_is_bit_identical() -> None:
    model = _llama_eager()
    want = _llama_steps(model)
    with offload_layers(model, recast=range(3), min_tensor_size_to_offload=MIN):
        found: list[int] = []
        real = KeptLayer.finish

        def finish(self: KeptLayer) -> None:
            real(self)
            found.append(self.recast_bytes)

        KeptLayer.finish = finish  # type: ignore[method-assign]
        try:
            got = _llama_steps(model)
        finally:
            KeptLayer.finish = real  # type: ignore[method-assign]
        assert len(found) == 6 and all(b > 0 for b in found)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(got, want, strict=True):
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_inside_the_models_own_checkpoint_nothing_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = _layers()
    saving: list[KeptLayer] = []
    real_saving = KeptLayer.saving
    monkeypatch.setattr(KeptLayer, "saving", lambda self: saving.append(self) or real_saving(self))

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x

    model = Checkpointed()
    want = step(layers, _input)
    with offload_layers(model, recast=[0], min_tensor_size_to_offload=MIN):
        for p in layers.parameters():
            p.grad = None
        x = _input()
        with pytest.warns(UserWarning, match="inside the model's own activation checkpoint"):
            loss = model(x).float().square().mean()
        # The checkpoint keeps the layer's input only: the kept layer took nothing.
        assert saving == []
        loss.backward()
        grads = [p.grad.clone() for p in layers.parameters()]
    assert torch.equal(loss.detach(), want.loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, want.grads, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_offloaded": 1, "recast": [0]}, r"layers \[0\] are in both offloaded and recast"),
        ({"recomputed": [2], "recast": [2]}, r"layers \[2\] are in both recomputed and recast"),
        ({"recast": [3]}, r"recast.*\[0, 2\]"),
        ({"recast": [1], "parts": {1: {"qkv": "recompute"}}}, "recomputed or recast whole"),
        ({"parts": {1: {"qkv": "recast"}}}, "must be one of 'keep', 'offload', 'recompute'"),
    ],
)
def test_bad_recast_arguments_are_refused(kwargs: dict, match: str) -> None:
    layers = _layers()
    with pytest.raises(ValueError, match=match):
        offload_layers(layers, min_tensor_size_to_offload=MIN, **kwargs)
    assert all(type(layer) is SoftmaxInFp32 for layer in layers)  # nothing left wrapped


class _Branch(nn.Module):
    """Saves a tensor on a branch the loss does not use: backward never reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.seen: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unused = torch.exp(self.lin(x))  # exp saves its result; its node never runs
        self.seen.append(weakref.ref(unused))
        return x + self.lin(x).tanh()


def test_what_backward_never_read_goes_with_the_graph() -> None:
    layers = nn.ModuleList(_Branch() for _ in range(2))
    with offload_layers(layers, recast=[0], min_tensor_size_to_offload=1) as handle:
        loss = step(layers, lambda: torch.randn(8, 64, requires_grad=True)).loss
        gc.collect()
        # Freed with the graph, not held until the next forward.
        assert layers[0].seen[-1]() is None and layers[1].seen[-1]() is None
        assert handle._runner.recast[0]._current is None
        assert torch.isfinite(loss)


def test_a_forward_without_backward_frees_everything() -> None:
    # A validation step with grad enabled: the graph, and with it every tensor the
    # layers saved (small ones too, detached), goes when the loss does.
    layers = nn.ModuleList(_Branch() for _ in range(3))
    with offload_layers(layers, recast=[0, 2], min_tensor_size_to_offload=1 << 20):
        x = torch.randn(8, 64, requires_grad=True)
        out = x
        for layer in layers:
            out = layer(out)
        out_ref = weakref.ref(out)
        del out
        gc.collect()
        assert out_ref() is None
        assert all(layer.seen[-1]() is None for layer in layers)


def test_two_forwards_before_one_backward_stay_apart() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])
    x1, x2 = torch.randn(32, 64), torch.randn(32, 64)

    def two() -> list[torch.Tensor]:
        for p in layers.parameters():
            p.grad = None
        out = [x1, x2]
        for layer in layers:
            out = [layer(t) for t in out]
        (out[0].square().mean() + 3 * out[1].square().mean()).backward()
        return [p.grad.clone() for p in layers.parameters()]

    want = two()
    with offload_layers(layers, recast=[0, 1], min_tensor_size_to_offload=1):
        got = two()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_an_inplace_change_to_a_saved_views_base_still_fails() -> None:
    class Sliced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)
            self.w = nn.Parameter(torch.randn(48, 64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            self.h = h
            return torch.mm(h[:, :48], self.w)  # mm saves the slice, not dense

    layers = nn.ModuleList([Sliced()])
    for recast in ([], [0]):
        handle = (
            offload_layers(layers, recast=recast, min_tensor_size_to_offload=1) if recast else None
        )
        y = layers[0](torch.randn(32, 64, requires_grad=True))
        with torch.no_grad():
            layers[0].h.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        if handle is not None:
            handle.remove()
