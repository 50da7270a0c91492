"""The code samples of README.md and docs/quickstart.md run, here on the CPU stand-in.

The quickstart says its samples run without a GPU; this holds it to that. Each sample is
the first Python block after its heading, run as written (the second quickstart sample
continues the first's names, as a reader would run them).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _sample(page: str, heading: str) -> str:
    text = (ROOT / page).read_text()
    start = text.index(f"\n{heading}\n")
    match = re.compile(r"^```python\n(.*?)^```$", re.M | re.S).search(text, start)
    assert match, f"{page}: no Python block after {heading!r}"
    return match.group(1)


def _moved(namespace: dict) -> int:
    return namespace["ctx"].offload_synchronizer.transport.bytes_offloaded


@pytest.fixture(autouse=True)
def _v2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)


def test_readme_sample_runs_and_offloads() -> None:
    namespace: dict = {}
    exec(_sample("README.md", "## Use it"), namespace)
    assert namespace["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert _moved(namespace) > 0


def test_quickstart_samples_run_and_offload() -> None:
    namespace: dict = {}
    exec(_sample("docs/quickstart.md", "## 1. Default scheduling"), namespace)
    assert _moved(namespace) > 0
    exec(
        _sample("docs/quickstart.md", "## 2. Manual synchronization (pipeline schedules)"),
        namespace,
    )
    assert _moved(namespace) > 0
    assert all(p.grad is not None for layer in namespace["layers"] for p in layer.parameters())
