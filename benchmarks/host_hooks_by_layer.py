"""Which layers' saved-tensor hooks cost the step: all of them, the first two, or others.

A step timed from a synchronized GPU makes the device wait for the host until the host has
queued a lead, so host time in the first layers' forward lands on the step, and the same
time further on hides behind the device's work. This script puts ``host_overhead.py``'s
floor of any hooks (hooks that only detach what they are given) around all the layers of
``cpu-offload compare``'s default model, around the first two, the middle two or the last
two, and runs V2 with nothing eligible (k=2, which offloads the first two) and V2 with no
layer offloaded (k=0: the context and sync function around every layer, with no
saved-tensor hooks at all), in turns whose order rotates, three steps a turn (a number of
turns that is a multiple of the seven variants runs each in every position equally
often). Each figure is the median over the turns of the step's ratio to no hooks in the
same turn, with its interquartile range: over every turn, and over the turns whose host
probe read within 10% of the run's lower quartile (``_report.CalmTurns``: this leaves out
the run's slowest turns, not every slow phase of the host).

    python benchmarks/host_hooks_by_layer.py --turns 63
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from _host_floors import kept, same
from _report import CalmTurns, paired_ratios, probed, quartiles, rotated
from host_overhead import CUDA_SPEC, NEVER

from cpu_offload import CudaTransport, v2
from cpu_offload.models import build_layers

STEPS_PER_TURN = 3


def variants() -> dict[str, Callable[[], None]]:
    """One training step (forward, backward, gradients dropped) for each variant."""
    spec = CUDA_SPEC
    n = spec.layers
    layers = build_layers(spec, "cuda")
    x0 = spec.make_input("cuda")
    hooks = torch.autograd.graph.saved_tensors_hooks(kept, same)
    ctx, sync = v2.get_cpu_offload_context(
        True, 2, n, transport=CudaTransport(), min_tensor_size_to_offload=NEVER
    )
    # No layer offloaded: V2's per-layer protocol alone, without saved-tensor hooks.
    bare_ctx, bare_sync = v2.get_cpu_offload_context(True, 0, n, transport=CudaTransport())

    def backward(x: torch.Tensor) -> None:
        x.float().sum().backward()
        for p in layers.parameters():
            p.grad = None

    def hooked(around: set[int]) -> Callable[[], None]:
        def step() -> None:
            x = x0.detach().requires_grad_()
            for j, layer in enumerate(layers):
                if j in around:
                    with hooks:
                        x = layer(x)
                else:
                    x = layer(x)
            backward(x)

        return step

    def v2_steps(
        context: object, sync_function: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[], None]:
        def step() -> None:
            x = x0.detach().requires_grad_()
            for layer in layers:
                with context:  # type: ignore[attr-defined]
                    x = layer(x)
                x = sync_function(x)
            backward(x)

        return step

    return {
        "no hooks": hooked(set()),
        "hooks around all layers": hooked(set(range(n))),
        "hooks around the first 2": hooked({0, 1}),
        "hooks around the last 2": hooked({n - 2, n - 1}),
        f"hooks around the middle 2 ({n // 2 - 1}, {n // 2})": hooked({n // 2 - 1, n // 2}),
        "v2, nothing eligible (k=2)": v2_steps(ctx, sync),
        "v2, no layer offloaded (k=0)": v2_steps(bare_ctx, bare_sync),
    }


def measure(
    steps: dict[str, Callable[[], None]], turns: int
) -> tuple[dict[str, list[float]], list[float]]:
    """Per variant, the median step (ms) of each turn, from a synchronized GPU; and each
    turn's host probe (``_report.probed``)."""
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}

    def turn_of(turn: int) -> None:
        for name in rotated(list(steps), turn):
            ms = []
            for _ in range(STEPS_PER_TURN):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                steps[name]()
                torch.cuda.synchronize()
                ms.append((time.perf_counter() - t0) * 1e3)
            times[name].append(statistics.median(ms))

    probes = [probed(turn_of, turn) for turn in range(turns)]
    return times, probes


def _summary(ratios: list[float]) -> str:
    low, high = quartiles(ratios)
    return f"{statistics.median(ratios):.4f} [{low:.4f}, {high:.4f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=63, help="turns of every variant (a multiple of 7)")
    args = p.parse_args(argv)
    if args.turns < 2:
        p.error(f"--turns must be at least 2 (the interquartile range needs two), got {args.turns}")
    if not torch.cuda.is_available():
        p.error("this benchmark needs a GPU: the host is on the step's path only beside one")
    # Nothing is saved by V2 on purpose: it says once that it offloaded nothing.
    warnings.filterwarnings("ignore", message="the V2 CPU offload context ran all")
    times, probes = measure(variants(), args.turns)
    calm = CalmTurns(probes)
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {CUDA_SPEC}, "
        f"{args.turns} turns of {STEPS_PER_TURN} steps; calm: {calm.describe()}"
    )
    base = times["no hooks"]
    print(f"  {'':32s} {'fastest step':>15s}  paired x, every turn  {'calm turns':>24s}")
    for name, ms in times.items():
        ratios = paired_ratios(ms, base)
        quiet = calm.keep(ratios)
        print(f"  {name:32s} {min(ms):12.2f} ms  {_summary(ratios)}  {_summary(quiet)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
