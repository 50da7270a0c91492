"""Host time of V2's per-layer protocol, on the GPU and on the CPU, with nothing saved.

Each iteration runs 8 "layers" that save nothing for backward (``x * 2``), so that only
what a layer costs the host around its forward and backward is timed: entering and
leaving the context, ``sync_function``, the backward pre-hook that starts the layer's
backward, and the end-of-backward callback. Beside it, on the same tensors:

* ``floor``: the same layers inside ``host_overhead.py``'s floor, hooks that only detach
  (what any hooks cost);
* ``floor + prehooks``: the floor with a Python pre-hook that does nothing registered on
  each layer's output node, as ``sync_function`` registers V2's: the price of running
  Python from the backward, which on CUDA runs on autograd's device thread.

Every case runs forward and backward (``fwd+bwd``); ``fwd`` is the forward alone (V2's
iteration released after it). The figures are the best of seven means of ``--iters``
iterations, in microseconds per iteration of 8 layers; CUDA is synchronized before and
after each timed group. ``--device cpu`` runs the same on CPU tensors with the host
stand-in transport, where the backward runs on the calling thread.

    python benchmarks/host_protocol.py --device cuda
    python benchmarks/host_protocol.py --device cpu
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch
from _host_floors import kept, same
from host_overhead import NEVER

from cpu_offload import CudaTransport, HostTransport, v2

LAYERS = 8


def _nothing(grad: object) -> None:
    return None


def cases(device: str) -> dict[str, Callable[[], object]]:
    """The timed cases, each one iteration of ``LAYERS`` layers."""
    transport = CudaTransport() if device == "cuda" else HostTransport()
    ctx, sync = v2.get_cpu_offload_context(
        True, 2, LAYERS, transport=transport, min_tensor_size_to_offload=NEVER
    )
    w = torch.ones(4, requires_grad=True, device=device)
    hooks = torch.autograd.graph.saved_tensors_hooks(kept, same)  # host_overhead's floor

    def v2_forward() -> torch.Tensor:
        x = w * 1
        for _ in range(LAYERS):
            with ctx:
                x = x * 2
            x = sync(x)
        return x

    def floor_forward(prehooks: bool = False) -> torch.Tensor:
        x = w * 1
        for _ in range(LAYERS):
            with hooks:
                x = x * 2
            if prehooks:
                assert x.grad_fn is not None
                x.grad_fn.register_prehook(_nothing)
        return x

    def v2_forward_only() -> None:
        v2_forward()
        ctx.offload_synchronizer.release_all()

    return {
        "floor fwd": floor_forward,
        "floor fwd+bwd": lambda: floor_forward().sum().backward(),
        "floor + prehooks fwd+bwd": lambda: floor_forward(True).sum().backward(),
        "v2 fwd": v2_forward_only,
        "v2 fwd+bwd": lambda: v2_forward().sum().backward(),
    }


def time_case(fn: Callable[[], object], device: str, iters: int) -> float:
    """Best of seven means of ``iters`` calls, in microseconds."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(7):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best / iters * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--iters", type=int, default=2000, help="iterations per timed group")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters must be at least 1, got {args.iters}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a GPU; use --device cpu")
    # Nothing is saved, on purpose: V2 says once that it offloaded nothing.
    warnings.filterwarnings("ignore", message="the V2 CPU offload context ran all")
    times = {
        name: time_case(fn, args.device, args.iters) for name, fn in cases(args.device).items()
    }
    print(f"torch {torch.__version__}, device {args.device}, us per iteration of {LAYERS} layers")
    for name, us in times.items():
        print(f"  {name:26s} {us:8.1f}")
    over = (times["v2 fwd+bwd"] - times["floor fwd+bwd"]) / LAYERS
    hook = (times["floor + prehooks fwd+bwd"] - times["floor fwd+bwd"]) / LAYERS
    print(f"  v2 over the floor: {over:.1f} us per layer; a Python pre-hook: {hook:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
