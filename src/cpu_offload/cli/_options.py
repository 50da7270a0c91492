"""Option types and options shared by the ``cpu-offload`` commands.

Every parser here turns a bad value into ``argparse.ArgumentTypeError`` naming the
option, so that argparse exits with status 2 and that message before anything runs.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "DTYPES",
    "MAX_LAYERS",
    "add_model_options",
    "add_output_option",
    "by_device",
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
    """An argparse type: a file to write, checked before anything runs.

    Its folder must exist and be writable, and the path must not be a folder (nor a
    file that cannot be written).
    """

    def parse(text: str) -> str:
        path = Path(text).expanduser()
        if path.is_dir():
            raise argparse.ArgumentTypeError(
                f"{name} {text!r} is a folder; give the path of a file to write"
            )
        folder = path.resolve().parent
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(
                f"{name} {text!r}: the folder {str(folder)!r} does not exist"
            )
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise argparse.ArgumentTypeError(f"{name} {text!r}: cannot write there")
        return text

    return parse


def add_output_option(
    parser: argparse.ArgumentParser, option: str, metavar: str, help: str
) -> None:
    """Add ``option``, a file to write, checked by :func:`output_path` before the run."""
    parser.add_argument(
        option, metavar=metavar, type=output_path(option), help=f"{help} (its folder must exist)"
    )


def by_device(field: str) -> str:
    """A default that differs by device, as the help shows it: ``"GPU / CPU"``."""
    from ..compare.defaults import CPU_DEFAULTS, GPU_DEFAULTS

    return f"{getattr(GPU_DEFAULTS, field)} / {getattr(CPU_DEFAULTS, field)}"


def add_model_options(parser: argparse.ArgumentParser, note: str = "") -> None:
    """Add the model options every command shares, with the same types and defaults.

    ``--model``, ``--hidden``, ``--heads``, ``--seq``, ``--batch``, ``--layers``,
    ``--dtype``, ``--device`` and ``--min-tensor-size``; each left unset is None, and
    :func:`cpu_offload.cli._model.resolve_model` fills in the device's default from
    :mod:`cpu_offload.compare.defaults`. ``note`` ends the help of ``--model``.
    """
    from ..compare.defaults import CPU_DEFAULTS, GPU_DEFAULTS
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
    parser.add_argument(
        "--hidden",
        type=positive("--hidden"),
        help=f"model width, built-in kinds (default: {by_device('hidden')})",
    )
    parser.add_argument(
        "--heads",
        type=positive("--heads"),
        help=f"attention heads, built-in kinds (default: {by_device('heads')})",
    )
    parser.add_argument(
        "--seq", type=positive("--seq"), help=f"sequence length (default: {by_device('seq')})"
    )
    parser.add_argument(
        "--batch", type=positive("--batch"), help=f"batch size (default: {by_device('batch')})"
    )
    parser.add_argument(
        "--layers",
        type=int_in("--layers", 1, MAX_LAYERS),
        help=f"number of layers n, at most {MAX_LAYERS}; for hf: it overrides "
        f"num_hidden_layers (default: {by_device('layers')}; hf: the config's)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help=f"parameters' dtype (default: {by_device('dtype')})",
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), help="(default: cuda when available, else cpu)"
    )
    parser.add_argument(
        "--min-tensor-size",
        type=int_in("--min-tensor-size", 0),
        help="smallest tensor to offload, in elements, >= 0 (default: "
        f"{GPU_DEFAULTS.builtin_min_tensor_size} / {CPU_DEFAULTS.builtin_min_tensor_size} for "
        f"the built-in kinds, {GPU_DEFAULTS.user_min_tensor_size} / "
        f"{CPU_DEFAULTS.user_min_tensor_size} for other models)",
    )
