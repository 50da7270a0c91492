"""The floors the host-overhead benchmarks measure V2 against: saved-tensor hooks that only
detach what they are given (the least any hooks cost), and bare copies of V2's bytes at
its schedule's points (the least moving them costs)."""

from __future__ import annotations

import torch


def kept(t: torch.Tensor) -> torch.Tensor:
    """Pack hook of the floor: keep the tensor, detached as V2 keeps it (NOTE [Kept
    tensors are detached] in ``cpu_offload/v2/synchronizer.py``)."""
    return t if t.requires_grad and t.is_leaf else t.detach()


def same(t: torch.Tensor) -> torch.Tensor:
    """Unpack hook of the floor: the tensor as packed."""
    return t


class SavedCounter:
    """Counts the tensors saved for backward during one step (outer hooks)."""

    def __init__(self) -> None:
        self.count = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return t


class BareCopies:
    """V2's copies and nothing else: the same bytes at the same points, whole layers at once.

    Hooks that only detach, as the hooks floor's, plus copies of as many bytes as V2
    moves for each of the first ``k`` layers (``nbytes``, read off V2's layers once its
    choice of what to keep has settled), at its default schedule's points: out to a
    pinned host buffer when the layer's forward ends, the compute stream waiting for it
    before the forward of layer ``n-k+i``; back into a device buffer on a second stream
    when the backward of layer ``n-k+i-1`` begins, the compute stream waiting for it
    before layer ``i``'s own backward. One copy per layer each way, from buffers
    allocated once, and nothing released or rebuilt: what is left is the link's time,
    the copies' weight on the host and on the device's memory, and two copy calls per
    layer. It is a reference, not a strict lower bound: V2 starts each tensor's copy
    after that tensor's own save and waits for each reloaded tensor where backward
    reads it, while these copies wait for whole layers. With ``wait=False`` the compute
    stream never waits for a copy: the copies' weight alone, without the schedule's
    stalls.

    Raises:
        ValueError: If ``nbytes`` does not name between 1 and ``n - 1`` layers.
    """

    def __init__(self, n: int, nbytes: list[int], wait: bool = True) -> None:
        if not 0 < len(nbytes) < n:
            raise ValueError(f"nbytes: one entry per offloaded layer, 1 to {n - 1}, got {nbytes}")
        self.n, self.k, self.wait = n, len(nbytes), wait
        self.out_stream, self.in_stream = torch.cuda.Stream(), torch.cuda.Stream()
        self.layer = -1

        def buffers(**kw: object) -> list[torch.Tensor]:
            return [torch.empty(b, dtype=torch.uint8, **kw) for b in nbytes]  # type: ignore[arg-type]

        self.src, self.back = buffers(device="cuda"), buffers(device="cuda")
        self.host = buffers(pin_memory=True)
        self.out_done: list[torch.cuda.Event | None] = [None] * self.k
        self.in_done: list[torch.cuda.Event | None] = [None] * self.k
        self.hooks = torch.autograd.graph.saved_tensors_hooks(kept, same)

    def __enter__(self) -> None:
        self.layer = (self.layer + 1) % self.n
        self.hooks.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Ends the current layer's forward (the variant's ``sync``)."""
        layer, n, k = self.layer, self.n, self.k
        if layer < k:
            self.out_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.out_stream):
                self.host[layer].copy_(self.src[layer], non_blocking=True)
            self.out_done[layer] = self.out_stream.record_event()
        if self.wait and n - k - 1 <= layer < n - 1:  # the forward of layer n-k+i comes next
            torch.cuda.current_stream().wait_event(self.out_done[layer - (n - k - 1)])
        if not x.requires_grad:
            raise ValueError("BareCopies needs each layer's output to require grad")
        out = x if x.grad_fn is not None else x.view_as(x)
        out.grad_fn.register_prehook(lambda grads: self._backward_starts(layer))
        return out

    def _backward_starts(self, layer: int) -> None:
        i = layer - (self.n - self.k - 1)  # the layer whose copy back starts here
        if 0 <= i < self.k:
            self.in_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.in_stream):
                self.back[i].copy_(self.host[i], non_blocking=True)
            self.in_done[i] = self.in_stream.record_event()
        if self.wait and layer < self.k:
            torch.cuda.current_stream().wait_event(self.in_done[layer])
