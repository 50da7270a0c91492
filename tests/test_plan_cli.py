"""``cpu-offload plan``: budgets, the printed plan, saved plans, and exit 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import cli_usage_error

from cpu_offload.cli import main
from cpu_offload.cli.plan import parse_budget
from cpu_offload.plan.io import load_plan

SMALL = "plan --layers 3 --hidden 32 --heads 2 --seq 16 --batch 2 --steps 1 --quiet"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12GiB", 12 * 2**30),
        ("800MiB", 800 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("64kib", 64 * 1024),
        ("0.6", 0.6),
        ("1", 1.0),
    ],
)
def test_parse_budget(text: str, value: float) -> None:
    assert parse_budget(text) == value


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("2", r"a bare number must be in \(0, 1\]"),
        ("0", r"a bare number must be in \(0, 1\]"),
        ("12XB", "unknown unit 'XB'"),
        ("-1GiB", "must be a size such as 12GiB"),
        ("lots", "must be a size such as 12GiB"),
        ("0B", "more than 0 bytes"),
    ],
)
def test_parse_budget_rejects(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_budget(text)


def test_bad_budget_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    err = cli_usage_error([*SMALL.split(), "--budget", "12XB"], capsys)
    assert "--budget" in err and "unknown unit" in err
    err = cli_usage_error(["plan"], capsys)
    assert "--budget" in err


def test_no_plan_fits_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    err = cli_usage_error([*SMALL.split(), "--budget", "1KiB", "--no-measure"], capsys)
    assert "no plan fits a budget of 1,024 bytes" in err
    # A fraction of the peak that is less than a byte: the same clear error.
    err = cli_usage_error([*SMALL.split(), "--budget", "1e-12", "--no-measure"], capsys)
    assert "no plan fits a budget of 1 bytes" in err


def test_plan_prints_modelled_and_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, figures = tmp_path / "plan.json", tmp_path / "figures.json"
    assert (
        main([*SMALL.split(), "--budget", "0.6", "--save", str(path), "--json", str(figures)]) == 0
    )
    out = capsys.readouterr().out
    assert "| no offloading |" in out and "| plan " in out
    assert "CPU stand-in" in out
    plan = load_plan(path)
    assert plan.profile is not None and len(plan.choices) == 3
    rows = json.loads(figures.read_text())["rows"]
    assert rows[0]["name"] == "no offloading"
    assert all(r["measured_step_ms"] > 0 and r["measured_peak_bytes"] is None for r in rows)
    # Planning again from the saved profile needs no profiling, and agrees.
    assert main([*SMALL.split(), "--budget", "0.6", "--load", str(path), "--no-measure"]) == 0
    assert f"| plan {plan.describe()} |" in capsys.readouterr().out


def test_load_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = cli_usage_error(
        [*SMALL.split(), "--budget", "0.5", "--load", str(tmp_path / "missing.json")], capsys
    )
    assert "--load" in err and "missing.json" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "cpu-offload-plan", "version": 9}')
    err = cli_usage_error([*SMALL.split(), "--budget", "0.5", "--load", str(bad)], capsys)
    assert "plan.version 9 is not supported" in err
