"""Holding a CUDA stream back while the host enqueues what is to be timed.

CUDA events time the stream, not the work between them: where the host is slower to
enqueue the work than the device is to run it (a slow phase of a shared machine, another
thread holding the GIL), the stream waits for the host and the events time the host. A
spin kernel queued first (``torch.cuda._sleep``, a busy wait of a number of GPU cycles)
keeps the stream busy while the host enqueues the events and the work behind it; the
events then time the work alone. The planner's probe (NOTE [Device time under a host-bound
step] in ``plan/_probe.py``) and the link's measurement (:mod:`cpu_offload._link`) use it.
"""

from __future__ import annotations

import torch

__all__ = ["cycles_per_ms"]


def cycles_per_ms() -> float:
    """How many cycles of ``torch.cuda._sleep`` the current device spins per millisecond
    now.

    Returns:
        The rate of a spin of a million cycles timed with CUDA events. It follows the
        GPU's clock (an idle GPU clocks down), so it is measured where it is used, and a
        spin sized by it is a lower bound only while the clock does not slow down.
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 1_000_000
    torch.cuda._sleep(cycles)  # the first launch loads the kernel
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)
