"""Reloads in the order backward reads, on a real GPU: the copies back follow the reads,
exact, and no higher a peak than copying back in the order of the saves (NOTE in
``engine/reload_order.py``)."""

from __future__ import annotations

import pytest
from helpers import ReloadOrderRecorder, assert_bit_equal, step

from cpu_offload import v2
from cpu_offload.engine.reload_order import ReadOrder
from cpu_offload.engine.tensor_group import GroupPlan, Unit
from cpu_offload.models import ModelSpec, build_layers

pytestmark = pytest.mark.cuda

DEV = "cuda"


def _save_order(self: ReadOrder, plan: GroupPlan) -> list[Unit]:
    return [u for u in plan.units if not u.kept]


@pytest.mark.parametrize("kind", ["gpt", "encoder", "mha"])
def test_reloads_follow_the_reads_exactly_at_no_higher_peak(kind, deterministic, monkeypatch):
    # gpt: SDPA with q, k and v views of one projection; encoder: nn.TransformerEncoderLayer;
    # mha: nn.MultiheadAttention. Three steps each: the first reload copies the latest
    # saved first, the later ones follow the order the previous backward read.
    spec = ModelSpec(kind=kind, hidden=256, heads=4, seq=1024, batch=8, layers=6)
    layers = build_layers(spec, DEV)

    def make():
        return spec.make_input(DEV)

    ref = step(layers, make)

    def peaks(recorder: ReloadOrderRecorder | None) -> list[int]:
        ctx, sync = v2.get_cpu_offload_context(
            enabled=True, num_layers=3, model_layers=6, min_tensor_size_to_offload=1024
        )
        out = []
        for iteration in range(3):
            if recorder is not None:
                recorder.clear()
            got = step(layers, make, ctx, sync)
            assert_bit_equal(ref, got)
            if recorder is not None and iteration > 0:
                recorder.assert_queued_in_read_order()
            out.append(got.requested_peak_bytes)
        return out

    with monkeypatch.context() as m:
        in_read_order = peaks(ReloadOrderRecorder(m))
    with monkeypatch.context() as m:
        m.setattr(ReadOrder, "moved_in_order", _save_order)
        in_save_order = peaks(None)
    assert max(in_read_order) <= max(in_save_order), (in_read_order, in_save_order)
