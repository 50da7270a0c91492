"""``benchmarks/make_docs.py``: docs/choosing.md's tables come from the newest results."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _make_docs():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("make_docs", ROOT / "benchmarks/make_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(text: str, name: str) -> str:
    start = text.index(f"<!-- BEGIN generated: {name} ")
    return text[start : text.index(f"<!-- END generated: {name} -->")]


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, Path]:
    results = tmp_path / "results"
    results.mkdir()
    for name in ("activation-h100-2026-11-23.json", "optimizer-h100-2026-11-23.json"):
        shutil.copy(RESULTS / name, results / name)
    page = tmp_path / "choosing.md"
    shutil.copy(ROOT / "docs/choosing.md", page)
    return results, page


def test_the_committed_page_is_up_to_date(workspace):
    _, page = workspace
    _make_docs().write_choosing(RESULTS, page)
    assert page.read_text() == (ROOT / "docs/choosing.md").read_text(), (
        "docs/choosing.md is stale: run python3 benchmarks/make_docs.py"
    )


def test_tables_carry_the_measured_figures_and_their_source(workspace):
    results, page = workspace
    _make_docs().write_choosing(results, page)
    text = page.read_text()
    data = json.loads((results / "optimizer-h100-2026-11-23.json").read_text())
    optimizer = _section(text, "optimizer")
    for row in data["rows"]:
        assert f"| {row['label']} | {row['step_ms']:.1f} |" in optimizer
    assert "torch 2.11.0+cu130" in optimizer and "NVIDIA H100 80GB HBM3" in optimizer
    activation = _section(text, "activation")
    assert "| A, k=4 of 16 |" in activation and "| B, k=12 of 24 |" in activation
    assert "2026-11-23" in _section(text, "decision")


def test_a_newer_run_replaces_the_old_one_but_a_shrunk_run_does_not(workspace):
    results, page = workspace
    make_docs = _make_docs()
    old = json.loads((results / "optimizer-h100-2026-11-23.json").read_text())
    new = copy.deepcopy(old)
    new["meta"]["date"] = "2026-12-01T09:00:00+00:00"
    new["meta"]["torch"] = "2.12.0+cu130"
    for row in new["rows"]:
        row["step_ms"] *= 0.5
        row["label"] = row["label"].replace("fp32 back", "bf16 transfers")
    (results / "optimizer-h100-2026-12-01.json").write_text(json.dumps(new))
    shrunk = copy.deepcopy(new)
    shrunk["meta"]["date"] = "2026-12-02T09:00:00+00:00"
    shrunk["meta"]["workload"]["full_size"] = False
    (results / "optimizer-smoke-2026-12-02.json").write_text(json.dumps(shrunk))
    make_docs.write_choosing(results, page)
    optimizer = _section(page.read_text(), "optimizer")
    assert "optimizer-h100-2026-12-01.json" in optimizer and "torch 2.12.0+cu130" in optimizer
    assert "bf16 transfers" in optimizer and "fp32 back" not in optimizer
    # Ratios are within the run, so halving every step time keeps them.
    decision = _section(page.read_text(), "decision")
    base = old["rows"][0]["step_ms"]
    fastest = min(r["step_ms"] for r in old["rows"] if r["offload_fraction"] == 0.25)
    assert f"0.25: 9.0 GiB at {fastest / base:.2f}x" in decision


def test_a_page_without_markers_is_refused(workspace):
    results, page = workspace
    page.write_text("# no tables here\n")
    with pytest.raises(SystemExit, match="no '<!-- BEGIN generated: decision"):
        _make_docs().write_choosing(results, page)
