"""Megatron-LM's HybridDeviceOptimizer beside ours, in one process (benchmark helper).

Megatron's file is not part of this repository: pass the path of
``hybrid_optimizer.py`` (or of a folder holding it, e.g. a Megatron-LM checkout or a
folder with just that file) with ``--peer``. It needs only torch; it is imported from
that path alone, without the rest of Megatron.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PEER_FILE = "hybrid_optimizer.py"


def load_peer(path: Path) -> type[torch.optim.Optimizer]:
    """Megatron's ``HybridDeviceOptimizer`` class, imported from ``path``.

    Raises:
        FileNotFoundError: If no ``hybrid_optimizer.py`` is at or under ``path``.
    """
    if path.is_dir():
        found = sorted(path.rglob(PEER_FILE))
        if not found:
            raise FileNotFoundError(f"--peer: no {PEER_FILE} under {path}")
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"--peer: {path} does not exist")
    spec = importlib.util.spec_from_file_location("_peer_hybrid_optimizer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HybridDeviceOptimizer  # type: ignore[no-any-return]


def device_bytes_of_state(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state (fp32 masters included) that live on a GPU."""
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_cuda and id(value) not in seen:
                seen.add(id(value))
                total += value.numel() * value.element_size()
    return total


def time_training(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    make_optimizer: Callable[[], torch.optim.Optimizer],
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """Time whole training iterations back to back; one device sync per iteration.

    An iteration is forward, backward, ``step()``, ``zero_grad()``; the wall time from
    one iteration's start to the next's includes whatever the previous ``step()`` left
    running (a host step that finishes under the next forward is paid where it is
    waited for). Memory: the peak allocated during the timed iterations and the GPU
    bytes of the optimizer's state.
    """
    model.zero_grad(set_to_none=True)
    optimizer = make_optimizer()
    times: list[float] = []
    try:
        for i in range(warmup + steps + 1):
            if i == warmup:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = loss_fn(model)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # The next iteration's forward waits for anything still pending; the loss
            # is read so that the host follows the device as a training loop's logging
            # would.
            loss.item()
            if i > warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        sync = getattr(optimizer, "synchronize", None)
        if sync is not None:
            sync()
        torch.cuda.synchronize()
        return {
            "iteration_ms": statistics.median(times),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 1024**3,
            "state_gib": device_bytes_of_state(optimizer) / 1024**3,
            "checksum": float(sum(p.detach().float().sum() for p in model.parameters())),
        }
    finally:
        # Optimizers whose step hooks close over themselves (Megatron's) form reference
        # cycles: without a collection their GPU state would still be allocated while
        # the next optimizer is measured, and count in its peak.
        del optimizer
        gc.collect()
        torch.cuda.empty_cache()
