"""How much host time the planner's probe adds to the steps it times (GPU).

The probe's hooks run inside the host time they measure for each layer (NOTE [The
probe's own host time] in ``cpu_offload/plan/_probe.py``). This script times the host's
part of steps without a probe, with the probe on the device's clock (two CUDA events a
layer) and with the probe on the host's clock alone, in alternating rounds:

* on layers that only return a view of their input (no kernel), where the probe is all
  there is to time: its cost per layer, with little noise;
* on the real models of ``plan.py`` with every layer kept and every layer recomputed:
  the host's forward (the step's start to the loss) and the backward's enqueueing.

    python benchmarks/probe_cost.py --workloads compare,llama,megatron
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plan_workloads import WORKLOAD_DIMS, build  # noqa: E402
from _report import timed_as_users_train  # noqa: E402

from cpu_offload._layer_stack import find_layers  # noqa: E402
from cpu_offload.layers import offload_layers  # noqa: E402
from cpu_offload.plan._probe import Clock, Probe  # noqa: E402

#: Without a probe, the probe on the device's clock, the probe on the host's clock.
MODES = ("none", "events", "host")


def host_ms(layers: Sequence[nn.Module], step: Callable[[], torch.Tensor], mode: str) -> tuple:
    """The host's forward and backward (ms) of one step under ``mode``."""
    torch.cuda.synchronize()
    probe = None if mode == "none" else Probe(layers, Clock(True, events=mode == "events"))
    try:
        start = time.perf_counter()
        loss = step()
        forward = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        torch.cuda.synchronize()
    finally:
        if probe is not None:
            probe.remove()
    return (forward - start) * 1e3, (end - forward) * 1e3


class _View(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)


def rounds(
    layers: Sequence[nn.Module], step: Callable[[], torch.Tensor], n_rounds: int, steps: int
) -> dict[str, tuple[float, float]]:
    """Per mode, the median over rounds of each round's median forward and backward."""
    got: dict[str, list[list[tuple[float, float]]]] = {m: [] for m in MODES}
    for _ in range(n_rounds):
        for mode in MODES:
            got[mode].append([host_ms(layers, step, mode) for _ in range(steps)])
    med = statistics.median
    return {
        m: (med(med(s[0] for s in r) for r in v), med(med(s[1] for s in r) for r in v))
        for m, v in got.items()
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="compare", help="comma-separated, of plan.py's")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    views = [_View() for _ in range(8)]
    x0 = torch.zeros(4, device="cuda", requires_grad=True)

    def view_step() -> torch.Tensor:
        x = x0
        for layer in views:
            x = layer(x)
        return x.sum()

    f = {m: fb[0] for m, fb in rounds(views, view_step, args.rounds, 30).items()}
    print(
        f"view layers: {f['none'] * 1e3 / 8:.1f} us a layer on the host without a probe; "
        f"the probe adds {(f['events'] - f['none']) * 1e3 / 8:.1f} us with events, "
        f"{(f['host'] - f['none']) * 1e3 / 8:.1f} on the host's clock",
        flush=True,
    )
    print("| workload | layers | forward none / events / host ms | added a layer, us | "
          "backward enqueue none / events / host ms |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name in args.workloads.split(","):
        if name not in WORKLOAD_DIMS:
            p.error(f"--workloads: {name!r} is not one of {sorted(WORKLOAD_DIMS)}")
        model, step = build(name, False)
        layers = find_layers(model)
        n = len(layers)
        with timed_as_users_train():
            for label, recomputed in (("kept", ()), ("recomputed", range(n))):
                with offload_layers(layers, offloaded=(), recomputed=recomputed):
                    for _ in range(3):
                        step().backward()
                    r = rounds(layers, step, args.rounds, args.steps)
                fw = " / ".join(f"{r[m][0]:.2f}" for m in MODES)
                added = " / ".join(f"{(r[m][0] - r['none'][0]) / n * 1e3:+.0f}" for m in MODES[1:])
                bw = " / ".join(f"{r[m][1]:.2f}" for m in MODES)
                print(f"| {name} | {label} | {fw} | {added} | {bw} |", flush=True)
        del model, step
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
