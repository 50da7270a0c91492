"""offload_layers(parts=...): parts of a layer kept, offloaded or recomputed (CPU stand-in)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import StepTensors
from test_layers import _assert_equal, _llama, _lm_loss, _tokens
from test_layers import _train as train
from torch import nn

from cpu_offload import HostTransport, offload_layers
from cpu_offload.compare._profile import SavedLog, saved_bytes
from cpu_offload.engine.selection import ActivationPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D = 32
MIN = 64  # elements: every activation here is offloadable


class Block(nn.Module):
    """Plain PyTorch: self-attention through ``nn.MultiheadAttention`` (query, key and
    value one tensor), an MLP and two norms."""

    def __init__(self, d: int = D, heads: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def _blocks(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(n)])


def _batches(count: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2, 16, D, generator=gen) for _ in range(count)]


def _square(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _train(model: nn.Module, batches, loss_fn=_square):  # type: ignore[no-untyped-def]
    """Losses and gradients of one step per batch (``_square`` loss by default)."""
    return train(model, batches, loss_fn)


def _run(model, batches, loss_fn=None, **offload):  # type: ignore[no-untyped-def]
    """Trained with ``offload``; the transport and the handle (removed again)."""
    transport = HostTransport()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        handle = offload_layers(
            model, transport=transport, min_tensor_size_to_offload=MIN, **offload
        )
    with handle:
        kwargs = {} if loss_fn is None else {"loss_fn": loss_fn}
        got = _train(model, batches, **kwargs)
    return got, transport, handle


PLANS = {
    "each-choice": {0: {"mlp": "offload", "attn": "recompute"}, 1: {"norm2": "offload"}},
    "inner-parts": {1: {"mlp.0": "recompute", "mlp.2": "offload", "attn": "offload"}},
    "with-whole-layers": {2: {"attn": "recompute", "mlp": "keep"}},
}


@pytest.mark.parametrize("parts", PLANS.values(), ids=PLANS.keys())
def test_parts_are_bit_identical_and_remove_restores(parts) -> None:  # type: ignore[no-untyped-def]
    model = _blocks()
    batches = _batches()
    want = _train(model, batches)
    whole = {"offloaded": [0]} if 0 not in parts else {}
    got, transport, handle = _run(model, batches, parts=parts, recomputed=[3], **whole)
    _assert_equal(got, want)
    offloads = any("offload" in p.values() for p in parts.values()) or whole
    assert (transport.bytes_offloaded > 0) == bool(offloads)
    assert handle.parts == parts
    # remove() put every part's and every layer's forward back.
    assert not any("forward" in m.__dict__ for m in model.modules())
    _assert_equal(_train(model, batches), want)


def _saved_inside(module: nn.Module, model: nn.Module, x: torch.Tensor) -> SavedLog:
    """What autograd saves inside ``module``'s forward in one forward of ``model``."""
    saved = SavedLog()
    hooks = torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t)
    pre = module.register_forward_pre_hook(lambda *_: hooks.__enter__())
    post = module.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    try:
        model(x).sum().backward()
    finally:
        pre.remove()
        post.remove()
    return saved


def test_only_what_the_offloaded_part_saves_moves() -> None:
    model = _blocks()
    batches = _batches(1)
    policy = ActivationPolicy(MIN, lambda t: t.device.type == "cpu")
    _, mlp_bytes, _ = saved_bytes(_saved_inside(model[0].mlp, model, batches[0]), policy)
    _, part, _ = _run(model, batches, parts={0: {"mlp": "offload"}})
    _, whole, _ = _run(model, batches, offloaded=[0])
    assert part.bytes_offloaded == mlp_bytes > 0
    assert whole.bytes_offloaded > part.bytes_offloaded


