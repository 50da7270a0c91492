"""use_with_megatron_core: the recipe in one call, on the stand-in megatron.core tree."""

from __future__ import annotations

import copy

import pytest
import torch
from test_compat_callers import _config, _train, fake_megatron  # noqa: F401 - the fixture

import cpu_offload
from cpu_offload import HostTransport
from cpu_offload.megatron import use_with_megatron_core


@pytest.mark.parametrize("call_style", ["positional6", "positional7", "keyword"])
@pytest.mark.parametrize("switch", ["0", "1"])
def test_one_call_routes_megatron_core_to_cpu_offload(
    fake_megatron,  # noqa: F811
    monkeypatch,
    switch,
    call_style,
):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", switch)
    tb = fake_megatron["megatron.core.transformer.transformer_block"]
    layers_mod = fake_megatron["megatron.core.tensor_parallel.layers"]
    transport = HostTransport()
    with use_with_megatron_core(transport=transport) as handle:
        assert handle.active and layers_mod.HAVE_TE is True
        torch.manual_seed(0)
        config = _config(True)
        linears = [layers_mod.ColumnParallelLinear(config, 512) for _ in range(config.num_layers)]
        block = tb.TransformerBlock(config, linears, call_style)
    # Removed: the attributes are Megatron-Core's again; the built block keeps its context.
    assert layers_mod.HAVE_TE is False and tb.get_cpu_offload_context is None
    plain_config = _config(False)
    plain_linears = copy.deepcopy(linears)
    for layer in plain_linears:
        layer.config = plain_config
    plain = tb.TransformerBlock(plain_config, plain_linears, call_style)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(64, 16, 512, generator=gen) for _ in range(2)]
    # The linear layers read HAVE_TE when they run: set it as during the build.
    monkeypatch.setattr(layers_mod, "HAVE_TE", True)
    got = _train(block, inputs)
    want = _train(plain, inputs)
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, ref_loss)
        for g, r in zip(grads, ref_grads, strict=True):
            assert torch.equal(g, r)
    assert transport.bytes_offloaded > 0, "nothing was offloaded"


def test_seventh_positional_is_retain_pinned(fake_megatron, monkeypatch):  # noqa: F811
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "0")
    tb = fake_megatron["megatron.core.transformer.transformer_block"]
    with use_with_megatron_core(transport=HostTransport()):
        block = tb.TransformerBlock(_config(True, retain=True), [], "positional7")
    assert block.offload_context.offload_synchronizer.retain_pinned_cpu_buffers is True


def test_memory_budget_reaches_every_context(fake_megatron, monkeypatch):  # noqa: F811
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "0")
    tb = fake_megatron["megatron.core.transformer.transformer_block"]
    with use_with_megatron_core(transport=HostTransport(), memory_budget=3 << 30):
        block = tb.TransformerBlock(_config(True), [], "keyword")
    assert block.offload_context.offload_synchronizer.memory_budget == 3 << 30


@pytest.mark.parametrize(
    ("budget", "error"), [(-1, ValueError), (1.5e9, TypeError), (True, TypeError)]
)
def test_memory_budget_is_checked(fake_megatron, budget, error):  # noqa: F811
    with pytest.raises(error, match="memory_budget"):
        use_with_megatron_core(memory_budget=budget)


def test_remove_restores_and_is_idempotent(fake_megatron):  # noqa: F811
    tb = fake_megatron["megatron.core.transformer.transformer_block"]
    before = tb.get_cpu_offload_context
    handle = use_with_megatron_core()
    assert tb.get_cpu_offload_context is handle.function
    handle.remove()
    handle.remove()
    assert tb.get_cpu_offload_context is before and not handle.active


def test_without_megatron_core_the_error_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "megatron", None)
    with pytest.raises(ImportError, match="needs megatron-core"):
        use_with_megatron_core()


def test_transport_is_checked(fake_megatron):  # noqa: F811
    with pytest.raises(TypeError, match="transport must be a cpu_offload Transport"):
        use_with_megatron_core(transport="cuda")
    assert cpu_offload.megatron.use_with_megatron_core is use_with_megatron_core
