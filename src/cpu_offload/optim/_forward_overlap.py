"""Host steps that finish under the next forward (``overlap_host_step_with_forward``).

``step()`` queues the host buckets on a worker thread, in the order the next forward
reads their parameters, and returns. Each parameter's new value is copied back as soon
as its bucket is stepped; ``Entry.landed`` is set once that copy is queued and
``Entry.h2d_event`` marks the copy itself. Readers wait for exactly the parameters they
read:

* every module's forward, through one global forward pre-hook: a module waits for its
  own parameters and for those of descendants that the first forward did not run
  (``nn.MultiheadAttention`` reads ``out_proj``'s parameters without calling it); the
  descendants that ran wait for theirs;
* ``module.state_dict()`` of those modules (a state-dict pre-hook on each);
* ``synchronize()``, and through it the optimizer's ``state_dict()``,
  ``load_state_dict()``, ``add_param_group()`` and the next ``step()``;
* any other read of a pending parameter's values, anywhere (``_pending``: its class is
  swapped until it lands, and every torch function on it waits first).

The same hook learns, in the first forward, which modules run and in which order they
read the parameters; the host buckets follow that order from the first ``step()`` on.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch

from cpu_offload._compat import is_current_stream_capturing
from cpu_offload._compile import keep_engine_out_of_compile

from ._copies import step_host_subs
from ._entries import Entry, Sub
from ._pending import (
    hand_over,
    is_writer,
    mark_pending,
    unmark_pending,
    wait_for_copy,
    wait_for_others,
    writing,
)

__all__ = ["ForwardOverlap", "UnguardedReadError"]


class UnguardedReadError(RuntimeError):
    """A parameter was read while its update from the host could still be in flight."""


class _ForwardPreHook:
    # Global hook: holds the overlap state weakly so that it never keeps it alive.
    def __init__(self, owner: ForwardOverlap) -> None:
        self._owner = weakref.ref(owner)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        owner = self._owner()
        if owner is not None:
            owner.before_forward(module)


class _StateDictPreHook:
    def __init__(self, owner: ForwardOverlap) -> None:
        self._owner = weakref.ref(owner)

    def __reduce__(self) -> tuple[Any, ...]:
        # A pickled or deep-copied model (torch.save(model)) carries its hooks: the copy
        # has no optimizer to wait for.
        return (_NoWait, ())

    def __call__(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        owner = self._owner()
        if owner is not None:
            owner.before_state_dict(module)


class ForwardOverlap:
    """Pending host updates of one optimizer and the waits for them."""

    def __init__(self, cuda_device: torch.device | None) -> None:
        # Compiled forwards call the pre-hook and read pending parameters: TorchDynamo
        # must run this package's code as it is, not trace it.
        keep_engine_out_of_compile()
        self.cuda_device = cuda_device
        self._pending: dict[int, Entry] = {}
        # Marking a parameter pending (step()) and giving it its class back (a reader,
        # possibly on another thread) change _pending and the class together.
        self._marks = threading.Lock()
        self._entry_by_id: dict[int, Entry] = {}
        self._order: dict[int, int] = {}  # id(param) -> first-read position in a forward
        self._first_device_read: int | None = None  # of a parameter stepped on the device
        # id(module) -> ids of the parameters it waits for (entries change on rebuilds)
        self._guards: dict[int, list[int]] = {}
        self._seen: dict[int, torch.nn.Module] = {}  # modules run while learning
        self.learning = True
        self._future: Future[dict[str, float]] | None = None
        self._error: BaseException | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="cpu_offload_hdo_step")
        self._handles: list[Any] = [
            torch.nn.modules.module.register_module_forward_pre_hook(_ForwardPreHook(self))
        ]
        weakref.finalize(self, _close, self._handles, self._executor, self._pending)

    # ------------------------------------------------------------------ entries

    def track(self, entries: Sequence[Entry]) -> None:
        """Watch the parameters of ``entries`` (after a rebuild; nothing may be pending)."""
        assert not self._pending
        self._entry_by_id = {id(e.param): e for e in entries}
        self._note_first_device_read()

    def _note_first_device_read(self) -> None:
        # A streamed entry is stepped on the device too, by the stream lane from step()
        # on: the host lane's buckets read after it wait for gradients as device layers'
        # followers do.
        device_reads = [
            self._order[key]
            for key, e in self._entry_by_id.items()
            if (not e.host or e.streamed) and key in self._order
        ]
        self._first_device_read = min(device_reads, default=None)

    def read_after_device_param(self, entry: Entry) -> bool:
        """Whether a forward reads a parameter stepped on the device before ``entry``'s.

        Stepped on the device: a parameter the device optimizer owns, or a streamed one
        (``stream_share``).

        False until the first forward showed the order.
        """
        position = self._order.get(id(entry.param))
        first = self._first_device_read
        return position is not None and first is not None and position > first

    def forward_position(self, entry: Entry) -> int | None:
        """Where a forward first read the entry's parameter (None: not seen)."""
        return self._order.get(id(entry.param))

    # ------------------------------------------------------------------ the hook

    def before_forward(self, module: torch.nn.Module) -> None:
        """Wait for the parameters this module's forward reads; note it while learning."""
        if self.learning:
            self._seen.setdefault(id(module), module)
        if not self._pending:
            return
        guarded = self._guards.get(id(module))
        if guarded is None:
            # A module the first forward did not run: its own parameters.
            guarded = [id(p) for p in module._parameters.values() if p is not None]
        for key in guarded:
            entry = self._pending.get(key)
            if entry is not None:
                self.wait(entry)

    def before_state_dict(self, module: torch.nn.Module) -> None:
        """Wait for the module's guarded parameters (``module.state_dict()``)."""
        self.before_forward(module)

    def finish_learning(self) -> None:
        """Turn the modules the first forward ran into what each one waits for.

        A module guards its own parameters and those of descendants whose forward did
        not run (``nn.MultiheadAttention`` reads ``out_proj``'s parameters without
        calling it); descendants that ran guard theirs. Parameters are ordered by the
        first module guarding them.
        """
        if not self.learning:
            return
        self.learning = False
        seen, self._seen = self._seen, {}

        def collect(module: torch.nn.Module, out: list[int]) -> None:
            for p in module._parameters.values():
                if p is None or id(p) not in self._entry_by_id:
                    continue
                self._order.setdefault(id(p), len(self._order))
                out.append(id(p))
            for child in module._modules.values():
                if child is not None and id(child) not in seen:
                    collect(child, out)

        for key, module in seen.items():
            guarded: list[int] = []
            collect(module, guarded)
            if guarded:
                self._guards[key] = guarded
                # model.state_dict() reads the parameters too: it waits for them as well.
                hook = module.register_state_dict_pre_hook(_StateDictPreHook(self))
                self._handles.append(hook)
        self._note_first_device_read()

    # ------------------------------------------------------------------ waiting

    def wait(self, entry: Entry) -> None:
        """Order the current stream (and the host) after the entry's update.

        Raises:
            RuntimeError: Inside a CUDA graph capture, where no stream may wait for a copy
                queued outside it (that fails the capture); the parameter stays pending.
        """
        landed = entry.landed
        if landed is not None:
            landed.wait()
        # Checked once the copy is queued (the host step may still run before that):
        # everything stays as it is, so the first read after the capture waits.
        if entry.h2d_event is not None and is_current_stream_capturing():
            raise _read_in_capture()
        # Only this update's mark goes: a reader that waited for one step's update must
        # not unmark the next step's (``landed`` is new for every update). A mark with
        # nothing pending behind it is stale and goes too.
        with self._marks:
            current = self._pending.get(id(entry.param))
            if current is None or (current is entry and entry.landed is landed):
                self._pending.pop(id(entry.param), None)
                # Only this entry's mark: another optimizer may have marked it since.
                unmark_pending(entry.param, entry)
        entry.unguarded = False
        if self._error is not None:
            self._raise_error()
        if entry.h2d_event is not None and self.cuda_device is not None:
            torch.cuda.current_stream(self.cuda_device).wait_event(entry.h2d_event)

    def wait_all(self) -> dict[str, float]:
        """Wait for every pending update; return the host step's timings (or {}).

        Raises:
            RuntimeError: If called on the thread that runs the host step (from a hook
                of its optimizers), which would wait for itself.
        """
        if is_writer():
            raise RuntimeError(
                "HybridDeviceOptimizer: waiting for the host step from inside it (an "
                "optimizer step hook that reads or changes the optimizer's state on the "
                "host-step thread) would never return; do that between steps"
            )
        future, self._future = self._future, None
        timings: dict[str, float] = {}
        if future is not None:
            try:
                timings = future.result()
            except BaseException as exc:  # raised below, for the waiting caller
                self._error = exc
        if self._error is not None:
            self._raise_error()
        for entry in list(self._pending.values()):
            self.wait(entry)
        return timings

    def _raise_error(self) -> None:
        # Reported once: nothing stays pending behind a failed host step.
        error, self._error = self._error, None
        self._future = None
        with self._marks:
            for entry in self._pending.values():
                entry.unguarded = False
                unmark_pending(entry.param)
            self._pending.clear()
        raise RuntimeError(
            "the host optimizer step that ran after step() returned failed; the "
            "offloaded parameters were not all updated"
        ) from error

    @property
    def busy(self) -> bool:
        """Whether updates may still be in flight."""
        return bool(self._pending) or self._future is not None

    # ------------------------------------------------------------------ stepping

    def submit(self, subs: Sequence[Sub], h2d: torch.cuda.Stream | None) -> None:
        """Step ``subs`` on the worker, in order, each entry's copy back as it is done."""
        entries = [entry for sub in subs for entry in sub.entries]
        self._mark_all(entries)
        try:
            self._future = self._executor.submit(self._run, list(subs), h2d)
        except BaseException:  # a shut-down executor: no reader may wait for it
            with self._marks:
                self._unmark(entries)
            raise

    def mark_queued(self, entries: Sequence[Entry]) -> None:
        """Make readers of ``entries`` wait for their updates already queued on the device.

        For entries stepped by the stream lane (``_stream``): their new values are
        queued by the time ``step()`` returns, so ``landed`` is set at once and a reader
        waits only for ``h2d_event`` on its stream.
        """
        stepped = [entry for entry in entries if entry.h2d_event is not None]  # a gradient
        for landed in self._mark_all(stepped):
            landed.set()

    def _mark_all(self, entries: Sequence[Entry]) -> list[threading.Event]:
        """Make the entries' parameters pending, each behind a new ``landed`` event, all
        or none (a failure leaves no reader waiting for a host step never submitted)."""
        for entry in entries:
            # Another optimizer's update of the same parameter lands first; its wait
            # takes its own lock, so not under ours.
            wait_for_others(entry.param, self.wait)
        marked: list[threading.Event] = []
        with self._marks:
            try:
                for entry in entries:
                    marked.append(self._mark(entry))
            except BaseException:
                self._unmark(entries[: len(marked)])
                raise
        return marked

    def _unmark(self, entries: Sequence[Entry]) -> None:
        """Undo :meth:`_mark` of ``entries`` (under ``_marks``), leaving no reader waiting."""
        for entry in entries:
            self._pending.pop(id(entry.param), None)
            entry.unguarded = False
            unmark_pending(entry.param, entry)
            if entry.landed is not None:
                entry.landed.set()

    def _mark(self, entry: Entry) -> threading.Event:
        """Make ``entry``'s parameter pending behind a new ``landed`` event (under ``_marks``)."""
        entry.marked = mark_pending(entry.param, self.wait, entry)  # first: it may raise
        entry.landed = threading.Event()
        entry.unguarded = True
        self._pending[id(entry.param)] = entry
        return entry.landed

    def _run(self, subs: list[Sub], h2d: torch.cuda.Stream | None) -> dict[str, float]:
        device = torch.cuda.device(self.cuda_device) if self.cuda_device is not None else None
        try:
            # Grad mode is per thread: the copies back write leaf parameters in place.
            # The parameters are pending (``_pending``): this thread writes them
            # without waiting for itself.
            with torch.no_grad(), writing(), device if device is not None else nullcontext():
                return step_host_subs(subs, h2d, on_copied=_mark_landed)
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            # Never leave a reader waiting: a failure is reported by wait().
            for sub in subs:
                for entry in sub.entries:
                    if entry.landed is not None:
                        entry.landed.set()

    def check_read(self, entry: Entry) -> None:
        """Raise if backward reached a parameter that no reader waited for."""
        if entry.unguarded:
            raise UnguardedReadError(
                f"a parameter of shape {tuple(entry.param.shape)} was used in a forward "
                "pass while its update from the host step could still be in flight "
                "(overlap_host_step_with_forward=True): it was read outside its own "
                "module's forward (a functional call on another module's parameter, or "
                "code outside any module). Call optimizer.synchronize() before such "
                "reads, or turn the option off"
            )


