"""The host's fixed cost of each part recomputed or offloaded on its own: the model, the
probes that measure it, and the profile that runs them (CPU stand-in)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_plan_parts import LAYER, OFF, K, R, _parts
from test_plan_parts_probe import MIN, _core_blocks

from cpu_offload.plan import profile_model
from cpu_offload.plan._parts_host import part_probes, with_part_host
from cpu_offload.plan.model import HostCost, Link, Profile, estimate
from cpu_offload.plan.usage import use_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The layer's host: a 2 ms forward, 4 ms backward; recomputing the whole layer adds 0.4
# and 2.0, offloading it 1.0 and 1.0 (0.5 and 0.25 of that the engine's alone).
HOST = HostCost(
    forward_ms=2.0,
    backward_ms=4.0,
    recompute_forward_ms=0.4,
    recompute_backward_ms=2.0,
    offload_forward_ms=1.0,
    offload_backward_ms=1.0,
    engaged_forward_ms=0.5,
    engaged_backward_ms=0.25,
)
FIXED = dict(
    part_recompute_forward_ms=0.1,
    part_recompute_backward_ms=0.2,
    part_offload_forward_ms=0.3,
    part_offload_backward_ms=0.05,
)


def _layer(**fixed: float) -> object:
    return replace(LAYER, host=replace(HOST, **fixed))


def test_each_part_on_its_own_pays_the_hosts_fixed_cost() -> None:
    layer = _layer(**FIXED)
    # The core and the MLP recomputed run a quarter and a half of the layer's forward on
    # the host (its parts' host times, 0.25 and 0.5 of 2.0 ms): that share of the whole
    # layer's recomputation less its one checkpoint, and two checkpoints.
    both = use_of(layer, _parts(core=R, mlp=R), False)  # type: ignore[arg-type]
    assert both.host_forward_ms == pytest.approx(2.0 + 0.375 * (0.4 - 0.1) + 2 * 0.1)
    assert both.host_backward_ms == pytest.approx(4.0 + 0.375 * (2.0 - 0.2) + 2 * 0.2)
    # Every part recomputed: the whole layer's cost and two checkpoints more.
    every = use_of(layer, _parts(proj=R, core=R, mlp=R), False)  # type: ignore[arg-type]
    assert every.host_forward_ms == pytest.approx(2.0 + 0.625 * (0.4 - 0.1) + 3 * 0.1)
    # The projection offloaded moves 10 of the layer's 210 bytes, under the engine.
    sent = use_of(layer, _parts(proj=OFF), False)  # type: ignore[arg-type]
    assert sent.host_forward_ms == pytest.approx(2.0 + 0.5 + 10 / 210 * (0.5 - 0.3) + 0.3)
    assert sent.host_backward_ms == pytest.approx(4.0 + 0.25 + 10 / 210 * (0.75 - 0.05) + 0.05)
    # A whole layer is one checkpoint, or one offloaded layer: its cost holds its one.
    assert use_of(layer, R, False).host_forward_ms == pytest.approx(2.4)  # type: ignore[arg-type]
    assert use_of(layer, OFF, False).host_backward_ms == pytest.approx(5.0)  # type: ignore[arg-type]
    # Parts all kept cost what the kept layer costs.
    assert use_of(layer, _parts(), False).host_forward_ms == 2.0  # type: ignore[arg-type]
    # In a step where the host bounds it, two recomputed parts cost more than one.
    profile = Profile((layer,) * 4, Link(1e-4, 1e-4))  # type: ignore[arg-type]
    one = estimate(profile, [_parts(core=R)] * 4).step_ms
    two = estimate(profile, [_parts(core=R, mlp=R)] * 4).step_ms
    assert two > one > estimate(profile, [K] * 4).step_ms


def test_the_probes_take_the_cheapest_part_and_the_fewest_bytes() -> None:
    profile = Profile((_layer(),) * 4, Link(1e-4, 1e-4))  # type: ignore[arg-type]
    probes = part_probes(profile)
    # The core has the least host time of the three parts; the projection moves 10 bytes
    # (the core 120, the MLP 80). Offloading probes the first half of the layers.
    assert probes["recompute"]["parts"] == {j: {"core": "recompute"} for j in range(4)}
    assert probes["offload"]["parts"] == {j: {"proj": "offload"} for j in range(2)}
    # One layer is the last, which the schedule never offloads.
    assert list(part_probes(Profile((_layer(),), Link(1e-4, 1e-4)))) == ["recompute"]  # type: ignore[arg-type]


class _Times:
    """Stand-in for a probed step's times: what the host took per layer."""

    def __init__(self, forward: list[float], backward: list[float], lead_ms: float = 0.0) -> None:
        self.host_forward, self.host_backward = forward, backward
        self.host_lead_ms = lead_ms


