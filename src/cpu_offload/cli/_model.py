"""The model that ``--model`` names, for every ``cpu-offload`` command."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..compare.workload import Workload

__all__ = ["model_workload"]


def model_workload(
    parser: argparse.ArgumentParser, args: argparse.Namespace, device: str, dtype: torch.dtype
) -> Workload | None:
    """The workload ``--model`` names, or None for a built-in layer kind.

    ``--model package.module:factory`` calls the factory (with those of device, dtype,
    ``--seq`` and ``--batch`` it accepts); ``--model hf:PATH/config.json`` builds a
    ``transformers`` model (``--seq``, ``--batch`` and ``--layers`` apply). Bad input
    exits with status 2 and a message naming the option.
    """
    from ..compare.workload import factory_workload, hf_workload
    from ..models import MODEL_KINDS

    if args.model in MODEL_KINDS:
        return None
    if ":" not in args.model:
        parser.error(
            f"--model {args.model!r}: choose a built-in kind ({', '.join(MODEL_KINDS)}), "
            "package.module:factory or hf:PATH/config.json"
        )
    given = [o for o in ("hidden", "heads") if getattr(args, o) is not None]
    if given:
        parser.error(f"--{given[0]} applies to the built-in kinds only; {args.model} sets its own")
    hf = args.model.startswith("hf:")
    if args.layers is not None and not hf:
        parser.error("--layers applies to the built-in kinds and hf: models only")
    try:
        if hf:
            path = args.model[3:]
            if not Path(path).exists():
                parser.error(f"--model {args.model!r}: {path!r} does not exist")
            gpu = device == "cuda"
            seq = args.seq or (2048 if gpu else 128)
            batch = args.batch or (2 if gpu else 4)
            return hf_workload(path, device, dtype, seq, batch, args.layers)
        return factory_workload(args.model, device, dtype, args.seq, args.batch)
    except ValueError as err:
        parser.error(str(err))
