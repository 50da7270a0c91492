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
from cpu_offload.engine.recast import CastRef

MIN = 1024


@pytest.fixture(params=["v1", "v2"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1" if request.param == "v1" else "0")
    return request.param


def _casts_gone(handle: object, index: int) -> None:
    """Between forward and backward: layer ``index`` let its saved casts go, and holds
    the rest."""
    state = handle._runner.recast[index].state  # type: ignore[attr-defined]
    assert state.recast_bytes == PROBS_BYTES
    casts = [
        e
        for e, ref in zip(state._entries, state._plan.refs, strict=True)
        if isinstance(ref, CastRef)
    ]
    assert len(casts) == 1 and casts[0].tensor is None
    gc.collect()
    assert casts[0].weak() is None  # nothing else held the bf16 probabilities
    assert state.moved_bytes == 0 and state.budget_kept_bytes > 0


def test_recast_layers_are_bit_identical_and_let_their_casts_go(backend: str) -> None:
    layers = _layers()
    want = step(layers, _input)
    # Any backend: nothing is offloaded here, so no offload context is made at all.
    with offload_layers(layers, recast=[0, 1], min_tensor_size_to_offload=MIN) as handle:
        assert handle.recast == (0, 1) and handle.context is None
        for _ in range(2):  # the second iteration lets the first one's tensors go first

            def check() -> None:
                _casts_gone(handle, 0)
                _casts_gone(handle, 1)

            assert_bit_equal(step(layers, _input, between=check), want)
        assert "recast=[0, 1]" in repr(handle)
    assert_bit_equal(step(layers, _input), want)  # removed: the layers run as before


def test_recast_beside_offloaded_and_recomputed_layers(backend: str) -> None:
    layers = _layers(4)
    want = step(layers, _input)
    with offload_layers(
        layers,
        num_offloaded=1,
        recomputed=[3],
        recast=[1, 2],
        min_tensor_size_to_offload=MIN,
        transport=HostTransport(),
    ) as handle:
        for _ in range(2):
            got = step(layers, _input, between=lambda: _casts_gone(handle, 2))
            assert_bit_equal(got, want)
        assert handle.backend == backend


def test_reassign_moves_the_recast_layers() -> None:
    layers = _layers()
    want = step(layers, _input)
    with offload_layers(layers, recast=[0], min_tensor_size_to_offload=MIN) as handle:
        assert_bit_equal(step(layers, _input), want)
        handle.reassign(recast=[2])
        assert handle.recast == (2,)
        assert_bit_equal(step(layers, _input, between=lambda: _casts_gone(handle, 2)), want)
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
        got = step(layers, make, between=lambda: None)
        assert all(k.state.recast_bytes == 0 for k in handle._runner.recast.values())
    assert_bit_equal(got, want)


def test_eager_llama_with_every_layer_recast_is_bit_identical() -> None:
    model = _llama_eager()
    want = _llama_steps(model)
    with offload_layers(model, recast=range(3), min_tensor_size_to_offload=MIN) as handle:
        got = _llama_steps(model)
        assert all(k.state.recast_bytes > 0 for k in handle._runner.recast.values())
    for (loss_a, grads_a), (loss_b, grads_b) in zip(got, want, strict=True):
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_inside_the_models_own_checkpoint_nothing_is_taken() -> None:
    layers = _layers()

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
    with offload_layers(model, recast=[0], min_tensor_size_to_offload=MIN) as handle:
        x = _input()
        with pytest.warns(UserWarning, match="inside the model's own activation checkpoint"):
            loss = model(x).float().square().mean()
        # The checkpoint keeps the layer's input only: the kept layer took nothing.
        assert not handle._runner.recast[0].state.has_tensors
        loss.backward()
    assert torch.equal(loss.detach(), want.loss)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_offloaded": 1, "recast": [0]}, r"layers \[0\] are in both offloaded and recast"),
        ({"recomputed": [2], "recast": [2]}, r"layers \[2\] are in both recomputed and recast"),
        ({"recast": [3]}, "recast"),
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


def test_what_backward_never_read_goes_when_the_backward_ends() -> None:
    layers = nn.ModuleList(_Branch() for _ in range(2))
    with offload_layers(layers, recast=[0], min_tensor_size_to_offload=1) as handle:
        loss = step(layers, lambda: torch.randn(8, 64, requires_grad=True)).loss
        gc.collect()
        # Released at the backward's end, not held until the next forward.
        assert layers[0].seen[-1]() is None and layers[1].seen[-1]() is None
        assert not handle._runner.recast[0].state.has_tensors
        assert torch.isfinite(loss)
