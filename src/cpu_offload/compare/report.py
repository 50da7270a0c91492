"""Presenting a comparison: a terminal table, JSON, and a timeline picture."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .optimizer import OptimizerReport
from .runner import CompareReport, VariantResult

__all__ = [
    "format_bytes",
    "format_optimizer_table",
    "format_table",
    "write_json",
    "write_plot",
]

_MIB = 1024 * 1024


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps at least 1 of it.

    Example:
        >>> format_bytes(512), format_bytes(3 * 2**19), format_bytes(5 * 2**40)
        ('512 B', '1.50 MiB', '5,120.00 GiB')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{nbytes:.0f} B"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _align(rows: list[list[str]]) -> list[str]:
    """Rows of cells as aligned lines: the first column left, the others right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def format_table(report: CompareReport) -> str:
    """The report as aligned text for a terminal: the activation variants, then the
    optimizer section when it ran.

    Args:
        report: From :func:`~cpu_offload.compare.run_compare`.

    Returns:
        The text, without a trailing newline.
    """
    c = report.config
    sizes = ", ".join(
        f"{name} {c[name]}"
        for name in ("hidden", "heads", "seq", "batch")
        if c.get(name) is not None
    )
    if c.get("parameters") is not None:
        millions = float(c["parameters"]) / 1e6  # type: ignore[arg-type]
        sizes = ", ".join(filter(None, [sizes, f"{millions:,.1f}M parameters"]))
    sizes = ", ".join(filter(None, [sizes, str(c["dtype"])]))
    version = f"cpu-offload {report.package_version}; " if report.package_version else ""
    out = [
        f"cpu-offload compare: {c['model']} x{c['layers']} ({sizes})"
        + (f", k={c['offloaded']} offloaded" if report.results else "")
        + f", {c['steps']} steps",
        f"device: {report.device}; {version}torch {report.torch_version}; deterministic "
        f"kernels: {c['deterministic']}",
    ]
    if report.results:
        out += _activation_lines(report)
    if report.optimizer is not None:
        out += ["", format_optimizer_table(report.optimizer)]
    return "\n".join(out)


