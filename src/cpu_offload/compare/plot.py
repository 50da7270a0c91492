"""The picture of a comparison: each shown variant's step on its streams, memory over
the step for every variant on the same time axis, and the optimizer section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .optimizer import OptimizerReport
from .runner import CompareReport, VariantResult

__all__ = ["write_plot"]

_MIB = 1024 * 1024

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
    fig = _figure(plt, report, variants)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _figure(plt: Any, report: CompareReport, variants: tuple[str, ...]) -> Any:
    """The figure :func:`write_plot` saves (``plt``: ``matplotlib.pyplot``)."""
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
        # One time axis for the timelines and the memory: a moment is at the same place.
        end = max(
            [s.end_ms for r in shown for s in r.spans]
            + [t for r in report.results for t, _ in r.memory]
            + [1e-3]
        )
        for ax in panels[: len(shown) + 1]:
            ax.set_xlim(0.0, end)
    if report.optimizer is not None:
        _draw_optimizer(panels[-1], report.optimizer)
    fig.tight_layout()
    return fig


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


#: Line styles and markers of the memory curves, so that curves drawn over each other
#: stay told apart.
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "x", "+", "*")


def _curve_styles(names: list[str]) -> dict[str, tuple[str, str, float]]:
    """(line style, marker, line width) of each memory curve, each pair different.

    Later curves are thinner, so that one drawn over an earlier one leaves it visible.

    Example:
        >>> _curve_styles(["none", "v2"])
        {'none': ('-', 'o', 3.0), 'v2': ('--', 's', 2.6)}
    """
    return {
        name: (_STYLES[i % len(_STYLES)], _MARKERS[i % len(_MARKERS)], max(3.0 - 0.4 * i, 0.8))
        for i, name in enumerate(names)
    }


def _same_curves(report: CompareReport) -> list[list[str]]:
    """Groups of variants whose memory curves are identical (each group of two or more)."""
    groups: dict[tuple[tuple[float, int], ...], list[str]] = {}
    for r in report.results:
        if r.memory:
            groups.setdefault(tuple(r.memory), []).append(r.name)
    return [names for names in groups.values() if len(names) > 1]


def _draw_memory(ax: Any, report: CompareReport) -> None:
    """Memory above the step's start over one step, one line per activation variant."""
    drawn = [r for r in report.results if r.memory]
    styles = _curve_styles([r.name for r in drawn])
    for r in drawn:
        t, m = zip(*r.memory, strict=True)
        style, marker, lw = styles[r.name]
        ax.step(
            t,
            [b / _MIB for b in m],
            where="post",
            label=r.name,
            linestyle=style,
            marker=marker,
            markersize=4,
            linewidth=lw,
            alpha=0.85,
        )
    ax.set_xlabel("ms")
    ax.set_ylabel("MiB above the step's start" + (" (simulated)" if report.simulated else ""))
    ax.set_title("memory over the step")
    same = _same_curves(report)
    title = "same curve: " + "; ".join(" = ".join(g) for g in same) if same else None
    ax.legend(fontsize=7, ncol=4, title=title, title_fontsize=7, loc="best")


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
