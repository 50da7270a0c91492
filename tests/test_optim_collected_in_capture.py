"""An optimizer with ``overlap_host_step_with_forward`` freed by the garbage collector
inside a CUDA graph capture (NOTE [An optimizer collected inside a capture] in
``cpu_offload/optim/_forward_overlap.py``), and a pending parameter read inside one.

Its finalizer must not synchronize there (that invalidates the capture, from any
thread), so it never does for a parameter it can leave pending, and those parameters
must still never be read stale: they stay pending, and their first read waits for the
copy. The CPU tests drive the
finalizer with a capture and a stream stood in; the ``cuda`` test runs the real path::

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python -m pytest \\
        tests/test_optim_collected_in_capture.py -m cuda -q
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from typing import Any

import pytest
import torch

import cpu_offload.optim._forward_overlap as overlap_module
import cpu_offload.optim._pending as pending_module
from cpu_offload.optim import HybridDeviceOptimizer
from cpu_offload.optim._entries import Entry
from cpu_offload.optim._forward_overlap import ForwardOverlap, _close, _LateLanding
from cpu_offload.optim._pending import (
    hand_over,
    is_pending,
    mark_pending,
    unmark_pending,
    wait_for_others,
)


class _Event:
    """Stands in for a CUDA event of a copy back; synchronizing it is recorded, with
    whether the parameter was still pending then (``param`` set by the test)."""

    def __init__(self, param: torch.Tensor | None = None, fail: bool = False) -> None:
        self.param = param
        self.fail = fail
        self.synchronized: list[bool] = []

    def synchronize(self) -> None:
        self.synchronized.append(self.param is not None and is_pending(self.param))
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")


class _Stream:
    """Stands in for the reader's current stream; records the events it waits for."""

    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class _Owner:
    """The optimizer's overlap state as the pending mark sees it: a bound ``wait``."""

    def __init__(self) -> None:
        self.waited: list[Entry] = []

    def wait(self, entry: Entry) -> None:
        self.waited.append(entry)
        unmark_pending(entry.param)


