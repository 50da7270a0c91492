"""The link between a CUDA device and pinned host memory, measured.

``compare`` reports it beside each run and the planner models copies with it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

__all__ = ["measure_link"]


def measure_link(nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float, float]:
    """Pinned-memory copy bandwidth in GB/s: device-to-host, host-to-device, both at once."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            s1.wait_stream(torch.cuda.current_stream())
            s2.wait_stream(torch.cuda.current_stream())
            fn()
            torch.cuda.current_stream().wait_stream(s1)
            torch.cuda.current_stream().wait_stream(s2)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    def d2h() -> None:
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)

    def both() -> None:
        d2h()
        h2d()

    d = nbytes / timed(d2h) / 1e6
    h = nbytes / timed(h2d) / 1e6
    b = 2 * nbytes / timed(both) / 1e6
    return d, h, b
