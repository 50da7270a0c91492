"""Option types and options shared by the ``cpu-offload`` commands.

Every parser here turns a bad value into ``argparse.ArgumentTypeError`` naming the
option, so that argparse exits with status 2 and that message before anything runs.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "DTYPES",
    "MAX_LAYERS",
    "add_model_option",
    "int_in",
    "output_path",
    "positive",
    "positive_float",
]

#: ``--dtype`` choices and the ``torch`` dtype each one names.
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

#: The largest ``--layers``: a deeper built-in model is not a comparison but a long wait.
MAX_LAYERS = 512


def int_in(name: str, low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]`` (no upper bound when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{name} must be in [{low}, {high}], got {value}")
        return value

    return parse


def positive(name: str) -> Callable[[str], int]:
    """An argparse type: an integer >= 1."""
    return int_in(name, 1)


def positive_float(name: str) -> Callable[[str], float]:
    """An argparse type: a finite number > 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a finite number > 0, got {text!r}")
        return value

    return parse


def output_path(name: str) -> Callable[[str], str]:
    """An argparse type: a file to write, whose folder must exist."""

    def parse(text: str) -> str:
        folder = Path(text).expanduser().resolve().parent
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(
                f"{name} {text!r}: the folder {str(folder)!r} does not exist"
            )
        return text

    return parse


def add_model_option(parser: argparse.ArgumentParser, note: str = "") -> None:
    """Add ``--model`` (a built-in kind, ``package.module:factory`` or ``hf:PATH``)."""
    from ..models import MODEL_KINDS

    parser.add_argument(
        "--model",
        default="gpt",
        metavar="MODEL",
        help=f"a built-in layer kind ({', '.join(MODEL_KINDS)}); package.module:factory, "
        "a function returning (model, make_batch[, loss_fn]), called with those of device, "
        "dtype, seq and batch it accepts; or hf:PATH/config.json, a transformers causal "
        "LM built from a config with random weights (pip install 'cpu-offload[hf]'). "
        f"{note + ' ' if note else ''}(default: gpt)",
    )