class _OwnFunction(torch.nn.Parameter):
    """A parameter class with a ``__torch_function__`` of its own: it cannot be marked."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


def _entry(param: torch.nn.Parameter | None = None) -> Entry:
    param = torch.nn.Parameter(torch.zeros(3)) if param is None else param
    return Entry(param=param, group=0, host=True, offloaded=True, inner=param, master=False)


def _pending_entry(owner: _Owner) -> Entry:
    entry = _entry()
    entry.h2d_event = _Event(entry.param)  # type: ignore[assignment]
    entry.marked = mark_pending(entry.param, owner.wait, entry)  # as step() marks it
    assert entry.marked
    return entry


def _capturing(monkeypatch: pytest.MonkeyPatch, value: bool) -> None:
    for module in (overlap_module, pending_module):
        monkeypatch.setattr(module, "is_current_stream_capturing", lambda: value)


def _reader_stream(monkeypatch: pytest.MonkeyPatch) -> _Stream:
    """The stream every ``torch.cuda.current_stream()`` gives from now on in this test."""
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return stream


class _Handle:
    def __init__(self) -> None:
        self.removed = False

    def remove(self) -> None:
        self.removed = True


@pytest.mark.parametrize("capturing", [False, True])
def test_a_collected_optimizer_leaves_the_read_to_wait(
    monkeypatch: pytest.MonkeyPatch, capturing: bool
) -> None:
    # The finalizer never synchronizes (inside a capture on any thread that fails it):
    # the parameter stays pending, and its first read waits for the copy on the host.
    _capturing(monkeypatch, capturing)
    owner = _Owner()
    entry = _pending_entry(owner)
    param, event = entry.param, entry.h2d_event
    _close([], overlap_module.ThreadPoolExecutor(1), {id(param): entry})
    del owner, entry  # as the finalizer leaves them: the optimizer is gone
    assert event.synchronized == []  # type: ignore[union-attr]
    assert is_pending(param)

    if capturing:
        # A value read inside the capture cannot wait there: refused, still pending.
        with pytest.raises(RuntimeError, match=r"inside a CUDA graph capture.*synchronize\(\)"):
            param.sum()
        assert is_pending(param) and event.synchronized == []  # type: ignore[union-attr]
        _capturing(monkeypatch, False)

    # The host waits for the copy while the parameter is still marked (a read on
    # another thread meanwhile waits too), then the read runs on its own class.
    assert param.sum().item() == 0.0
    assert event.synchronized == [True]  # type: ignore[union-attr]
    assert type(param) is torch.nn.Parameter and not param.__dict__


def test_close_hands_every_parameter_over_before_a_failing_synchronize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A parameter that cannot stay pending is synchronized, after every other one is
    # handed over; its failure (inside a capture) leaves nothing half closed.
    _capturing(monkeypatch, True)
    owner = _Owner()
    unswappable = _entry(_OwnFunction(torch.zeros(2)))
    assert not mark_pending(unswappable.param, owner.wait, unswappable)
    failing = _Event(fail=True)
    unswappable.h2d_event = failing  # type: ignore[assignment]
    later = _pending_entry(owner)
    never_copied = _entry()
    assert mark_pending(never_copied.param, owner.wait, never_copied)
    pending = {id(e.param): e for e in (unswappable, later, never_copied)}
    handles = [_Handle(), _Handle()]
    executor = overlap_module.ThreadPoolExecutor(1)
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        _close(handles, executor, pending)  # type: ignore[arg-type]
    assert failing.synchronized == [False]
    assert is_pending(later.param) and later.h2d_event.synchronized == []  # type: ignore[union-attr]
    assert not is_pending(never_copied.param)
    assert not pending and all(h.removed for h in handles)
    with pytest.raises(RuntimeError, match="shutdown"):
        executor.submit(print)


def test_late_landing_refuses_a_read_inside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    _capturing(monkeypatch, True)
    event = _Event()
    landing = _LateLanding(event)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="optimizer's synchronize"):
        landing.wait(torch.zeros(1))
    assert event.synchronized == []


def test_a_new_optimizer_waits_for_a_collected_ones_copy_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _capturing(monkeypatch, False)
    entry = _pending_entry(_Owner())
    param, event = entry.param, entry.h2d_event
    _close([], overlap_module.ThreadPoolExecutor(1), {id(param): entry})
    assert is_pending(param)
    # A later optimizer marks it for its own update: the collected one's copy lands
    # first, and reads then wait for the new update, not for the old copy only.
    newer = _Owner()
    again = _entry(param)
    with pytest.raises(RuntimeError, match="another optimizer's update"):
        mark_pending(param, newer.wait, again)  # not waited for: refused, unchanged
    assert event.synchronized == []  # type: ignore[union-attr]
    wait_for_others(param, newer.wait)
    assert event.synchronized == [True] and not is_pending(param)  # type: ignore[union-attr]
    assert mark_pending(param, newer.wait, again)
    assert param.sum().item() == 0.0
    assert newer.waited == [again] and not is_pending(param)


def test_a_late_reader_leaves_a_newer_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reader waiting on the host for the collected optimizer's copy while a new
    # optimizer marks the parameter for its own update must not take that mark away.
    _capturing(monkeypatch, False)
    entry = _pending_entry(_Owner())
    param = entry.param
    landing = _LateLanding(_Event(param))  # type: ignore[arg-type]
    assert hand_over(param, entry, landing.wait)
    newer = _Owner()
    again = _entry(param)
    unmark_pending(param, param)  # as the reader's wait would, after the copy landed
    assert mark_pending(param, newer.wait, again)
    landing.wait(param)  # the reader's own unmark comes late
    assert is_pending(param)
    param.sum()
    assert newer.waited == [again]


def test_close_leaves_another_updates_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    # The collected optimizer's entry is still in its pending map, but the parameter was
    # marked for another optimizer's update since: the finalizer leaves that mark.
    _capturing(monkeypatch, False)
    old = _entry()
    old.h2d_event = _Event()  # type: ignore[assignment]
    old.marked = True  # its step marked it; the newer update marked it again since
    newer = _Owner()
    again = _entry(old.param)
    assert mark_pending(old.param, newer.wait, again)
    for h2d_event in (old.h2d_event, None):
        old.h2d_event = h2d_event
        _close([], overlap_module.ThreadPoolExecutor(1), {id(old.param): old})
        assert is_pending(old.param)
        assert old.h2d_event is None or old.h2d_event.synchronized == []  # type: ignore[attr-defined]
    old.param.sum()
    assert newer.waited == [again]


def test_close_waits_for_every_unmarked_copy_and_raises_the_first_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _capturing(monkeypatch, True)
    entries = [_entry(_OwnFunction(torch.zeros(2))) for _ in range(2)]
    events = [_Event(fail=True), _Event(fail=True)]
    for entry, event in zip(entries, events, strict=True):
        entry.h2d_event = event  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="not permitted"):
        _close([], overlap_module.ThreadPoolExecutor(1), {id(e.param): e for e in entries})
    assert [e.synchronized for e in events] == [[False], [False]]


def test_a_failed_marking_leaves_nothing_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    # step() marks every parameter before it submits the host step: a failure half way
    # leaves none pending (a reader would wait for a host step never submitted).
    overlap = ForwardOverlap(None)
    entries = [_entry() for _ in range(3)]
    overlap.track(entries)
    real = overlap_module.mark_pending

    def failing(param: torch.Tensor, wait: Any, entry: Entry) -> bool:
        if entry is entries[2]:
            raise RuntimeError("marked on another thread")
        return real(param, wait, entry)

    monkeypatch.setattr(overlap_module, "mark_pending", failing)
    for entry in entries:
        entry.h2d_event = _Event()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="marked on another thread"):
        overlap.mark_queued(entries)
    assert not overlap.busy and not any(is_pending(e.param) for e in entries)
    assert all(e.landed is None or e.landed.is_set() for e in entries)
    assert not any(e.unguarded for e in entries)
    overlap.wait_all()  # returns: nothing left to wait for


def test_another_optimizers_update_is_waited_for_outside_the_lock() -> None:
    # Its wait takes its own lock: waited for under this optimizer's, two optimizers
    # marking each other's parameters on two threads could deadlock.
    overlap = ForwardOverlap(None)
    entry = _entry()
    overlap.track([entry])
    seen: list[bool] = []

    class _Other:
        def wait(self, other_entry: Entry) -> None:
            seen.append(overlap._marks.locked())
            unmark_pending(other_entry.param)

    other, other_entry = _Other(), _entry(entry.param)
    assert mark_pending(entry.param, other.wait, other_entry)
    entry.h2d_event = _Event()  # type: ignore[assignment]
    overlap.mark_queued([entry])
    assert seen == [False]
    assert is_pending(entry.param) and overlap.busy
    overlap.wait_all()
    assert not is_pending(entry.param)


def test_the_same_optimizer_marking_again_takes_the_new_entry() -> None:
    owner = _Owner()
    first = _pending_entry(owner)
    second = _entry(first.param)
    assert mark_pending(first.param, owner.wait, second)
    assert owner.waited == []  # its own mark: nothing to wait for first
    first.param.sum()
    assert owner.waited == [second]


class _QueuedOnWait:
    """A ``landed`` event whose wait returns once the host step queued the copy back."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry

    def wait(self) -> None:
        if self.entry.h2d_event is None:
            self.entry.h2d_event = _Event()  # type: ignore[assignment]

    def set(self) -> None:
        pass


