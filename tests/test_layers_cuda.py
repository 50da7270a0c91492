"""offload_layers on a GPU: a transformers Llama, bit-identical, with less memory.

Run with deterministic kernels:
``CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python3 -m pytest -m cuda tests/test_layers_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cpu_offload import offload_layers

pytestmark = pytest.mark.cuda

LAYERS = 8


def _llama():
    transformers = pytest.importorskip("transformers")
    # Activations dominate: 4 x 2048 tokens of width 1024 against ~100M parameters.
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=LAYERS,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)


def _train(model, batches):
    """Three SGD steps; the loss, every gradient and the peak memory of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    out = []
    for tokens in batches:
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()], peak))
        opt.step()
    return out


@pytest.mark.parametrize("switch", ["0", "1"])
def test_llama_half_offloaded_bit_identical_and_a_fifth_less_memory(
    switch, deterministic, monkeypatch
):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", switch)
    gen = torch.Generator("cuda").manual_seed(1)
    batches = [torch.randint(0, 1024, (4, 2048), device="cuda", generator=gen) for _ in range(3)]
    model = _llama()
    reference = copy.deepcopy(model)
    want = _train(reference, batches)
    del reference
    torch.cuda.empty_cache()
    with offload_layers(model, num_offloaded=LAYERS // 2) as handle:
        got = _train(model, batches)
        engine = getattr(handle.context, "offload_synchronizer", None)  # V2
        engine = engine or handle.context.offload_handler  # V1
        moved = engine.transport.bytes_offloaded
    assert moved > 0
    for i, ((loss, grads, peak), (ref_loss, ref_grads, ref_peak)) in enumerate(
        zip(got, want, strict=True)
    ):
        assert torch.equal(loss, ref_loss), (i, loss, ref_loss)
        for g, r in zip(grads, ref_grads, strict=True):
            assert torch.equal(g, r), f"step {i}: max |diff| {(g.float() - r.float()).abs().max()}"
        assert peak <= 0.8 * ref_peak, (i, peak, ref_peak)
