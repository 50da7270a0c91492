"""Where V2's extra step time goes: each layer's start on the device and on the host.

On compare's default model (GPT, 8 layers, h 2048, seq 2048, batch 2, bf16), without
offloading and with V2 offloading the first k layers, alternating, this records a CUDA
event and the host clock at each layer's forward start, at the loss, at each layer's
backward start and at the step's end (no profiler: its host cost would change what is
measured). A layer whose device time equals its host time ran right behind the host (the
host bounds it); a gap between one layer's device start and the next that grows with
offloading, where the host is ahead, is the device waiting (for copies, at the schedule's
points).

It then times the engine's own entry points inside real steps (host wall time per step):
what the host spends grouping a layer's tensors, queueing its copies, and so on.

    python benchmarks/host_timeline.py                 # deterministic kernels, k=2
    python benchmarks/host_timeline.py -k 4 --no-deterministic
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from host_overhead import CUDA_SPEC as SPEC  # noqa: E402  (compare's default model)

from cpu_offload import v2  # noqa: E402
from cpu_offload.engine import layer_state, tensor_group, transport  # noqa: E402
from cpu_offload.models import build_layers  # noqa: E402
from cpu_offload.v2.default import DefaultOffloadSynchronizer  # noqa: E402

#: The engine's entry points timed inside real steps: (class, method).
ENTRY_POINTS = [
    (DefaultOffloadSynchronizer, "fwd_step"),
    (DefaultOffloadSynchronizer, "bwd_step"),
    (DefaultOffloadSynchronizer, "finish_part_of_bwd"),
    (layer_state.OffloadableLayerState, "push_tensor"),
    (layer_state.OffloadableLayerState, "start_offload"),
    (tensor_group.TensorGroupProcessor, "process"),
    (transport.CudaTransport, "offload_all"),
    (transport.CudaTransport, "record"),
    (layer_state.OffloadableLayerState, "release_activation_forward_gpu_memory"),
    (layer_state.OffloadableLayerState, "start_reload"),
    (layer_state.OffloadableLayerState, "pop_tensor"),
]


class _Mark(torch.autograd.Function):
    """Records the backward start of a layer (its output's gradient arrives)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, marks: list, name: str) -> torch.Tensor:
        ctx.marks, ctx.name = marks, name  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.marks.append(_mark(ctx.name))  # type: ignore[attr-defined]
        return grad, None, None


def _mark(name: str) -> tuple[str, torch.cuda.Event, float]:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return name, event, time.perf_counter()


def _step(layers: torch.nn.ModuleList, x0: torch.Tensor, ctx: object, sync: object) -> list:
    """One training step with marks; returns (name, device ms, host ms) from its start."""
    marks: list = []
    x = x0.detach().requires_grad_()
    torch.cuda.synchronize()
    marks.append(_mark("start"))
    for i, layer in enumerate(layers):
        x = _Mark.apply(x, marks, f"b{i}")
        marks.append(_mark(f"f{i}"))
        if ctx is None:
            x = layer(x)
        else:
            with ctx:  # type: ignore[attr-defined]
                x = layer(x)
            x = sync(x)  # type: ignore[operator]
    loss = x.float().sum()
    marks.append(_mark("loss"))
    loss.backward()
    marks.append(_mark("end"))
    torch.cuda.synchronize()
    for p in layers.parameters():
        p.grad = None
    _, first, host0 = marks[0]
    return [(n, first.elapsed_time(e), (h - host0) * 1e3) for n, e, h in marks]


def timeline(k: int, rounds: int, steps: int) -> dict[str, list[tuple[str, float, float]]]:
    """Median marks per variant over ``rounds`` alternating rounds of ``steps`` steps."""
    layers = build_layers(SPEC, "cuda")
    x0 = SPEC.make_input("cuda")
    variants: dict[str, tuple[object, object]] = {
        "none": (None, None),
        f"v2 k={k}": v2.get_cpu_offload_context(
            enabled=True, num_layers=k, model_layers=SPEC.layers
        ),
    }
    runs: dict[str, list] = {name: [] for name in variants}
    for ctx, sync in variants.values():
        for _ in range(3):
            _step(layers, x0, ctx, sync)
    for _ in range(rounds):
        for name, (ctx, sync) in variants.items():
            runs[name].extend(_step(layers, x0, ctx, sync) for _ in range(steps))
    out = {}
    for name, rs in runs.items():
        names = [m[0] for m in rs[0]]
        out[name] = [
            (
                n,
                statistics.median(r[j][1] for r in rs),
                statistics.median(r[j][2] for r in rs),
            )
            for j, n in enumerate(names)
        ]
    return out


def _timed(fn: Callable, key: str, acc: dict[str, float]) -> Callable:
    @functools.wraps(fn)
    def run(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - start

    return run


def components(k: int, steps: int) -> dict[str, float]:
    """Host ms per step inside each of :data:`ENTRY_POINTS` (nested ones overlap)."""
    acc: dict[str, float] = {}
    saved = [(cls, name, getattr(cls, name)) for cls, name in ENTRY_POINTS]
    try:
        for cls, name, fn in saved:
            setattr(cls, name, _timed(fn, f"{cls.__name__}.{name}", acc))
        layers = build_layers(SPEC, "cuda")
        x0 = SPEC.make_input("cuda")
        ctx, sync = v2.get_cpu_offload_context(enabled=True, num_layers=k, model_layers=SPEC.layers)
        for _ in range(5):
            _step(layers, x0, ctx, sync)
        acc.clear()
        for _ in range(steps):
            _step(layers, x0, ctx, sync)
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    return {key: seconds / steps * 1e3 for key, seconds in acc.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", type=int, default=2, help="layers offloaded (of 8)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5, help="steps per variant and round")
    p.add_argument("--no-deterministic", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA GPU")
    torch.use_deterministic_algorithms(not args.no_deterministic)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, deterministic "
          f"{not args.no_deterministic}")  # fmt: skip
    print("marks: device ms / host ms since the step's start (medians); fI = layer I's "
          "forward starts, bI = its backward starts")  # fmt: skip
    for name, marks in timeline(args.k, args.rounds, args.steps).items():
        print(f"{name}: step {marks[-1][1]:.2f} ms")
        print("  " + "  ".join(f"{n} {d:.2f}/{h:.2f}" for n, d, h in marks))
    print(
        f"host ms per step inside the engine's entry points (v2 k={args.k}; nested ones overlap):"
    )
    for key, ms in sorted(components(args.k, 20).items(), key=lambda kv: -kv[1]):
        print(f"  {key:58s} {ms:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
