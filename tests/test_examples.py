"""The examples run, small, on a CPU (the CPU stand-in moves the bytes)."""

from __future__ import annotations

import importlib.util
import os
import re
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


def _bytes_moved(out: str) -> int:
    match = re.search(r"^offloaded (\d+) bytes to host memory$", out, re.MULTILINE)
    assert match, out
    return int(match.group(1))


EXACT = "losses and trained parameters bit-identical to training without offloading"


def test_plain_pytorch():
    out = _run("plain_pytorch.py")
    assert "step 2: loss" in out
    assert _bytes_moved(out) > 0
    assert EXACT in out.splitlines()


def test_huggingface_llama():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install 'cpu-offload[hf]')")
    out = _run("huggingface_llama.py")
    assert "step 1: loss" in out
    assert _bytes_moved(out) > 0
    assert EXACT in out.splitlines()


def test_huggingface_trainer():
    for needed in ("transformers", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"{needed} is not installed (pip install 'cpu-offload[hf]')")
    out = _run("huggingface_trainer.py")
    assert _bytes_moved(out) > 0
    assert (
        "training loss and trained parameters bit-identical to training without offloading"
        in out.splitlines()
    )


def test_megatron_core_exits_cleanly_without_what_it_needs():
    # The tests run it without a GPU: it stops before building anything, and says why.
    if importlib.util.find_spec("megatron") is None:
        expected = "megatron-core is not installed: pip install megatron-core"
    else:
        expected = "Megatron-Core's GPTModel needs a GPU here; nothing to run"
    assert _run("megatron_core.py").strip() == expected


def test_compare_my_model():
    out = _run("compare_my_model.py")
    assert "bit-identical to no offloading: none, v1-sync, v1-async, v2, checkpoint" in out
    match = re.search(r"^v2 offloaded (\d+) bytes per step$", out, re.MULTILINE)
    assert match and int(match.group(1)) > 0, out


def test_every_example_is_tested():
    tested = {
        "plain_pytorch.py",
        "huggingface_llama.py",
        "huggingface_trainer.py",
        "megatron_core.py",
        "compare_my_model.py",
    }
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested
