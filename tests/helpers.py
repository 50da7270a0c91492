"""Helpers shared by the tests: one training step with and without offloading."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cpu_offload import HostTransport, v2
from cpu_offload.cli import main as cli_main
from cpu_offload.models import run_layers

#: The size threshold, in elements, the V2 tests give the CPU stand-in by default.
V2_MIN = 256
#: The number of layers of the V2 tests' contexts by default.
V2_LAYERS = 4


@dataclass
class StepResult:
    loss: torch.Tensor
    grads: list[torch.Tensor]
    peak_bytes: int = 0  # peak CUDA memory above the level before the step
    # The same for the bytes tensors asked for: max_memory_allocated counts whole blocks,
    # whose sizes depend on what the allocator cached before (up to 1 MiB more a block).
    requested_peak_bytes: int = 0


def step(
    layers: nn.ModuleList,
    make_input: Callable[[], torch.Tensor],
    context: object | None = None,
    sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
    between: Callable[[], None] | None = None,
) -> StepResult:
    """Forward, loss, backward; returns the loss, every gradient and the memory peak.

    The input is made inside, and not kept, so that the first layer's saved input can
    really be freed once offloaded (as in a training loop).
    """
    for p in layers.parameters():
        p.grad = None
    cuda = next(layers.parameters()).is_cuda
    if cuda:
        gc.collect()  # an earlier test's garbage freed mid-step would lower the peak read
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        requested_base = torch.cuda.memory_stats()["requested_bytes.all.current"]
        torch.cuda.reset_peak_memory_stats()
    out = run_layers(layers, make_input(), context, sync)
    if between is not None:
        between()
    loss = out.float().square().mean()
    del out
    loss.backward()
    peak = requested = 0
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        requested = torch.cuda.memory_stats()["requested_bytes.all.peak"] - requested_base
    grads = [p.grad.clone() for p in layers.parameters()]
    return StepResult(loss.detach().clone(), grads, peak, requested)


def v2_context(k: int = 1, n: int = V2_LAYERS, **kwargs: Any) -> Any:
    """V2's context and sync function for ``k`` of ``n`` layers on the CPU stand-in, with
    ``V2_MIN`` as threshold unless given; quiet about ``k == n - 1``."""
    kwargs.setdefault("transport", HostTransport())
    kwargs.setdefault("min_tensor_size_to_offload", V2_MIN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # k == n-1
        return v2.get_cpu_offload_context(True, k, n, **kwargs)


def assert_bit_equal(a: StepResult, b: StepResult) -> None:
    """Loss and every gradient identical, bit for bit."""
    assert torch.equal(a.loss, b.loss), f"loss differs: {a.loss.item()} vs {b.loss.item()}"
    assert len(a.grads) == len(b.grads)
    for i, (ga, gb) in enumerate(zip(a.grads, b.grads, strict=True)):
        assert torch.equal(ga, gb), f"gradient {i} differs: max |diff| {(ga - gb).abs().max()}"


def top_saved_tensor_hooks() -> object:
    """The innermost saved-tensor hooks pushed now, or None.

    Uses a private PyTorch function that older releases (2.6) lack; there the calling
    test is skipped rather than passed without its check.
    """
    import pytest

    probe = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if probe is None:
        pytest.skip("this PyTorch cannot show the saved-tensor hook stack")
    return probe(False)


def cli_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``cpu-offload`` with ``argv``, check that it exits with status 2, return stderr."""
    with pytest.raises(SystemExit) as err:
        cli_main(argv)
    assert err.value.code == 2
    return capsys.readouterr().err


def error_in_another_thread(action: Callable[[], object]) -> RuntimeError:
    """Run ``action`` on a second thread; return the one RuntimeError it must raise."""
    errors: list[RuntimeError] = []

    def run() -> None:
        try:
            action()
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(errors) == 1, "the second thread was not refused"
    return errors[0]


class StepTensors(TorchDispatchMode):
    """Weak references to every tensor the operations run under it return."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        return out

    def alive(self, model: nn.Module) -> list[torch.Tensor]:
        """Tensors the step made that are still alive, the gradients left out."""
        grads = {id(p.grad) for p in model.parameters() if p.grad is not None}
        out = []
        for ref in self.refs:
            t = ref()
            if t is not None and id(t) not in grads:
                out.append(t)
        return out

    def live_bytes(self, model: nn.Module) -> int:
        """Bytes of the storages of :meth:`alive` tensors, each storage once, those of the
        model's parameters left out (a linear layer saves a transposed view of its weight)."""
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        storages = {
            t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in self.alive(model)
        }
        return sum(n for key, n in storages.items() if key not in params)


class ReloadOrderRecorder:
    """Per reload of a layer's units: the order their copies back were queued in, and the
    order backward first read them in (NOTE [Reloads in the order backward reads]).

    Installed on :class:`~cpu_offload.v2.OffloadableLayerState` with ``monkeypatch``; units
    are told apart by ``id``, so :meth:`clear` it before the iteration to check.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from cpu_offload.v2 import OffloadableLayerState

        self.queued: list[list[int]] = []
        self.first_reads: dict[int, int] = {}
        reload_units, join_reload = (
            OffloadableLayerState._reload_units,
            OffloadableLayerState._join_reload,
        )

        def logged_reload(state, units, buffers):  # type: ignore[no-untyped-def]
            if len(units) > 1:  # a layer's reload (one unit alone: read again on demand)
                self.queued.append([id(u) for u in units])
            return reload_units(state, units, buffers)

        def logged_join(state, unit, stream, *, reads=False):  # type: ignore[no-untyped-def]
            if reads:
                self.first_reads.setdefault(id(unit), len(self.first_reads))
            return join_reload(state, unit, stream, reads=reads)

        monkeypatch.setattr(OffloadableLayerState, "_reload_units", logged_reload)
        monkeypatch.setattr(OffloadableLayerState, "_join_reload", logged_join)

    def clear(self) -> None:
        self.queued.clear()
        self.first_reads.clear()

    def assert_queued_in_read_order(self) -> None:
        """Every reload since :meth:`clear` queued its copies in the order backward then
        read them (units never read at the end)."""
        assert self.queued, "no layer was reloaded"
        last = len(self.first_reads)
        for queued in self.queued:
            read = sorted(queued, key=lambda u: self.first_reads.get(u, last))
            assert queued == read, "copies back not queued in the order backward read them"


def fail_on_call(obj: object, name: str, call: int) -> None:
    """Make ``obj.name`` raise ``RuntimeError("injected failure")`` on its ``call``-th call.

    The other calls run the method; ``del obj.name`` restores it.
    """
    real, calls = getattr(obj, name), []

    def failing(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    setattr(obj, name, failing)