def _activation_lines(report: CompareReport) -> list[str]:
    none = report.result("none")
    sim = " (SIMULATED)" if report.simulated else ""
    head = [
        "variant",
        "max|dloss|",
        "max|dgrad|",
        f"peak MiB{sim}",
        "x none",
        f"step ms{sim}",
        "spread ms",
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
                "-" if report.simulated else f"{r.step_spread_ms:.2f}",
                _fmt(r.step_ms / none.step_ms if none.step_ms else None, ".3f"),
                _fmt(r.offload_gbps, ".1f"),
                _fmt(r.reload_gbps, ".1f"),
                _fmt(r.stall_ms, ".2f"),
            ]
        )
    lines = _align(rows)
    out: list[str] = []
    if report.link_d2h_gbps is not None:
        out.append(
            f"pinned copy in this run: D2H {report.link_d2h_gbps:.1f} GB/s, H2D "
            f"{report.link_h2d_gbps:.1f} GB/s, both at once {report.link_duplex_gbps:.1f} GB/s"
        )
    out.append(
        f"noise floor (two runs without offloading): loss {_fmt(report.noise_floor_loss, '.3g')}, "
        f"gradients {_fmt(report.noise_floor_grad, '.3g')}"
    )
    if report.same_random_state:
        generators = "CPU generator" if report.simulated else "CPU and CUDA generators"
        out.append(
            f"random state: every step of every variant starts from the same one ({generators}),"
            " so dropout draws the same masks in each"
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
    return out


def format_optimizer_table(report: OptimizerReport) -> str:
    """The optimizer section as aligned text for a terminal.

    Args:
        report: The ``optimizer`` section of a :class:`CompareReport`.

    Returns:
        The text, without a trailing newline.
    """
    where = "accounted, CPU stand-in" if report.stand_in else "measured"
    timing = "CPU, not a GPU" if report.stand_in else "median"
    head = [
        "optimizer offload",
        f"GPU MiB params+state ({where})",
        "x none",
        "host state MiB",
        f"step ms ({timing})",
        "x none",
        "max|dparam|",
        "max|dmaster|",
        "max|dloss|",
    ]
    if not report.stand_in:
        head.append("peak MiB")
    rows = [head]
    for r in report.results:
        row = [
            r.name,
            f"{r.device_bytes / _MIB:,.1f}",
            f"{r.device_ratio:.3f}",
            f"{r.host_state_bytes / _MIB:,.1f}",
            f"{r.step_ms:.2f}",
            # CPU step times of the stand-in say nothing about a GPU: no ratio for them.
            "-" if report.stand_in else f"{r.step_ratio:.3f}",
            f"{r.max_param_diff:.3g}",
            _fmt(r.max_master_diff, ".3g"),
            f"{r.max_loss_diff:.3g}",
        ]
        if not report.stand_in:
            row.append(f"{r.peak_allocated_bytes / _MIB:,.1f}")
        rows.append(row)
    hyper = ", ".join(f"{k} {v:g}" for k, v in report.hyperparameters.items())
    title = (
        f"optimizer offloading: HybridDeviceOptimizer, {report.optimizer} on both sides ({hyper}), "
        f"param_update_in_fp32={report.param_update_in_fp32}, {report.steps} steps after "
        f"{report.warmup} warm-up; device: {report.device}"
    )
    close = [r.name for r in report.results if r.within_tolerance()]
    far = [r.name for r in report.results if r.name not in close]
    verdict = [
        "within 1e-3 of no offloading (loss; parameters, through fp32 masters where there "
        "are any): " + ("; ".join(close) or "none")
    ]
    if far:
        verdict.append("BEYOND 1e-3 of no offloading: " + "; ".join(far))
    return "\n".join([title, "", *_align(rows), "", *verdict, *report.notes])


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
    """Draw the stream timeline of one step per variant, memory over the step, and the
    optimizer section's GPU memory and step time per configuration (when it ran).

    Args:
        report: From :func:`~cpu_offload.compare.run_compare`.
        path: The file to write, in the format its suffix names (``.png``, ``.pdf``,
            ``.svg``, ...: what matplotlib writes).
        variants: Activation variants whose timelines are drawn (the first variant
            with a timeline when none of them ran).

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
    heights = [2.2] * len(shown)
    if report.results:
        heights.append(3.0)
    if report.optimizer is not None:
        heights.append(3.2)
    fig, axes = plt.subplots(len(heights), 1, figsize=(12, sum(heights) + 0.5), squeeze=False)
    panels = list(axes[:, 0])
    for ax, r in zip(panels, shown, strict=False):
        _draw_timeline(ax, r, report.simulated)
    if report.results:
        _draw_memory(panels[len(shown)], report)
    if report.optimizer is not None:
        _draw_optimizer(panels[-1], report.optimizer)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_LANES = ("compute", "offload", "reload", "stall")


def _draw_timeline(ax: Any, r: VariantResult, simulated: bool) -> None:
    """One variant's step: a bar per span, one lane per stream."""
    for span in r.spans:
        y = _LANES.index(span.lane)
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
    ax.set_yticks(range(len(_LANES)), ["compute", "offload (D2H)", "reload (H2D)", "stall"])
    ax.invert_yaxis()
    ax.set_title(f"{r.name}: one step, {r.step_ms:.1f} ms" + (" (simulated)" if simulated else ""))
    ax.set_xlabel("ms")


def _draw_memory(ax: Any, report: CompareReport) -> None:
    """Memory above the step's start over one step, one line per activation variant."""
    for r in report.results:
        if r.memory:
            t, m = zip(*r.memory, strict=True)
            ax.step(t, [b / _MIB for b in m], where="post", label=r.name)
    ax.set_xlabel("ms")
    ax.set_ylabel("MiB above the step's start" + (" (simulated)" if report.simulated else ""))
    ax.set_title("memory over the step")
    ax.legend(fontsize=7, ncol=4)


def _draw_optimizer(ax: Any, report: OptimizerReport) -> None:
    """GPU memory of parameters plus optimizer state per configuration, step ratio beside."""
    names = [r.name for r in report.results]
    x = range(len(names))
    ax.bar(x, [r.device_bytes / _MIB for r in report.results], color=_COLORS["compute"])
    ax.set_xticks(list(x), names, fontsize=7)
    ax.set_ylabel("GPU MiB, params + state", fontsize=8)
    if report.stand_in:
        # CPU step times of the stand-in predict nothing about a GPU: not drawn.
        ax.set_title(
            f"optimizer offloading ({report.optimizer}): GPU memory by accounting "
            "(CPU stand-in; step times not shown)"
        )
        return
    ratio_ax = ax.twinx()
    ratio_ax.plot(list(x), [r.step_ratio for r in report.results], "o-", color=_COLORS["offload"])
    ratio_ax.set_ylabel("step time x no offload", fontsize=8)
    ratio_ax.set_ylim(bottom=0)
    ax.set_title(f"optimizer offloading ({report.optimizer}): GPU memory (bars), step time (line)")
