"""Parts of layers on a GPU: a transformers Llama and plain PyTorch blocks with
nn.MultiheadAttention, parts offloaded and recomputed, bit-identical, with less memory;
and a part by part plan within its budget.

Run with deterministic kernels:
``CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python3 -m pytest -m cuda tests/test_layer_parts_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_layer_parts import Block
from test_layers_cuda import LAYERS, _llama
from test_layers_cuda import _train as _train_llama
from torch import nn

from cpu_offload import offload_layers
from cpu_offload.plan import Choice, apply_plan, estimate, profile_model, search

pytestmark = pytest.mark.cuda


def _assert_same(got, want) -> None:  # type: ignore[no-untyped-def]
    for i, ((loss, grads, _), (ref_loss, ref_grads, _)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(loss, ref_loss), (i, loss, ref_loss)
        for g, r in zip(grads, ref_grads, strict=True):
            assert torch.equal(g, r), f"step {i}: max |diff| {(g.float() - r.float()).abs().max()}"


def _tokens() -> list[torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(1)
    return [torch.randint(0, 1024, (4, 2048), device="cuda", generator=gen) for _ in range(2)]


def test_llama_parts_offloaded_and_recomputed_bit_identical_with_less_memory(
    deterministic,  # type: ignore[no-untyped-def]
) -> None:
    batches = _tokens()
    model = _llama()
    reference = copy.deepcopy(model)
    want = _train_llama(reference, batches)
    del reference
    torch.cuda.empty_cache()
    parts = {j: {"mlp": "offload", "self_attn": "recompute"} for j in range(LAYERS // 2)}
    with offload_layers(model, parts=parts) as handle:
        got = _train_llama(model, batches)
        moved = handle.context.offload_synchronizer.transport.bytes_offloaded
    assert moved > 0
    _assert_same(got, want)
    assert all(peak < ref_peak for (_, _, peak), (_, _, ref_peak) in zip(got, want, strict=True))


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(1024, heads=16) for _ in range(6)]).to("cuda", torch.bfloat16)


def _train_blocks(model: nn.Module, batches: list[torch.Tensor]) -> list:  # type: ignore[type-arg]
    out = []
    for x in batches:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = model(x).float().square().mean()
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()], peak))
    return out


def test_multihead_attention_blocks_parts_bit_identical_with_less_memory(
    deterministic,  # type: ignore[no-untyped-def]
) -> None:
    gen = torch.Generator("cuda").manual_seed(2)
    batches = [
        torch.randn(4, 1024, 1024, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(2)
    ]
    model = _blocks()
    want = _train_blocks(model, batches)
    parts = {j: {"attn": "recompute", "mlp": "offload"} for j in range(4)}
    with offload_layers(model, parts=parts):
        got = _train_blocks(model, batches)
    _assert_same(got, want)
    assert all(peak < ref_peak for (_, _, peak), (_, _, ref_peak) in zip(got, want, strict=True))


def test_a_part_by_part_plan_keeps_its_budget(deterministic) -> None:  # type: ignore[no-untyped-def]
    batch = _tokens()[:1]
    model = _llama()
    want = _train_llama(copy.deepcopy(model), batch)
    torch.cuda.empty_cache()

    def step() -> torch.Tensor:
        return model(input_ids=batch[0], labels=batch[0], use_cache=False).loss

    profile = profile_model(model, step, steps=2, parts=True)
    assert all(cost.parts for cost in profile.layers)
    keep = estimate(profile, [Choice.KEEP] * LAYERS).peak_bytes
    lowest = estimate(profile, [Choice.RECOMPUTE] * LAYERS).peak_bytes
    budget = (keep + lowest) // 2
    plan = search(profile, budget)
    with apply_plan(model, plan, check_budget=False):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        got = _train_llama(model, batch)
        peak = torch.cuda.max_memory_allocated()
    # The whole step's peak, parameters, gradients and all, as the budget counts it.
    assert peak <= 1.01 * budget, (plan.describe(), plan.parts, peak, budget)
    _assert_same(got, want)
