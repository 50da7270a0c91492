"""V1 offload handlers: what happens to a marked tensor when it is saved and used."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._compat import queue_backward_callback
from .._tensor_group import TensorGroupProcessor
from .._transport import CudaTransport, HostTransport, Transport, is_dense
from ..v2.layer_state import LayerPhase, OffloadableLayerState

__all__ = [
    "AsyncDoubleBufferGroupOffloadHandler",
    "OffloadHandler",
    "SynchronizedGroupOffloadHandler",
    "layer_windows",
]


def _offload_everything(tensor: torch.Tensor) -> bool:
    return True


class _OnDevice:
    """A checker restricted to the tensors the transport can move."""

    def __init__(self, transport: Transport, checker: Callable[[torch.Tensor], bool]) -> None:
        self.transport = transport
        self.checker = checker

    def __call__(self, tensor: torch.Tensor) -> bool:
        return self.transport.accepts(tensor) and self.checker(tensor)


class _Tag(tuple):  # noqa: SLOT001 - carries the iteration beside the (group, index) pair
    """A ``(group, index)`` tag that also knows the iteration it was made in."""

    iteration: int


def _tag(group: int, index: int, iteration: int) -> _Tag:
    tag = _Tag((group, index))
    tag.iteration = iteration
    return tag


class OffloadHandler:
    """Base of the V1 handlers: what to keep for a saved tensor and how to get it back."""

    def tensor_push(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        """Take a tensor saved for backward; return what autograd should keep."""
        raise NotImplementedError("tensor_push is not implemented in the OffloadHandler base")

    def tensor_pop(self, tensor_tag: Any, **kwargs: Any) -> torch.Tensor:
        """Give back the tensor kept as ``tensor_tag``."""
        raise NotImplementedError("tensor_pop is not implemented in the OffloadHandler base")

    def is_current_group_offloaded(self) -> bool:
        """Whether tensors saved now would be offloaded."""
        return False

    def abort(self) -> None:
        """Forget the current iteration (an exception ended it)."""


class SynchronizedGroupOffloadHandler(OffloadHandler):
    """Offloads the first ``num_offload_group`` groups with copies on the compute stream.

    Each commit (:class:`~cpu_offload.v1.GroupCommitFunction`) ends a group in forward
    and starts one in backward. Tensors are tagged ``(group, index)``.

    Args:
        num_offload_group: How many groups (layers), from the first, to offload.
        tensor_need_offloading_checker: Predicate choosing the tensors to offload.
        debug: Keep the offloaded tensor's device and shape in the tag state for inspection.
    """

    def __init__(
        self,
        num_offload_group: int,
        tensor_need_offloading_checker: Callable[[torch.Tensor], bool] = _offload_everything,
        debug: bool = False,
    ) -> None:
        if isinstance(num_offload_group, bool) or not isinstance(num_offload_group, int):
            raise TypeError("num_offload_group must be an int")
        if num_offload_group < 0:
            raise ValueError(f"num_offload_group must be >= 0, got {num_offload_group}")
        self.num_offload_group = num_offload_group
        self.tensor_need_offloading_checker = tensor_need_offloading_checker
        self.debug = debug
        self.current_group = 0
        self.tensor_count_current_group = 0
        self.tensor_tag_to_state: dict[tuple[int, int], Any] = {}

    def groupid_reset(self) -> None:
        """Start counting groups from 0 (a new iteration)."""
        self.current_group = 0
        self.tensor_count_current_group = 0
        self.tensor_tag_to_state.clear()

    def abort(self) -> None:
        self.groupid_reset()

    def on_group_commit_forward(self) -> None:
        """A group's forward ended."""
        self.current_group += 1
        self.tensor_count_current_group = 0

    def on_group_commit_backward(self) -> None:
        """A group's backward begins."""
        self.current_group -= 1
        if self.current_group < 0:
            raise RuntimeError(
                "more group commits in backward than in forward: the commit function must "
                "be called once per layer in forward"
            )

    def is_current_group_offloaded(self) -> bool:
        return self.current_group < self.num_offload_group

    @staticmethod
    def offload(src: torch.Tensor, pin_memory: bool = True) -> tuple[torch.device, torch.Tensor]:
        """Copy ``src`` to host memory (same strides when dense).

        Returns:
            ``(device, cpu_copy)``, the state :meth:`reload` takes.
        """
        pin = pin_memory and src.is_cuda
        if is_dense(src):
            cpu_backup = torch.empty_strided(
                src.size(), src.stride(), dtype=src.dtype, device="cpu", pin_memory=pin
            )
        else:
            cpu_backup = torch.empty(src.size(), dtype=src.dtype, device="cpu", pin_memory=pin)
        cpu_backup.copy_(src, non_blocking=pin)
        return src.device, cpu_backup

    @staticmethod
    def reload(
        state: tuple[torch.device, torch.Tensor],
        non_blocking: bool | None = None,
        copy_buffer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Copy a host copy made by :meth:`offload` back to its device.

        Args:
            state: ``(device, cpu_copy)``.
            non_blocking: Asynchronous copy; by default when the copy is pinned.
            copy_buffer: A device tensor to copy into instead of a new allocation.
        """
        device, cpu_backup = state
        if non_blocking is None:
            non_blocking = cpu_backup.is_pinned()
        if copy_buffer is None:
            copy_buffer = torch.empty_strided(
                cpu_backup.size(), cpu_backup.stride(), dtype=cpu_backup.dtype, device=device
            )
        copy_buffer.copy_(cpu_backup, non_blocking=non_blocking)
        return copy_buffer

    def tensor_push(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        if not (self.is_current_group_offloaded() and self.tensor_need_offloading_checker(tensor)):
            return tensor
        tag = (self.current_group, self.tensor_count_current_group)
        self.tensor_count_current_group += 1
        self.tensor_tag_to_state[tag] = self.offload(tensor)
        return tag

    def tensor_pop(self, tensor_tag: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(tensor_tag, torch.Tensor):
            return tensor_tag
        state = self.tensor_tag_to_state.pop(tensor_tag, None)
        if state is None:
            raise RuntimeError(f"no offloaded tensor with tag {tensor_tag}")
        return self.reload(state)


def layer_windows(num_offload_group: int, num_model_group: int) -> list[int]:
    """The layer at whose forward commit each offloaded group is released.

    Group ``i`` is released when the forward reaches layer ``(n // k) * (i + 1) - 1``,
    the remainder ``n % k`` spread one layer each over the first groups; in backward it
    is reloaded symmetrically, when the backward reaches the same layer.
    """
    n, k = num_model_group, num_offload_group
    if k == 0:
        return []
    return [(n // k) * (i + 1) - 1 + min(i + 1, n % k) for i in range(k)]


class AsyncDoubleBufferGroupOffloadHandler(SynchronizedGroupOffloadHandler):
    """Offloads on its own device-to-host stream, reloads with prefetch on another.

    The first ``num_offload_group`` groups are offloaded, their releases spread evenly
    over the model (see :func:`layer_windows`), and reloaded symmetrically in backward
    ahead of use. With ``double_buffering`` two sets of reload buffers are allocated
    once and alternated between groups, so reloads allocate nothing after the first
    iteration; prefetch is then one group ahead at most, so that a buffer set is never
    overwritten while the group in it is still needed.

    Args:
        num_offload_group: How many groups (layers), from the first, to offload (k).
        num_model_group: Number of groups in the model (n).
        tensor_need_offloading_checker: Predicate choosing the tensors to offload.
        double_buffering: Reuse two sets of reload buffers.
        debug: Unused; kept for signature compatibility.
        transport: What moves the bytes; by default two CUDA streams when CUDA is
            available, else the CPU stand-in.
    """

    def __init__(
        self,
        num_offload_group: int,
        num_model_group: int,
        tensor_need_offloading_checker: Callable[[torch.Tensor], bool] = _offload_everything,
        double_buffering: bool = False,
        debug: bool = False,
        *,
        transport: Transport | None = None,
    ) -> None:
        super().__init__(num_offload_group, tensor_need_offloading_checker, debug)
        if isinstance(num_model_group, bool) or not isinstance(num_model_group, int):
            raise TypeError("num_model_group must be an int")
        if not 0 <= num_offload_group <= num_model_group:
            raise ValueError(
                f"num_offload_group must be in [0, num_model_group] = [0, {num_model_group}], "
                f"got {num_offload_group}"
            )
        self.num_model_group = num_model_group
        self.double_buffering = double_buffering
        self.iteration = 0  # stamps tags, so a stale backward fails instead of mixing data
        if transport is None:
            if torch.cuda.is_available():
                transport = CudaTransport(torch.cuda.Stream(), reload_stream=torch.cuda.Stream())
            else:
                transport = HostTransport()
        self.transport = transport
        processor = TensorGroupProcessor()
        self.groups = [
            OffloadableLayerState(
                transport=transport,
                policy=_OnDevice(transport, tensor_need_offloading_checker),
                processor=processor,
                name=f"group {i}",
            )
            for i in range(num_offload_group)
        ]
        self.windows = layer_windows(num_offload_group, num_model_group)
        self._release_at: dict[int, list[int]] = {}
        self._reload_at: dict[int, list[int]] = {}
        for group, window in enumerate(self.windows):
            self._release_at.setdefault(window, []).append(group)
            reload_layer = min(window, group + 1) if double_buffering else window
            self._reload_at.setdefault(reload_layer, []).insert(0, group)
        self._buffers: list[list[torch.Tensor | None]] = [[], []]
        self._forward_done = False

    # -- forward ---------------------------------------------------------------------

    def tensor_push(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        if self.current_group >= self.num_model_group:
            self.groupid_reset()  # a forward began without the previous backward
        if not self.is_current_group_offloaded():
            return tensor
        out = self.groups[self.current_group].push_tensor(tensor)
        if isinstance(out, torch.Tensor):
            return out
        return _tag(self.current_group, out, self.iteration)

    def on_group_commit_forward(self) -> None:
        layer = self.current_group
        if layer >= self.num_model_group:
            self.groupid_reset()
            layer = 0
        if layer < self.num_offload_group:
            self.groups[layer].start_offload()
        for group in self._release_at.get(layer, ()):
            self.groups[group].release_activation_forward_gpu_memory()
        super().on_group_commit_forward()

    # -- backward --------------------------------------------------------------------

    def on_group_commit_backward(self) -> None:
        super().on_group_commit_backward()
        layer = self.current_group
        if layer + 1 < len(self.groups):
            # The group after this one has finished its backward: drop what it reloaded.
            self.groups[layer + 1].release_all_memory()
        for group in self._reload_at.get(layer, ()):
            self._reload(group)
        if layer == 0:
            queue_backward_callback(self._end_of_backward)

    def _reload(self, group: int) -> None:
        state = self.groups[group]
        if state.phase is not LayerPhase.OFFLOAD_FINISHED:
            return
        if not self.double_buffering:
            state.start_reload()
            return
        buffers = self._buffers[group % 2]
        state.start_reload([b for b in buffers if b is not None])
        if not buffers:
            self._buffers[group % 2] = [t for t in state.reloaded_tensors() if t is not None]

    def tensor_pop(self, tensor_tag: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(tensor_tag, torch.Tensor):
            return tensor_tag
        group, index = tensor_tag
        if getattr(tensor_tag, "iteration", self.iteration) != self.iteration:
            raise RuntimeError(
                "a tensor saved under the V1 offload context belongs to an earlier forward "
                "pass whose memory was released when the next forward began: run backward "
                "before the next forward (or use one offload context per micro-batch in flight)"
            )
        state = self.groups[group]
        if state.phase is LayerPhase.OFFLOAD_FINISHED:
            state.start_reload()  # backward skipped the commit hook: reload without prefetch
        return state.pop_tensor(index)

    def _end_of_backward(self) -> None:
        for state in self.groups:
            state.wait_for_reloads()
            state.release_all_memory()

    def groupid_reset(self) -> None:
        super().groupid_reset()
        self.iteration += 1
        for state in self.groups:
            state.release_all_memory()

    def is_current_group_offloaded(self) -> bool:
        return self.current_group < self.num_offload_group
