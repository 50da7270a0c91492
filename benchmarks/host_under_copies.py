"""Does the host's own work slow down while copies stream between the GPU and host memory?

Where the host bounds a forward, offloading stretches layers the engine does not touch
(``host_timeline.py``). This measures, alternating, the host time of a fixed piece of
work while the GPU is idle and while large copies stream to pinned host memory, to the
device, or both ways: ``launch`` is 500 tiny CUDA adds (kernel launches, no waiting),
``cpu`` is 500 tiny CPU adds (the interpreter and the dispatcher only), and ``adamw`` is
one step of PyTorch's fused host AdamW, the work of an offloaded optimizer, reported as
its rate in G elements per second (it reads and writes 28 bytes of host memory per
element: does it share the memory's bandwidth with the copies?).

    python benchmarks/host_under_copies.py
    python benchmarks/host_under_copies.py --gib 1 --rounds 10
    python benchmarks/host_under_copies.py --adamw-numel 0    # without the AdamW samples
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _launches(small: torch.Tensor, ops: int) -> float:
    start = time.perf_counter()
    x = small
    for _ in range(ops):
        x = x + 1.0
    elapsed = time.perf_counter() - start
    torch.cuda.current_stream().synchronize()  # the adds only, not the copies
    return elapsed * 1e3


def _cpu(ops: int) -> float:
    start = time.perf_counter()
    v = torch.zeros(2)
    for _ in range(ops):
        v = v + 1.0
    return (time.perf_counter() - start) * 1e3


def _adamw_rate(optimizer: torch.optim.Optimizer, numel: int) -> float:
    start = time.perf_counter()
    optimizer.step()
    return numel / (time.perf_counter() - start) / 1e9


def _host_adamw(numel: int) -> torch.optim.Optimizer:
    chunk = 1 << 26  # steps a list of tensors, as an offloaded optimizer's buckets do
    params = []
    for start in range(0, numel, chunk):
        param = torch.zeros(min(chunk, numel - start))
        param.grad = torch.full_like(param, 1e-3)
        params.append(param)
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    optimizer.step()  # creates the moments
    return optimizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="size of each copy")
    p.add_argument("--copies", type=int, default=10, help="copies queued per condition")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--samples", type=int, default=12, help="samples per condition and round")
    p.add_argument("--ops", type=int, default=500)
    p.add_argument(
        "--adamw-numel", type=int, default=1 << 27, help="elements of the host AdamW (0: none)"
    )
    p.add_argument("--adamw-samples", type=int, default=3, help="AdamW steps per condition")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA GPU")
    n = int(args.gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    small = torch.zeros(16, device="cuda")
    adamw = _host_adamw(args.adamw_numel) if args.adamw_numel > 0 else None
    d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()
    res: dict[str, list[float]] = {}
    short = 0
    for _ in range(args.rounds):
        for cond in ("idle", "to host", "to device", "both ways"):
            torch.cuda.synchronize()
            for _ in range(args.copies):
                if cond in ("to host", "both ways"):
                    with torch.cuda.stream(d2h):
                        host.copy_(dev, non_blocking=True)
                if cond in ("to device", "both ways"):
                    with torch.cuda.stream(h2d):
                        dev.copy_(host, non_blocking=True)
            if adamw is not None:  # first, while the copies surely run
                for _ in range(args.adamw_samples):
                    rate = _adamw_rate(adamw, args.adamw_numel)
                    res.setdefault(f"{cond}, adamw", []).append(rate)
            for _ in range(args.samples):
                res.setdefault(f"{cond}, launch", []).append(_launches(small, args.ops))
                res.setdefault(f"{cond}, cpu", []).append(_cpu(args.ops))
            start = time.perf_counter()
            torch.cuda.synchronize()
            if cond != "idle" and time.perf_counter() - start < 0.005:
                short += 1  # the copies ended before the samples did
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {args.copies} copies "
          f"of {args.gib} GiB per condition; ms per {args.ops} ops, adamw in G elements/s "
          f"of {args.adamw_numel} elements")  # fmt: skip
    for key, values in res.items():
        print(f"  {key:20s} median {statistics.median(values):7.3f}  min {min(values):7.3f}")
    if short:
        print(f"warning: in {short} conditions the copies ended before the samples: raise --copies")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
