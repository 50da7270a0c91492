"""Whether a built-in model fits in memory, worked out before anything is allocated.

One layer is built on the meta device (shapes, no memory) and run forward once to see
what it saves for backward; the model needs its parameters, their gradients and every
layer's saved activations (the run without offloading keeps them all).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..models import ModelSpec, build_layers
from ._profile import distinct_bytes, saved_in_forward

__all__ = ["MemoryNeed", "available_memory", "memory_need"]


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a built-in model needs to train one step without offloading, about (the meta
    device runs attention by its reference kernel, which may save more than a fast one)."""

    parameters: int
    gradients: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.activations


def memory_need(spec: ModelSpec) -> MemoryNeed:
    """About the memory ``spec``'s model needs: parameters, gradients and activations.

    Nothing is allocated: one layer runs on the meta device. Activations are what the
    layers save for backward; temporaries, copies of gradients and optimizer state come
    on top, so a model that needs more than there is cannot run.

    Example:
        >>> spec = ModelSpec(kind="linear", hidden=1024, seq=8, batch=2, layers=4)
        >>> need = memory_need(spec)
        >>> need.parameters == 4 * (1024 * 1024 + 1024) * 4 == need.gradients
        True
    """
    one = ModelSpec(spec.kind, spec.hidden, spec.heads, spec.seq, spec.batch, 1, spec.dtype)
    # build_layers seeds the generator for its weights: leave the caller's state alone.
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        layer = build_layers(one, "meta")[0]
    saved = saved_in_forward(layer, (one.make_input("meta").requires_grad_(),), {})
    params = sum(p.numel() * p.element_size() for p in layer.parameters()) * spec.layers
    return MemoryNeed(params, params, distinct_bytes(saved.tensors) * spec.layers)


def _host_available() -> int | None:
    """Memory the host can give without swapping: ``MemAvailable``, else free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None  # not known on this system: nothing to check against


def available_memory(device: str) -> int | None:
    """Bytes free for a model on ``device``: free GPU memory on ``"cuda"``, available
    host memory otherwise (None where the system does not say)."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    return _host_available()
