"""The planner on a GPU: profile, plan, apply; bit-identical, with less memory.

Run with deterministic kernels:
``CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python3 -m pytest -m cuda tests/test_plan_cuda.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpu_offload import CudaTransport, offload_layers
from cpu_offload.models import ModelSpec, build_layers, run_layers
from cpu_offload.plan import Choice, apply_plan, estimate, profile_model, search
from cpu_offload.plan.profile import measure_choices

pytestmark = pytest.mark.cuda

SPEC = ModelSpec(kind="gpt", hidden=512, heads=8, seq=512, batch=4, layers=6, dtype=torch.bfloat16)


def _model():  # type: ignore[no-untyped-def]
    layers = build_layers(SPEC, "cuda")
    x = SPEC.make_input("cuda")
    return layers, x


def _train(layers, x):  # type: ignore[no-untyped-def]
    layers.zero_grad(set_to_none=True)
    loss = run_layers(layers, x).float().square().mean()
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), [p.grad.clone() for p in layers.parameters()]


def _budget(profile) -> int:  # type: ignore[no-untyped-def]
    """Halfway between keeping everything and the lowest peak any plan reaches."""
    keep = estimate(profile, [Choice.KEEP] * SPEC.layers).peak_bytes
    lowest = estimate(profile, [Choice.RECOMPUTE] * (SPEC.layers - 1) + [Choice.KEEP]).peak_bytes
    assert lowest < keep
    return (keep + lowest) // 2


def test_profile_plan_apply_bit_identical(deterministic) -> None:  # type: ignore[no-untyped-def]
    layers, x = _model()
    profile = profile_model(layers, lambda: run_layers(layers, x).float().square().mean(), steps=2)
    assert profile.device == torch.cuda.get_device_name()
    assert profile.static_bytes > 0 and profile.link.d2h_gbps > 0
    for cost in profile.layers:
        assert 0 < cost.offload_bytes <= cost.saved_bytes
        assert cost.forward_ms > 0 and cost.backward_ms > 0

    # The profile counts what the engine moves.
    transport = CudaTransport()
    with offload_layers(layers, 1, transport=transport):
        run_layers(layers, x).float().square().mean().backward()
    torch.cuda.synchronize()
    assert transport.bytes_offloaded == profile.layers[0].offload_bytes

    plan = search(profile, _budget(profile))
    assert plan.choices != (Choice.KEEP,) * SPEC.layers

    want = _train(*_model())
    fresh, fx = _model()
    with apply_plan(fresh, plan):
        got = _train(fresh, fx)
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.equal(g, w)


def test_profile_measures_host_and_device_apart_on_cuda() -> None:
    # How close the model comes to measured steps is the benchmark's business
    # (benchmarks/plan.py); here: on CUDA every layer gets the host's time for each
    # choice, the device's own times, and the head's, all finite and not negative.
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64))
        for _ in range(6)
    ).cuda()
    x = torch.randn(8, 64, device="cuda")

    def step() -> torch.Tensor:
        h = x
        for layer in layers:
            h = layer(h)
        return h.square().mean()

    profile = profile_model(layers, step, steps=2, min_tensor_size_to_offload=256)
    for cost in profile.layers:
        assert cost.host is not None
        assert cost.forward_ms > 0 and cost.backward_ms > 0 and cost.host.forward_ms > 0
        # No layer saves a cast: no round of recast layers, and no figure for them.
        assert cost.host.recast_forward_ms is None and cost.host.recast_backward_ms is None
        assert all(v >= 0 and v == v for v in vars(cost.host).values() if v is not None)
    assert profile.head_ms >= 0 and profile.head_host_ms >= 0 and profile.other_ms >= 0
    keep = estimate(profile, [Choice.KEEP] * 6)
    host_ms = sum(c.host.forward_ms + c.host.backward_ms for c in profile.layers if c.host)
    assert keep.step_ms >= host_ms
    assert profile_model(layers, step, steps=1, host=False).layers[0].host is None


def test_the_rounds_time_the_host_without_events(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [The probe's own host time]: the rounds, of which only the host's times are
    # read, record no CUDA event; the steps that time the device (the stream held back
    # before each layer) do.
    import cpu_offload.plan._timing as timing_module

    real = timing_module.timed_step
    seen: list[tuple[bool, bool, bool]] = []

    def spy(layers, step, clock, *args, **kwargs):  # type: ignore[no-untyped-def]
        probe, times = real(layers, step, clock, *args, **kwargs)
        stamps = [t for f in probe.fwd for t in f] + [t for b in probe.bwd for t in b]
        events = all(isinstance(t, torch.cuda.Event) for t in stamps)
        host = all(isinstance(t, float) for t in stamps)
        assert events or host
        seen.append((kwargs.get("sleep") is not None, clock.events, events))
        return probe, times

    monkeypatch.setattr(timing_module, "timed_step", spy)
    layers, x = _model()
    profile_model(layers, lambda: run_layers(layers, x).float().square().mean(), steps=1)
    rounds = [s for s in seen if not s[0]]
    device = [s for s in seen if s[0]]
    assert rounds and device
    assert all(not clock_events and not events for _, clock_events, events in rounds)
    assert all(clock_events and events for _, clock_events, events in device)


def test_plan_uses_less_memory_than_keeping_everything() -> None:
    layers, x = _model()

    def step() -> torch.Tensor:
        return run_layers(layers, x).float().square().mean()

    profile = profile_model(layers, step, steps=1, recompute=False)
    plan = search(profile, _budget(profile))
    _, keep_peak = measure_choices(layers, step, [Choice.KEEP] * SPEC.layers, steps=1)
    _, plan_peak = measure_choices(layers, step, plan.choices, steps=1)
    assert keep_peak is not None and plan_peak is not None
    assert plan_peak < keep_peak


SCRIPT = Path(__file__).parent / "scripts" / "plan_budget_steps.py"
SRC = Path(__file__).resolve().parents[1] / "src"


#: Sizes at which budgets of 0.8 and 0.6 of the peak leave room beside the static memory
#: and the head (a Llama's 32000-word head dominates a small model's peak).
DIMS = {
    "llama": ["--layers", "12", "--hidden", "1024", "--seq", "2048", "--batch", "4"],
    "megatron": [],
}


def _plans_on(model: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), model, *DIMS[model]],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Its subprocess may take 900 s: the test's own limit lies beyond that.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("model", "needs"), [("llama", "transformers"), ("megatron", "megatron.core")]
)
def test_plans_keep_their_budgets_on_real_models(model: str, needs: str) -> None:
    pytest.importorskip(needs)
    result = _plans_on(model)
    assert [b["fraction"] for b in result["budgets"]] == [0.8, 0.6, 0.45]
    planned = [b for b in result["budgets"] if "no_plan" not in b]
    # The largest budgets fit a plan; a budget below every plan's modelled peak (the
    # head and the static memory of a large vocabulary) raises NoPlanFits instead.
    assert [b["fraction"] for b in planned][:2] == [0.8, 0.6], result
    for b in result["budgets"]:
        if "no_plan" in b:
            assert "no plan fits a budget of" in b["no_plan"], b
            continue
        assert b["error"] is None and b["differ"] == [], b
        limit = b["budget"] * 1.01
        # A first step over budget tightens the plan (with a warning); every step after
        # the budget check is done stays within it.
        checked = b["step_peaks"][b["tightened"] :]
        assert checked and max(checked) <= limit, b
        assert b["plan"] != "K" * len(b["plan"]), b
