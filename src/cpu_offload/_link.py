"""The link between a CUDA device and pinned host memory, measured.

``compare`` reports it beside each run and the planner models copies with it.

NOTE [Timing the link]
A copy can only be slowed: by the host, when the stream reaches the start event before
the host has enqueued the copy behind it, and by the machine's other work on the link or
in host memory. Each copy is therefore queued behind a spin kernel (:mod:`._hold`) that
keeps the stream busy while the host enqueues the events and the copy (a repeat whose
spin ended first is run again, with a longer spin), and the link's rate is the fastest
of the repeats. A median of five repeats timed without the spin read 31.2 GB/s device to
host, 43.3 host to device and 50.1 both ways in a profile taken right after another
model's, on an H100 host whose other profiles read about 54, 54 and 81 to 94: a slow
host or other traffic, which the spin and the fastest repeat each keep out. The planner
then modelled offloading a transformers Llama's layers 33 to 40% slower than it measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._args import check_int
from ._hold import cycles_per_ms

__all__ = ["fastest_clean", "measure_link"]

#: How long the spin holds the stream while the host enqueues a timed copy (ms): far
#: longer than a few launches take, and than the interpreter's switch between threads.
HOLD_MS = 20.0


def measure_link(nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float, float]:
    """Pinned-memory copy bandwidth of the current CUDA device, timed on the device alone.

    Args:
        nbytes: Bytes per copy (at least 1).
        repeats: Timed copies of each kind, after one warm-up copy (at least 1); the
            fastest counts (NOTE [Timing the link]). A repeat whose spin ended before the
            host had enqueued the copy is run again with a longer spin (at most
            ``2 * repeats`` such repeats; if no repeat is clean, the fastest of them counts).

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
    main = torch.cuda.current_stream()

    def timed_behind(fn: Callable[[], None]) -> Callable[[int], tuple[float, bool]]:
        def run(hold: int) -> tuple[float, bool]:
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
            # Still spinning once all is enqueued: the events time the copies alone.
            reached = a.query()
            b.synchronize()
            return a.elapsed_time(b), reached

        return run

    def d2h() -> None:
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)

    def both() -> None:
        d2h()
        h2d()

    # A warm-up of each kind, which also runs the GPU's clock up before the spin's rate
    # is measured.
    for fn in (d2h, h2d):
        fn()
    torch.cuda.synchronize()
    hold = int(HOLD_MS * cycles_per_ms())
    d_ms, hold = fastest_clean(timed_behind(d2h), repeats, hold)
    h_ms, hold = fastest_clean(timed_behind(h2d), repeats, hold)
    b_ms, hold = fastest_clean(timed_behind(both), repeats, hold)
    return nbytes / d_ms / 1e6, nbytes / h_ms / 1e6, 2 * nbytes / b_ms / 1e6


def fastest_clean(
    run: Callable[[int], tuple[float, bool]], repeats: int, hold: int
) -> tuple[float, int]:
    """The fastest of ``repeats`` clean timings (NOTE [Timing the link]).

    Args:
        run: Times one repeat behind a spin of ``hold`` cycles: its ms, and whether the
            stream had reached the start event before the host had enqueued everything
            (late: the spin ended first, and the repeat may have timed the host).
        repeats: Clean timings wanted (at least 1).
        hold: The spin's cycles; doubled after each late repeat.

    Returns:
        ``(ms, hold)``: the fastest clean timing (or, after ``2 * repeats`` late ones,
        the fastest late one), and the spin to use from here.

    Example:
        >>> def run(hold):  # late while the spin is shorter than 400 cycles
        ...     return (5.0 if hold < 400 else 1.0 + hold / 1000), hold < 400
        >>> fastest_clean(run, repeats=2, hold=100)
        (1.4, 400)
    """
    clean: list[float] = []
    late: list[float] = []
    while len(clean) < repeats and len(late) < 2 * repeats:
        ms, reached = run(hold)
        if reached:
            # The GPU's clock ran slower when the spin's rate was measured than now.
            late.append(ms)
            hold *= 2
        else:
            clean.append(ms)
    return min(clean or late), hold
