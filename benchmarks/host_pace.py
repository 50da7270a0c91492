"""Whether the profile's host probe follows the host's phases: the probe
(:func:`cpu_offload.plan._probe.host_probe_ms`) and a host-bound plan's steps, alternating.

Each turn runs the probe, three steps of a plan of the ``transformers`` Llama of
``plan.py`` (wall time, and the forward thread's CPU time until ``backward()`` returns),
and the probe again; the slower of the two probes counts, as in the profile. It prints the range of each and their correlations over the turns:
where the probe reads slow, the same steps should take more of the host's time.

    python benchmarks/host_pace.py             # 60 s, the plan ORROKKKKKKRK
    DURATION=30 PLAN=RRRRKKKKKKKK python benchmarks/host_pace.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plan_workloads import build  # noqa: E402
from _report import timed_as_users_train  # noqa: E402

from cpu_offload import offload_layers  # noqa: E402
from cpu_offload.plan._probe import probed  # noqa: E402


def _correlation(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    model, step = build("llama", False)
    params = [p for p in model.parameters() if p.requires_grad]
    letters = os.environ.get("PLAN", "ORROKKKKKKRK")
    seconds = float(os.environ.get("DURATION", "60"))

    def one() -> tuple[float, float]:
        for p in params:
            p.grad = None
        t0, c0 = time.perf_counter(), time.thread_time()
        step().backward()
        c1 = time.thread_time()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3, (c1 - c0) * 1e3

    probe, wall, cpu = [], [], []
    off = [i for i, c in enumerate(letters) if c == "O"]
    rec = [i for i, c in enumerate(letters) if c == "R"]
    with timed_as_users_train(), offload_layers(model, offloaded=off, recomputed=rec):
        for _ in range(3):
            one()
        end = time.time() + seconds
        while time.time() < end:
            (w, c), p = probed(lambda: tuple(zip(*(one() for _ in range(3)), strict=True)))
            probe.append(p)  # as the profile takes it
            wall.append(statistics.median(w))
            cpu.append(statistics.median(c))
    print(f"plan {letters}, {len(probe)} turns on {torch.cuda.get_device_name()}")
    for name, values in (("probe ms", probe), ("step ms", wall), ("step cpu ms", cpu)):
        print(
            f"{name:12s} min {min(values):7.2f} median {statistics.median(values):7.2f} "
            f"max {max(values):7.2f}"
        )
    print(f"correlation probe-step {_correlation(probe, wall):.2f}")
    print(f"correlation probe-cpu  {_correlation(probe, cpu):.2f}")


if __name__ == "__main__":
    main()