def test_the_fixed_cost_is_what_a_probe_adds_beyond_the_shares() -> None:
    # The profile's host times came without fixed costs (any there are replaced). The
    # rounds: kept layers; the core recomputed in every layer, costing its share of the
    # whole layer's recomputation less one checkpoint, and a checkpoint of FIXED; the projection offloaded in layers 0 and 1, every layer
    # under the engine. The second round runs 1.5 times slower.
    profile = Profile((_layer(part_offload_forward_ms=9.0),) * 4, Link(1e-4, 1e-4))  # type: ignore[arg-type]
    probes = part_probes(profile)
    share, moved = 0.25 / 2.0, 10 / 210

    def runs(forward: list[float], backward: list[float], pace: float) -> list[_Times]:
        return [_Times([pace * f for f in forward], [pace * b for b in backward])] * 2

    rounds: dict[str, list[list[_Times]]] = {"keep": [], "recompute": [], "offload": []}
    for pace in (1.0, 1.5, 1.0):
        rounds["keep"].append(runs([2.0] * 4, [4.0] * 4, pace))
        rounds["recompute"].append(
            runs([2.0 + share * 0.3 + 0.1] * 4, [4.0 + share * 1.8 + 0.2] * 4, pace)
        )
        sent_f = 2.0 + 0.5 + moved * 0.2 + 0.3
        sent_b = 4.0 + 0.25 + moved * 0.7 + 0.05
        rounds["offload"].append(runs([sent_f] * 2 + [2.5] * 2, [sent_b] * 2 + [4.25] * 2, pace))
    # The probes read the second round slow: it is left out.
    probe_ms = dict.fromkeys(rounds, [5.0, 7.5, 5.0])
    out = with_part_host(profile, probes, rounds, probe_ms, 5.0, pace="calm")  # type: ignore[arg-type]
    for cost in out.layers:
        assert cost.host is not None
        for name, value in FIXED.items():
            assert getattr(cost.host, name) == pytest.approx(value), name
        assert replace(cost.host, **dict.fromkeys(FIXED, 0.0)) == HOST
    # A probe that adds nothing beyond the shares leaves no fixed cost (and none below 0).
    rounds["recompute"] = rounds["keep"]
    out = with_part_host(profile, probes, rounds, probe_ms, 5.0, pace="calm")  # type: ignore[arg-type]
    assert out.layers[0].host is not None
    assert out.layers[0].host.part_recompute_forward_ms == 0.0


def _probes_seen(monkeypatch: pytest.MonkeyPatch) -> list[dict]:  # type: ignore[type-arg]
    from cpu_offload.plan._timing import HostAndDevice

    seen: list[dict] = []  # type: ignore[type-arg]
    real = HostAndDevice._rounds

    def recorded(self, configs):  # type: ignore[no-untyped-def]
        seen.append(dict(configs))
        return real(self, configs)

    monkeypatch.setattr(HostAndDevice, "_rounds", recorded)
    return seen


def _profile(model, x, **kwargs):  # type: ignore[no-untyped-def]
    return profile_model(
        model,
        lambda: model(x).square().mean(),
        steps=1,
        min_tensor_size_to_offload=MIN,
        **kwargs,
    )


