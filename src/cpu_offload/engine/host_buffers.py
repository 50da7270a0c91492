"""Host buffers for offloaded tensors, reused across training steps.

A steady training loop offloads the same shapes every step: the pool hands back the
buffers the previous step released, so that it stops allocating (pinned) host memory
after its first step, and bounds the number of distinct sizes when shapes vary.
"""

from __future__ import annotations

import torch

from .._compat import pinned_alloc_in_capture_supported
from .layout import TensorLayout

__all__ = ["HostBufferPool", "LayerHostBuffers"]


class HostBufferPool:
    """Host buffers reused across iterations, bucketed by their size in bytes.

    Buffers are raw ``uint8`` tensors; :meth:`view` gives a typed, strided view. The
    pool never frees memory on its own: releasing a buffer only makes it available to
    the next :meth:`acquire` of the same size, so a training loop with steady shapes
    stops allocating after its first step.

    Args:
        pin_memory: Allocate page-locked memory (needed for asynchronous copies).
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = {}
        #: Number of buffers allocated so far (grows only when the pool had none free).
        self.allocations = 0
        #: Bytes of host memory owned by the pool, free or in use.
        self.allocated_bytes = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        """The buffer size that serves a request of ``nbytes``.

        Powers of two up to 1 MiB, then steps of an eighth of the power of two below:
        at most 12.5% is wasted, and a workload whose shapes vary (sequence lengths)
        reuses a bounded number of buffer sizes instead of one per shape.
        """
        if nbytes <= 512:
            return 512
        if nbytes <= 1 << 20:
            return 1 << (nbytes - 1).bit_length()
        step = (1 << (nbytes.bit_length() - 1)) // 8
        return -(-nbytes // step) * step

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes (its size class), reused if one is free."""
        size = self.size_class(nbytes)
        bucket = self._free.get(size)
        if bucket:
            return bucket.pop()
        self.allocations += 1
        self.allocated_bytes += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)

    def release(self, buffer: torch.Tensor) -> None:
        """Give a buffer back for reuse."""
        self._free.setdefault(buffer.numel(), []).append(buffer)

    def clear(self) -> None:
        """Drop the free buffers (buffers in use stay with their users)."""
        for bucket in self._free.values():
            for buf in bucket:
                self.allocated_bytes -= buf.numel()
        self._free.clear()

    @staticmethod
    def view(buffer: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
        """``buffer`` seen as a tensor of ``layout`` (same strides as the device tensor)."""
        # Pool buffers are multiples of 512 bytes (see size_class), so the whole buffer
        # reinterprets as any dtype: one view and one as_strided, no slice.
        if buffer.numel() % layout.dtype.itemsize:
            buffer = buffer[: layout.nbytes]
        return buffer.view(layout.dtype).as_strided(layout.size, layout.stride)


class LayerHostBuffers:
    """The host buffers of one layer's offloaded units, and whose they are.

    From the pool each iteration by default. With ``retain`` the layer holds its buffers
    at fixed addresses across iterations (CUDA graphs before PyTorch 2.11), so the saved
    tensors must keep their sizes. Buffers taken while a CUDA graph is captured belong
    to the graph, which copies to their addresses at every replay: they never go back to
    the pool.

    Args:
        retain: Hold the buffers across iterations (``retain_pinned_cpu_buffers``).
        name: The layer's name, for errors.
    """

    def __init__(self, retain: bool, name: str) -> None:
        self.retain = retain
        self.name = name
        self.retained: list[torch.Tensor] = []
        self._retained_sizes: list[int] = []
        self._captured: list[torch.Tensor] = []

    def acquire(
        self, pool: HostBufferPool, sizes: list[int], capturing: bool
    ) -> list[torch.Tensor]:
        """Buffers for units of ``sizes`` bytes, in order.

        Raises:
            RuntimeError: With ``retain``, when the sizes differ from the retained
                buffers', or when the first buffers would be taken during a capture on
                PyTorch < 2.11.
        """
        if not self.retain:
            buffers = [pool.acquire(n) for n in sizes]
            if capturing:
                self._captured.extend(buffers)
            return buffers
        if not self.retained:
            if capturing and not pinned_alloc_in_capture_supported():
                raise RuntimeError(
                    f"{self.name} has no retained host buffers yet: with "
                    "retain_pinned_cpu_buffers=True, run one eager (warm-up) iteration before "
                    "capturing a CUDA graph, so that the buffers exist before the capture "
                    "(PyTorch < 2.11 cannot allocate pinned memory during capture)"
                )
            self.retained = [pool.acquire(n) for n in sizes]
            self._retained_sizes = sizes
            return self.retained
        if sizes != self._retained_sizes:
            raise RuntimeError(
                f"retain_pinned_cpu_buffers=True needs the same saved tensors every "
                f"iteration, but {self.name} now saves blocks of {sizes} bytes where its "
                f"retained host buffers hold {self._retained_sizes} bytes. Keep shapes fixed, "
                "or create the offload context with retain_pinned_cpu_buffers=False."
            )
        return self.retained

    def returns_to_pool(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` goes back to the pool when the layer releases it."""
        return not self.retain and not any(buffer is b for b in self._captured)
