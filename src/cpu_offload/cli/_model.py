"""The model that the model options name, for every ``cpu-offload`` command.

:func:`resolve_model` turns ``--device``, ``--dtype``, ``--model`` and
``--min-tensor-size`` into a :class:`ModelChoice`, with the device's defaults from
:mod:`cpu_offload.compare.defaults`; :func:`builtin_spec` turns the sizes into the
built-in model's :class:`~cpu_offload.models.ModelSpec`. Bad input exits with status 2
and a message naming the option.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ._options import DTYPES

if TYPE_CHECKING:
    import torch

    from ..compare.defaults import ModelDefaults
    from ..compare.workload import Workload
    from ..models import ModelSpec

__all__ = ["ModelChoice", "builtin_spec", "model_workload", "resolve_model"]


@dataclass(frozen=True)
class ModelChoice:
    """The model options, resolved.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        dtype: The parameters' dtype.
        defaults: The defaults on that device.
        workload: The user's model (``package.module:factory`` or ``hf:``), or None for
            a built-in kind (built later, by :func:`builtin_spec`, once the number of
            layers is known).
        min_numel: ``--min-tensor-size`` or its default for this kind of model.
    """

    device: str
    dtype: torch.dtype
    defaults: ModelDefaults
    workload: Workload | None
    min_numel: int

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


def resolve_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelChoice:
    """Resolve the model options of ``args`` (see :func:`~._options.add_model_options`).

    A model of the user's is built here (its factory called, its first forward tried);
    a built-in kind is not.
    """
    import torch

    from ..compare.defaults import defaults_for

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    defaults = defaults_for(device)
    dtype = getattr(torch, DTYPES[args.dtype or defaults.dtype])
    workload = model_workload(parser, args, device, dtype, defaults)
    min_numel = args.min_tensor_size
    if min_numel is None:
        min_numel = defaults.min_tensor_size(builtin=workload is None)
    return ModelChoice(device, dtype, defaults, workload, min_numel)


def builtin_spec(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model: ModelChoice, layers: int
) -> ModelSpec:
    """The built-in kind of ``--model`` with ``layers`` layers and the sizes of ``args``."""
    from ..models import ModelSpec

    d = model.defaults
    spec = ModelSpec(
        kind=args.model,
        hidden=args.hidden or d.hidden,
        heads=args.heads or d.heads,
        seq=args.seq or d.seq,
        batch=args.batch or d.batch,
        layers=layers,
        dtype=model.dtype,
    )
    if spec.hidden % spec.heads:
        parser.error(f"--heads ({spec.heads}) must divide --hidden ({spec.hidden})")
    _check_fits(parser, spec, model.device)
    return spec


def _check_fits(parser: argparse.ArgumentParser, spec: ModelSpec, device: str) -> None:
    """Exit with status 2 when the built-in model cannot fit in the memory there is."""
    from ..compare._fits import available_memory, memory_need
    from ..compare.report import format_bytes

    free = available_memory(device)
    if free is None:
        return
    need = memory_need(spec)
    if need.total <= free:
        return
    where = "of GPU memory free" if device == "cuda" else "of host memory available"
    sizes = ", ".join(
        f"--{name} {getattr(spec, name)}" for name in ("layers", "hidden", "seq", "batch")
    )
    parser.error(
        f"the built-in model of {sizes} needs about {format_bytes(need.total)} (parameters "
        f"{format_bytes(need.parameters)}, gradients {format_bytes(need.gradients)}, activations "
        f"{format_bytes(need.activations)}), more than the {format_bytes(free)} {where}: make it smaller"
    )


def model_workload(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    device: str,
    dtype: torch.dtype,
    defaults: ModelDefaults,
) -> Workload | None:
    """The workload ``--model`` names, or None for a built-in layer kind.

    ``--model package.module:factory`` calls the factory (with those of device, dtype,
    ``--seq`` and ``--batch`` it accepts); ``--model hf:PATH/config.json`` builds a
    ``transformers`` model (``--seq``, ``--batch`` and ``--layers`` apply, ``defaults``
    for those not given). Bad input exits with status 2 and a message naming the option.
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
            seq, batch = args.seq or defaults.seq, args.batch or defaults.batch
            return hf_workload(path, device, dtype, seq, batch, args.layers)
        return factory_workload(args.model, device, dtype, args.seq, args.batch)
    except ValueError as err:
        parser.error(str(err))