@pytest.mark.parametrize("copy_queued", [True, False])
def test_a_live_optimizer_refuses_a_read_inside_a_capture(
    monkeypatch: pytest.MonkeyPatch, copy_queued: bool
) -> None:
    # A stream cannot wait inside a capture for a copy queued outside it: the read is
    # refused before anything changes, and the first read after the capture waits.
    # Not yet queued when the read comes: the host step queues it during the wait.
    overlap = ForwardOverlap(None)
    entry = _entry()
    param = entry.param
    overlap.track([entry])
    with overlap._marks:
        overlap._mark(entry)
    entry.landed = _QueuedOnWait(entry)  # type: ignore[assignment]
    if copy_queued:
        entry.h2d_event = _Event()  # type: ignore[assignment]
    overlap._pending[id(param)] = entry
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


def test_a_finalizer_run_while_a_mark_changes_does_not_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Marking allocates, so the garbage collector can free another optimizer right
    # there, on the same thread, and its finalizer changes its own marks.
    _capturing(monkeypatch, False)
    collected = _pending_entry(_Owner())
    real_class = pending_module._pending_class

    def collecting(cls: type) -> type:
        _close([], overlap_module.ThreadPoolExecutor(1), {id(collected.param): collected})
        return real_class(cls)

    monkeypatch.setattr(pending_module, "_pending_class", collecting)
    # A fresh lock of the same kind: a deadlock keeps only this test's lock held.
    reentrant = type(pending_module._SWAP) is type(threading.RLock())
    monkeypatch.setattr(
        pending_module, "_SWAP", threading.RLock() if reentrant else threading.Lock()
    )
    owner, entry = _Owner(), _entry()
    done: list[bool] = []
    marking = threading.Thread(
        target=lambda: done.append(mark_pending(entry.param, owner.wait, entry)), daemon=True
    )
    marking.start()
    marking.join(10)
    assert done == [True] and is_pending(entry.param) and is_pending(collected.param)


