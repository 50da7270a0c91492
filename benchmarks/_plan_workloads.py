"""The workloads of ``plan.py`` and the benchmarks beside it: each a model on the GPU and a
step that runs its forward and returns the loss.

* ``llama``: a ``transformers`` Llama built from a config;
* ``megatron`` and ``D``: Megatron-Core's GPT, the second at workload D's size;
* ``compare``: the default model of ``cpu-offload compare`` on a GPU; ``A``: workload A.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable

import torch
from _models import LLAMA_VOCAB, MEGATRON_VOCAB, llama, megatron_gpt
from activation_offload import WORKLOADS
from torch import nn

from cpu_offload.models import ModelSpec, build_layers, run_layers

__all__ = ["QUICK_DIMS", "WORKLOAD_DIMS", "build", "own_methods"]

# Each workload: its builder and its dimensions, full and --quick.
WORKLOAD_DIMS = {
    "llama": ("llama", dict(layers=12, hidden=1024, seq=2048, batch=4)),
    "megatron": ("megatron", dict(layers=12, hidden=1024, heads=8, seq=2048, batch=2)),
    "D": ("megatron", dict(layers=16, hidden=2048, heads=16, seq=2048, batch=2)),
    # cpu-offload compare's default model on a GPU.
    "compare": ("gpt", dict(hidden=2048, heads=16, batch=2, seq=2048, layers=8)),
    "A": ("gpt", WORKLOADS["A"]),
}
QUICK_DIMS = {
    "llama": dict(layers=8, hidden=512, seq=1024, batch=4),
    "megatron": dict(layers=8, hidden=512, heads=8, seq=1024, batch=2),
    "D": dict(layers=8, hidden=1024, heads=8, seq=1024, batch=2),
    "compare": dict(hidden=1024, heads=8, batch=2, seq=1024, layers=8),
    "A": dict(hidden=2048, heads=16, batch=2, seq=2048, layers=8),
}


def _gpt(dims: dict) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    spec = ModelSpec(kind="gpt", dtype=torch.bfloat16, **dims)
    layers = build_layers(spec, "cuda")
    x = spec.make_input("cuda")
    return layers, lambda: run_layers(layers, x).float().square().mean()


def _llama(dims: dict) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    model = llama(dims["hidden"], dims["layers"], dims["seq"])
    ids = torch.randint(0, LLAMA_VOCAB, (dims["batch"], dims["seq"]), device="cuda")
    return model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss


def _megatron(dims: dict) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    # offload_layers finds Float16Module's module.decoder.layers.
    model, loss = megatron_gpt(
        dims["layers"], dims["hidden"], dims["heads"], dims["seq"], dims["batch"]
    )
    tokens = torch.randint(0, MEGATRON_VOCAB, (dims["batch"], dims["seq"]), device="cuda")
    return model, lambda: loss(tokens)


def build(name: str, quick: bool) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The model of workload ``name`` (its ``--quick`` size if ``quick``) and its step."""
    kind, dims = WORKLOAD_DIMS[name]
    dims = QUICK_DIMS[name] if quick else dims
    return {"llama": _llama, "megatron": _megatron, "gpt": _gpt}[kind](dims)


def own_methods(model: nn.Module) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """A ``transformers`` model's own activation checkpointing of every decoder layer, with
    and (where its version has it) without ``offload=True``; none for other models.
    ``activation_checkpointing_enable`` where the version has it, else the older
    ``gradient_checkpointing_enable``."""
    new = hasattr(model, "activation_checkpointing_enable")
    prefix = "activation" if new else "gradient"
    enable = getattr(model, f"{prefix}_checkpointing_enable", None)
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        return {}
    disable = getattr(model, f"{prefix}_checkpointing_disable")

    def installer(offload: bool) -> Callable[[], contextlib.AbstractContextManager]:
        @contextlib.contextmanager
        def installed():  # type: ignore[no-untyped-def]
            kwargs: dict = {f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}
            if offload:
                kwargs["offload"] = True
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(**kwargs)
            try:
                yield
            finally:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    disable()

        return installed

    out = {"transformers checkpointing": installer(False)}
    if "offload" in inspect.signature(enable).parameters:
        out["transformers checkpointing, offload=True"] = installer(True)
    return out
