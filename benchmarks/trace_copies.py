"""Where a profiled step waits: the compute stream's gaps and the link's busy spans.

Reads a chrome trace that ``torch.profiler`` exported (``.json`` or ``.json.gz``; the
shared ``megatron_gpt.py --profile-k K --trace PREFIX`` writes one of two steps) and
prints, for the stream that ran the most kernels, every gap between kernels longer than
``--gap`` ms, and, per stream and direction, the spans during which copies ran back to
back (copies closer than 0.2 ms are one span). Times are ms from the trace's first GPU
event. A step bound by its copies out shows the compute stream waiting at the release
points while the device-to-host span runs on.

    python benchmarks/trace_copies.py trace.json.gz --gap 1
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

DIRECTIONS = ("DtoH", "HtoD")
JOIN_US = 200  # copies closer than this are one span


def load(path: Path) -> list[dict[str, Any]]:
    """The trace's GPU events (kernels, copies, memsets), by start time."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(gpu, key=lambda e: e["ts"])


def spans(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Back-to-back runs of ``events`` as (start, end) in trace microseconds."""
    out: list[list[float]] = []
    for e in events:
        start, end = e["ts"], e["ts"] + e["dur"]
        if out and start - out[-1][1] < JOIN_US:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def report(events: list[dict[str, Any]], gap_ms: float) -> str:
    """The compute stream's gaps over ``gap_ms`` and each copy direction's spans."""
    t0 = events[0]["ts"]

    def ms(t: float) -> str:
        return f"{(t - t0) / 1e3:.1f}"

    kernels: dict[int, list[dict[str, Any]]] = defaultdict(list)
    copies: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["cat"] == "kernel":
            kernels[e["tid"]].append(e)
        elif e["cat"] == "gpu_memcpy":
            for d in DIRECTIONS:
                if d in e["name"]:
                    copies[(e["tid"], d)].append(e)
    stream, ks = max(kernels.items(), key=lambda kv: len(kv[1]))
    lines = [f"compute stream {stream}: {len(ks)} kernels, gaps over {gap_ms} ms:"]
    for before, after in zip(ks, ks[1:], strict=False):
        gap = after["ts"] - (before["ts"] + before["dur"])
        if gap > gap_ms * 1e3:
            lines.append(f"  at {ms(before['ts'] + before['dur'])} ms: {gap / 1e3:.2f} ms")
    for (tid, d), es in sorted(copies.items()):
        mib = sum(e.get("args", {}).get("bytes", 0) for e in es) / 2**20
        lines.append(f"stream {tid} {d}: {len(es)} copies, {mib:.0f} MiB, spans:")
        for a, b in spans(es):
            lines.append(f"  {ms(a)} to {ms(b)} ms ({(b - a) / 1e3:.1f} ms)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--gap", type=float, default=1.0, help="smallest gap to print, ms")
    args = p.parse_args()
    if args.gap < 0:
        p.error(f"--gap must be >= 0 (ms), got {args.gap}")
    events = load(args.trace)
    if not events:
        p.error(f"{args.trace}: no GPU events (profile with ProfilerActivity.CUDA)")
    print(report(events, args.gap))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
