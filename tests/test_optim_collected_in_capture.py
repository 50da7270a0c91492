"""An optimizer with ``overlap_host_step_with_forward`` freed by the garbage collector
inside a CUDA graph capture (NOTE [An optimizer collected inside a capture] in
``cpu_offload/optim/_forward_overlap.py``), and a pending parameter read inside one.

Its finalizer must not synchronize there (that invalidates the capture), and the
parameters whose copies back it would have waited for must still never be read stale:
they stay pending, and their first read waits for the copy. The CPU tests drive the
finalizer with a capture and a stream stood in; the ``cuda`` test runs the real path::

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python -m pytest \\
        tests/test_optim_collected_in_capture.py -m cuda -q
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch

import cpu_offload.optim._forward_overlap as overlap_module
from cpu_offload.optim import HybridDeviceOptimizer
from cpu_offload.optim._entries import Entry
from cpu_offload.optim._forward_overlap import ForwardOverlap, _close, _LateLanding
from cpu_offload.optim._pending import is_pending, mark_pending


class _Event:
    """Stands in for a CUDA event of a copy back; synchronizing it is recorded."""

    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


class _Stream:
    """Stands in for the reader's current stream; records the events it waits for."""

    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class _Owner:
    """The optimizer's overlap state as the pending mark sees it: a bound ``wait``."""

    def wait(self, entry: Entry) -> None:
        raise AssertionError("the collected optimizer's wait was called")


def _entry() -> Entry:
    param = torch.nn.Parameter(torch.zeros(3))
    return Entry(param=param, group=0, host=True, offloaded=True, inner=param, master=False)


def _pending_entry(owner: _Owner) -> Entry:
    entry = _entry()
    entry.h2d_event = _Event()  # type: ignore[assignment]
    assert mark_pending(entry.param, owner.wait, entry)
    return entry


def _capturing(monkeypatch: pytest.MonkeyPatch, value: bool) -> None:
    monkeypatch.setattr(overlap_module, "is_current_stream_capturing", lambda: value)


def _reader_stream(monkeypatch: pytest.MonkeyPatch) -> _Stream:
    """The stream every ``torch.cuda.current_stream()`` gives from now on in this test."""
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return stream


def test_collected_outside_a_capture_waits_for_the_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    _capturing(monkeypatch, False)
    owner = _Owner()
    entry = _pending_entry(owner)
    _close([], overlap_module.ThreadPoolExecutor(1), {id(entry.param): entry})
    assert entry.h2d_event.synchronized == 1  # type: ignore[union-attr]
    assert not is_pending(entry.param)


def test_collected_inside_a_capture_leaves_the_read_to_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _capturing(monkeypatch, True)
    owner = _Owner()
    entry = _pending_entry(owner)
    param, event = entry.param, entry.h2d_event
    _close([], overlap_module.ThreadPoolExecutor(1), {id(param): entry})
    del owner, entry  # as the finalizer leaves them: the optimizer is gone
    assert event.synchronized == 0  # type: ignore[union-attr]
    assert is_pending(param)

    # A value read inside the capture cannot wait there: refused, still pending.
    with pytest.raises(RuntimeError, match=r"inside a CUDA graph capture.*synchronize\(\)"):
        param.sum()
    assert is_pending(param)

    # The first read after the capture orders its stream after the copy, then runs.
    _capturing(monkeypatch, False)
    stream = _reader_stream(monkeypatch)
    assert param.sum().item() == 0.0
    assert stream.waited == [event]
    assert type(param) is torch.nn.Parameter and not param.__dict__


def test_late_landing_refuses_a_read_inside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    _capturing(monkeypatch, True)
    landing = _LateLanding(_Event(), torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="optimizer's synchronize"):
        landing.wait(torch.zeros(1))


def test_a_live_optimizer_refuses_a_read_inside_a_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A stream cannot wait inside a capture for a copy queued outside it: the read is
    # refused before anything changes, and the first read after the capture waits.
    overlap = ForwardOverlap(None)
    entry = _entry()
    param = entry.param
    overlap.track([entry])
    with overlap._marks:
        overlap._mark(entry).set()  # its new value is queued: only the copy is left
    entry.h2d_event = _Event()  # type: ignore[assignment]
    overlap.cuda_device = torch.device("cpu")
    _capturing(monkeypatch, True)
    with pytest.raises(RuntimeError, match=r"inside a CUDA graph capture.*synchronize\(\)"):
        param.sum()
    assert is_pending(param) and overlap.busy

    _capturing(monkeypatch, False)
    stream = _reader_stream(monkeypatch)
    assert param.sum().item() == 0.0
    assert stream.waited == [entry.h2d_event]
    assert not is_pending(param) and not overlap.busy


@pytest.mark.cuda
def test_an_optimizer_collected_inside_a_capture_keeps_it_valid() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, device="cuda")
    ref = copy.deepcopy(model)
    kw: dict[str, Any] = {"offload_fraction": 1.0, "lr": 1e-3, "weight_decay": 0.01}
    opt = HybridDeviceOptimizer(model.parameters(), overlap_host_step_with_forward=True, **kw)
    plain = HybridDeviceOptimizer(ref.parameters(), **kw)
    x = torch.randn(2, 8, device="cuda")
    for stepped, optimizer in ((ref, plain), (model, opt)):
        stepped(x).sum().backward()
        optimizer.step()
    del optimizer
    overlap = opt._overlap
    assert overlap is not None and overlap._future is not None
    overlap._future.result()  # the host step is done: its copies back are queued
    assert is_pending(model.weight) and is_pending(model.bias)
    alive = weakref.ref(overlap)
    static = torch.randn(4, 8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    gc.disable()  # the collection happens inside the capture, not before it
    try:
        cycle: list[Any] = [opt]
        cycle.append(cycle)  # only the garbage collector frees the optimizer now
        del opt, overlap, cycle
        with torch.cuda.graph(graph):
            doubled = static * 2
            assert alive() is not None
            gc.collect()  # runs the optimizer's finalizer
            assert alive() is None
            out = doubled + 1
    finally:
        gc.enable()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, static * 2 + 1)
    # The parameters stayed pending; their first reads wait for the copies back.
    assert is_pending(model.weight) and is_pending(model.bias)
    assert torch.equal(model.weight.detach(), ref.weight.detach())
    assert torch.equal(model.bias.detach(), ref.bias.detach())
    assert type(model.weight) is torch.nn.Parameter and not model.weight.__dict__