def test_a_late_reader_of_a_live_optimizer_leaves_a_newer_mark() -> None:
    # A reader still inside one optimizer's wait when another optimizer, having waited
    # for the same update, marks the parameter for its own: the reader leaves that mark.
    overlap = ForwardOverlap(None)
    entry = _entry()
    overlap.track([entry])
    with overlap._marks:
        overlap._mark(entry).set()
    newer, again = _Owner(), _entry(entry.param)
    wait_for_others(entry.param, newer.wait)  # runs the first optimizer's wait
    assert mark_pending(entry.param, newer.wait, again)
    overlap.wait(entry)  # the late reader
    assert is_pending(entry.param)
    entry.param.sum()
    assert newer.waited == [again]


def test_a_read_as_the_optimizer_dies_waits_for_its_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its weak reference is cleared before its finalizer hands the copy over: a read in
    # between still waits for the copy back, and leaves only that mark.
    monkeypatch.setattr(pending_module, "is_current_stream_capturing", lambda: False)
    owner = _Owner()
    entry = _pending_entry(owner)
    del owner  # gone, its finalizer not run (nothing here registered one)
    assert entry.param.sum().item() == 0.0
    assert entry.h2d_event.synchronized == [True]  # type: ignore[union-attr]
    assert not is_pending(entry.param)

    monkeypatch.setattr(pending_module, "is_current_stream_capturing", lambda: True)
    owner = _Owner()
    entry = _pending_entry(owner)
    del owner
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        entry.param.sum()
    assert is_pending(entry.param) and entry.h2d_event.synchronized == []  # type: ignore[union-attr]


def test_a_step_the_executor_refuses_leaves_nothing_waiting() -> None:
    overlap = ForwardOverlap(None)
    entries = [_entry() for _ in range(2)]
    overlap.track(entries)
    overlap._executor.shutdown()

    class _Sub:
        pass

    sub = _Sub()
    sub.entries = entries  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="shutdown"):
        overlap.submit([sub], None)  # type: ignore[list-item]
    assert not overlap.busy and not any(is_pending(e.param) for e in entries)
    assert all(e.landed is not None and e.landed.is_set() for e in entries)
    overlap.wait_all()
