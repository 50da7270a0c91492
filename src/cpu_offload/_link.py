"""The link between a CUDA device and pinned host memory, measured.

``compare`` reports it beside each run and the planner models copies with it.

NOTE [Timing the link]
A copy can only be slowed: by the host, when the stream reaches the start event before
the host has enqueued the copy behind it, and by the machine's other work on the link or
in host memory. Each copy is therefore queued behind a spin kernel (:mod:`._hold`) that
keeps the stream busy while the host enqueues the events and the copy, and the link's
rate is the fastest of the repeats. A median of five repeats timed without the spin read
31 GB/s device to host (54 in every other profile of the same H100 host) in a profile
taken right after another model's: the planner then modelled offloading a transformers
Llama's layers 33 to 40% slower than it measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._args import check_int
from ._hold import cycles_per_ms

__all__ = ["measure_link"]

#: How long the spin holds the stream while the host enqueues a timed copy (ms): far
#: longer than a few launches take, and than the interpreter's switch between threads.
HOLD_MS = 20.0


def measure_link(nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float, float]:
    """Pinned-memory copy bandwidth of the current CUDA device, timed on the device alone.

    Args:
        nbytes: Bytes per copy (at least 1).
        repeats: Timed copies of each kind, after one warm-up copy (at least 1); the
            fastest counts (NOTE [Timing the link]).

    Returns:
        GB/s device to host, host to device, and both directions at once (the bytes of
        both copies over the time of the pair, on two streams).

    Raises:
        TypeError: If ``nbytes`` or ``repeats`` is not an int.
        ValueError: If either is below 1.
    """
    for name, value in (("nbytes", nbytes), ("repeats", repeats)):
        if check_int(name, value) < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    hold = int(HOLD_MS * cycles_per_ms())

    def timed(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(repeats + 1):  # the first copy of each kind is a warm-up
            main = torch.cuda.current_stream()
            torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(hold)
            a.record()
            s1.wait_stream(main)
            s2.wait_stream(main)
            fn()
            main.wait_stream(s1)
            main.wait_stream(s2)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return min(times[1:])

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