def _mark_landed(entry: Entry) -> None:
    assert entry.landed is not None
    entry.landed.set()


class _NoWait:
    """What a state-dict pre-hook becomes in a copy of the model: nothing to wait for."""

    def __call__(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        pass


# NOTE [An optimizer collected inside a capture]
# The overlap state's finalizer runs when the garbage collector frees it, which can be
# at any allocation, on any thread, a CUDA graph capture's included (an optimizer in a
# reference cycle is freed only by the collector). A capture forbids host
# synchronization: an event's synchronize() there invalidates it, and in the default
# (global) capture mode that holds for a synchronize on any thread. So the finalizer
# never waits for a copy back: it leaves each parameter whose copy back may be in flight
# pending, behind a _LateLanding that holds the copy's event. The first value read
# waits for the copy on the host (every stream then sees the new value), outside a
# capture; a read inside one is refused (it cannot wait there, and without waiting it
# could see the old value). An optimizer that later marks the parameter pending again
# waits for that copy first (_pending.wait_for_others), and a reader that waited for the
# copy leaves that optimizer's mark in place (it unmarks only the mark it waited for).
# A parameter that cannot stay pending (a subclass with its own __torch_function__) has
# nothing to make its reads wait: the finalizer synchronizes its copy, after handing
# over every other one. Inside a capture that synchronize fails the capture: its error
# is printed as ignored in the finalizer, and the capture fails when it ends.


def _read_in_capture() -> RuntimeError:
    # A stream waiting inside a capture for an event recorded outside it fails the
    # capture, and a host synchronization is not allowed there either.
    return RuntimeError(
        "HybridDeviceOptimizer: a parameter was read inside a CUDA graph capture while "
        "its update from the host step (overlap_host_step_with_forward) was still being "
        "copied back; call the optimizer's synchronize() before capturing (and before "
        "dropping the optimizer), or capture after the first forward that follows step()"
    )


class _LateLanding:
    """The copy back of a parameter whose optimizer was collected before it was read."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self, param: torch.Tensor) -> None:
        """Wait on the host for the copy, then give ``param`` its class back (unless a
        later update marked it meanwhile).

        Raises:
            RuntimeError: Inside a CUDA graph capture, where no wait is possible.
        """
        wait_for_copy(param, self.event, param)  # hand_over's mark: its entry is the param


def _close(handles: list[Any], executor: ThreadPoolExecutor, pending: dict[int, Entry]) -> None:
    # The worker holds the optimizer's overlap state while it steps, so this runs once
    # no host step is running (possibly on the worker itself: no join).
    # NOTE [An optimizer collected inside a capture]
    unswappable: list[torch.cuda.Event] = []
    errors: list[BaseException] = []
    try:
        for entry in pending.values():
            param, event = entry.param, entry.h2d_event
            if event is None:
                unmark_pending(param, entry)  # nothing was copied back: nothing to wait for
            elif not entry.marked:
                unswappable.append(event)  # nothing makes its reads wait
            else:
                # False: read already, or marked for another update since; either way
                # its reads no longer need this copy's wait.
                hand_over(param, entry, _LateLanding(event).wait)
        for event in unswappable:
            try:
                event.synchronize()
            except Exception as exc:  # each one is still waited for; the first is raised
                errors.append(exc)
    finally:
        pending.clear()
        for handle in handles:
            handle.remove()
        handles.clear()
        executor.shutdown(wait=False)
    if errors:
        raise errors[0]
