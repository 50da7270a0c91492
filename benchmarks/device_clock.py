"""Whether the device runs faster while the planner profiles it than in steady training.

A GPU held at its power limit (an H200 at 700 W: the SM clock falls from 1980 to about
1725 MHz within seconds of steady load) clocks higher after a pause. The planner's
profile times plain steps right after pauses (its host probes) and each layer's device
time with the stream held back between layers; a training step runs back to back. Three
measurements on one of ``plan.py``'s workloads (``compare`` by default):

* ``warmup``: plain steps back to back for ``--seconds``, beside ``nvidia-smi``'s SM
  clock, temperature, power and throttle reasons sampled every 0.5 s;
* ``pause``: after a pause (two host probes, 0.05, 0.3 or 1 s), eight plain steps, each
  timed alone; per position, the median over 12 repeats; then 100 steps back to back;
* ``profile``: ``profile_model``'s per-layer device times and recomputation beside the
  same times after 2 s of steps (events around each layer, nothing held back), and the
  recomputation's cost per layer from steady plain steps with every layer recomputed;
* ``pace``: what the profile scales its device times and its recomputation by
  (``cpu_offload.plan._clock.steady_pace``), read five times;
* ``holds``: the layers' device times with the stream held back before each layer (as
  the profile times them), held back once before each pass, and after 1 s of steps with
  nothing held back, with every layer kept and recomputed; beside them plain steps
  back to back of both.

    python benchmarks/device_clock.py --what warmup,pause,profile,pace,holds
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plan_workloads import WORKLOAD_DIMS, build  # noqa: E402

import cpu_offload.plan._probe as probe_module  # noqa: E402
from cpu_offload import offload_layers  # noqa: E402
from cpu_offload._compat import in_backward  # noqa: E402
from cpu_offload._layer_stack import find_layers  # noqa: E402
from cpu_offload.plan import profile_model  # noqa: E402
from cpu_offload.plan._clock import steady_pace  # noqa: E402
from cpu_offload.plan._probe import Clock, host_probe_ms, median_times, plain_step_ms, timed_step  # noqa: E402,E501

WHAT = ("warmup", "pause", "profile", "pace", "holds")
Step = Callable[[], torch.Tensor]


def _run_for(step: Step, clock: Clock, seconds: float) -> list[tuple[float, float]]:
    start, times = time.perf_counter(), []
    while time.perf_counter() - start < seconds:
        times.append((time.perf_counter() - start, plain_step_ms(step, clock, 1)))
    return times


def warmup(step: Step, clock: Clock, seconds: float) -> None:
    query = "timestamp,clocks.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active"
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-lms", "500"],
        stdout=subprocess.PIPE,
        text=True,
    )
    times = _run_for(step, clock, seconds)
    smi.terminate()
    samples = smi.communicate()[0].strip().splitlines()
    print(f"warmup: {len(times)} steps back to back")
    for t, ms in times[:: max(1, len(times) // 25)]:
        print(f"  t={t:6.1f} s  step {ms:6.2f} ms")
    first = statistics.median(ms for _, ms in times[:10])
    last = statistics.median(ms for _, ms in times[-50:])
    print(f"  first 10 steps: median {first:.2f} ms; last 50: {last:.2f} ms")
    print(f"  nvidia-smi ({query}):")
    for line in samples[:: max(1, len(samples) // 25)]:
        print(f"    {line}")


def pause(step: Step, clock: Clock) -> None:
    _run_for(step, clock, 1.0)
    print("pause: median step ms at positions 1..8 after the pause")
    for how in ("probe", 0.05, 0.3, 1.0):
        positions: list[list[float]] = [[] for _ in range(8)]
        for _ in range(12):
            torch.cuda.synchronize()
            if how == "probe":
                host_probe_ms()
                host_probe_ms()
            else:
                time.sleep(how)
            for times in positions:
                times.append(plain_step_ms(step, clock, 1))
        print(f"  {how!s:>5}: " + " ".join(f"{statistics.median(p):.2f}" for p in positions))
    steady = [plain_step_ms(step, clock, 1) for _ in range(100)]
    print(f"  100 steps back to back: median {statistics.median(steady):.2f}")


def profile(model: torch.nn.Module, step: Step, clock: Clock) -> None:
    layers = find_layers(model)
    n = len(layers)
    got = profile_model(model, step, steps=3, warmup=2)
    costs = got.layers
    print(
        f"profile: forward {statistics.fmean([c.forward_ms for c in costs]):.3f}, backward "
        f"{statistics.fmean([c.backward_ms for c in costs]):.3f}, recompute "
        f"{statistics.fmean([c.recompute_ms or 0.0 for c in costs]):.3f} ms a layer"
    )
    _run_for(step, clock, 2.0)
    runs = [timed_step(layers, step, clock)[1] for _ in range(20)]
    forward = statistics.fmean(median_times(runs, "forward"))
    backward = statistics.fmean(median_times(runs, "backward"))
    print(f"after 2 s of steps: forward {forward:.3f}, backward {backward:.3f} ms a layer")
    _run_for(step, clock, 2.0)
    plain = plain_step_ms(step, clock, 20)
    with offload_layers(layers, offloaded=(), recomputed=range(n)):
        _run_for(step, clock, 2.0)
        every = plain_step_ms(step, clock, 20)
    _run_for(step, clock, 2.0)
    plain_again = plain_step_ms(step, clock, 20)
    extra = (every - (plain + plain_again) / 2) / n
    print(
        f"after 2 s of steps: plain {plain:.2f} / {plain_again:.2f} ms, every layer "
        f"recomputed {every:.2f} ms: +{extra:.3f} ms a layer"
    )


def pace(model: torch.nn.Module, step: Step, clock: Clock, repeats: int = 5) -> None:
    """Print what ``steady_pace`` reads, ``repeats`` times: its spread on this device."""
    layers = find_layers(model)

    def every() -> object:
        return offload_layers(layers, offloaded=(), recomputed=range(len(layers)))

    read = [steady_pace(step, clock, recompute=every) for _ in range(repeats)]
    for name, values in (
        ("factor", [r.factor for r in read]),
        ("recompute_ratio", [r.recompute_ratio or 0.0 for r in read]),
    ):
        shown = ", ".join(f"{v:.3f}" for v in values)
        print(f"pace: {name} {repeats} times: {shown} (median {statistics.median(values):.3f})")


class _PassHold(probe_module.Probe):
    """A probe that holds the stream back once before each pass (``sleep``: the
    forward's and the backward's cycles) instead of before each layer."""

    def _hold(self, j: int) -> None:
        assert self.sleep is not None
        if in_backward():
            if j == len(self.layers) - 1:
                torch.cuda._sleep(self.sleep[1])
        elif j == 0:
            torch.cuda._sleep(self.sleep[0])


def holds(model: torch.nn.Module, step: Step, clock: Clock, steps: int = 7) -> None:
    """Print the layers' device times held back before each layer, once before each
    pass and not at all (after 1 s of steps), with every layer kept and recomputed, and
    plain steps of both after 1 s of steps."""
    layers = find_layers(model)
    n = len(layers)
    for _ in range(3):
        timed_step(layers, step, clock)
    host = [timed_step(layers, step, Clock(True, events=False))[1] for _ in range(5)]
    fwd, bwd = median_times(host, "host_forward_own"), median_times(host, "host_backward")
    per_layer = probe_module.sleep_cycles([max(f, b) for f, b in zip(fwd, bwd, strict=True)])
    per_ms = probe_module.cycles_per_ms()
    per_pass = [int((1.3 * sum(fwd) + 1.0) * per_ms), int((1.3 * sum(bwd) + 1.0) * per_ms)]
    print(f"holds: host forward {sum(fwd):.2f} ms, backward {sum(bwd):.2f} ms a step")
    got: dict[tuple[str, str], tuple[float, float]] = {}
    base = probe_module.Probe
    for config, kwargs in (("kept", {}), ("recomputed", {"recomputed": range(n)})):
        with offload_layers(layers, offloaded=(), **kwargs):
            plain_step_ms(step, clock, 2)
            for how in ("each layer", "each pass", "nothing"):
                sleep = {"each layer": per_layer, "each pass": per_pass}.get(how)
                if how == "nothing":
                    _run_for(step, clock, 1.0)
                probe_module.Probe = _PassHold if how == "each pass" else base
                try:
                    runs = [timed_step(layers, step, clock, sleep=sleep)[1] for _ in range(steps)]
                finally:
                    probe_module.Probe = base
                got[config, how] = (
                    statistics.fmean(median_times(runs, "forward")),
                    statistics.fmean(median_times(runs, "backward")),
                )
                print(
                    f"  {config:10s} held back before {how:10s}: forward {got[config, how][0]:.3f}, "
                    f"backward {got[config, how][1]:.3f} ms a layer"
                )
            _run_for(step, clock, 1.0)
            got[config, "plain"] = (plain_step_ms(step, clock, 10), 0.0)
    for how in ("each layer", "each pass", "nothing"):
        again = got["recomputed", how][1] - got["kept", how][1]
        print(f"  recomputation a layer, held back before {how}: {again:.3f} ms")
    kept, again = got["kept", "plain"][0], got["recomputed", "plain"][0]
    print(
        f"  plain steps after 1 s: kept {kept:.2f} ms, recomputed {again:.2f} ms: "
        f"+{(again - kept) / n:.3f} ms a layer"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="compare", choices=sorted(WORKLOAD_DIMS))
    parser.add_argument("--what", default=",".join(WHAT), help=f"any of {', '.join(WHAT)}")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of warmup")
    args = parser.parse_args()
    what = [w for w in args.what.split(",") if w]
    unknown = sorted(set(what) - set(WHAT))
    if unknown or not what:
        parser.error(f"--what: expected any of {', '.join(WHAT)}, got {args.what!r}")
    if args.seconds <= 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: it times a GPU's clock")
    model, step = build(args.workload, False)
    clock = Clock(True)
    if "warmup" in what:
        warmup(step, clock, args.seconds)
    if "pause" in what:
        pause(step, clock)
    if "profile" in what:
        profile(model, step, clock)
    if "pace" in what:
        pace(model, step, clock)
    if "holds" in what:
        holds(model, step, clock)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
