"""What the GPU benchmark scripts share: one workload per process, and the files they write."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from typing import Any

import torch


def run_isolated(script: str, argv: list[str], on_failure: dict[str, Any]) -> dict[str, Any]:
    """Run ``script`` with ``argv`` in a fresh Python; return the JSON of its last line.

    A fresh process starts from an empty GPU, so that nothing one workload leaves
    behind can push the next one out of memory. When the process fails, the result is
    ``on_failure`` with an ``error`` naming the exit code.
    """
    proc = subprocess.run(
        [sys.executable, script, *argv], stdout=subprocess.PIPE, text=True, check=False
    )
    if proc.returncode != 0:
        return {**on_failure, "error": f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_reports(
    json_path: str | None,
    markdown_path: str | None,
    device: str,
    results: list[dict[str, Any]],
    markdown: str,
    **meta: Any,
) -> None:
    """Write the figures as JSON (with device, torch version and date) and the tables."""
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(
                {
                    "device": device,
                    "torch": torch.__version__,
                    "date": datetime.date.today().isoformat(),
                    **meta,
                    "results": results,
                },
                fh,
                indent=2,
                default=str,
            )
    if markdown_path:
        with open(markdown_path, "w") as fh:
            fh.write(markdown)
