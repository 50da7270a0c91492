"""The examples run, small, on a CPU (the CPU stand-in moves the bytes)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(name: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # small and on the CPU, as in CI
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_plain_pytorch():
    assert "step 2: loss" in _run("plain_pytorch.py")


def test_huggingface_llama():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install 'cpu-offload[hf]')")
    assert "step 1: loss" in _run("huggingface_llama.py")


def test_megatron_core_exits_cleanly_without_what_it_needs():
    out = _run("megatron_core.py")
    assert "step 2: loss" in out or "megatron-core is not installed" in out or "GPU" in out


def test_compare_my_model():
    assert "bit-identical to no offloading: none, v1-sync, v1-async, v2" in _run(
        "compare_my_model.py"
    )


def test_every_example_is_tested():
    tested = {"plain_pytorch.py", "huggingface_llama.py", "megatron_core.py", "compare_my_model.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested
