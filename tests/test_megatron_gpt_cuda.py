"""Megatron-Core's GPT with the package in Transformer Engine's place, on the GPU.

Needs megatron-core (0.19.2 is what this was written against) and a GPU; skipped
otherwise. Each case trains in its own process (the backend switch, the process group
and Megatron's global state are per process) and compares every loss and gradient of 3
steps with the same model trained without offloading.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "megatron_gpt_steps.py"
SRC = Path(__file__).resolve().parents[1] / "src"


def _train(switch: str, *flags: str) -> tuple[str, int, int]:
    env = dict(os.environ)
    env["NVTE_CPU_OFFLOAD_V1"] = switch
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1].split()
    assert last[0] == "OK", proc.stdout
    return last[1], int(last[3]), int(last[4])


@pytest.mark.cuda
@pytest.mark.parametrize(("switch", "backend"), [("1", "v1"), ("0", "v2")])
def test_megatron_gpt_with_retained_buffers_trains_exactly(switch, backend):
    pytest.importorskip("megatron.core")
    got, offloaded_peak, plain_peak = _train(switch, "--retain", "--k", "2")
    assert got == backend
    assert offloaded_peak < plain_peak, (offloaded_peak, plain_peak)
