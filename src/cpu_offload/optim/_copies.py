"""The copy path of an offloaded parameter: gradient to the host, new value back.

One entry's gradient goes to its pinned host buffer (:func:`send_grad`, from backward
or from ``step()``), becomes the host optimizer's gradient (:func:`take_host_grad`), and
the stepped host copy goes back into the device parameter (:func:`copy_back`). A copy
queued on a stream records an event on the entry; whoever reads the other side waits
for exactly that event.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ._entries import Entry, Sub

__all__ = [
    "copy_back",
    "copy_converted",
    "grad_buffer",
    "send_grad",
    "step_host_subs",
    "take_host_grad",
]


def copy_converted(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """``dst.copy_(src)`` with any dtype conversion done on ``src``'s device.

    PyTorch converts on the host for a blocking device-to-host copy; converting on the
    GPU first keeps the host's memory bandwidth for the host step.
    """
    if src.dtype != dst.dtype:
        src = src.to(dst.dtype)
    dst.copy_(src, non_blocking=non_blocking)


def _widen_after_copy(
    event: torch.cuda.Event | None, buf: torch.Tensor, wide: torch.Tensor
) -> None:
    # Runs on the worker thread while backward goes on (grad_copy_dtype="param" with a
    # fp32 master): wait for the copy to the host, then widen it for the master.
    if event is not None:
        event.synchronize()
    wide.copy_(buf)


def grad_buffer(entry: Entry, grad: torch.Tensor, pin: bool) -> torch.Tensor:
    """The entry's host gradient buffer, (re)allocated if ``grad`` does not fit it.

    fp32 for a fp32 master with ``grad_copy_dtype="master"`` (widened on the device),
    the gradient's own dtype otherwise.
    """
    dtype = entry.inner.dtype if entry.host_grad is None and entry.master else grad.dtype
    buf = entry.grad_buf
    if buf is None or buf.dtype != dtype or buf.shape != grad.shape:
        buf = torch.empty(
            grad.shape, dtype=dtype, device="cpu", pin_memory=entry.param.is_cuda and pin
        )
        entry.grad_buf = buf
    return buf


def send_grad(
    entry: Entry,
    grad: torch.Tensor,
    stream: torch.cuda.Stream | None,
    pin: bool,
    widen_on: ThreadPoolExecutor | None = None,
) -> tuple[torch.cuda.Event | None, bool]:
    """Queue ``grad``'s copy into the entry's host buffer.

    On ``stream``, which the caller has ordered after the gradient's producer, or
    synchronously when None. With ``widen_on``, a host-widened gradient
    (``grad_copy_dtype="param"``) is widened by that worker once the copy is done.

    Returns:
        The copy's event (None for a synchronous copy) and whether it is being widened
        on the worker (``entry.pending``).
    """
    if entry.pending is not None:
        # The worker may still read the previous copy in this buffer.
        entry.pending.result()
        entry.pending = None
    buf = grad_buffer(entry, grad, pin)
    event = None
    if stream is not None:
        current = torch.cuda.current_stream(grad.device)
        with torch.cuda.stream(stream):
            copy_converted(buf, grad, non_blocking=True)
            event = stream.record_event()
        if stream != current:
            # The side stream reads the gradient: keep its memory until that is done.
            grad.record_stream(stream)
    else:
        copy_converted(buf, grad, non_blocking=False)
    widened = False
    if widen_on is not None and entry.host_grad is not None and buf.dtype != entry.host_grad.dtype:
        entry.pending = widen_on.submit(_widen_after_copy, event, buf, entry.host_grad)
        widened = True
    return event, widened


def check_dense_grads(entries: Sequence[Entry]) -> None:
    """Refuse, before any parameter is stepped, a sparse gradient that would be copied.

    An offloaded parameter's gradient travels into a dense host buffer (and a streamed
    one's is stepped by a dense kernel); a sparse one would fail there, half-way through
    the step, after the device side was stepped.

    Raises:
        RuntimeError: Naming the parameter (its index in param-group order).
    """
    for index, entry in enumerate(entries):
        grad = entry.param.grad
        if entry.offloaded and grad is not None and grad.layout != torch.strided:
            raise RuntimeError(
                f"HybridDeviceOptimizer: parameter {index} (in param-group order) is "
                f"offloaded and has a {grad.layout} gradient; offloaded parameters need "
                "dense gradients. Make its gradient dense, or keep it out of the offloaded "
                "part (a lower offload_fraction, or is_device_param)"
            )


def take_host_grad(entry: Entry) -> None:
    """Wait for the entry's gradient on the host and hand it to its host optimizer."""
    if not entry.offloaded:
        return
    if not entry.has_grad:
        entry.inner.grad = None
        return
    if entry.h2d_event is not None:
        # The previous copy back may still read the host buffers about to be written.
        entry.h2d_event.synchronize()
    buf = entry.grad_buf
    assert buf is not None
    if entry.pending is not None:
        entry.pending.result()
        entry.pending = None
    elif entry.d2h_event is not None:
        entry.d2h_event.synchronize()
    if entry.host_grad is not None:
        if not entry.widened:
            entry.host_grad.copy_(buf)
        entry.inner.grad = entry.host_grad
    elif buf.dtype == entry.inner.dtype:
        entry.inner.grad = buf
    else:
        entry.inner.grad = buf.to(entry.inner.dtype)


