"""Reloads in the order backward reads, on a real GPU: exact, and no higher a peak than
copying back in the order of the saves (NOTE in ``engine/reload_order.py``)."""

from __future__ import annotations

import pytest
from helpers import assert_bit_equal, step

from cpu_offload import v2
from cpu_offload.models import ModelSpec, build_layers
from cpu_offload.v2 import OffloadableLayerState

pytestmark = pytest.mark.cuda

DEV = "cuda"


def _save_order(self: OffloadableLayerState, moved: list) -> list[int]:
    return list(range(len(moved)))


@pytest.mark.parametrize("kind", ["gpt", "encoder", "mha"])
def test_reloads_in_read_order_are_exact_and_peak_no_higher(kind, deterministic, monkeypatch):
    # gpt: SDPA with q, k and v views of one projection; encoder: nn.TransformerEncoderLayer;
    # mha: nn.MultiheadAttention. Three steps each: the first reload copies the latest
    # saved first, the later ones follow the order the previous backward read.
    spec = ModelSpec(kind=kind, hidden=256, heads=4, seq=1024, batch=8, layers=6)
    layers = build_layers(spec, DEV)

    def make():
        return spec.make_input(DEV)

    ref = step(layers, make)

    def peaks() -> list[int]:
        ctx, sync = v2.get_cpu_offload_context(
            enabled=True, num_layers=3, model_layers=6, min_tensor_size_to_offload=1024
        )
        out = []
        for _ in range(3):
            got = step(layers, make, ctx, sync)
            assert_bit_equal(ref, got)
            out.append(got.peak_bytes)
        states = ctx.offload_synchronizer.layers
        learnt = [s._read_order for s in states[:3]]
        assert all(order is not None for order in learnt)
        return out

    in_read_order = peaks()
    with monkeypatch.context() as m:
        m.setattr(OffloadableLayerState, "reload_order", _save_order)
        in_save_order = peaks()
    assert max(in_read_order) <= max(in_save_order), (in_read_order, in_save_order)