@pytest.mark.filterwarnings("error::UserWarning")
def test_a_profile_with_parts_and_the_hosts_time_runs_the_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _probes_seen(monkeypatch)
    model = _core_blocks()
    x = torch.randn(2, 16, 32)
    profile = _profile(model, x, parts=True, host=True)
    # The whole-layer rounds, then the probes' rounds, whose parts the engine moves
    # (a probe below the threshold would warn that nothing was offloaded).
    assert len(seen) == 2
    assert list(seen[1]) == ["keep", "recompute", "offload"]
    assert all("parts" in seen[1][probe] for probe in ("recompute", "offload"))
    for cost in profile.layers:
        assert cost.host is not None and cost.parts
        assert min(v for v in vars(cost.host).values() if v is not None) >= 0
    # Without parts, or without the host's time, no probe runs.
    seen.clear()
    _profile(model, x, host=True)
    assert len(seen) == 1
    seen.clear()
    _profile(model, x, parts=True, host=False)
    assert seen == []
    # Without recomputation timed, nothing of it is probed.
    seen.clear()
    _profile(model, x, parts=True, host=True, recompute=False)
    assert list(seen[-1]) == ["keep", "offload"]


def test_v1_profiles_parts_without_the_offload_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # V1 offloads no part: its profile probes recomputed parts only.
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    seen = _probes_seen(monkeypatch)
    model = _core_blocks()
    profile = _profile(model, torch.randn(2, 16, 32), parts=True, host=True)
    assert list(seen[-1]) == ["keep", "recompute"]
    assert all(c.host is not None and c.host.part_offload_forward_ms == 0 for c in profile.layers)


def test_the_probes_are_judged_against_the_profiles_calm_reference() -> None:
    # Of the probes' three rounds, the host ran 1.3 times slower in the last two. Against
    # their own probes alone those rounds would pass for calm (their lower quartile is
    # slow too); against the calm reference of the profile's other host times they do
    # not, and the fixed costs come from the first round.
    from cpu_offload.plan._timing import HostAndDevice

    profile = Profile((_layer(),) * 4, Link(1e-4, 1e-4))  # type: ignore[arg-type]
    timing = object.__new__(HostAndDevice)
    timing.calm_probe_ms = 5.0
    share = 0.25 / 2.0
    paces = (1.0, 1.3, 1.3)

    def rounds(configs):  # type: ignore[no-untyped-def]
        out = {
            "keep": [[_Times([p * 2.0] * 4, [p * 4.0] * 4)] for p in paces],
            "recompute": [
                [
                    _Times(
                        [p * (2.0 + share * 0.3 + 0.1)] * 4,
                        [p * (4.0 + share * 1.8 + 0.2)] * 4,
                    )
                ]
                for p in paces
            ],
        }
        out["offload"] = out["keep"]  # adds nothing: no fixed cost, not below 0
        # The plain step is the device's: it does not show the slow host.
        return (
            {k: v for k, v in out.items() if k in configs},
            [1000.0] * 3,
            {k: [6.5] * 3 if k == "offload" else [5.4, 6.5, 6.5] for k in configs},
        )

    timing._rounds = rounds  # type: ignore[method-assign]
    timing.recompute = True
    out = timing.part_host(profile, pace="calm")
    host = out.layers[0].host
    assert host is not None
    assert host.part_recompute_forward_ms == pytest.approx(0.1)
    assert host.part_recompute_backward_ms == pytest.approx(0.2)
    assert host.part_offload_forward_ms == 0.0
    # With the pace "every", the slow rounds count too: their median is the slow one's.
    slow = timing.part_host(profile).layers[0].host  # the default pace
    assert slow is not None
    assert slow.part_recompute_forward_ms > host.part_recompute_forward_ms + 0.01
    assert slow.part_recompute_backward_ms > host.part_recompute_backward_ms + 0.01