def copy_back(entry: Entry, stream: torch.cuda.Stream | None) -> None:
    """Queue the stepped values of a host entry into its parameter (on ``stream``)."""
    if entry.inner.grad is None:
        return  # not stepped: nothing changed
    if not entry.offloaded:
        if entry.master:
            entry.param.copy_(entry.inner)
            entry.note_param_written()
            entry.inner.grad = None
        return
    source = entry.inner
    if entry.stage is not None:
        entry.stage.copy_(entry.inner)  # narrow on the host: half the bytes cross PCIe
        source = entry.stage
    if stream is None:
        entry.param.copy_(source)
        entry.note_param_written()
        return
    with torch.cuda.stream(stream):
        if source.dtype != entry.param.dtype:
            # param_copy_dtype="master": fp32 crosses PCIe, narrowed on the device.
            wide = torch.empty(source.shape, dtype=source.dtype, device=entry.param.device)
            wide.copy_(source, non_blocking=True)
            entry.param.copy_(wide)
        else:
            entry.param.copy_(source, non_blocking=True)
        entry.h2d_event = stream.record_event()
    entry.note_param_written()


def step_host_subs(
    subs: Sequence[Sub],
    stream: torch.cuda.Stream | None,
    on_copied: Callable[[Entry], None] | None = None,
    before: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Step host buckets in order: wait for the gradients, step, queue the copies back.

    Bucket by bucket, so that one bucket's copies back cross the link while the host
    steps the next. ``before`` is called with each bucket's index before its gradients
    are taken; ``on_copied`` with each entry once its copy back is queued.

    Returns:
        Seconds spent waiting for gradients (``host_wait_s``), in the host optimizers
        (``host_step_s``) and queueing the copies back (``host_copy_back_s``).
    """
    wait = host_step = copy = 0.0
    for index, sub in enumerate(subs):
        t0 = time.perf_counter()
        if before is not None:
            before(index)
        for entry in sub.entries:
            take_host_grad(entry)
        t1 = time.perf_counter()
        sub.optimizer.step()
        t2 = time.perf_counter()
        for entry in sub.entries:
            copy_back(entry, stream)
            if on_copied is not None:
                on_copied(entry)
        wait += t1 - t0
        host_step += t2 - t1
        copy += time.perf_counter() - t2
    return {"host_step_s": host_step, "host_wait_s": wait, "host_copy_back_s": copy}
