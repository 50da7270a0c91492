"""compare's output for people: within 100 columns (``--wide`` for the rest), headers that
differ, a line naming the fastest variant at each peak, and a picture whose memory
curves stay visible on the timelines' time axis."""

from __future__ import annotations

import re

import pytest

from cpu_offload.cli import main
from cpu_offload.compare import (
    CompareConfig,
    CompareReport,
    OptimizerCompareConfig,
    OptimizerVariant,
    VariantResult,
    format_table,
    run_compare,
)
from cpu_offload.compare._table import Column, table
from cpu_offload.models import ModelSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MIB = 2**20
SPEC = ModelSpec(kind="gpt", hidden=32, heads=4, seq=16, batch=2, layers=4)
EVERY_VARIANT = ["v1-sync", "v1-async", "v1-async-db", "v2", "checkpoint", "save_on_cpu"]


@pytest.fixture(scope="module")
def cpu_report() -> CompareReport:
    """Every variant and an optimizer section, on the CPU stand-in."""
    config = CompareConfig(
        spec=SPEC,
        num_offloaded=2,
        variants=EVERY_VARIANT,
        steps=1,
        warmup=0,
        device="cpu",
        min_numel=256,
        optimizer=OptimizerCompareConfig(variants=(OptimizerVariant(0.5),)),
    )
    return run_compare(config)


def _gpu_like_report() -> CompareReport:
    """A report as a GPU run fills it: every column has a figure, some of them wide."""

    def row(name: str, peak_mib: float, ms: float, copies: bool) -> VariantResult:
        figures = {"offload_gbps": 24.6, "reload_gbps": 25.1, "stall_ms": 1.25} if copies else {}
        return VariantResult(name, 0.0, 0.0, int(peak_mib * MIB), ms,
                             step_spread_ms=0.75, **figures)  # type: ignore[arg-type]  # fmt: skip

    results = [
        row("none", 123_456.7, 1000.0, False),
        row("v1-sync", 74_074.0, 1310.0, False),
        row("v1-async-db", 98_765.4, 1040.0, True),
        row("v2", 74_074.0, 1050.0, True),
        row("checkpoint", 61_728.4, 1300.0, False),
    ]
    return CompareReport(
        config={
            "model": "gpt",
            "layers": 8,
            "offloaded": 2,
            "steps": 10,
            "dtype": "bfloat16",
            "deterministic": True,
        },  # fmt: skip
        device="NVIDIA H100 80GB HBM3",
        torch_version="2.13.0",
        simulated=False,
        noise_floor_loss=0.0,
        noise_floor_grad=0.0,
        link_d2h_gbps=24.9,
        link_h2d_gbps=25.3,
        link_duplex_gbps=44.1,
        results=results,
        notes=["WARNING: " + "a long note that goes on " * 20],
    )


def _table_headers(text: str) -> list[list[str]]:
    """The column names of each table of ``--wide`` text (the line above each rule)."""
    lines = text.splitlines()
    return [
        re.split(r"\s{2,}", lines[i - 1].strip())
        for i, line in enumerate(lines)
        if i and re.fullmatch(r"-{20,}", line)
    ]


@pytest.mark.parametrize("make", ["cpu", "gpu-like"])
def test_every_line_within_100_columns_and_wide_in_one_piece(
    make: str, cpu_report: CompareReport
) -> None:
    report = cpu_report if make == "cpu" else _gpu_like_report()
    narrow = format_table(report)
    assert max(len(line) for line in narrow.splitlines()) <= 100
    wide = format_table(report, width=None)
    tables = _table_headers(wide)
    assert len(tables) == (2 if report.optimizer is not None else 1)  # one piece each
    for headers in tables:
        assert len(headers) == len(set(headers)), headers  # no two columns alike
    activation = tables[0]
    assert "peak x none" in activation and "step x none" in activation
    assert "spread ms" in activation and "stall ms" in activation
    assert max(len(line) for line in wide.splitlines()) > 100  # notes are not wrapped


def test_a_table_too_wide_is_split_and_each_part_names_the_rows() -> None:
    text = format_table(_gpu_like_report(), width=60)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 60
    rules = [i for i, line in enumerate(lines) if re.fullmatch(r"-{20,}", line)]
    assert len(rules) == 2  # the activation table, in two parts
    for i in rules:
        assert lines[i - 1].split()[0] == "variant"
        assert [lines[i + j].split()[0] for j in (1, 2, 5)] == ["none", "v1-sync", "checkpoint"]
    every = " ".join(" ".join(lines[i - 2 : i]) for i in rules)
    for name in ("|dloss|", "|dgrad|", "MiB", "x none", "ms", "GB/s"):
        assert name in every


def test_table_refuses_repeated_headers() -> None:
    with pytest.raises(ValueError, match="column headers must differ; repeated: x none"):
        table([Column("", "a"), Column("", "x none"), Column("", "x none")], [], width=None)


def test_closing_line_names_the_fastest_variant_at_each_peak() -> None:
    report = _gpu_like_report()
    last = format_table(report, width=None).splitlines()[-1]
    # Lowest peak first; a variant is named where it is faster than every one below it.
    assert last == (
        "fastest by step time and peak: at <= 60.28 GiB: checkpoint (1.30x none); "
        "at <= 72.34 GiB: v2 (1.05x none); at <= 96.45 GiB: v1-async-db (1.04x none); "
        "at <= 120.56 GiB: none (1.00x none)"
    )


def test_closing_line_on_the_cpu_says_simulated(cpu_report: CompareReport) -> None:
    text = format_table(cpu_report, width=None)
    line = next(x for x in text.splitlines() if x.startswith("fastest by"))
    assert line.startswith("fastest by simulated step time and peak: at <= ")
    lowest = min(cpu_report.results, key=lambda r: (r.peak_bytes, r.step_ms))
    assert f": {lowest.name} (" in line


def test_cli_wide(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--hidden", "32", "--heads", "4", "--seq", "16", "--layers", "3"]
    argv += ["--variants", "v2", "--steps", "1", "--warmup", "0", "--quiet"]
    assert main([*argv, "--no-optimizer", "--min-tensor-size", "64"]) == 0
    narrow = capsys.readouterr().out
    assert main([*argv, "--no-optimizer", "--min-tensor-size", "64", "--wide"]) == 0
    wide = capsys.readouterr().out
    assert max(map(len, narrow.splitlines())) <= 100 < max(map(len, wide.splitlines()))
    assert "peak MiB  peak x none  step ms  spread ms  step x none" in wide


def test_plot_memory_curves_stay_visible_on_the_timelines_axis(
    cpu_report: CompareReport,
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cpu_offload.compare.plot import _figure

    fig = _figure(plt, cpu_report, ("v2", "v1-async"))
    try:
        v1_async, v2, memory, _ = fig.axes
        assert v1_async.get_title().startswith("v1-async") and v2.get_title().startswith("v2")
        assert v1_async.get_xlim() == v2.get_xlim() == memory.get_xlim()
        longest = max(r.memory[-1][0] for r in cpu_report.results)
        assert memory.get_xlim() == (0.0, pytest.approx(longest))
        lines = memory.get_lines()
        assert [line.get_label() for line in lines] == [r.name for r in cpu_report.results]
        looks = {(line.get_linestyle(), line.get_marker()) for line in lines}
        assert len(looks) == len(lines)  # no curve drawn like another
        # On the CPU, save_on_cpu runs the layers as they are: the same curve as v1-sync.
        same = memory.get_legend().get_title().get_text()
        assert same.startswith("same curve: ") and "v1-sync = save_on_cpu" in same
    finally:
        plt.close(fig)
