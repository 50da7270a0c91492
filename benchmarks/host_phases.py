"""Whether a configuration's step times follow the host's speed: per-step times of whole-layer
plans in alternating rounds, with Python's garbage collector on and then off.

For each step it prints the wall time, and the forward thread's own CPU time and wall time
until ``backward()`` returns (the backward runs on autograd's device thread). Where the same
work takes more CPU time in one round than in another, the host itself ran slower; where a
step's wall time follows it, the host bounds that configuration.

    python benchmarks/host_phases.py                       # the Llama of plan.py
    W=megatron PLANS='{"none": "KKKKKKKKKKKK", "rec": "KRKKKKRRKKKR"}' python benchmarks/host_phases.py

``PLANS``: label -> one letter per layer (K keep, O offload, R recompute); ``STEPS``: timed
steps per configuration and round (20).
"""

from __future__ import annotations

import gc
import json
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

DEFAULT_PLANS = {
    "none": "KKKKKKKKKKKK",
    "plan": "ORROKKKKKKRK",
    "rec": "KRKKKKRRKKKR",
    "off2": "OOKKKKKKKKKK",
}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    model, step = build(os.environ.get("W", "llama"), False)
    plans = json.loads(os.environ["PLANS"]) if "PLANS" in os.environ else DEFAULT_PLANS
    steps = int(os.environ.get("STEPS", "20"))
    params = [p for p in model.parameters() if p.requires_grad]

    def one() -> tuple[float, float, float]:
        for p in params:
            p.grad = None
        t0, c0 = time.perf_counter(), time.thread_time()
        step().backward()
        t1, c1 = time.perf_counter(), time.thread_time()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3, (c1 - c0) * 1e3, (t1 - t0) * 1e3

    out: dict[str, list[tuple[float, float, float]]] = {}
    with timed_as_users_train():
        for mode in ("on", "off"):
            if mode == "off":
                gc.collect()
                gc.disable()
            for _ in range(3):
                for label, letters in plans.items():
                    off = [i for i, c in enumerate(letters) if c == "O"]
                    rec = [i for i, c in enumerate(letters) if c == "R"]
                    with offload_layers(model, offloaded=off, recomputed=rec):
                        for _ in range(3):
                            one()
                        out.setdefault(f"{label} gc={mode}", []).extend(one() for _ in range(steps))
            gc.enable()
    for key, ts in out.items():
        w = sorted(t[0] for t in ts)
        c = sorted(t[1] for t in ts)
        e = sorted(t[2] for t in ts)
        print(
            f"{key:24s} wall min {w[0]:6.1f} p25 {w[len(w) // 4]:6.1f} "
            f"med {statistics.median(w):6.1f} p75 {w[3 * len(w) // 4]:6.1f} max {w[-1]:6.1f} "
            f"| enqueue wall med {statistics.median(e):6.1f} cpu med {statistics.median(c):6.1f} "
            f"max {c[-1]:6.1f}"
        )
    first = next(iter(plans))
    last = "plan" if "plan" in plans else list(plans)[-1]
    print(f"steps in order ({last} gc=on):", [round(t[0], 1) for t in out[f"{last} gc=on"]])
    print(
        f"enqueue cpu/wall in order ({last} gc=on):",
        [(round(t[1], 1), round(t[2], 1)) for t in out[f"{last} gc=on"]],
    )
    print(f"{first} gc=on:", [round(t[0], 1) for t in out[f"{first} gc=on"]])


if __name__ == "__main__":
    main()
