"""Where a forward's host time goes: inside the layers' module hooks, or between them.

A layer whose class defines its own ``__call__`` (Megatron-Core's ``TransformerLayer``,
``transformers``' decoder layers) is wrapped around that ``__call__``, so what the package
does for it (a recomputed layer's checkpoint, an offloaded layer's engine) runs outside
the module hooks. This script times, in steps with every layer kept and with every layer
recomputed (alternating rounds), the forward on the host split four ways: before the
first layer's pre-hook, inside the layers' hooks, between one layer's forward hook and
the next layer's pre-hook, and after the last layer. What the package does for the
first layer outside its hooks lies before it, with the model's own work there, and for
the last layer after it. It is the measurement behind NOTE
[A layer's host time runs from the previous layer's end] in
``cpu_offload/plan/_probe.py``.

    python benchmarks/host_between_layers.py --workloads megatron,llama
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plan_workloads import WORKLOAD_DIMS, build  # noqa: E402
from _report import timed_as_users_train  # noqa: E402

from cpu_offload._compat import in_backward  # noqa: E402
from cpu_offload._layer_stack import find_layers  # noqa: E402
from cpu_offload.layers import offload_layers  # noqa: E402


class _Marks:
    """Host timestamps of each layer's forward pre-hook and forward hook in one forward
    (the step's own forward: not a recomputation inside backward)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.pre: dict[int, float] = {}
        self.post: dict[int, float] = {}
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for j, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._mark(self.pre, j)))
            self.handles.append(layer.register_forward_hook(self._mark(self.post, j)))

    @staticmethod
    def _mark(into: dict[int, float], j: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            if torch.is_grad_enabled() and not in_backward():
                into[j] = time.perf_counter()

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _split(
    layers: list[nn.Module], step: Callable[[], torch.Tensor], recomputed: range, steps: int
) -> list[float]:
    """Median ms of the forward and of its four parts over ``steps`` steps (after one)."""
    n = len(layers)
    cuda = torch.cuda.is_available()
    rows = []
    with offload_layers(layers, offloaded=(), recomputed=recomputed):
        marks = _Marks(layers)  # after the wrapping: the hooks see what nn.Module does
        try:
            for i in range(steps + 1):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                loss = step()
                end = time.perf_counter()
                loss.backward()
                if cuda:
                    torch.cuda.synchronize()
                pre, post = marks.pre, marks.post
                parts = (
                    pre[0] - start,
                    sum(post[j] - pre[j] for j in range(n)),
                    sum(pre[j + 1] - post[j] for j in range(n - 1)),
                    end - post[n - 1],
                )
                if i:
                    rows.append([(end - start) * 1e3] + [p * 1e3 for p in parts])
        finally:
            marks.remove()
    return [statistics.median(column) for column in zip(*rows, strict=True)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="megatron,llama")
    p.add_argument("--rounds", type=int, default=2, help="rounds of kept, then recomputed")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    p.add_argument("--quick", action="store_true", help="the smaller models of plan.py")
    args = p.parse_args()
    for flag in ("rounds", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    names = args.workloads.split(",")
    for name in names:
        if name not in WORKLOAD_DIMS:
            p.error(f"--workloads: {name!r} is not one of {sorted(WORKLOAD_DIMS)}")
    print("| workload | round | layers | forward ms | before | inside | between | after |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name in names:
        model, step = build(name, args.quick)
        layers = find_layers(model)
        with timed_as_users_train():
            for r in range(args.rounds):
                for label, recomputed in (("kept", range(0)), ("recomputed", range(len(layers)))):
                    ms = _split(layers, step, recomputed, args.steps)
                    cells = " | ".join(f"{v:.2f}" for v in ms)
                    print(f"| {name} | {r + 1} | {label} | {cells} |", flush=True)
        del model, step, layers
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
