"""Whether destroying one CUDA graph while another is captured invalidates that capture.

Why ``tests/test_graphs_cuda.py`` collects garbage before each test: graphs that an
earlier test left in a reference cycle (``torch.cuda.make_graphed_callables`` makes one)
are destroyed whenever the garbage collector runs, which may be inside a later capture.
Each case runs in a fresh process, since a failed capture leaves CUDA state behind:

* ``none``: no earlier graph;
* ``kept``: an earlier graph that stays alive through the capture;
* ``pinned``: an earlier graph that took pinned host memory during its capture (as the
  offload context does without ``retain_pinned_cpu_buffers``), whose last reference goes
  between the two matrix products of the new capture;
* ``plain``: the same with an earlier graph without host memory.

    python benchmarks/graph_destroyed_in_capture.py
"""

from __future__ import annotations

import subprocess
import sys

import torch

CASES = ("none", "kept", "pinned", "plain")


def _earlier_graph(pinned: bool) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    src = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = src * 2
        if pinned:
            host = torch.empty(4 << 20, dtype=torch.uint8, pin_memory=True)
            host.view(torch.float32).copy_(out, non_blocking=True)
            del host
    torch.cuda.synchronize()
    return graph


def run(case: str) -> str:
    """Capture two matrix products; between them, the earlier graph of ``case`` dies (but
    for ``none`` and ``kept``)."""
    x = torch.randn(256, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: cuBLAS's handle and workspace before capturing
        for _ in range(3):
            (x @ x) @ x
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    earlier = None if case == "none" else _earlier_graph(case == "pinned")
    holder = {"graph": earlier}
    del earlier
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            y = x @ x
            if case != "kept":
                holder.clear()  # the earlier graph's last reference
            y = y @ x
        torch.cuda.synchronize()
    except Exception as exc:  # reported, whatever CUDA raised
        return f"capture failed: {str(exc).splitlines()[0]}"
    return "capture succeeded"


def main() -> int:
    if len(sys.argv) > 1:
        if sys.argv[1] not in CASES:
            raise SystemExit(f"case must be one of {', '.join(CASES)}, not {sys.argv[1]!r}")
        print(run(sys.argv[1]))
        return 0
    for case in CASES:
        done = subprocess.run(
            [sys.executable, __file__, case], capture_output=True, text=True, timeout=300
        )
        lines = (done.stdout or done.stderr).strip().splitlines()
        print(f"{case}: {lines[-1] if lines else ''} (exit {done.returncode})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
