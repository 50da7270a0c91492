"""Recomputation and offloading on layers that keep state or checkpoint themselves.

CPU stand-in. Each step runs under :class:`StepTensors`, which keeps a weak reference to
every tensor the step creates: after backward, none may be alive but the gradients.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import pickle
import warnings
import weakref

import pytest
import torch
from helpers import StepTensors
from torch import nn
from torch.utils.checkpoint import checkpoint

from cpu_offload import HostTransport, offload_layers
from cpu_offload.plan import Choice, Plan, apply_plan, profile_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D = 32
TOKENS = 64
MIN = 64  # elements: every activation here is offloadable


class StatefulBlock(nn.Module):
    """Keeps its MLP's input on itself from the middle of its forward to the end, as
    Megatron-Core's TransformerLayer does with its MLP norm's output."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Linear(D, D)
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.attn(x))
        self.kept = self.norm(h)
        y = h + torch.relu(self.mlp(self.kept))
        self.kept = None  # after the last tensor saved for backward
        return y


class CallCheckpointed(nn.Module):
    """Checkpoints its whole ``nn.Module.__call__`` in its own ``__call__``, as
    transformers' GradientCheckpointingLayer does in transformers 5.0 to 5.2x."""

    gradient_checkpointing = True

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            call = functools.partial(super().__call__, **kwargs)
            return checkpoint(call, *args, use_reentrant=False)
        return super().__call__(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class CheckpointingParent(nn.Module):
    """Checkpoints each layer around its call, in the parent's forward (transformers 4.x)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(D, 4 * D), nn.ReLU()) for _ in range(n))
        self.proj = nn.ModuleList(nn.Linear(4 * D, D) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, proj in zip(self.layers, self.proj, strict=True):
            x = x + proj(checkpoint(layer, x, use_reentrant=False))
        return x


def _train(model: nn.Module, x: torch.Tensor) -> tuple[StepTensors, torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    with StepTensors() as tracked:
        loss = model(x).square().mean()
        loss.backward()
    result = loss.detach().clone(), [p.grad.clone() for p in model.parameters()]
    del loss
    return tracked, *result


def _input() -> torch.Tensor:
    return torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(0), requires_grad=True)


def _stack(block: type[nn.Module], n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[block() for _ in range(n)])


@pytest.mark.parametrize(
    "plan", ["RRRR", "ORKR", "RKRK"], ids=["recompute-all", "mixed", "alternate"]
)
def test_recomputed_stateful_blocks_keep_nothing_after_backward(plan: str) -> None:
    model = _stack(StatefulBlock)
    _, want_loss, want_grads = _train(model, _input())
    choices = tuple(Choice({"K": "keep", "O": "offload", "R": "recompute"}[c]) for c in plan)
    transport = HostTransport()
    plan_ = Plan(choices, 1, 0.0, 0)
    with apply_plan(model, plan_, min_tensor_size_to_offload=MIN, transport=transport):
        tracked, loss, grads = _train(model, _input())
        assert all(block.kept is None for block in model)
        transport.pool.clear()  # the host buffers kept for the next step
        assert tracked.alive(model) == []
    assert torch.equal(loss, want_loss)
    for g, w in zip(grads, want_grads, strict=True):
        assert torch.equal(g, w)


def _live_after_forward(model: nn.Module, plan: str | None) -> int:
    """Bytes the forward of one step leaves alive for backward, under ``plan`` or none."""
    choices = tuple(Choice({"K": "keep", "R": "recompute"}[c]) for c in plan or "")
    with contextlib.ExitStack() as stack:
        if plan is not None:
            stack.enter_context(
                apply_plan(model, Plan(choices, 1, 0.0, 0), transport=HostTransport())
            )
        model.zero_grad(set_to_none=True)
        with StepTensors() as live:
            loss = model(_input()).square().mean()
            kept = live.live_bytes(model)
            loss.backward()
    return kept


@pytest.mark.parametrize("plan", ["RRRR", "RKRK", "KKKR"])
def test_recomputed_stateful_blocks_keep_what_the_profile_models(plan: str) -> None:
    # A recomputed layer keeps its input and drops the rest of what it saves, as the
    # planner's model counts it; a stopped recomputation would keep the layer's state.
    model = _stack(StatefulBlock)
    x = _input()
    profile = profile_model(model, lambda: model(x).square().mean(), steps=1)
    modelled = sum(
        cost.saved_bytes - cost.input_bytes
        for cost, choice in zip(profile.layers, plan, strict=True)
        if choice == "R"
    )
    assert modelled > 0
    assert _live_after_forward(model, None) - _live_after_forward(model, plan) == modelled


def test_early_stop_is_what_kept_the_state() -> None:
    # The defect the test above guards against, shown with PyTorch's default early stop.
    block = StatefulBlock()
    x = _input()
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert block.kept is not None


def test_offloading_beside_a_call_level_checkpoint_moves_only_the_inputs() -> None:
    model = _stack(CallCheckpointed)
    _, want_loss, want_grads = _train(model, _input())
    transport = HostTransport()
    with offload_layers(model, 2, min_tensor_size_to_offload=MIN, transport=transport):
        assert all(type(layer).__name__ == "CallCheckpointed" for layer in model)
        tracked, loss, grads = _train(model, _input())
        transport.pool.clear()
        assert tracked.alive(model) == []
    # The checkpoint keeps each layer's input and drops the rest: offloading layers 0
    # and 1 moves exactly their two inputs.
    assert transport.bytes_offloaded == 2 * TOKENS * D * 4
    assert torch.equal(loss, want_loss)
    for g, w in zip(grads, want_grads, strict=True):
        assert torch.equal(g, w)
    assert all(type(layer) is CallCheckpointed for layer in model)


def test_a_wrapped_call_level_layer_copies_and_pickles_as_a_plain_layer() -> None:
    model = _stack(CallCheckpointed, 2)
    with offload_layers(model, 1, min_tensor_size_to_offload=MIN):
        twin = copy.deepcopy(model[0])
        buffer = io.BytesIO()
        torch.save(model[0], buffer)
        assert type(twin) is CallCheckpointed
        assert type(pickle.loads(pickle.dumps(model[0]))) is CallCheckpointed
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert type(loaded) is CallCheckpointed
        x = _input()
        assert torch.equal(twin(x), model[0].forward(x))


def test_the_class_replaced_after_wrapping_is_refused_by_remove() -> None:
    model = _stack(CallCheckpointed, 2)
    handle = offload_layers(model, 1, min_tensor_size_to_offload=MIN)
    model[1].__class__ = CallCheckpointed
    with pytest.raises(RuntimeError, match="class of CallCheckpointed was replaced"):
        handle.remove()


def test_offloading_inside_a_parent_level_checkpoint_pushes_no_hooks() -> None:
    torch.manual_seed(0)
    model = CheckpointingParent(4)
    alone, want_loss, want_grads = _train(model, _input())
    kept_alone = len(alone.refs)
    transport = HostTransport()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with offload_layers(model.layers, 2, min_tensor_size_to_offload=MIN, transport=transport):
            tracked, loss, grads = _train(model, _input())
            assert tracked.alive(model) == []
    # The checkpoint kept nothing for the offload hooks to take: nothing moved, and
    # the step made as many tensors as the checkpoint alone.
    assert transport.bytes_offloaded == 0
    assert len(tracked.refs) == kept_alone
    assert any("activation checkpoint" in str(w.message) for w in caught)
    assert torch.equal(loss, want_loss)
    for g, w in zip(grads, want_grads, strict=True):
        assert torch.equal(g, w)


def _llama(checkpointing: bool):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def test_offload_layers_beside_transformers_checkpointing_moves_only_the_inputs() -> None:
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for offload in (False, True):
        model = _llama(checkpointing=True)
        transport = HostTransport()
        handle = (
            offload_layers(model, 2, min_tensor_size_to_offload=MIN, transport=transport)
            if offload
            else None
        )
        model.zero_grad(set_to_none=True)
        with StepTensors() as tracked:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        del loss
        transport.pool.clear()
        assert tracked.alive(model) == []
        if handle is not None:
            # Each checkpointed layer keeps its hidden-state input (2 x 32 x 64 float32).
            assert transport.bytes_offloaded == 2 * (2 * 32 * 64 * 4)
            handle.remove()
    (want_loss, want_grads), (loss, grads) = results
    assert torch.equal(loss, want_loss)
    for g, w in zip(grads, want_grads, strict=True):
        assert torch.equal(g, w)


def test_the_kv_cache_is_left_out_of_training_forwards() -> None:
    # A cache would keep every layer's keys and values, and the recomputation in
    # backward would update it a second time (keys twice as long).
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    model = _llama(checkpointing=False)
    want = model(input_ids=ids, labels=ids, use_cache=False).loss
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with offload_layers(model, recomputed=[0, 1, 2, 3]):
        with pytest.warns(UserWarning, match="the transformers cache passed as"):
            out = model(input_ids=ids, labels=ids, use_cache=True)
        out.loss.backward()
        cache = out.past_key_values
        assert cache is None or cache.get_seq_length() == 0
        with torch.no_grad():  # evaluation keeps its cache
            kept = model(input_ids=ids, use_cache=True).past_key_values
        assert kept.get_seq_length() == 32
    assert torch.equal(out.loss, want)
    for g, w in zip((p.grad for p in model.parameters()), want_grads, strict=True):
        assert torch.equal(g, w)


def test_a_class_made_from_the_wrapped_one_stays_and_remove_still_works() -> None:
    # FSDP2's fully_shard gives a module a class made from its own, as this does.
    model = _stack(CallCheckpointed, 2)
    handle = offload_layers(model, 1, min_tensor_size_to_offload=MIN)
    sharded = type("FSDPCallCheckpointed", (type(model[0]),), {})
    model[0].__class__ = sharded
    handle.remove()
    assert type(model[0]) is sharded and type(model[1]) is CallCheckpointed
    x = _input()
    assert torch.equal(model[0](x), CallCheckpointed.forward(model[0], x))


@pytest.mark.parametrize("block", [CallCheckpointed, StatefulBlock])
def test_a_copy_made_while_wrapped_keeps_nothing_of_the_original_alive(block) -> None:  # type: ignore[no-untyped-def]
    import gc

    model = _stack(block, 2)
    handle = offload_layers(model, 1, min_tensor_size_to_offload=MIN)
    twin = copy.deepcopy(model)
    alive = weakref.ref(model[0])
    handle.remove()
    del model, handle
    gc.collect()
    assert alive() is None
    twin(_input()).sum().backward()  # the copy runs as a plain model


def test_a_filled_cache_is_the_models_input_and_is_not_dropped() -> None:
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    model = _llama(checkpointing=False)

    def prefix():  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return model(input_ids=ids[:, :16], use_cache=True).past_key_values

    want = model(input_ids=ids[:, 16:], past_key_values=prefix()).logits
    with offload_layers(model, 2, min_tensor_size_to_offload=MIN):
        cache = prefix()
        got = model(input_ids=ids[:, 16:], past_key_values=cache).logits
        assert cache.get_seq_length() == 32  # the layers extended it, as without offloading
    assert torch.equal(got, want)
    with offload_layers(model, recomputed=[1]):
        with pytest.raises(ValueError, match="already holds positions, and the recomputed"):
            model(input_ids=ids[:, 16:], past_key_values=prefix())
    assert isinstance(cache, transformers.Cache)


class RefusesSubclasses(CallCheckpointed):
    def __init_subclass__(cls, **kwargs):  # type: ignore[no-untyped-def]
        raise TypeError("RefusesSubclasses cannot be subclassed")


def test_a_layer_that_cannot_be_wrapped_leaves_no_other_layer_wrapped() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(CallCheckpointed(), RefusesSubclasses(), CallCheckpointed())
    with pytest.raises(TypeError, match="cannot be subclassed"):
        offload_layers(model, 1, min_tensor_size_to_offload=MIN)
    assert [type(layer) for layer in model] == [
        CallCheckpointed,
        RefusesSubclasses,
        CallCheckpointed,
    ]
    offload_layers(model[::2], 1, min_tensor_size_to_offload=MIN).remove()  # wraps again


class _Watch:
    def forward_started(self) -> None: ...

    def forward_ended(self, output: object) -> None: ...


def test_watch_steps_and_reassign_are_refused_where_they_cannot_work() -> None:
    class Reassigning(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            handle.reassign(recomputed=[2])
            return x * 2

    torch.manual_seed(0)
    model = nn.Sequential(StatefulBlock(), Reassigning(), StatefulBlock())
    handle = offload_layers(model, recomputed=[0])
    with pytest.raises(TypeError, match="lacks forward_ended"):
        handle.watch_steps(type("Half", (), {"forward_started": lambda self: None})())
    with pytest.raises(RuntimeError, match="during a forward or a backward"):
        model(_input())
    assert handle.recomputed == (0,)
    handle.remove()
    for call in (lambda: handle.watch_steps(_Watch()), lambda: handle.reassign()):
        with pytest.raises(RuntimeError, match="after remove\\(\\)"):
            call()
