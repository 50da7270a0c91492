"""Exact fingerprints of gradients, to tell whether an early gradient copy still holds.

A gradient copied to the host during backward is reused in ``step()`` only if nothing
changed it in between: the same tensor, the same version counter and the same
fingerprint of its bits, taken on its device (see :func:`fingerprint`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._entries import Entry

__all__ = ["check_early_copies", "fingerprint", "keep_unchanged_early_copies"]

# Integer dtypes of each element width, to read a tensor's bits element by element:
# signed (for max and min) and unsigned (zero-extended when widened, for the sum).
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UINT_VIEW = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}

_FINGERPRINT_CHUNK = 1 << 24  # elements widened at a time: bounds the temporary memory
_FINGERPRINT_ROW = 1 << 15  # 2^15 unsigned 16-bit codes sum below 2^31: int32 rows


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """An exact checksum of ``tensor``'s bits, as int64 ``(sum, max, min)``, on its device.

    Each element's bits are read as *unsigned* integers of its width (8-byte elements
    as two 4-byte halves) and summed exactly in int64. Signed codes would let +x
    and a negative value mirror each other and cancel when both are zeroed; unsigned
    codes are all positive, so zeroing any nonzero elements, any single-element edit
    and any uniform power-of-2 scaling (which adds the same amount to every nonzero
    code) change the sum. Integer reductions are exact in any order, so the value does
    not depend on the reduction's layout. Max and min of the signed codes come on top.

    It runs on the device stream between backward and the host step, so it reads each
    element once for the sum (widened by the unsigned view in one conversion, summed
    in int32 rows that cannot overflow, then in int64) and once for max and min.

    Args:
        tensor: Any dense tensor.

    Returns:
        A 3-element int64 tensor on ``tensor``'s device.

    Example:
        >>> x = torch.tensor([1.0, -2.0])
        >>> bool(torch.equal(fingerprint(x), fingerprint(x.clone())))
        True
        >>> bool(torch.equal(fingerprint(x), fingerprint(x * 2)))
        False
    """
    if tensor.numel() == 0:
        return torch.zeros(3, dtype=torch.int64, device=tensor.device)
    flat = tensor.detach().reshape(-1)
    size = tensor.element_size()
    ints = flat.view(_INT_VIEW[size]) if size <= 8 else flat.contiguous().view(torch.int64)
    # Wider elements are summed as their 4-byte halves, so that the sum stays exact.
    words = flat if size <= 4 else flat.contiguous().view(torch.int32)
    codes = words.view(_UINT_VIEW[words.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for chunk in codes.split(_FINGERPRINT_CHUNK):
        if chunk.element_size() <= 2:
            wide = chunk.to(torch.int32)
            full = wide.numel() - wide.numel() % _FINGERPRINT_ROW
            rows = wide[:full].view(-1, _FINGERPRINT_ROW).sum(1, dtype=torch.int32)
            total += rows.sum(dtype=torch.int64) + wide[full:].sum(dtype=torch.int64)
        else:
            total += chunk.to(torch.int64).sum()
    low, high = torch.aminmax(ints)
    return torch.stack([total, high.to(torch.int64), low.to(torch.int64)])


def check_early_copies(
    entries: Sequence[Entry],
) -> tuple[list[Entry], torch.Tensor | None, torch.cuda.Event | None]:
    """Queue the check of the gradients that have a still-plausible early copy.

    Returns the candidates, whether each gradient's fingerprint is unchanged (a host
    bool tensor, complete once the returned event is) and that event (None off CUDA).
    Drops the other early copies.
    """
    candidates: list[Entry] = []
    now: list[torch.Tensor] = []
    for entry in entries:
        record, entry.early = entry.early, None
        grad = entry.param.grad
        if record is None or grad is None:
            continue
        if record.grad() is not grad or grad._version != record.version:
            continue
        entry.early = record
        candidates.append(entry)
        now.append(fingerprint(grad))
    if not candidates:
        return [], None, None
    then = torch.stack([e.early.fingerprint for e in candidates])  # type: ignore[union-attr]
    same = (torch.stack(now) == then).all(dim=1)
    if not same.is_cuda:
        return candidates, same, None
    # A non-blocking copy and an event, so that the device step can be queued before
    # the host waits for these (and thereby for the end of backward).
    same_host = same.to("cpu", non_blocking=True)
    return candidates, same_host, torch.cuda.current_stream(same.device).record_event()


def keep_unchanged_early_copies(
    candidates: Sequence[Entry], same: torch.Tensor | None, event: torch.cuda.Event | None
) -> int:
    """Keep the early copies whose gradient's fingerprint is unchanged; count them."""
    if not candidates or same is None:
        return 0
    if event is not None:
        event.synchronize()
    kept = 0
    for entry, ok in zip(candidates, same.tolist(), strict=True):
        if ok:
            kept += 1
        else:
            entry.early = None
    return kept