def _live_after_forward(model: nn.Module, x: torch.Tensor, **offload) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Bytes the forward leaves alive for backward, and after backward."""
    with offload_layers(
        model, transport=HostTransport(), min_tensor_size_to_offload=MIN, **offload
    ):
        model.zero_grad(set_to_none=True)
        with StepTensors() as live:
            loss = model(x).square().mean()
            after_forward = live.live_bytes(model)
            loss.backward()
            del loss
            after_backward = live.live_bytes(model)
    return after_forward, after_backward


def test_a_recomputed_part_keeps_only_its_inputs() -> None:
    model = _blocks()
    x = _batches(1)[0]
    hidden = x.numel() * 4 * 4  # the MLP's hidden activation, float32
    kept, _ = _live_after_forward(model, x, recomputed=[3])
    recomputed, after = _live_after_forward(
        model, x, parts={0: {"mlp": "recompute"}}, recomputed=[3]
    )
    # The MLP saved its hidden activation twice over (GELU's input and output): gone.
    assert kept - recomputed >= 2 * hidden
    assert after == 0


def test_parts_of_a_transformers_llama_are_bit_identical() -> None:
    model = _llama()
    tokens = _tokens()
    want = _train(model, tokens, _lm_loss)
    parts = {
        0: {"self_attn": "recompute", "mlp": "offload"},
        1: {"mlp.act_fn": "recompute", "self_attn.o_proj": "offload", "input_layernorm": "keep"},
        2: {"mlp.down_proj": "recompute"},
    }
    got, transport, _ = _run(model, tokens, _lm_loss, parts=parts)
    _assert_equal(got, want)
    assert transport.bytes_offloaded > 0


def test_parts_under_no_grad_run_as_they_are() -> None:
    model = _blocks()
    x = _batches(1)[0]
    with torch.no_grad():
        want = model(x)
    transport = HostTransport()
    parts = {0: {"mlp": "offload", "attn": "recompute"}}
    with offload_layers(model, parts=parts, transport=transport, min_tensor_size_to_offload=MIN):
        with torch.no_grad():
            assert torch.equal(model(x), want)
    assert transport.bytes_offloaded == 0


def test_reassign_changes_the_parts() -> None:
    model = _blocks()
    batches = _batches()
    want = _train(model, batches)
    transport = HostTransport()
    handle = offload_layers(
        model, parts={0: {"mlp": "offload"}}, transport=transport, min_tensor_size_to_offload=MIN
    )
    with handle:
        _assert_equal(_train(model, batches[:1]), want[:1])
        handle.reassign(parts={1: {"attn": "recompute"}})
        assert "forward" not in model[0].mlp.__dict__ and "forward" in model[1].attn.__dict__
        assert handle.parts == {1: {"attn": "recompute"}} and handle.offloaded == ()
        moved = transport.bytes_offloaded
        _assert_equal(_train(model, batches[1:]), want[1:])
        assert transport.bytes_offloaded == moved  # the old context moves nothing now
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_reassign_keeps_the_parts_it_wraps_and_changes_their_choices() -> None:
    # As the budget check tightens a plan: the same part, another choice, one more part.
    model = _blocks()
    batches = _batches()
    want = _train(model, batches)
    transport = HostTransport()
    handle = offload_layers(
        model, parts={0: {"mlp": "offload"}}, transport=transport, min_tensor_size_to_offload=MIN
    )
    with handle:
        _assert_equal(_train(model, batches[:1]), want[:1])
        handle.reassign(parts={0: {"mlp": "recompute", "attn": "offload"}, 1: {"mlp": "offload"}})
        assert handle.parts == {
            0: {"mlp": "recompute", "attn": "offload"},
            1: {"mlp": "offload"},
        }
        moved = transport.bytes_offloaded
        calls = []
        hook = model[0].mlp[0].register_forward_hook(lambda *_: calls.append(1))
        _assert_equal(_train(model, batches[1:]), want[1:])
        hook.remove()
        assert len(calls) == 2 * len(batches[1:])  # layer 0's MLP is recomputed now
        assert transport.bytes_offloaded > moved
        # A part another handle wraps is still refused.
        other = [nn.Sequential(model[1].mlp)]
        with pytest.raises(ValueError, match=r"parts\[0\]\['0'\] .* wrapped by another"):
            offload_layers(other, parts={0: {"0": "offload"}}, transport=transport)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    ("parts", "error", "match"),
    [
        ([0], TypeError, "parts must map layer indices"),
        ({"0": {}}, TypeError, r"parts must hold ints \(layer indices\), got '0'"),
        ({7: {"mlp": "keep"}}, ValueError, r"layer index 7 is out of range \[0, 3\]"),
        ({0: ["mlp"]}, TypeError, r"parts\[0\] must map submodule names"),
        ({0: {"ffn": "offload"}}, ValueError, r"'ffn' is not a submodule of layer 0.*norm1, attn"),
        ({0: {"mlp": "drop"}}, ValueError, r"parts\[0\]\['mlp'\] must be one of 'keep'"),
        ({0: {"mlp": "offload", "mlp.0": "keep"}}, ValueError, "'mlp.0' lies inside 'mlp'"),
        ({1: {"mlp": "keep"}}, ValueError, "layer 1 is also offloaded, recomputed or recast whole"),
    ],
)
def test_bad_parts_are_named(parts, error, match) -> None:  # type: ignore[no-untyped-def]
    model = _blocks()
    with pytest.raises(error, match=match):
        offload_layers(model, parts=parts, recomputed=[1], transport=HostTransport())
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_module_is_a_part_once_and_of_one_handle() -> None:
    model = _blocks()
    model[2].mlp = model[0].mlp  # tied: one module in two layers
    with pytest.raises(ValueError, match=r"parts\[2\]\['mlp'\] is the module of parts\[0\]"):
        offload_layers(model, parts={0: {"mlp": "recompute"}, 2: {"mlp": "recompute"}})
    model = _blocks()
    inner = offload_layers([block.mlp for block in model], recomputed=[1])
    with pytest.raises(ValueError, match="wrapped by another offload_layers already"):
        offload_layers(model, parts={1: {"mlp": "offload"}}, transport=HostTransport())
    inner.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_part_inside_the_models_own_checkpoint_says_it_does_nothing() -> None:
    model = _llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    tokens = _tokens(1)
    want = _train(model, tokens, _lm_loss)
    transport = HostTransport()
    with offload_layers(
        model, parts={0: {"mlp": "offload"}}, transport=transport, min_tensor_size_to_offload=MIN
    ):
        with pytest.warns(UserWarning, match="runs inside the model's own activation checkpoint"):
            got = _train(model, tokens, _lm_loss)
    _assert_equal(got, want)


def test_v1_offloads_no_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    model = _blocks()
    with pytest.raises(ValueError, match="V1 backend .* cannot do"):
        offload_layers(model, parts={0: {"mlp": "offload"}}, transport=HostTransport())
    # Recomputing parts needs no offloading, under either backend.
    want = _train(model, _batches(1))
    with offload_layers(model, parts={0: {"mlp": "recompute"}}):
        _assert_equal(_train(model, _batches(1)), want)
