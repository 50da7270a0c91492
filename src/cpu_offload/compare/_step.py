"""One training step of a variant on a workload, with the marks of its timeline."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._random import SameRandomState
from .simulate import Span
from .variants import Variant
from .workload import Workload

__all__ = ["Installed", "Step", "one_step"]


@dataclass
class Step:
    loss: torch.Tensor
    grads: list[torch.Tensor]
    ms: float
    peak: int
    spans: list[Span]
    memory: list[tuple[float, int]]


class _Recorder:
    """Events on the compute stream at layer boundaries, and memory at each of them."""

    def __init__(self, cuda: bool, base: int) -> None:
        self.cuda = cuda
        self.base = base
        self.marks: list[tuple[str, object, int]] = []

    def mark(self, label: str) -> None:
        mem = torch.cuda.memory_allocated() - self.base if self.cuda else 0
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((label, ev, mem))
        else:
            self.marks.append((label, time.perf_counter(), mem))

    def backward_hook(self, label: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self.mark(label)

        return hook

    def elapsed(self, start: object, end: object) -> float:
        if self.cuda:
            return start.elapsed_time(end)  # type: ignore[attr-defined]
        return (end - start) * 1e3  # type: ignore[operator]


def _hidden(out: Any) -> torch.Tensor | None:
    """The hidden state of a layer's output: itself or its first element."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out:
        return out[0] if isinstance(out[0], torch.Tensor) else None
    for name in getattr(out, "__dataclass_fields__", {}):
        value = getattr(out, name)
        if value is not None:
            return value if isinstance(value, torch.Tensor) else None
    return None


class Installed:
    """A variant installed on a workload's layers, each layer's forward replaced.

    Each of its steps starts from ``random_state`` (the same for every variant of a
    comparison).
    """

    def __init__(self, variant: Variant, workload: Workload, random_state: SameRandomState) -> None:
        self.variant = variant
        self.workload = workload
        self.random_state = random_state
        self.recorder: _Recorder | None = None
        self._saved: list[tuple[torch.nn.Module, bool, Any]] = []
        last = len(workload.layers) - 1
        for j, layer in enumerate(workload.layers):
            original = layer.forward
            self._saved.append((layer, "forward" in layer.__dict__, layer.__dict__.get("forward")))

            @functools.wraps(original)
            def forward(*args: Any, _j: int = j, _f: Any = original, **kwargs: Any) -> Any:
                rec = self.recorder
                if rec is not None:
                    rec.mark(f"F{_j}")
                out = self.variant.call(_j, _f, args, kwargs)
                if rec is not None:
                    hidden = _hidden(out)
                    if hidden is not None and hidden.grad_fn is not None:
                        hidden.grad_fn.register_prehook(rec.backward_hook(f"B{_j}"))
                    if _j == last:
                        rec.mark("head")
                return out

            layer.forward = forward  # type: ignore[method-assign]
        self._patches = variant.install(list(workload.layers))

    def remove(self) -> None:
        for patch in self._patches:
            patch.undo()
        self._patches = []
        for layer, had_own, previous in self._saved:
            if had_own:
                layer.forward = previous  # type: ignore[method-assign]
            else:
                del layer.__dict__["forward"]
        self._saved.clear()


def one_step(installed: Installed, record: bool, keep_grads: bool = False) -> Step:
    """Forward, loss and backward of the workload under the installed variant."""
    workload, variant = installed.workload, installed.variant
    params = [p for p in workload.model.parameters() if p.requires_grad]
    cuda = params[0].is_cuda
    for p in params:
        # Gradients stay allocated between steps (zero_grad(set_to_none=False)), so the
        # peak above the step's start is activations and temporaries alone, whichever
        # moment of backward each variant peaks at.
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    for t in variant.transports:
        t.timeline = [] if (record and cuda) else None
    base = 0
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    rec = _Recorder(cuda, base)
    with installed.random_state.replay():
        batch = workload.make_batch()  # before the first mark: not part of the step
        installed.recorder = rec if record else None
        rec.mark("start")
        try:
            loss = workload.loss_fn(workload.model, batch)
        finally:
            installed.recorder = None
        if record:
            rec.mark("loss")
        del batch
        loss.backward()
        rec.mark("end")
    peak = 0
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    ms = rec.elapsed(rec.marks[0][1], rec.marks[-1][1])
    spans: list[Span] = []
    memory: list[tuple[float, int]] = []
    if record:
        spans, memory = _timeline(rec, variant)
    for t in variant.transports:
        t.timeline = None
    return Step(
        loss.detach().float(),
        # Only the steps compared keep their gradients, in their own dtype: a copy of
        # every gradient per step would take more memory than the model on a big one.
        [p.grad.clone() for p in params if p.grad is not None] if keep_grads else [],
        ms,
        peak,
        spans,
        memory,
    )


def _timeline(rec: _Recorder, variant: Variant) -> tuple[list[Span], list[tuple[float, int]]]:
    start = rec.marks[0][1]
    times = [(label, rec.elapsed(start, ev), mem) for label, ev, mem in rec.marks]
    memory = [(t, m) for _, t, m in times]
    spans: list[Span] = []
    fwd = [(lbl, t) for lbl, t, _ in times if lbl.startswith("F") or lbl in ("head", "loss")]
    for (lbl, t0), (_, t1) in zip(fwd, fwd[1:], strict=False):
        spans.append(Span("compute", lbl, t0, t1))
    bwd = [(lbl, t) for lbl, t, _ in times if lbl.startswith("B")] + [("end", times[-1][1])]
    for (lbl, t0), (_, t1) in zip(bwd, bwd[1:], strict=False):
        spans.append(Span("compute", lbl, t0, t1))
    for transport in variant.transports:
        for span in transport.timeline or ():
            spans.append(
                Span(
                    span.kind,
                    f"{span.nbytes / 2**20:.0f} MiB",
                    rec.elapsed(start, span.start),
                    rec.elapsed(start, span.end),
                    span.nbytes,
                )
            )
    return spans, memory
