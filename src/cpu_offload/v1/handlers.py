"""V1 offload handlers: what happens to a marked tensor when it is saved and used."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._compat import queue_backward_callback
from .._warn import warn_at_caller
from ..engine.layer_state import LayerPhase, OffloadableLayerState
from ..engine.selection import is_dense
from ..engine.tensor_group import TensorGroupProcessor
from ..engine.transport import CudaTransport, Transport, resolve_transport

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

    def attach_context(self) -> None:
        """A context (:class:`~cpu_offload.v1.CpuOffloadHookWithOffloadHandler`) drives
        this handler and reports its entries and exits."""

    def on_context_enter(self) -> None:
        """The offload context was entered (a layer's forward begins)."""

    def on_context_exit(self) -> None:
        """The offload context was left normally (a layer's forward ended)."""


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
        self._calls = _CommitOrder()

    def groupid_reset(self) -> None:
        """Start counting groups from 0 (a new iteration)."""
        self.current_group = 0
        self.tensor_count_current_group = 0
        self.tensor_tag_to_state.clear()
        self._calls.new_iteration()

    def abort(self) -> None:
        self._forget()

    def _forget(self) -> None:
        """Forget the iteration and the call order (after an exception or a misuse)."""
        self.groupid_reset()
        self._calls.reset()

    def attach_context(self) -> None:
        self._calls.tracked = True

    def on_context_enter(self) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation pass: nothing is saved, nothing is counted
        if self._calls.backward_seen:
            self.groupid_reset()  # the previous iteration's backward began: a new one
        self._calls.enter()

    def on_context_exit(self) -> None:
        self._calls.exit()

    def on_group_commit_forward(self) -> None:
        """A group's forward ended.

        Raises:
            RuntimeError: When the commit function is called inside the context, twice
                for one layer, or before any layer ran under the context; the iteration
                is forgotten, so that the next forward starts afresh.
        """
        misuse = self._calls.commit()
        if misuse is not None:
            self._forget()
            raise RuntimeError(misuse)
        self.current_group += 1
        self.tensor_count_current_group = 0

    def on_group_commit_backward(self) -> None:
        """A group's backward begins.

        Raises:
            RuntimeError: When backward goes through more commits than forward did (the
                iteration is forgotten first).
        """
        self._calls.backward()
        self.current_group -= 1
        if self.current_group < 0:
            self._forget()
            raise RuntimeError(
                "backward went through more layer commits than forward did: call the commit "
                "function once per layer in forward, and pass model_layers = the number of "
                "layers run under the offload context in one iteration"
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


class _CommitOrder:
    """Checks the order of context entries and commits, for the handlers' errors.

    The order is checked only for a handler that a context drives
    (``CpuOffloadHookWithOffloadHandler`` attaches itself), so that handlers driven by
    other hooks work as before.
    Under ``torch.no_grad`` nothing is counted (evaluation passes commit nothing).
    """

    def __init__(self) -> None:
        self.tracked = False  # a context reports its entries
        self.inside = False  # inside the context's `with` block now
        self.layer_ran = False  # a layer ran under the context since the last commit
        self.backward_seen = False  # a backward began since this iteration's forwards

    def reset(self) -> None:
        """Forget everything but whether a context reports its entries."""
        self.inside = self.layer_ran = self.backward_seen = False

    def new_iteration(self) -> None:
        """A new iteration's forward begins (the layer now running stays counted)."""
        self.backward_seen = False

    def enter(self) -> None:
        """Record an entry with grad enabled."""
        self.inside = True

    def exit(self) -> None:
        if self.inside:
            self.inside = False
            self.layer_ran = True

    def commit(self) -> str | None:
        """Record a forward commit; the misuse it is, if any."""
        if not self.tracked:
            return None
        if self.inside:
            return (
                "the commit function was called inside the CPU offload context: call "
                "x = commit_function(x) on the layer's output after its `with` block"
            )
        if not self.layer_ran:
            return (
                "the commit function was called twice for one layer, or before any layer "
                "ran under the CPU offload context: call it once after each layer's `with` "
                "block"
            )
        self.layer_ran = False
        return None

    def backward(self) -> None:
        """Record a backward commit."""
        self.backward_seen = True


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
        if transport is None and torch.cuda.is_available():
            transport = CudaTransport(torch.cuda.Stream(), reload_stream=torch.cuda.Stream())
        self.transport = transport = resolve_transport(transport)
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
        self._warned_nothing_offloaded = False

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
        super().on_group_commit_forward()  # checks the call order before anything moves
        if layer < self.num_offload_group:
            self.groups[layer].start_offload()
        for group in self._release_at.get(layer, ()):
            self.groups[group].release_activation_forward_gpu_memory()
        if layer == self.num_model_group - 1:
            self._check_something_offloaded()

    def _check_something_offloaded(self) -> None:
        # A whole forward ran: V1 offloads marked tensors only, and none was marked. The
        # offloaded groups hold what they took until the iteration is released.
        if self._warned_nothing_offloaded or self.num_offload_group == 0:
            return
        if any(group.has_tensors for group in self.groups[: self.num_offload_group]):
            return
        self._warned_nothing_offloaded = True
        warn_at_caller(
            f"the V1 CPU offload context ran all {self.num_model_group} layers of an iteration "
            f"and offloaded nothing, although {self.num_offload_group} layer(s) are to be "
            "offloaded: V1 offloads only tensors marked with mark_activation_offload (or "
            "the activation_offloading attribute). Mark the activations, or unset "
            "NVTE_CPU_OFFLOAD_V1 to use V2, which finds them itself"
        )

    # -- backward --------------------------------------------------------------------

    def on_group_commit_backward(self) -> None:
        if not self._calls.backward_seen and self.current_group != self.num_model_group:
            ran = self.current_group
            self._forget()
            raise ValueError(
                f"backward began after {ran} layer commits under the V1 CPU offload context, "
                f"but model_layers={self.num_model_group}: pass the number of layers run "
                "under the context in one iteration"
            )
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
