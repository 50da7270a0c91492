"""Exact fingerprints of gradients, to tell whether an early gradient copy still holds.

A gradient copied to the host during backward is reused in ``step()`` only if nothing
changed it in between: the same tensor, the same version counter and the same
fingerprint of its bits, taken on its device (see :func:`fingerprint`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._entries import Entry

__all__ = ["EarlyCopyChecks", "fingerprint"]

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
    tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        # Lazy conjugate or negative views: their bits are those of the resolved values.
        tensor = tensor.resolve_conj().resolve_neg()
    flat = tensor.reshape(-1)
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


class _BucketCheck:
    """The check of one bucket's early copies: a host bool per candidate, and its event."""

    def __init__(
        self,
        candidates: list[Entry],
        same: torch.Tensor | None,
        event: torch.cuda.Event | None,
    ) -> None:
        self.candidates = candidates
        self.same = same
        self.event = event
        self.settled = not candidates


class EarlyCopyChecks:
    """Whether each early gradient copy still holds, checked bucket by bucket.

    The checks are queued on the current stream in host-stepping order, one event per
    bucket, so that the host can step the first bucket as soon as its own check is done
    rather than after every bucket's. Construction drops the early copies that are
    already stale (another tensor, another version counter); :meth:`settle` waits for a
    bucket's check and drops the early copies whose fingerprint changed.

    Args:
        buckets: The entries of each host bucket, in stepping order.
    """

    def __init__(self, buckets: Sequence[Sequence[Entry]]) -> None:
        self._checks: list[_BucketCheck] = []
        self.made = 0  # early copies made in backward
        self.candidates = 0  # of those, the ones still plausible (same tensor and version)
        self.kept = 0  # of those, the ones whose fingerprint is unchanged
        for entries in buckets:
            candidates: list[Entry] = []
            now: list[torch.Tensor] = []
            for entry in entries:
                record, entry.early = entry.early, None
                if record is None:
                    continue
                self.made += 1
                grad = entry.param.grad
                if grad is None:
                    continue
                if record.grad() is not grad or grad._version != record.version:
                    continue
                entry.early = record
                candidates.append(entry)
                now.append(fingerprint(grad))
            self.candidates += len(candidates)
            if not candidates:
                self._checks.append(_BucketCheck([], None, None))
                continue
            then = torch.stack([e.early.fingerprint for e in candidates])  # type: ignore[union-attr]
            same = (torch.stack(now) == then).all(dim=1)
            event = None
            if same.is_cuda:
                # A non-blocking copy and an event: the host waits for this bucket's
                # check (and thereby for the end of backward) only when it steps it.
                same = same.to("cpu", non_blocking=True)
                event = torch.cuda.current_stream(then.device).record_event()
            self._checks.append(_BucketCheck(candidates, same, event))

    def settle(self, index: int) -> list[Entry]:
        """Decide bucket ``index``'s early copies; return the entries decided now.

        Waits for that bucket's check. If it rejected a copy, the gradients were changed
        after backward (clipping, unscaling) and later buckets' copies are likely stale
        too: all remaining checks are decided at once, so that every needed copy can be
        queued together. Kept entries keep ``entry.early``; rejected ones lose it.
        """
        decided: list[Entry] = []
        if self._settle_one(self._checks[index], decided):
            for check in self._checks[index + 1 :]:
                self._settle_one(check, decided)
        return decided

    def settle_all(self) -> list[Entry]:
        """Decide every bucket's early copies; return the entries decided now."""
        decided: list[Entry] = []
        for check in self._checks:
            self._settle_one(check, decided)
        return decided

    def _settle_one(self, check: _BucketCheck, decided: list[Entry]) -> bool:
        """Decide one bucket; True if it rejected an early copy."""
        if check.settled:
            return False
        check.settled = True
        if check.event is not None:
            check.event.synchronize()
        assert check.same is not None
        rejected = False
        for entry, ok in zip(check.candidates, check.same.tolist(), strict=True):
            if ok:
                self.kept += 1
            else:
                entry.early = None
                rejected = True
        decided.extend(check.candidates)
        return rejected
