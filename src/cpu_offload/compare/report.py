"""Presenting a comparison: text for a terminal (within 100 columns unless asked
otherwise) and JSON; :mod:`cpu_offload.compare.plot` draws it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ._table import DEFAULT_WIDTH, Column, table, wrap
from .optimizer import OptimizerReport
from .runner import CompareReport, VariantResult

__all__ = [
    "format_bytes",
    "format_optimizer_table",
    "format_table",
    "write_json",
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


def format_table(report: CompareReport, width: int | None = DEFAULT_WIDTH) -> str:
    """The report as aligned text for a terminal: the activation variants, then the
    optimizer section when it ran.

    Args:
        report: From :func:`~cpu_offload.compare.run_compare`.
        width: The most characters a line has: tables wider than that are split into
            tables of fewer columns and longer lines are wrapped. None: every table in
            one piece and no line wrapped.

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
        out += _activation_lines(report, width)
    out = wrap(out, width)
    if report.optimizer is not None:
        out += ["", format_optimizer_table(report.optimizer, width)]
    return "\n".join(out)


_ACTIVATION_COLUMNS = (
    Column("", "variant"),
    Column("max", "|dloss|"),
    Column("max", "|dgrad|"),
    Column("peak", "MiB"),
    Column("peak", "x none"),
    Column("step", "ms"),
    Column("spread", "ms"),
    Column("step", "x none"),
    Column("D2H", "GB/s"),
    Column("H2D", "GB/s"),
    Column("stall", "ms"),
)


def _activation_lines(report: CompareReport, width: int | None) -> list[str]:
    none = report.result("none")
    rows = []
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
    lines = table(_ACTIVATION_COLUMNS, rows, width)
    if report.simulated:
        lines.insert(0, "peak MiB, step ms and stall ms are SIMULATED (no GPU): see the note below")
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
    out.append(_fastest_line(report))
    return out


def _fastest_line(report: CompareReport) -> str:
    """The fastest variant at or under each peak the variants reached.

    Only the peaks where the fastest changes are named: above one of them, up to the
    next, the same variant stays the fastest (the lower peak wins a tie).
    """
    none = report.result("none")
    frontier: list[VariantResult] = []
    for r in sorted(report.results, key=lambda r: (r.peak_bytes, r.step_ms)):
        if not frontier or r.step_ms < frontier[-1].step_ms:
            frontier.append(r)
    parts = [
        f"at <= {format_bytes(r.peak_bytes)}: {r.name}"
        + (f" ({r.step_ms / none.step_ms:.2f}x none)" if none.step_ms else "")
        for r in frontier
    ]
    kind = "simulated " if report.simulated else ""
    return f"fastest by {kind}step time and peak: " + "; ".join(parts)


_OPTIMIZER_COLUMNS = (
    Column("", "optimizer offload"),
    Column("GPU MiB", "params+state"),
    Column("GPU", "x none"),
    Column("host MiB", "state"),
    Column("step", "ms"),
    Column("step", "x none"),
    Column("max", "|dparam|"),
    Column("max", "|dmaster|"),
    Column("max", "|dloss|"),
    Column("peak", "MiB"),
)


def format_optimizer_table(report: OptimizerReport, width: int | None = DEFAULT_WIDTH) -> str:
    """The optimizer section as aligned text for a terminal.

    Args:
        report: The ``optimizer`` section of a :class:`CompareReport`.
        width: As for :func:`format_table`.

    Returns:
        The text, without a trailing newline.
    """
    where = "accounted, CPU stand-in" if report.stand_in else "measured"
    timing = "CPU, not a GPU" if report.stand_in else "median"
    # The peak is measured on a GPU only.
    columns = _OPTIMIZER_COLUMNS if not report.stand_in else _OPTIMIZER_COLUMNS[:-1]
    rows = []
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
    lines = [
        title,
        "",
        f"GPU MiB params+state ({where}); step ms ({timing})",
        *table(columns, rows, width),
        "",
        *verdict,
        *report.notes,
    ]
    return "\n".join(wrap(lines, width))


def _result_dict(r: VariantResult) -> dict[str, object]:
    d = dataclasses.asdict(r)
    d["spans"] = [dataclasses.asdict(s) for s in r.spans]
    return d


def write_json(report: CompareReport, path: str | Path) -> None:
    """Write the whole report, timelines included, as JSON."""
    data = dataclasses.asdict(report)
    data["results"] = [_result_dict(r) for r in report.results]
    Path(path).write_text(json.dumps(data, indent=2, default=str))
