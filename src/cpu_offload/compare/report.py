"""Presenting a comparison: a terminal table, JSON, and a timeline picture."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .runner import CompareReport, VariantResult

__all__ = ["format_table", "write_json", "write_plot"]

_MIB = 1024 * 1024


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: CompareReport) -> str:
    """The report as aligned text for a terminal."""
    none = report.result("none")
    sim = " (SIMULATED)" if report.simulated else ""
    head = [
        "variant",
        "max|dloss|",
        "max|dgrad|",
        f"peak MiB{sim}",
        "x none",
        f"step ms{sim}",
        "x none",
        "D2H GB/s",
        "H2D GB/s",
        "stall ms",
    ]
    rows = [head]
    for r in report.results:
        rows.append(
            [
                r.name,
                f"{r.max_loss_diff:.3g}",
                f"{r.max_grad_diff:.3g}",
                f"{r.peak_bytes / _MIB:,.1f}",
                _fmt(r.peak_bytes / none.peak_bytes if none.peak_bytes else None, ".3f"),
                f"{r.step_ms:.2f}",
                _fmt(r.step_ms / none.step_ms if none.step_ms else None, ".3f"),
                _fmt(r.offload_gbps, ".1f"),
                _fmt(r.reload_gbps, ".1f"),
                _fmt(r.stall_ms, ".2f"),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    c = report.config
    out = [
        f"cpu-offload compare: {c['model']} x{c['layers']} (hidden {c['hidden']}, heads {c['heads']}, "
        f"seq {c['seq']}, batch {c['batch']}, {c['dtype']}), k={c['offloaded']} offloaded, "
        f"{c['steps']} steps",
        f"device: {report.device}; torch {report.torch_version}; deterministic kernels: "
        f"{c['deterministic']}",
    ]
    if report.link_d2h_gbps is not None:
        out.append(
            f"pinned copy in this run: D2H {report.link_d2h_gbps:.1f} GB/s, H2D "
            f"{report.link_h2d_gbps:.1f} GB/s, both at once {report.link_duplex_gbps:.1f} GB/s"
        )
    out.append(
        f"noise floor (two runs without offloading): loss {report.noise_floor_loss:.3g}, "
        f"gradients {report.noise_floor_grad:.3g}"
    )
    out += ["", *lines, ""]
    if report.floor_ms:
        floors = ", ".join(f"{name} {ms:.2f} ms" for name, ms in report.floor_ms.items())
        out.append(f"transfer-bound floor of the default schedule (model): {floors}")
    exact = [r.name for r in report.results if r.max_loss_diff == 0 and r.max_grad_diff == 0]
    inexact = [r.name for r in report.results if r.name not in exact]
    out.append("bit-identical to no offloading: " + (", ".join(exact) or "none"))
    if inexact:
        out.append("DIFFERENT from no offloading: " + ", ".join(inexact))
    out += report.notes
    return "\n".join(out)


def _result_dict(r: VariantResult) -> dict[str, object]:
    d = dataclasses.asdict(r)
    d["spans"] = [dataclasses.asdict(s) for s in r.spans]
    return d


def write_json(report: CompareReport, path: str | Path) -> None:
    """Write the whole report, timelines included, as JSON."""
    data = dataclasses.asdict(report)
    data["results"] = [_result_dict(r) for r in report.results]
    Path(path).write_text(json.dumps(data, indent=2, default=str))


_COLORS = {"compute": "#4C72B0", "offload": "#DD8452", "reload": "#55A868", "stall": "#C44E52"}


def write_plot(
    report: CompareReport, path: str | Path, variants: tuple[str, ...] = ("v2", "v1-async")
) -> None:
    """Draw the stream timeline of one step per variant, and memory over the step.

    Raises:
        RuntimeError: If matplotlib is not installed (``pip install cpu-offload[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("--plot needs matplotlib: pip install 'cpu-offload[plot]'") from err
    shown = [r for r in report.results if r.name in variants and r.spans]
    if not shown:
        shown = [r for r in report.results if r.spans][:1]
    fig, axes = plt.subplots(len(shown) + 1, 1, figsize=(12, 2.2 * len(shown) + 3), squeeze=False)
    lanes = ["compute", "offload", "reload", "stall"]
    for ax, r in zip(axes[:, 0], shown, strict=False):
        for span in r.spans:
            y = lanes.index(span.lane)
            ax.barh(
                y,
                span.end_ms - span.start_ms,
                left=span.start_ms,
                height=0.6,
                color=_COLORS[span.lane],
                edgecolor="white",
                linewidth=0.5,
            )
            if span.lane == "compute" and span.end_ms - span.start_ms > 0:
                ax.text(
                    (span.start_ms + span.end_ms) / 2,
                    y,
                    span.label,
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
        ax.set_yticks(range(len(lanes)), ["compute", "offload (D2H)", "reload (H2D)", "stall"])
        ax.invert_yaxis()
        ax.set_title(
            f"{r.name}: one step, {r.step_ms:.1f} ms" + (" (simulated)" if report.simulated else "")
        )
        ax.set_xlabel("ms")
    mem_ax = axes[-1, 0]
    for r in report.results:
        if r.memory:
            t, m = zip(*r.memory, strict=True)
            mem_ax.step(t, [b / _MIB for b in m], where="post", label=r.name)
    mem_ax.set_xlabel("ms")
    mem_ax.set_ylabel("MiB above the step's start" + (" (simulated)" if report.simulated else ""))
    mem_ax.set_title("memory over the step")
    mem_ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
